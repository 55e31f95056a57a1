"""Quantization helpers of the tests: the weights' row-wise quantization as the tests spell
it (one scale per row, the weights' own rounding generator for stochastic rounding: what
``Int8Weight`` does), and a counter of the int8 GEMMs that really run."""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from fsdp_int8._generators import WEIGHT_ROUNDING
from fsdp_int8.quant import absmax_dequantize, absmax_quantize


def quantize_rowwise(values: torch.Tensor, stochastic: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    return absmax_quantize(
        values, rounding="stochastic" if stochastic else "nearest",
        generator=WEIGHT_ROUNDING.generator(values.device), what="a tensor",
    )


def dequantize_rowwise(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return absmax_dequantize(q, scale, dtype=dtype)


class CountIntMM(TorchDispatchMode):
    """Counts aten._int_mm where aten sees it: below every Python wrapper of ours."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._int_mm.default:
            self.calls += 1
        return func(*args, **(kwargs or {}))
