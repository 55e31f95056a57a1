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

Stochastic rounding adds 16 bits of uniform noise per value (:mod:`fsdp_int8._quant.noise`).
``compiled=True`` runs the signed whole-row path and whole-row dequantization as one
``torch.compile``-fused pass each (:mod:`fsdp_int8._quant.kernels`), with the same arithmetic in
the same order (the same results, bit for bit); blocks, columns, uint8,
``nonfinite="propagate"`` and meta tensors stay eager.
"""

from __future__ import annotations

from typing import Literal

import torch

from fsdp_int8._quant.kernels import (
    INT8_MAX,
    UINT8_MAX,
    ceil_div,
    dequantize_into,
    dequantize_whole,
    int8_rows,
    round_scaled,
    run_compiled,
    run_rounding,
    use_compiled,
)
from fsdp_int8._quant.noise import noise_values

__all__ = ["absmax_quantize", "absmax_dequantize", "dequantize_rows_into", "signed_row_absmax"]

Rounding = Literal["nearest", "stochastic"]
# What a NaN or Inf does in :func:`absmax_quantize` (its ``nonfinite`` says each value).
NonFinite = Literal["raise", "propagate", "unchecked"]


def block_parts(length: int, block_size: int) -> list[tuple[slice, slice, int, int]]:
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


def raise_non_finite(values: torch.Tensor, what: str, bits: str) -> None:
    bad = int((~torch.isfinite(values)).sum())
    raise ValueError(
        f"cannot quantize {what} of shape {tuple(values.shape)} to {bits}: it holds {bad} "
        "non-finite values (NaN or Inf). Check the loss, gradients and learning rate; a NaN "
        "scale would silently corrupt it."
    )


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
        noise = noise_values(tuple(x.shape), generator, x.device)
    elif rounding == "nearest":
        noise = None
    else:
        raise ValueError(f"rounding must be 'nearest' or 'stochastic', got {rounding!r}")
    if nonfinite == "propagate":
        x = torch.where(usable, x, torch.zeros_like(x))  # NaN / Inf blocks: in-range values
    # |x / scale| <= levels up to one ulp of the division: the clamp keeps the range exact.
    q = round_scaled(x, divisor, noise, -levels if signed else 0, levels, torch.int8 if signed else torch.uint8)
    return q, scale


# A low-precision result's fp32 products are made a block of rows at a time: at most an
# eighth of the elements (a quarter of a bf16 result's bytes) or this many, whichever is
# more. Whole, they would take twice a bf16 result's bytes: for an output head, the peak
# of a training step.
_FP32_BLOCK_ELEMENTS = 1 << 20


def _mul_into(q: torch.Tensor, scale: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """Eagerly, ``dequantize_whole``'s values written into ``out``: the product in
    fp32, rounded once to ``out``'s dtype. Converted first, then multiplied in place: a
    mixed int8 x fp32 ``torch.mul`` takes CPUs' slow type-promoting loop, about 10x slower
    than the copy and the fp32 multiply (docs/performance.md, "Kernel choices").
    ``scale`` broadcasts against ``q`` (one per row, or one row for all)."""
    if out.dtype == torch.float32:
        return out.copy_(q).mul_(scale)
    row_elements = max(1, out[0].numel()) if out.shape[0] else 1
    block = max(1, max(out.numel() // 8, _FP32_BLOCK_ELEMENTS) // row_elements)
    for start in range(0, out.shape[0], block):
        rows = slice(start, start + block)
        out[rows].copy_(q[rows].to(torch.float32).mul_(scale if scale.shape[0] == 1 else scale[rows]))
    return out


def dequantize_rows_into(
    q: torch.Tensor, scale: torch.Tensor, out: torch.Tensor, *, compiled: bool = False
) -> torch.Tensor:
    """Write ``q [rows, K] * scale [rows]`` into the floating ``out [rows, K]`` in place
    (or ``[*lead, K]`` rows with ``[*lead]`` scales: a MoE weight ``[experts, out, in]``).

    The same values as ``absmax_dequantize(q, scale, dtype=out.dtype)`` (fp32 products,
    rounded once to ``out``'s dtype), without a temporary of ``out``'s size where the
    kernel is compiled.

    Args:
        q: int8 values; may be strided (FSDP2's gathered buffer).
        scale: One fp32 scale per row.
        out: The floating destination, ``q``'s shape; may be a parameter (this runs under
            ``no_grad``).
        compiled: Run as one ``torch.compile``d pass (same bits).

    Returns:
        ``out``.

    Raises:
        ValueError: ``q`` and ``out`` differ in shape, or ``scale`` is not one per row.
    """
    if q.shape != out.shape or q.dim() < 2 or tuple(scale.shape) != tuple(q.shape[:-1]):
        raise ValueError(
            f"dequantize_rows_into needs q and out of one shape and one scale per row, got "
            f"q {tuple(q.shape)}, scale {tuple(scale.shape)}, out {tuple(out.shape)}"
        )
    with torch.no_grad():  # `out` may be a parameter (FSDP2's unsharded weight)
        target = out.detach()
        if use_compiled(compiled, q):
            run_compiled(dequantize_into, q, scale.unsqueeze(-1), target)
        else:
            _mul_into(q, scale.unsqueeze(-1), target)
    return out


def _signed_absmax(x: torch.Tensor, dim: int) -> torch.Tensor:
    """``max |x|`` along ``dim``, NaN propagating, without an ``|x|`` temporary. Two
    reductions, not ``torch.aminmax``: on AVX2-only CPUs aminmax is a scalar loop, 10-20x
    slower than amax plus amin (docs/performance.md, "Kernel choices")."""
    return torch.maximum(x.amax(dim=dim), x.amin(dim=dim).neg())


def signed_row_absmax(values: torch.Tensor) -> torch.Tensor:
    """``max |x|`` of each row of a 2-D tensor: the absmax :func:`absmax_quantize` scales
    whole rows by. fp32 ``[rows]``; 0 for rows of length 0; NaN propagates.

    Args:
        values: A 2-D floating tensor ``[rows, K]``.
    """
    if values.shape[1] == 0:
        return values.new_zeros(values.shape[0], dtype=torch.float32)
    return _signed_absmax(values.float(), 1)


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
    compiled: bool = False,
    amax: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize a 2-D floating tensor with one absmax scale per block.

    Each block keeps ``scale = amax(|block|) / levels`` (127 or 255) and its values become
    ``round(x / scale)``; an all-zero block has scale 0 and stays 0.

    Args:
        values: ``[rows, K]``, any floating dtype (the arithmetic runs in fp32); may be
            strided.
        dim: ``-1`` (or ``1``): blocks run along rows; ``0``: one scale per column
            (no transposed copy is made).
        block_size: Elements per block along a row; ``None``: the whole row (or column).
            The last block of a row holds ``K % block_size`` elements when that is not 0.
        signed: ``int8`` in ``[-127, 127]``; otherwise ``uint8`` in ``[0, 255]`` (for
            non-negative values).
        rounding: ``"nearest"`` or ``"stochastic"``: ``floor(x / scale + u)`` with ``u``
            uniform on the 2^16 midpoints of ``[0, 1)``, unbiased.
        generator: Source of the stochastic-rounding noise (default: torch's).
        nonfinite: What a NaN or Inf does. ``"raise"``: ``ValueError`` naming the count,
            before anything is written (weights, optimizer states: a NaN scale would
            silently corrupt them). ``"propagate"``: its block gets a non-finite scale and
            in-range values (collectives, which must not raise on one rank only).
            ``"unchecked"``: no check and no device sync (activations).
        out: Optional destination of the 8-bit values (``values``' shape, may be strided).
        what: How an error message names ``values`` (``"a weight"``, ...).
        compiled: Run the signed whole-row path as one ``torch.compile``d pass (same bits).
        amax: Whole rows only: each row's absmax to scale by, ``[rows]`` fp32, at least the
            row's own (tensor-parallel peers holding parts of one row share the whole
            row's). The non-finite check is then the caller's; nothing is clipped.

    Returns:
        ``(q, scale)``: ``q`` of ``values``' shape; ``scale`` fp32 ``[rows]`` (whole rows),
        ``[K]`` (``dim=0``) or ``[rows, ceil(K / block_size)]`` (blocks).

    Raises:
        ValueError: ``values`` is not 2-D; a bad ``dim``, ``rounding``, ``out`` or
            ``amax``; ``block_size < 1``; blocks with ``dim=0``; with ``nonfinite="raise"``,
            NaN or Inf in ``values``.
        TypeError: a non-floating tensor or a non-int ``block_size``.

    Example::

        q, scale = absmax_quantize(x, block_size=64)
        x_hat = absmax_dequantize(q, scale, block_size=64)   # within half a step of x
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
    if amax is not None:
        if block_size is not None or dim != -1 or tuple(amax.shape) != (rows,):
            raise ValueError(f"amax= gives whole rows' absmax: [{rows}] with dim=-1 and no blocks")
        rounded, scale = _round_into(values.float(), amax.float().unsqueeze(1), levels, **options)
        out = rounded if out is None else out.copy_(rounded)
        return out, scale.squeeze(1)
    if block_size is None and dim == -1 and signed and nonfinite != "propagate" and use_compiled(compiled, values):
        q, scale = run_rounding(
            int8_rows, values, rows=rows, row_len=length, generator=generator, stochastic=rounding == "stochastic"
        )
        if nonfinite == "raise" and not bool(torch.isfinite(scale).all()):
            raise_non_finite(values, what, "int8" if signed else "uint8")
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
            raise_non_finite(values, what, "int8" if signed else "uint8")
        rounded, scale = _round_into(values32, amax.unsqueeze(dim), levels, **options)
        out.copy_(rounded)
        return out, scale.squeeze(dim)

    scales = torch.empty(rows, ceil_div(length, block_size), dtype=torch.float32, device=values.device)
    parts = []
    for columns, scale_columns, blocks, width in block_parts(length, block_size):
        x = values32[:, columns].reshape(rows, blocks, width)
        if signed:
            amax = _signed_absmax(x, 2)
        else:
            amax = x.amax(dim=2)
        parts.append((x, amax, columns, scale_columns, blocks, width))
    if nonfinite == "raise" and not values.is_meta and not bool(  # one read for all parts
        torch.stack([torch.isfinite(part[1]).all() for part in parts]).all()
    ):
        raise_non_finite(values, what, "int8" if signed else "uint8")
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
    compiled: bool = False,
) -> torch.Tensor:
    """Inverse of :func:`absmax_quantize`: ``q * scale`` per block, computed in fp32 and
    rounded once to ``dtype``.

    Args:
        q: ``[rows, K]`` int8 or uint8.
        scale: As returned by :func:`absmax_quantize` for the same ``dim`` / ``block_size``.
        dim: ``-1`` (per row or blocks in rows) or ``0`` (per column).
        block_size: As given to :func:`absmax_quantize`.
        dtype: Result dtype.
        compiled: Dequantize whole rows as one ``torch.compile``d pass (same bits).

    Returns:
        ``[rows, K]`` in ``dtype``.

    Raises:
        ValueError: ``q`` is not 2-D, or ``scale`` has the wrong shape.
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
        if use_compiled(compiled, q):
            return run_compiled(dequantize_whole, q, scale, dtype)
        return _mul_into(q, scale, torch.empty(q.shape, dtype=dtype, device=q.device))
    if tuple(scale.shape) != (rows, ceil_div(length, block_size)):
        raise ValueError(
            f"{rows} rows of {length} values in blocks of {block_size} need scales of shape "
            f"{(rows, ceil_div(length, block_size))}, got {tuple(scale.shape)}"
        )
    result = torch.empty(rows, length, dtype=dtype, device=q.device)
    for columns, scale_columns, blocks, width in block_parts(length, block_size):
        _mul_into(q[:, columns].reshape(rows, blocks, width), scale[:, scale_columns].unsqueeze(2),
                  result[:, columns].view(rows, blocks, width))
    return result
