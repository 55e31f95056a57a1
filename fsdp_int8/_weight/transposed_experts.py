"""Experts stored transposed, ``[experts, in, out]``: int8 over their transpose.

gpt-oss (transformers' ``is_transposed``) and Llama 4 keep each expert's weight as
``[in, out]`` and multiply ``x @ w``. Their output features are the last dim, while an
``Int8Weight`` keeps one scale per row (and FSDP2 shards dim 0). So a quantized module
holds each such weight as its transpose, ``[E, out, in]`` (one scale per expert and
output feature, as for every other experts module), under the same name, and its class is
swapped in place (``__class__`` assignment, as ``fully_shard`` and :mod:`.conv1d` do) to
one whose ``forward`` shows the module's own code, while it runs, the ``[E, in, out]`` view
it expects: ``weight.transpose(-2, -1)``, which for an int8 weight with int8 GEMMs is an
:class:`~fsdp_int8._weight.experts.ExpertsTransposed` (``torch._grouped_mm`` runs int8
GEMMs on it) and otherwise the values, transposed. Parameters, optimizers, FSDP2 and
checkpoints see the ``[E, out, in]`` weight and work unchanged.

Plain tensors under the weight's state-dict key are the model's own layout, ``[E, in,
out]`` (every Hugging Face state dict, and ``export_full_state_dict``'s output):
:meth:`_TransposedExperts._load_from_state_dict` transposes them before loading. The
swapped class is named after the original so that pickles find it in a fresh process
(this module's ``__getattr__`` rebuilds it from the name).
"""

from __future__ import annotations

import importlib
from typing import Any

import torch
import torch.nn as nn

__all__ = ["int8_transposed_experts_", "is_int8_transposed", "transposed_names"]

_PREFIX = "Int8Transposed__"
_CLASSES: dict[type, type] = {}


class _TransposedExperts:
    """Mixed in before an experts module's class: its ``_int8_transposed`` parameters are
    stored ``[E, out, in]`` and read by the module's code as ``[E, in, out]``."""

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        # The module's code reads its weights as [E, in, out] while it runs; everything else
        # (FSDP2, optimizers, state dicts) keeps reading the stored parameters. Under FSDP2
        # the stored entry is the unsharded weight its hooks put there before this call.
        stored = {name: self._parameters[name] for name in self._int8_transposed}
        try:
            for name, weight in stored.items():
                self._parameters[name] = weight.transpose(-2, -1)
            return super().forward(*args, **kwargs)
        finally:
            self._parameters.update(stored)

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs) -> None:
        for name in self._int8_transposed:
            value = state_dict.get(prefix + name)
            stored = self._parameters[name]
            # square ones too: a plain tensor is always [E, in, out]; a DTensor's full value
            # was transposed before torch sharded it (checkpoint/export.py, to_module_layout)
            if _plain(value) and value.dim() == 3 and value.shape[1:] == stored.shape[1:][::-1]:
                state_dict[prefix + name] = value.transpose(-2, -1).contiguous()
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)


def _plain(value: Any) -> bool:
    """A plain local tensor: not an int8 weight, not a DTensor."""
    from torch.distributed.tensor import DTensor

    from fsdp_int8._weight.tensor import Int8Weight

    return isinstance(value, torch.Tensor) and not isinstance(value, (Int8Weight, DTensor))


def _class_name(base: type) -> str:
    return f"{_PREFIX}{base.__module__.replace('.', '__')}___{base.__qualname__}"


def _class_for(base: type) -> type:
    """The swapped class of ``base`` (one per class, named after it)."""
    if base not in _CLASSES:
        name = _class_name(base)
        cls = type(name, (_TransposedExperts, base), {"__module__": __name__, "__qualname__": name})
        _CLASSES[base] = cls
        globals()[name] = cls
    return _CLASSES[base]


def __getattr__(name: str) -> type:
    """The swapped class a pickle names, rebuilt from its original class's path."""
    if not name.startswith(_PREFIX):
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    module, qualname = name[len(_PREFIX):].split("___", 1)
    base: Any = importlib.import_module(module.replace("__", "."))
    for part in qualname.split("."):
        base = getattr(base, part)
    return _class_for(base)


def is_int8_transposed(module: nn.Module) -> bool:
    """Whether ``module`` is an experts module whose weights this module swapped."""
    return isinstance(module, _TransposedExperts)


def transposed_names(module: nn.Module) -> tuple[str, ...]:
    """Names of ``module``'s weights stored as their ``[E, out, in]`` transpose."""
    return module.__dict__.get("_int8_transposed", ())


def int8_transposed_experts_(module: nn.Module, weights: dict[str, nn.Parameter]) -> None:
    """Give ``module`` the ``[E, out, in]`` ``weights`` (by name) and the class that reads
    them as ``[E, in, out]``; in place."""
    if not is_int8_transposed(module):
        module.__class__ = _class_for(type(module))
    module.__dict__["_int8_transposed"] = tuple(dict.fromkeys((*transposed_names(module), *weights)))
    for name, weight in weights.items():
        module._parameters[name] = weight
