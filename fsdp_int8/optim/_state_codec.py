"""Block-wise 8-bit optimizer states: the codec of :class:`~fsdp_int8.Int8AdamW`'s moments.

A state ``[rows, K]`` is cut into blocks of ``block_size`` consecutive elements of one
row (the last block of a row may be shorter); each block keeps one fp32 absmax scale.
Blocks never span two rows, so any set of rows (one rank's shard) quantizes to the same
bytes and scales as in the whole tensor, and checkpoints reshard bit-exactly. The
arithmetic is :func:`fsdp_int8.quant.absmax_quantize`'s, with round to nearest.
"""

from __future__ import annotations

import torch

from fsdp_int8.quant import NonFinite, absmax_dequantize, absmax_quantize


def quantize_state_blocks(
    values: torch.Tensor, block_size: int, *, signed: bool, out: torch.Tensor | None = None,
    nonfinite: NonFinite = "raise",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Round-to-nearest block-wise absmax quantization of a ``[rows, K]`` float state.

    Returns ``(q, scale)``: ``q`` is ``[rows, K]`` int8 in ``[-127, 127]`` (``signed``) or
    uint8 in ``[0, 255]`` (``values`` must then be >= 0), written into ``out`` if given;
    ``scale`` is fp32 ``[rows, ceil(K / block_size)]``, ``absmax(block) / levels``.
    Unsigned quantization never rounds a positive value to 0: it is the square root of a
    second moment, and a zero there would turn the Adam denominator into ``eps`` (see
    :class:`~fsdp_int8.Int8AdamW`).

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
