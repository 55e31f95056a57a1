"""Symmetric absmax quantization: the one quantizer every part of fsdp_int8 uses.

A tensor is cut into blocks (a whole row by default, or ``block_size`` consecutive
elements of a row, or a whole column with ``dim=0``); each block keeps one fp32 scale,
``scale = amax(|block|) / levels``, and its values become ``round(x / scale)`` in
``[-127, 127]`` (int8, ``signed=True``) or ``[0, 255]`` (uint8, for non-negative values).
All arithmetic runs in fp32 whatever the input dtype, so the int8 range stays symmetric
(never -128) for bf16 and fp16 inputs too. An all-zero block has scale 0 and stays 0.

Users of this module and their choices:

========================  ==========  ==========  =================  ==============
caller                    blocks      rounding    signed             non-finite
========================  ==========  ==========  =================  ==============
weights (``Int8Weight``)  rows        both        int8               ``"raise"``
activations (int8 GEMMs)  rows, cols  nearest     int8               ``"unchecked"``
8-bit optimizer states    in rows     nearest     int8 and uint8     ``"raise"``
gradient reduce-scatter   in rows     stochastic  int8               ``"propagate"``
========================  ==========  ==========  =================  ==============

Stochastic rounding is ``round(x / scale + v)`` with ``v = (r + 1/2) / 2**16 - 1/2`` and
``r`` a uniform 16-bit integer: ``floor(x / scale + u)`` with ``u`` uniform on the 2**16
midpoints of ``[0, 1)``. It rounds up with probability equal to the fraction of a step to
within 2**-17 (fp32 resolves ``x / scale`` to 2**-17 near 127 anyway), so it is unbiased,
and updates smaller than one step survive on average. The 16 bits come four to a 64-bit
draw of the caller's generator (see :mod:`fsdp_int8._generators`), a quarter of the draws
of one fp32 uniform per element: the same seed and saved state give the same rounding
(:func:`rounding_noise_bytes` says which bytes go to which value).

:func:`use_compiled_kernels` swaps the signed whole-row path and whole-row dequantization
for one ``torch.compile``-fused pass each, with the same arithmetic in the same order (the
same results, bit for bit); blocks, columns, uint8, ``nonfinite="propagate"`` and meta
tensors stay eager.
"""

from __future__ import annotations

import functools
import math
import warnings
from typing import Callable, Literal

import torch

__all__ = [
    "INT8_MAX", "UINT8_MAX", "ceil_div", "absmax_quantize", "absmax_dequantize",
    "use_compiled_kernels", "compiled_kernels_enabled",
]

INT8_MAX = 127  # symmetric: -127..127, so negation never overflows
UINT8_MAX = 255

Rounding = Literal["nearest", "stochastic"]
# "raise": a ValueError naming the count (weights, optimizer states: a NaN scale would
#   silently corrupt them). "propagate": a block holding NaN or Inf gets a non-finite
#   scale and in-range values (a collective must not raise on one rank only).
#   "unchecked": no check and no device sync (activations: NaN in, NaN out anyway).
NonFinite = Literal["raise", "propagate", "unchecked"]


