"""Block-wise 8-bit and 4-bit optimizer states: the codecs of :class:`~fsdp_int8.Int8AdamW`'s moments.

A state ``[rows, K]`` is cut into blocks of ``block_size`` consecutive elements of one
row (the last block of a row may be shorter); each block keeps one fp32 absmax scale.
Blocks never span two rows, so any set of rows (one rank's shard) quantizes to the same
bytes and scales as in the whole tensor, and checkpoints reshard bit-exactly. Rounding
is to the nearest level (deterministic: a resumed run repeats the same bits).

* 8 bits: :func:`fsdp_int8.quant.absmax_quantize`'s linear levels, int8 for the signed
  first moment and uint8 for the second moment's square root.
* 4 bits: sixteen levels of a table (``SIGNED_4BIT_LEVELS`` / ``UNSIGNED_4BIT_LEVELS``,
  fractions of the block's absmax), two codes per byte along the row: ``[rows, ceil(K/2)]``
  uint8, element ``2j`` in the low nibble, ``2j + 1`` in the high one. Why these tables:
  docs/optim.md, "4-bit states".

Unsigned states never round a positive value to level 0: they hold the square root of a
second moment, and a zero there would turn the Adam denominator into ``eps``.
"""

from __future__ import annotations

import torch

from fsdp_int8._quant.kernels import ceil_div
from fsdp_int8.quant import NonFinite, block_parts, absmax_dequantize, absmax_quantize, raise_non_finite

# The first moment's levels: a square law, 7 magnitudes each side of 0 (finer near 0, where
# most of a block's values sit) and one spare code (15) that is never written.
SIGNED_4BIT_LEVELS = tuple(sorted({s * (k / 7) ** 2 for k in range(1, 8) for s in (-1, 1)} | {0.0}))
# The square root of the second moment: 0 (exact zeros only) and 15 linear steps.
UNSIGNED_4BIT_LEVELS = tuple(k / 15 for k in range(16))

# Each quantized precision's state entries (:class:`~fsdp_int8.Int8AdamW`'s): the first
# moment and its scales, then the second moment's square root and its scales.
STATE_NAMES = {
    8: ("exp_avg_int8", "exp_avg_scale", "exp_avg_sq_sqrt_uint8", "exp_avg_sq_sqrt_scale"),
    4: ("exp_avg_4bit", "exp_avg_scale", "exp_avg_sq_sqrt_4bit", "exp_avg_sq_sqrt_scale"),
}
# Elements per block of a state of each precision when no block_size is given.
DEFAULT_BLOCK = {32: 64, 8: 64, 4: 128}

_TABLES: dict[tuple[bool, torch.device], tuple[torch.Tensor, torch.Tensor]] = {}


