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

DBRX's ``w2`` (2-D ``[E * F, hidden]``, each expert's ``[F, hidden]`` read as ``[in,
out]``) is held the same way, each expert's block of rows transposed: ``[E * hidden, F]``
(:func:`transposed_value` with ``E`` blocks). Its module's ``forward`` takes the weights as
arguments and is never the one that runs (:mod:`.dbrx_experts`), so it is shown nothing.

Plain tensors under the weight's state-dict key are the model's own layout, ``[E, in,
out]`` (every Hugging Face state dict, and ``export_full_state_dict``'s output):
:meth:`_TransposedExperts._load_from_state_dict` transposes them before loading. The
swapped classes are named after the original so that pickles find them in a fresh process
(this module's ``__getattr__`` rebuilds them from the name).
"""

from __future__ import annotations

import importlib
from typing import Any, Sequence

import torch
import torch.nn as nn

__all__ = [
    "int8_transposed_experts_", "is_int8_transposed", "transposed_names", "transposed_blocks", "transposed_value",
    "transposed_shape", "swapped_class",
]

_CLASSES: dict[tuple[type, type], type] = {}
# the prefix of each swapped class's name: its mixin, by the module that defines it
_MIXINS: dict[str, tuple[str, str]] = {
    "Int8Transposed__": (__name__, "_TransposedExperts"),
    "Int8Dbrx__": ("fsdp_int8._weight.dbrx_experts", "_Int8DbrxExperts"),
}


def transposed_value(value: torch.Tensor, blocks: int = 1) -> torch.Tensor:
    """``value`` with each block of rows transposed: the last two dims of a 3-D (or a
    ``blocks == 1``) tensor swapped (a view); a 2-D ``[blocks * a, b]`` as ``[blocks * b,
    a]`` (a copy). Its own inverse: the same call turns a stored weight back."""
    if value.dim() != 2 or blocks == 1:
        return value.transpose(-2, -1)
    rows, cols = value.shape
    return value.reshape(blocks, rows // blocks, cols).transpose(1, 2).reshape(blocks * cols, rows // blocks)


def transposed_shape(shape: Sequence[int], blocks: int = 1) -> torch.Size:
    """The shape of :func:`transposed_value` of a tensor of ``shape``."""
    if len(shape) != 2 or blocks == 1:
        return torch.Size((*shape[:-2], shape[-1], shape[-2]))
    return torch.Size((blocks * shape[1], shape[0] // blocks))


class _TransposedExperts:
    """Mixed in before an experts module's class: its ``_int8_transposed`` parameters are
    stored ``[E, out, in]`` and read by the module's code as ``[E, in, out]``."""

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        # The module's code reads its weights as [E, in, out] while it runs; everything else
        # (FSDP2, optimizers, state dicts) keeps reading the stored parameters. Under FSDP2
        # the stored entry is the unsharded weight its hooks put there before this call.
        stored = {name: self._parameters[name] for name in self._int8_transposed
                  if name not in self.__dict__.get("_int8_transposed_blocks", {})}
        try:
            for name, weight in stored.items():
                self._parameters[name] = weight.transpose(-2, -1)
            return super().forward(*args, **kwargs)
        finally:
            self._parameters.update(stored)

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs) -> None:
        for name in self._int8_transposed:
            value = state_dict.get(prefix + name)
            blocks = transposed_blocks(self, name)
            # square ones too: a plain tensor is always the model's layout; a DTensor's full
            # value was transposed before torch sharded it (checkpoint/export.py, layouts.to_int8_layout)
            if _plain(value) and value.shape == transposed_shape(self._parameters[name].shape, blocks):
                state_dict[prefix + name] = transposed_value(value, blocks).contiguous()
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)


def _plain(value: Any) -> bool:
    """A plain local tensor: not an int8 weight, not a DTensor."""
    from torch.distributed.tensor import DTensor

    from fsdp_int8._weight.tensor import Int8Weight

    return isinstance(value, torch.Tensor) and not isinstance(value, (Int8Weight, DTensor))


def swapped_class(mixin: type, base: type) -> type:
    """``base`` with ``mixin`` before it (one class per pair), named after both so that a
    pickle finds it here in a fresh process. ``mixin`` is one of :data:`_MIXINS`."""
    if (mixin, base) not in _CLASSES:
        prefix = next(p for p, (module, name) in _MIXINS.items() if name == mixin.__name__)
        name = f"{prefix}{base.__module__.replace('.', '__')}___{base.__qualname__}"
        cls = type(name, (mixin, base), {"__module__": __name__, "__qualname__": name})
        _CLASSES[mixin, base] = cls
        globals()[name] = cls
    return _CLASSES[mixin, base]


def __getattr__(name: str) -> type:
    """The swapped class a pickle names, rebuilt from its mixin's and original class's paths."""
    prefix = next((p for p in _MIXINS if name.startswith(p)), None)
    if prefix is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    module, qualname = name[len(prefix):].split("___", 1)
    base: Any = importlib.import_module(module.replace("__", "."))
    for part in qualname.split("."):
        base = getattr(base, part)
    mixin_module, mixin_name = _MIXINS[prefix]
    return swapped_class(getattr(importlib.import_module(mixin_module), mixin_name), base)


def is_int8_transposed(module: nn.Module) -> bool:
    """Whether ``module`` is an experts module whose weights this module swapped."""
    return isinstance(module, _TransposedExperts)


def transposed_names(module: nn.Module) -> tuple[str, ...]:
    """Names of ``module``'s weights stored as their ``[E, out, in]`` transpose."""
    return module.__dict__.get("_int8_transposed", ())


def transposed_blocks(module: nn.Module, name: str) -> int:
    """The ``blocks`` of :func:`transposed_value` for ``module``'s stored weight ``name``."""
    return module.__dict__.get("_int8_transposed_blocks", {}).get(name, 1)


def int8_transposed_experts_(module: nn.Module, weights: dict[str, nn.Parameter], blocks: dict[str, int]) -> None:
    """Give ``module`` the ``weights`` (by name) stored as :func:`transposed_value` of its
    own with ``blocks`` (by name), and the class that reads the 3-D ones as ``[E, in,
    out]``; in place. No ``weights``: nothing happens."""
    if not weights:
        return
    if not is_int8_transposed(module):
        module.__class__ = swapped_class(_TransposedExperts, type(module))
    module.__dict__["_int8_transposed"] = tuple(dict.fromkeys((*transposed_names(module), *weights)))
    flat = {name: count for name, count in blocks.items() if name in weights and weights[name].dim() == 2}
    if flat:
        module.__dict__["_int8_transposed_blocks"] = {**module.__dict__.get("_int8_transposed_blocks", {}), **flat}
    for name, weight in weights.items():
        module._parameters[name] = weight