def ceil_div(numerator: int, denominator: int) -> int:
    """``ceil(numerator / denominator)`` for non-negative integers."""
    return -(-numerator // denominator)


def _block_parts(length: int, block_size: int) -> list[tuple[slice, slice, int, int]]:
    """``(columns, scale columns, blocks, width)`` of a row's full blocks and its short tail.

    Splitting full blocks from the tail avoids padding (a copy of the whole tensor).
    """
    full, tail = divmod(length, block_size)
    parts = []
    if full:
        parts.append((slice(0, full * block_size), slice(0, full), full, block_size))
    if tail:
        parts.append((slice(full * block_size, length), slice(full, full + 1), 1, tail))
    return parts


def _check_block_size(block_size: int | None, dim: int) -> None:
    if block_size is None:
        return
    if isinstance(block_size, bool) or not isinstance(block_size, int):
        raise TypeError(f"block_size must be an int or None, got {block_size!r}")
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    if dim == 0:
        raise ValueError("blocks along columns (dim=0) are not supported: use block_size=None")


def _raise_non_finite(values: torch.Tensor, what: str, bits: str) -> None:
    bad = int((~torch.isfinite(values)).sum())
    raise ValueError(
        f"cannot quantize {what} of shape {tuple(values.shape)} to {bits}: it holds {bad} "
        "non-finite values (NaN or Inf). Check the loss, gradients and learning rate; a NaN "
        "scale would silently corrupt it."
    )


NOISE_BITS = 16
_NOISE_STEP = 2.0 ** -NOISE_BITS  # r * _NOISE_STEP, r in [-2**15, 2**15): the noise in steps
_NOISE_OFFSET = 2.0 ** -(NOISE_BITS + 1)  # ... plus half a noise step: symmetric about 0
_INT64_MIN = -(2**63)


def rounding_noise_bytes(shape: tuple[int, ...], generator: torch.Generator | None, device: torch.device) -> torch.Tensor:
    """The random bytes of :func:`rounding_noise`, ``int8 [..., 2 * shape[-1]]``: per row of
    ``K`` values, first their ``K`` high bytes, then their ``K`` low bytes.

    Eight bytes (four 16-bit values) to each 64-bit draw. Each half of a row is contiguous,
    so a compiled kernel reads both with vector loads (:func:`noise_from_bytes`); interleaved
    little-endian pairs would need gathers, which cost inductor's CPU code a quarter of the
    weight update.
    """
    count = math.prod(shape)
    words = torch.empty(ceil_div(count, 4), dtype=torch.int64, device=device)
    words.random_(_INT64_MIN, None, generator=generator)  # all 64 bits
    return words.view(torch.int8)[: 2 * count].view(*shape[:-1], 2 * shape[-1])


def noise_from_bytes(noise_bytes: torch.Tensor) -> torch.Tensor:
    """The 16-bit noise ``[..., K]`` from :func:`rounding_noise_bytes`' ``[..., 2K]`` bytes,
    as int32 (``high * 256 + unsigned low``): the form compiled kernels use, since inductor's
    CPU code vectorizes int8 loads and not int16 ones."""
    length = noise_bytes.shape[-1] // 2
    high, low = noise_bytes[..., :length], noise_bytes[..., length:]
    return high.to(torch.int32) * 256 + (low.to(torch.int32) & 255)


def rounding_noise(shape: tuple[int, ...], generator: torch.Generator | None, device: torch.device) -> torch.Tensor:
    """``int16`` uniform noise of ``shape``: :func:`noise_from_bytes`' values."""
    return _noise_values(shape, generator, device).to(torch.int16)


def _noise_values(shape: tuple[int, ...], generator: torch.Generator | None, device: torch.device) -> torch.Tensor:
    """:func:`rounding_noise`'s values as fp32 (exact: ``|r| < 2**15``), what the eager
    rounding adds: ``high * 256 + unsigned low``, built in fp32. Arithmetic, not an
    interleaving copy (a byte-strided ``torch.stack``, 5x slower on a CPU), and fp32, not
    int16 (an int16 operand sends ``add_`` down its type-promoting loop, 3x slower)."""
    noise_bytes = rounding_noise_bytes(shape, generator, device)
    length = shape[-1]
    high, low = noise_bytes[..., :length], noise_bytes[..., length:].view(torch.uint8)
    return high.to(torch.float32).mul_(256).add_(low.to(torch.float32))


def _round(
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
        scaled = torch.div(x, divisor).add_(_NOISE_OFFSET).add_(noise, alpha=_NOISE_STEP)
    return scaled.round_().clamp_(low, high).to(dtype)


def _round_into(
    x: torch.Tensor,
    amax: torch.Tensor,
    levels: int,
    *,
    signed: bool,
    rounding: Rounding,
    nonfinite: NonFinite,
    generator: torch.Generator | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(8-bit values, scale)`` of fp32 blocks ``x``; ``amax`` broadcasts against ``x``."""
    scale = amax / levels
    usable = scale > 0
    if nonfinite == "propagate":
        usable = usable & torch.isfinite(scale)
    # Zero (and, when propagating, non-finite) blocks divide by 1: their values stay
    # finite; a zero block rounds to 0, a non-finite one is carried by its scale.
    divisor = torch.where(usable, scale, torch.ones_like(scale))
    if rounding == "stochastic":
        noise = _noise_values(tuple(x.shape), generator, x.device)
    elif rounding == "nearest":
        noise = None
    else:
        raise ValueError(f"rounding must be 'nearest' or 'stochastic', got {rounding!r}")
    if nonfinite == "propagate":
        x = torch.where(usable, x, torch.zeros_like(x))  # NaN / Inf blocks: in-range values
    # |x / scale| <= levels up to one ulp of the division: the clamp keeps the range exact.
    q = _round(x, divisor, noise, -levels if signed else 0, levels, torch.int8 if signed else torch.uint8)
    return q, scale


# ---------------------------------------------------------------- compiled kernels
_COMPILED = {"enabled": False, "failed": False}  # failed: compiling raised once, never again


def use_compiled_kernels(enabled: bool = True) -> None:
    """Run whole-row quantization and dequantization (weights, their optimizer updates,
    activations) as ``torch.compile``d kernels, one fused pass each instead of five to
    ten, or eagerly again. Process-wide; off by default (``launch.train`` turns it on).
    Turning it on again after a failed compile retries compiling.

    The results are the same bit for bit. Each kernel compiles once per process and input
    dtype (dynamic shapes: seconds, cached on disk by inductor). If compiling fails (no C++
    compiler, an unsupported device) the call warns once and runs eagerly from then on.
    """
    _COMPILED["enabled"] = bool(enabled)
    if enabled:
        _COMPILED["failed"] = False


def compiled_kernels_enabled() -> bool:
    """Whether :func:`use_compiled_kernels` is on."""
    return _COMPILED["enabled"]


def _int8_rows(values: torch.Tensor, noise: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Signed int8, one scale per row, with ``_round_into``'s arithmetic (the compiled
    kernels' body; no integer arguments, which would become symbols and scalar code)."""
    x = values.float()
    scale = x.abs().amax(dim=1, keepdim=True) / INT8_MAX
    divisor = torch.where(scale > 0, scale, torch.ones_like(scale))
    return _round(x, divisor, noise, -INT8_MAX, INT8_MAX, torch.int8), scale.squeeze(1)


def _int8_rows_nearest(values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return _int8_rows(values, None)


def _int8_rows_stochastic(values: torch.Tensor, noise_bytes: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return _int8_rows(values, noise_from_bytes(noise_bytes))


def _dequantize_whole(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return torch.mul(q, scale).to(dtype)  # (a dtype argument is a constant, not a symbol)


def _dequantize_into(q: torch.Tensor, scale: torch.Tensor, out: torch.Tensor) -> None:
    """``out[...] = (q * scale)`` rounded to ``out``'s dtype: :func:`_dequantize_whole`'s
    values, written in place (compiled: one pass that stores straight into ``out``)."""
    out.copy_(torch.mul(q, scale))


def _mul_into(q: torch.Tensor, scale: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """Eagerly, :func:`_dequantize_whole`'s values written into ``out``: the product in
    fp32, rounded once to ``out``'s dtype. Converted first, then multiplied in place: a
    mixed int8 x fp32 ``torch.mul`` takes CPUs' slow type-promoting loop (1024 x 1024, one
    thread, AVX2: 2.2 ms, against 0.2 ms for the copy and the fp32 multiply)."""
    if out.dtype == torch.float32:
        return out.copy_(q).mul_(scale)
    return out.copy_(q.to(torch.float32).mul_(scale))


def dequantize_rows_into(q: torch.Tensor, scale: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """Write ``q [rows, K] * scale [rows]`` into the floating ``out [rows, K]`` in place.

    The same values as ``absmax_dequantize(q, scale, dtype=out.dtype)`` (fp32 products,
    rounded once to ``out``'s dtype), without a temporary of ``out``'s size where the
    compiled kernels are on. ``q`` may be strided (FSDP2's gathered buffer).
    """
    if q.shape != out.shape or tuple(scale.shape) != (q.shape[0],):
        raise ValueError(
            f"dequantize_rows_into needs q and out of one shape and one scale per row, got "
            f"q {tuple(q.shape)}, scale {tuple(scale.shape)}, out {tuple(out.shape)}"
        )
    with torch.no_grad():  # `out` may be a parameter (FSDP2's unsharded weight)
        target = out.detach()
        if _use_compiled(q):
            run_compiled(_dequantize_into, q, scale.unsqueeze(1), target)
        else:
            _mul_into(q, scale.unsqueeze(1), target)
    return out


@functools.cache
def compiled(function: Callable) -> Callable:
    """``torch.compile(function, dynamic=True)``, made once per function."""
    return torch.compile(function, dynamic=True)


def run_compiled(function: Callable, *args):
    """``compiled(function)(*args)``; on a compile failure, warn once and go eager for good.

    An error that the eager function raises too is the caller's: it propagates, and the
    compiled kernels stay on.
    """
    if _COMPILED["failed"]:
        return function(*args)
    try:
        return compiled(function)(*args)
    except Exception as error:  # noqa: BLE001 -- sorted out by the eager run below
        result = function(*args)
        _COMPILED["enabled"], _COMPILED["failed"] = False, True
        warnings.warn(
            f"fsdp_int8: torch.compile failed ({type(error).__name__}: {str(error)[:200]}); "
            "quantization kernels run eagerly from now on",
            RuntimeWarning,
            stacklevel=3,
        )
        return result


def _use_compiled(tensor: torch.Tensor) -> bool:
    return _COMPILED["enabled"] and not tensor.is_meta and tensor.numel() > 0


def _signed_absmax(x: torch.Tensor, dim: int) -> torch.Tensor:
    """``max |x|`` along ``dim``, NaN propagating, without an ``|x|`` temporary. Two
    reductions, not ``torch.aminmax``: on AVX2-only CPUs aminmax is a scalar loop, 10-20x
    slower than amax plus amin (1024 x 1024 fp32, one thread: 3.2 ms against 0.16 ms)."""
    return torch.maximum(x.amax(dim=dim), x.amin(dim=dim).neg())


def absmax_quantize(
    values: torch.Tensor,
    *,
    dim: int = -1,
    block_size: int | None = None,
    signed: bool = True,
    rounding: Rounding = "nearest",
    generator: torch.Generator | None = None,
    nonfinite: NonFinite = "raise",
    out: torch.Tensor | None = None,
    what: str = "a tensor",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize a 2-D floating tensor with one absmax scale per block.

    Args:
        values: ``[rows, K]``, any floating dtype (the arithmetic runs in fp32); may be
            strided.
        dim: ``-1`` (or ``1``): blocks run along rows; ``0``: one scale per column
            (no transposed copy is made).
        block_size: Elements per block along a row; ``None``: the whole row (or column).
            The last block of a row holds ``K % block_size`` elements when that is not 0.
        signed: ``int8`` in ``[-127, 127]``; otherwise ``uint8`` in ``[0, 255]`` (for
            non-negative values).
        rounding: ``"nearest"`` or ``"stochastic"`` (``floor(x / scale + u)``).
        generator: Source of the stochastic-rounding noise.
        nonfinite: What a NaN or Inf does (see :data:`NonFinite`).
        out: Optional destination of the 8-bit values (``values``' shape, may be strided).
        what: How an error message names ``values``.

    Returns:
        ``(q, scale)``: ``q`` of ``values``' shape; ``scale`` fp32 ``[rows]`` (whole rows),
        ``[K]`` (``dim=0``) or ``[rows, ceil(K / block_size)]`` (blocks).

    Raises:
        ValueError: with ``nonfinite="raise"``, if ``values`` holds NaN or Inf.
    """
    if values.dim() != 2:
        raise ValueError(f"absmax_quantize expects a 2-D tensor, got shape {tuple(values.shape)}")
    if not values.is_floating_point():
        raise TypeError(f"absmax_quantize expects a floating tensor, got {values.dtype}")
    if dim not in (-1, 0, 1):
        raise ValueError(f"dim must be -1, 0 or 1, got {dim}")
    _check_block_size(block_size, dim)
    dim = -1 if dim == 1 else dim
    levels = INT8_MAX if signed else UINT8_MAX
    q_dtype = torch.int8 if signed else torch.uint8
    rows, length = values.shape
    if out is not None and (out.shape != values.shape or out.dtype != q_dtype):
        raise ValueError(f"out must be {q_dtype} of shape {tuple(values.shape)}, got {out.dtype} {tuple(out.shape)}")
    if rounding not in ("nearest", "stochastic"):
        raise ValueError(f"rounding must be 'nearest' or 'stochastic', got {rounding!r}")
    options = dict(signed=signed, rounding=rounding, nonfinite=nonfinite, generator=generator)
    if block_size is None and dim == -1 and signed and nonfinite != "propagate" and _use_compiled(values):
        if rounding == "stochastic":
            noise_bytes = rounding_noise_bytes((rows, length), generator, values.device)
            q, scale = run_compiled(_int8_rows_stochastic, values, noise_bytes)
        else:
            q, scale = run_compiled(_int8_rows_nearest, values)
        if nonfinite == "raise" and not bool(torch.isfinite(scale).all()):
            _raise_non_finite(values, what, "int8" if signed else "uint8")
        return (q if out is None else out.copy_(q)), scale
    if out is None:
        out = torch.empty(rows, length, dtype=q_dtype, device=values.device)
    values32 = values.float()

    if block_size is None:  # one block per row (dim=-1) or per column (dim=0)
        reduced = length if dim == -1 else rows
        if reduced == 0:
            amax = values32.new_zeros(rows if dim == -1 else length)
        elif signed:
            amax = _signed_absmax(values32, dim)
        else:
            amax = values32.amax(dim=dim)
        if nonfinite == "raise" and not values.is_meta and not bool(torch.isfinite(amax).all()):
            _raise_non_finite(values, what, "int8" if signed else "uint8")
        rounded, scale = _round_into(values32, amax.unsqueeze(dim), levels, **options)
        out.copy_(rounded)
        return out, scale.squeeze(dim)

    scales = torch.empty(rows, ceil_div(length, block_size), dtype=torch.float32, device=values.device)
    parts = []
    for columns, scale_columns, blocks, width in _block_parts(length, block_size):
        x = values32[:, columns].reshape(rows, blocks, width)
        if signed:
            amax = _signed_absmax(x, 2)
        else:
            amax = x.amax(dim=2)
        parts.append((x, amax, columns, scale_columns, blocks, width))
    if nonfinite == "raise" and not values.is_meta and not all(
        bool(torch.isfinite(part[1]).all()) for part in parts
    ):
        _raise_non_finite(values, what, "int8" if signed else "uint8")
    for x, amax, columns, scale_columns, blocks, width in parts:
        rounded, scale = _round_into(x, amax.unsqueeze(2), levels, **options)
        scales[:, scale_columns] = scale.squeeze(2)
        out[:, columns].view(rows, blocks, width).copy_(rounded)
    return out, scales


def absmax_dequantize(
    q: torch.Tensor,
    scale: torch.Tensor,
    *,
    dim: int = -1,
    block_size: int | None = None,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Inverse of :func:`absmax_quantize`: ``q * scale`` per block, in ``dtype``.

    Args:
        q: ``[rows, K]`` int8 or uint8.
        scale: As returned by :func:`absmax_quantize` for the same ``dim`` / ``block_size``.
        dim: ``-1`` (per row or blocks in rows) or ``0`` (per column).
        block_size: As given to :func:`absmax_quantize`.
        dtype: Result dtype.
    """
    if q.dim() != 2:
        raise ValueError(f"absmax_dequantize expects a 2-D tensor, got shape {tuple(q.shape)}")
    _check_block_size(block_size, dim)
    rows, length = q.shape
    if block_size is None:
        expected = (length,) if dim == 0 else (rows,)
        if tuple(scale.shape) != expected:
            raise ValueError(f"scales of shape {expected} expected for {tuple(q.shape)}, got {tuple(scale.shape)}")
        scale = scale.unsqueeze(0 if dim == 0 else 1)
        if _use_compiled(q):
            return run_compiled(_dequantize_whole, q, scale, dtype)
        return _mul_into(q, scale, torch.empty(q.shape, dtype=dtype, device=q.device))
    if tuple(scale.shape) != (rows, ceil_div(length, block_size)):
        raise ValueError(
            f"{rows} rows of {length} values in blocks of {block_size} need scales of shape "
            f"{(rows, ceil_div(length, block_size))}, got {tuple(scale.shape)}"
        )
    result = torch.empty(rows, length, dtype=dtype, device=q.device)
    for columns, scale_columns, blocks, width in _block_parts(length, block_size):
        _mul_into(q[:, columns].reshape(rows, blocks, width), scale[:, scale_columns].unsqueeze(2),
                  result[:, columns].view(rows, blocks, width))
    return result
