"""Experts stored transposed, ``[experts, in, out]``: int8 over their transpose.

gpt-oss (transformers' ``is_transposed``) and Llama 4 keep each expert's weight as
``[in, out]`` and multiply ``x @ w``. Their output features are the last dim, while an
``Int8Weight`` keeps one scale per row (and FSDP2 shards dim 0). So a quantized module
holds each such weight as its transpose, ``[E, out, in]`` (one scale per expert and
output feature, as for every other experts module), under the same name. The module's
own code, which would read ``[E, in, out]``, never runs on it: its class is swapped in
place (``__class__`` assignment, as ``fully_shard`` and :mod:`.conv1d` do) for one that
computes through ``int8_grouped_mm`` on the held layout (:mod:`.grouped_experts`), and
``quantize_`` leaves transposed experts of a module it knows no such class for in full
precision. Parameters, optimizers, FSDP2 and checkpoints see the ``[E, out, in]`` weight.

DBRX's ``w2`` (2-D ``[E * F, hidden]``, each expert's ``[F, hidden]`` read as ``[in,
out]``) is held the same way, each expert's block of rows transposed: ``[E * hidden, F]``
(:func:`transposed_value` with ``E`` blocks). Its module's ``forward`` is never the one that
runs (:mod:`.dbrx_experts` computes for it).

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
    "hold_transposed_", "transposed_names", "transposed_blocks", "transposed_value", "transposed_shape",
    "swapped_class",
]

_CLASSES: dict[tuple[type, type], type] = {}
# the prefix of each swapped class's name: its mixin, by the module that defines it
_MIXINS: dict[str, tuple[str, str]] = {
    "Int8Transposed__": (__name__, "_TransposedExperts"),
    "Int8Dbrx__": ("fsdp_int8._weight.dbrx_experts", "_Int8DbrxExperts"),
    "Int8Grouped__": ("fsdp_int8._weight.grouped_experts", "_Int8GroupedExperts"),
    "Int8Llama4__": ("fsdp_int8._weight.grouped_experts", "_Int8Llama4Experts"),
    "Int8Torchtitan__": ("fsdp_int8._weight.grouped_experts", "Int8TorchtitanExperts"),
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
    stored ``[E, out, in]``, and plain values loaded under their names are the model's
    ``[E, in, out]``. The mixins of :mod:`.grouped_experts` and :mod:`.dbrx_experts`
    build on it; alone, it serves a module whose ``forward`` never runs (DBRX's ``mlp``)."""

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs) -> None:
        for name in transposed_names(self):
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
    pickle finds it here in a fresh process. ``mixin`` is one of :data:`_MIXINS`; ``base``
    may be a class this made, whose original class is then used."""
    base = next((b for (m, b), made in _CLASSES.items() if made is base), base)
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


def transposed_names(module: nn.Module) -> tuple[str, ...]:
    """Names of ``module``'s weights stored as their ``[E, out, in]`` transpose."""
    return module.__dict__.get("_int8_transposed", ())


def transposed_blocks(module: nn.Module, name: str) -> int:
    """The ``blocks`` of :func:`transposed_value` for ``module``'s stored weight ``name``."""
    return module.__dict__.get("_int8_transposed_blocks", {}).get(name, 1)


def hold_transposed_(module: nn.Module, weights: dict[str, nn.Parameter], blocks: dict[str, int]) -> None:
    """Give ``module`` (whose class has :class:`_TransposedExperts` mixed in) the
    ``weights`` (by name) stored as :func:`transposed_value` of its own with ``blocks`` (by
    name); in place."""
    module.__dict__["_int8_transposed"] = tuple(dict.fromkeys((*transposed_names(module), *weights)))
    flat = {name: count for name, count in blocks.items() if name in weights and weights[name].dim() == 2}
    if flat:
        module.__dict__["_int8_transposed_blocks"] = {**module.__dict__.get("_int8_transposed_blocks", {}), **flat}
    for name, weight in weights.items():
        module._parameters[name] = weight
