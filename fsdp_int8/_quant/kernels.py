"""Kernel bodies shared by the eager and the ``torch.compile``d paths, and the runner.

Each body is written once: run eagerly it is several passes over its tensor, compiled
(:func:`run_compiled`) it is one fused pass with the same fp32 operations in the same
order, so both give the same bits. None takes an integer argument: dynamic shapes would
turn it into a symbol and the loops into scalar code.

Whether a weight's kernels are compiled is its own configuration
(``Int8TrainingConfig.compile``, carried by each ``Int8Weight``); this module keeps two
facts per process: whether compiling has failed here, so that a machine without a
working compiler runs eagerly instead of failing every step, and whether a model asked
for compiled kernels explicitly (``compile="on"``), so that the failure warns; where
``compile="auto"`` chose them it is logged.
"""

from __future__ import annotations

import functools
import importlib.util
import logging
import os
import shutil
import warnings
from typing import Callable

import torch

from fsdp_int8._quant.noise import NOISE_OFFSET, NOISE_STEP, noise_from_bytes, rounding_noise_bytes

INT8_MAX = 127  # symmetric: -127..127, so negation never overflows
UINT8_MAX = 255


def ceil_div(numerator: int, denominator: int) -> int:
    """``ceil(numerator / denominator)`` for non-negative integers (blocks of a row, rows
    of a shard)."""
    return -(-numerator // denominator)


_compile_failed = False  # torch.compile raised once in this process: stay eager from then on
_warn_on_failure = False  # a model asked for compile="on": a failure warns
_log = logging.getLogger(__name__)


def round_scaled(
    x: torch.Tensor, divisor: torch.Tensor, noise: torch.Tensor | None, low: int, high: int, dtype: torch.dtype
) -> torch.Tensor:
    """``clamp(round(x / divisor [+ v]), low, high)`` in ``dtype``: the one rounding formula.

    Eager and compiled paths run exactly these fp32 operations in this order (noise: the
    fp32 sum of ``x / divisor + 2**-17`` and ``r * 2**-16``, ``r * 2**-16`` exact), so
    they agree bit for bit.
    """
    if noise is None:
        scaled = torch.div(x, divisor)
    else:  # x / divisor + 2**-17 (two roundings, as addcdiv's kernel makes), then the noise
        scaled = torch.div(x, divisor).add_(NOISE_OFFSET).add_(noise, alpha=NOISE_STEP)
    return scaled.round_().clamp_(low, high).to(dtype)


def int8_rows(values: torch.Tensor, noise: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Signed int8, one scale per row, with the quantizer's arithmetic."""
    x = values.float()
    scale = x.abs().amax(dim=1, keepdim=True) / INT8_MAX
    divisor = torch.where(scale > 0, scale, torch.ones_like(scale))
    return round_scaled(x, divisor, noise, -INT8_MAX, INT8_MAX, torch.int8), scale.squeeze(1)


def int8_rows_nearest(values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return int8_rows(values, None)


def int8_columns(values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Int8 with one scale per column (over the tokens), no transposed copy."""
    x = values.float()
    scale = x.abs().amax(dim=0, keepdim=True) / INT8_MAX
    divisor = torch.where(scale > 0, scale, torch.ones_like(scale))
    return round_scaled(x, divisor, None, -INT8_MAX, INT8_MAX, torch.int8), scale.squeeze(0)


def dequantize_whole(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return torch.mul(q, scale).to(dtype)  # (a dtype argument is a constant, not a symbol)


def dequantize_into(q: torch.Tensor, scale: torch.Tensor, out: torch.Tensor) -> None:
    """``out[...] = (q * scale)`` rounded to ``out``'s dtype: :func:`dequantize_whole`'s
    values, written in place (compiled: one pass that stores straight into ``out``)."""
    out.copy_(torch.mul(q, scale))


def as_buffer(values: torch.Tensor) -> torch.Tensor:
    """``values`` (2-D) as a GEMM's quantizer reads it: itself when run eagerly; inside a
    graph that inductor compiles for the CPU, a contiguous buffer of its own (computed
    once, before any quantization pass reads it; a no-op where it is one already).

    Without it inductor may inline ``values``' producer into every kernel that reads it.
    A producer its C++ code cannot vectorize (autograd's ``select_backward`` of a rotary
    embedding that rotates interleaved channel pairs, such as the launcher's formula
    without its hand-written backward) then turns the per-column absmax over the tokens
    into a scalar loop that recomputes the producer one element at a time down a column,
    a whole row apart per load. As a buffer, the producer runs once in row order and every
    quantization pass reads the buffer with vector loads.

    The buffer holds ``values`` in its dtype, so a pass that reads it quantizes the
    gradient eager quantizes (rounded to bf16), where an inlined producer gave its fp32
    value: compiled gradients move by the rounding, as close to eager's as before
    (``tests/test_compiled_gradient_quantization.py``). The boundary is inductor's
    ``force_stride_order`` prim: other backends run it as ``values`` itself (or a
    contiguous copy), so ``aot_eager`` stays eager's bit for bit. GPUs keep the inlined
    form (Triton vectorizes such producers; nothing is measured there).
    """
    if not torch.compiler.is_compiling() or values.device.type != "cpu":
        return values
    from torch._inductor import inductor_prims  # noqa: F401  (registers the prim)

    force_stride_order = getattr(torch.ops.prims, "inductor_force_stride_order", None)
    if force_stride_order is None:  # a torch without the prim: the inlined form
        return values
    return force_stride_order(values, (values.shape[1], 1))


@functools.cache
def compiled(function: Callable) -> Callable:
    """``torch.compile(function, dynamic=True)``, made once per function."""
    return torch.compile(function, dynamic=True)


def compiler_available(device_type: str) -> bool:
    """Whether ``torch.compile`` has a code generator for ``device_type`` here: a C++
    compiler for the CPU (``$CXX``, ``c++``, ``g++`` or ``clang++`` on the path), Triton for
    CUDA and XPU; nothing known for other devices."""
    if not torch._dynamo.is_dynamo_supported():
        return False
    if device_type == "cpu":
        names = (os.environ.get("CXX"), "c++", "g++", "clang++")
        return any(name and shutil.which(name) for name in names)
    if device_type in ("cuda", "xpu"):
        return importlib.util.find_spec("triton") is not None
    return False


def warn_on_failure() -> None:
    """A model asked for compiled kernels explicitly: a compile failure warns."""
    global _warn_on_failure
    _warn_on_failure = True


def compile_failed() -> bool:
    """Whether ``torch.compile`` failed in this process (its kernels then run eagerly)."""
    return _compile_failed


def _compiler_runs_eagerly() -> bool:
    """Whether ``torch.compile`` would run a function's Python body eagerly here: outside
    a graph being traced, under a ``TorchDispatchMode`` (torch's memory trackers,
    ``FlopCounterMode``, debug modes), whose frames dynamo skips. A kernel body run that way
    makes every intermediate whole (an fp32 product of a whole weight), where the eager
    paths of its callers work in bounded blocks of rows."""
    if torch.compiler.is_compiling():
        return False
    from torch.utils._python_dispatch import any_torch_dispatch_mode_on_stack

    return any_torch_dispatch_mode_on_stack()


def use_compiled(wanted: bool, tensor: torch.Tensor) -> bool:
    """Whether to run a compiled kernel on ``tensor``: asked for, worth a kernel, and
    compiled here (not under a dispatch mode, where the eager path gives the same bits
    with its own bounded temporaries)."""
    return (wanted and not _compile_failed and not tensor.is_meta and tensor.numel() > 0
            and not _compiler_runs_eagerly())


def run_compiled(function: Callable, *args):
    """``compiled(function)(*args)``; on a compile failure, warn once and go eager for good.

    Inside a graph being traced (a user's ``torch.compile`` of a block or model) the body
    runs as it is, so that the enclosing compile traces it and fuses it with its
    neighbours: a nested ``torch.compile`` cannot run there, and its failure must not turn
    off the compiled kernels outside that graph (the optimizer's write-back).

    An error that the eager function raises too is the caller's: it propagates, and the
    compiled kernels stay on.
    """
    global _compile_failed
    if _compile_failed or torch.compiler.is_compiling():
        return function(*args)
    try:
        return compiled(function)(*args)
    except Exception as error:  # noqa: BLE001 -- sorted out by the eager run below
        result = function(*args)
        _compile_failed = True
        message = (f"fsdp_int8: torch.compile failed ({type(error).__name__}: {str(error)[:200]}); "
                   "quantization kernels run eagerly from now on")
        if _warn_on_failure:
            warnings.warn(message, RuntimeWarning, stacklevel=3)
        else:  # compile="auto" chose the kernels: eager is a fine outcome
            _log.info(message)
        return result


@functools.cache
def _nearest(body: Callable) -> Callable:
    def kernel(*operands):
        return body(*operands, None)

    return kernel


@functools.cache
def _stochastic(body: Callable) -> Callable:
    def kernel(*operands_then_noise_bytes):
        *operands, noise_bytes = operands_then_noise_bytes
        return body(*operands, noise_from_bytes(noise_bytes))

    return kernel


def run_rounding(
    body: Callable, *operands: torch.Tensor, rows: int, row_len: int, generator: torch.Generator | None,
    stochastic: bool,
):
    """Run ``body(*operands, noise)`` as one compiled pass that rounds ``[rows, row_len]``
    values: the one place a compiled kernel gets its rounding.

    ``stochastic``: ``noise`` is the 16-bit noise drawn from ``generator``
    (:func:`~fsdp_int8._quant.noise.rounding_noise_bytes`, decoded inside the kernel);
    otherwise ``None`` (round to nearest). ``body`` ends in :func:`round_scaled` (through
    :func:`int8_rows`), so the compiled pass and the eager quantizer give the same bits.
    """
    if not stochastic:
        return run_compiled(_nearest(body), *operands)
    noise_bytes = rounding_noise_bytes((rows, row_len), generator, operands[0].device)
    return run_compiled(_stochastic(body), *operands, noise_bytes)
