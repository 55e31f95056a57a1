"""Quantization helpers of the tests: the weights' row-wise quantization as the tests spell
it (one scale per row, the weights' own rounding generator for stochastic rounding: what
``Int8Weight`` does), and a counter of the int8 GEMMs that really run."""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch
from torch._library.custom_ops import _maybe_get_opdef
from torch.utils._python_dispatch import TorchDispatchMode

from fsdp_int8._quant import kernels as _kernels
from fsdp_int8._quant.generators import WEIGHT_ROUNDING
from fsdp_int8.quant import absmax_dequantize, absmax_quantize


def quantize_rowwise(
    values: torch.Tensor, stochastic: bool = False, compiled: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    return absmax_quantize(
        values, rounding="stochastic" if stochastic else "nearest",
        generator=WEIGHT_ROUNDING.generator(values.device), what="a tensor", compiled=compiled,
    )


def dequantize_rowwise(
    q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32, compiled: bool = False
) -> torch.Tensor:
    return absmax_dequantize(q, scale, dtype=dtype, compiled=compiled)


def dispatch_into_own_ops(mode: TorchDispatchMode, func, args: tuple, kwargs: dict | None):
    """``func(*args, **kwargs)`` for ``mode``'s ``__torch_dispatch__``; fsdp_int8's own
    custom ops (the experts' grouped GEMMs) run their Python body under ``mode``, so that
    it sees the aten ops they run too."""
    opdef = _maybe_get_opdef(func)
    if opdef is not None and func.namespace == "fsdp_int8":
        with mode:
            return opdef._init_fn(*args, **(kwargs or {}))
    return func(*args, **(kwargs or {}))


class CountIntMM(TorchDispatchMode):
    """Counts aten._int_mm where aten sees it: below every Python wrapper of ours, inside
    fsdp_int8's custom ops too."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._int_mm.default:
            self.calls += 1
        return dispatch_into_own_ops(self, func, args, kwargs)


class CompiledRuns:
    calls = 0


@contextlib.contextmanager
def compiled_kernels_ran(at_least: int = 1) -> Iterator[CompiledRuns]:
    """Count the compiled kernels that really ran inside the block, and fail unless at
    least ``at_least`` did and none fell back to eager.

    A failing ``torch.compile`` makes ``_kernels.run_compiled`` warn and run the eager function
    instead: a test comparing "compiled" with eager results would then compare eager with
    eager and pass. Counted where every compiled kernel is called (``_kernels.compiled``'s
    functions), after they return.
    """
    runs = CompiledRuns()
    original = _kernels.compiled

    def counting(function):
        kernel = original(function)

        def call(*args):
            result = kernel(*args)
            runs.calls += 1
            return result

        return call

    _kernels.compiled = counting
    try:
        yield runs
    finally:
        _kernels.compiled = original
    assert not _kernels.compile_failed(), "torch.compile failed: the kernels ran eagerly"
    assert runs.calls >= at_least, f"{runs.calls} compiled kernel calls, expected at least {at_least}"