def _table(signed: bool, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """``(levels, boundaries)`` on ``device`` (made once per device: no copy per step).
    A value rounds to the level whose boundary interval holds it (midpoints of levels)."""
    key = (signed, device)
    if key not in _TABLES:
        levels = torch.tensor(SIGNED_4BIT_LEVELS if signed else UNSIGNED_4BIT_LEVELS, dtype=torch.float32)
        _TABLES[key] = (levels.to(device), ((levels[1:] + levels[:-1]) / 2).to(device))
    return _TABLES[key]


def quantize_state_blocks(
    values: torch.Tensor, block_size: int, *, signed: bool, out: torch.Tensor | None = None,
    nonfinite: NonFinite = "raise",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Round-to-nearest block-wise 8-bit absmax quantization of a ``[rows, K]`` float state.

    Returns ``(q, scale)``: ``q`` is ``[rows, K]`` int8 in ``[-127, 127]`` (``signed``) or
    uint8 in ``[0, 255]`` (``values`` must then be >= 0), written into ``out`` if given;
    ``scale`` is fp32 ``[rows, ceil(K / block_size)]``, ``absmax(block) / levels``.

    ``nonfinite="propagate"`` leaves the check to the caller: a block holding NaN or Inf
    gets a non-finite scale (an optimizer step on an accelerator reads that verdict once
    per step, :mod:`fsdp_int8._weight.update_checks`).

    Raises:
        ValueError: with ``nonfinite="raise"``, if ``values`` holds NaN or Inf (a NaN scale
            would corrupt the state).
    """
    q, scale = absmax_quantize(
        values, block_size=block_size, signed=signed, rounding="nearest", nonfinite=nonfinite,
        out=out, what="an optimizer state",
    )
    if not signed:
        torch.maximum(q, (values > 0).to(torch.uint8), out=q)  # level 0 only for exact zeros
    return q, scale


def dequantize_state_blocks(q: torch.Tensor, scale: torch.Tensor, block_size: int) -> torch.Tensor:
    """Inverse of :func:`quantize_state_blocks`: fp32 ``[rows, K]``, contiguous."""
    return absmax_dequantize(q, scale, block_size=block_size, dtype=torch.float32)


def packed_columns(length: int) -> int:
    """Bytes per row of a 4-bit state whose rows hold ``length`` values."""
    return ceil_div(length, 2)


def quantize_state_4bit(
    values: torch.Tensor, block_size: int, *, signed: bool, out: torch.Tensor, nonfinite: NonFinite = "raise",
) -> torch.Tensor:
    """Block-wise 4-bit quantization of a ``[rows, K]`` float state into ``out``
    (uint8 ``[rows, ceil(K / 2)]``, two codes per byte); returns the fp32 scales
    ``[rows, ceil(K / block_size)]``: each block's absmax (its level 1.0).

    ``values`` must be >= 0 when not ``signed``. ``nonfinite`` as for
    :func:`quantize_state_blocks` (a block with NaN or Inf gets a non-finite scale and
    level-0 codes with ``"propagate"``).

    Raises:
        ValueError: ``out`` of the wrong shape or dtype; with ``nonfinite="raise"``,
            ``values`` holds NaN or Inf.
    """
    rows, length = values.shape
    if out.dtype != torch.uint8 or tuple(out.shape) != (rows, packed_columns(length)):
        raise ValueError(f"out must be uint8 of shape {(rows, packed_columns(length))}, "
                         f"got {out.dtype} {tuple(out.shape)}")
    levels, boundaries = _table(signed, values.device)
    values32 = values.float()
    scales = torch.empty(rows, ceil_div(length, block_size), dtype=torch.float32, device=values.device)
    codes = torch.zeros(rows, 2 * out.shape[1], dtype=torch.uint8, device=values.device)
    for columns, scale_columns, blocks, width in block_parts(length, block_size):
        x = values32[:, columns].reshape(rows, blocks, width)
        amax = x.abs().amax(dim=2, keepdim=True)
        scales[:, scale_columns] = amax.squeeze(2)
        usable = amax > 0
        if nonfinite == "propagate":
            usable = usable & torch.isfinite(amax)
        fraction = x / torch.where(usable, amax, torch.ones_like(amax))
        if nonfinite == "propagate":
            fraction = torch.where(usable, fraction, torch.zeros_like(fraction))
        index = torch.bucketize(fraction, boundaries, out_int32=True)
        codes[:, columns].view(rows, blocks, width).copy_(index)
    if nonfinite == "raise" and not values.is_meta and not bool(torch.isfinite(scales).all()):
        raise_non_finite(values, "an optimizer state", "4 bits")
    if signed:
        codes[:, length:] = SIGNED_4BIT_LEVELS.index(0.0)  # a pad code of an odd row: level 0
    else:
        torch.maximum(codes[:, :length], (values32 > 0).to(torch.uint8), out=codes[:, :length])
    torch.bitwise_or(codes[:, 0::2], codes[:, 1::2] << 4, out=out)
    return scales


def dequantize_state_4bit(packed: torch.Tensor, scale: torch.Tensor, block_size: int, length: int,
                          *, signed: bool) -> torch.Tensor:
    """Inverse of :func:`quantize_state_4bit`: fp32 ``[rows, length]``, contiguous.

    Raises:
        ValueError: ``packed`` or ``scale`` does not fit ``length`` and ``block_size``.
    """
    rows = packed.shape[0]
    if packed.shape[1] != packed_columns(length) or tuple(scale.shape) != (rows, ceil_div(length, block_size)):
        raise ValueError(
            f"a 4-bit state of {rows} rows of {length} values in blocks of {block_size} is uint8 "
            f"{(rows, packed_columns(length))} with scales {(rows, ceil_div(length, block_size))}, "
            f"got {tuple(packed.shape)} and {tuple(scale.shape)}"
        )
    levels, _ = _table(signed, packed.device)
    codes = torch.stack((packed & 15, packed >> 4), dim=2).view(rows, -1)[:, :length]
    result = levels[codes.int()]
    for columns, scale_columns, blocks, width in block_parts(length, block_size):
        result[:, columns].view(rows, blocks, width).mul_(scale[:, scale_columns].unsqueeze(2))
    return result


def quantize_moment(bits: int, values: torch.Tensor, block_size: int, *, signed: bool, out: torch.Tensor,
                    nonfinite: NonFinite = "raise") -> torch.Tensor:
    """Quantize a ``[rows, K]`` moment into ``out`` in ``bits`` (8 or 4); its scales."""
    if bits == 8:
        return quantize_state_blocks(values, block_size, signed=signed, out=out, nonfinite=nonfinite)[1]
    return quantize_state_4bit(values, block_size, signed=signed, out=out, nonfinite=nonfinite)


def dequantize_moments(bits: int, stored: tuple[torch.Tensor, ...], block_size: int,
                       length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 ``(m, r)`` ``[rows, length]`` from ``stored`` = ``(q_m, s_m, q_r, s_r)`` (the
    entries of ``STATE_NAMES[bits]``): the first moment and the second moment's square root."""
    q_m, s_m, q_r, s_r = stored
    if bits == 8:
        return dequantize_state_blocks(q_m, s_m, block_size), dequantize_state_blocks(q_r, s_r, block_size)
    return (dequantize_state_4bit(q_m, s_m, block_size, length, signed=True),
            dequantize_state_4bit(q_r, s_r, block_size, length, signed=False))
