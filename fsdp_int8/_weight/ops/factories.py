"""Factories: new tensors like the weight, and small queries (``is_pinned``, ``equal``).

``new_zeros`` / ``new_empty`` / ``empty_like`` / ``clone`` / ``_to_copy`` keep the subclass
(``Module.to_empty`` uses ``empty_like``, FSDP2 pads with ``new_zeros``); ``zeros_like``
returns a plain tensor, because optimizers build their states with it.
"""

from __future__ import annotations

from typing import Sequence

import torch

from fsdp_int8._weight import op_table as _op_table
from fsdp_int8._weight.ops.math import dequantize_all
from fsdp_int8._weight.tensor import Int8Weight

aten = torch.ops.aten
_implements = _op_table.implements


# A 0-dim tensor "like" a weight is how torch.distributed.checkpoint's StateDictStager
# (dcp.async_save's default) copies a storage: new_empty([]) on the CPU, then set_().
_STAGING_HINT = (
    ". torch.distributed.checkpoint.async_save stages tensors that way (its default "
    "StateDictStager: new_empty([]), then set_ to a copy of the storage), which an int8 "
    "weight cannot follow: pass async_stager=fsdp_int8.checkpoint.CpuCopyStager() to "
    "async_save, or save with fsdp_int8.save_checkpoint(..., async_=True) (docs/limits.md)"
)


def zeros_in_rows(weight: Int8Weight, size: Sequence[int], dtype, device) -> Int8Weight:
    size = list(size)
    numel = torch.Size(size).numel()
    if not (len(size) >= 2 and size[-1] == weight.row_len) and not (
        len(size) == 1 and numel % weight.row_len == 0
    ):
        raise NotImplementedError(
            f"cannot make an Int8Weight of shape {size}: it must hold whole rows of "
            f"{weight.row_len} elements ([rows, {weight.row_len}], [*leading dims, "
            f"{weight.row_len}] or flat)" + (_STAGING_HINT if not size else "")
        )
    device = device or weight.device
    int_data = torch.zeros(size, dtype=torch.int8, device=device)
    scale_shape = size[:-1] if len(size) >= 2 else [numel // weight.row_len]
    scale = torch.zeros(scale_shape, dtype=torch.float32, device=device)
    return weight.with_tensors(int_data, scale, dtype=dtype)


def _wants_plain(dtype) -> bool:
    return dtype is not None and not dtype.is_floating_point


@_implements(aten.new_zeros.default, aten.new_empty.default)
def _new_zeros(func, weight, size, dtype=None, layout=None, device=None, pin_memory=None):
    # new_empty is served with zeros too: a garbage scale could dequantize to NaN.
    if _wants_plain(dtype):
        return torch.zeros(size, dtype=dtype, device=device or weight.device)
    return zeros_in_rows(weight, size, dtype, device)


@_implements(aten.empty_like.default)
def _empty_like(func, weight, dtype=None, layout=None, device=None, pin_memory=None,
                memory_format=None):
    if _wants_plain(dtype):
        return torch.zeros(weight.shape, dtype=dtype, device=device or weight.device)
    return zeros_in_rows(weight, weight.shape, dtype, device)


@_implements(aten.zeros_like.default)
def _zeros_like(func, weight, dtype=None, layout=None, device=None, pin_memory=None,
                memory_format=None):
    # Optimizers build their states with zeros_like: those must stay full precision.
    return torch.zeros(weight.shape, dtype=dtype or weight.dtype, device=device or weight.device)


@_implements(aten.clone.default)
def _clone(func, weight: Int8Weight, memory_format=None) -> Int8Weight:
    return weight.with_tensors(
        weight.int_data.clone(memory_format=torch.contiguous_format),
        weight.scale.clone(memory_format=torch.contiguous_format),
    )


@_implements(aten._to_copy.default)
def _to_copy(func, weight: Int8Weight, dtype=None, layout=None, device=None, pin_memory=None,
             non_blocking=False, memory_format=None) -> Int8Weight:
    if _wants_plain(dtype):
        raise NotImplementedError(
            f"cannot convert an Int8Weight to {dtype}: its outer dtype must be floating. Use "
            ".int_data for the raw int8 values or .dequantize() for a plain tensor."
        )
    device = device or weight.device
    moved = [
        t.to(device, non_blocking=non_blocking, copy=True, memory_format=torch.contiguous_format)
        for t in (weight.int_data, weight.scale)
    ]
    if pin_memory:
        moved = [t.pin_memory() for t in moved]
    return weight.with_tensors(*moved, dtype=dtype)


@_implements(aten.is_pinned.default)
def _is_pinned(func, weight: Int8Weight, device=None) -> bool:
    return weight.int_data.is_pinned() and weight.scale.is_pinned()


@_implements(aten._pin_memory.default)
def _pin_memory(func, weight: Int8Weight, device=None) -> Int8Weight:
    return weight.with_tensors(weight.int_data.pin_memory(), weight.scale.pin_memory())


@_implements(aten.equal.default)
def _equal(func, a: torch.Tensor, b: torch.Tensor) -> bool:
    if isinstance(a, Int8Weight) and isinstance(b, Int8Weight):
        (a_rows, a_scale), (b_rows, b_scale) = a.read_rows(), b.read_rows()
        return a.shape == b.shape and torch.equal(a_rows, b_rows) and torch.equal(a_scale, b_scale)
    return torch.equal(*dequantize_all((a, b)))
