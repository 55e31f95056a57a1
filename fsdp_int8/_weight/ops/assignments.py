"""Assignments round to nearest: they are initialisation or loading, not training.

``copy_`` from a float tensor, ``fill_``, ``uniform_``, ``normal_``, ``zero_``; ``copy_`` from
another ``Int8Weight`` copies its bytes.
"""

from __future__ import annotations

import torch

from fsdp_int8._weight import op_table as _op_table
from fsdp_int8._weight import tensor_parallel as _tensor_parallel
from fsdp_int8._weight.tensor import Int8Weight

aten = torch.ops.aten
_implements = _op_table.implements


@_implements(aten.copy_.default)
def _copy(func, dst: torch.Tensor, src: torch.Tensor, non_blocking: bool = False):
    if not isinstance(dst, Int8Weight):  # plain <- Int8Weight: write the values
        return dst.copy_(src.dequantize(dst.dtype if dst.is_floating_point() else None))
    if isinstance(src, Int8Weight):
        if src.numel() != dst.numel() or src.row_len != dst.row_len:
            raise RuntimeError(
                f"copy_ between Int8Weights of different layouts: {tuple(src.shape)} rows of "
                f"{src.row_len} into {tuple(dst.shape)} rows of {dst.row_len}"
            )
        return dst.write_rows_(*src.read_rows(), non_blocking=non_blocking)
    if not src.is_floating_point():
        raise TypeError(f"copy_ into an Int8Weight needs floating values, got {src.dtype}")
    return dst.assign_(src.to(dst.device).expand(dst.shape), stochastic=False)


@_implements(aten.zero_.default)
def _zero(func, weight: Int8Weight) -> Int8Weight:
    _tensor_parallel.check_requantizable(weight, "zero_")
    weight.int_data.zero_()
    weight.scale.zero_()
    return weight


@_implements(aten.fill_.Scalar, aten.uniform_.default, aten.normal_.default)
def _fill_random(func, weight: Int8Weight, *args, **kwargs) -> Int8Weight:
    # Initialisation: draw in fp32 exactly as for a plain tensor, then round to nearest.
    values = torch.empty(weight.shape, dtype=torch.float32, device=weight.device)
    func(values, *args, **kwargs)
    return weight.assign_(values, stochastic=False)
