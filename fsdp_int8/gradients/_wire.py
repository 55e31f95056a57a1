"""The all-to-all wire format of the quantized reduce-scatter: pack, then unpack and sum.

Row ``j`` of a sender's ``int8 [world, segment_bytes(S)]`` buffer goes to rank ``j``; the
slice that rank ``i`` sends to rank ``j`` (``nb = ceil(S / block_size)``)::

    | q[0] q[1] ... q[S-1]  (S int8) | scale[0] ... scale[nb-1]  (nb fp32 = 4 * nb bytes) |

The last block of a slice may be partial (``S % block_size`` values): its scale is the
absmax of those values only, and nothing is padded on the wire. An all-zero block has
scale 0 and arrives as exact zeros. A block holding NaN or Inf gets a non-finite scale and
arrives non-finite (NaN or Inf in every element of that block). The quantization itself is
:func:`fsdp_int8.quant.absmax_quantize` (stochastic rounding, ``nonfinite="propagate"``).
"""

from __future__ import annotations

import torch

from fsdp_int8._quant.kernels import ceil_div
from fsdp_int8.quant import absmax_dequantize, absmax_quantize

__all__ = ["DEFAULT_BLOCK_SIZE", "segment_bytes", "pack_segments", "unpack_and_sum"]

DEFAULT_BLOCK_SIZE = 256


def segment_bytes(numel: int, block_size: int = DEFAULT_BLOCK_SIZE) -> int:
    """Bytes of one rank-to-rank slice on the wire: ``numel`` int8 values + 4 bytes a block."""
    return numel + torch.float32.itemsize * ceil_div(numel, block_size)


@torch.no_grad()
def pack_segments(
    slices: torch.Tensor,
    skip: int | None,
    block_size: int = DEFAULT_BLOCK_SIZE,
    *,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """The all-to-all send buffer: ``int8 [world, segment_bytes(S)]``, row ``j`` for rank ``j``.

    Args:
        slices: ``[world, S]`` view of the rank-major reduce-scatter input.
        skip: The sender's own rank: its row is zeroed instead of quantized (the receiver
            adds its own slice exactly; the slot only keeps the buffer rank-major).
        block_size: Values per block.
        generator: Stochastic-rounding noise.
    """
    world, numel = slices.shape
    send = torch.empty(world, segment_bytes(numel, block_size), dtype=torch.int8, device=slices.device)
    ranges = [(0, world)] if skip is None else [(0, skip), (skip + 1, world)]
    for start, stop in ranges:
        if stop <= start:
            continue
        _, scales = absmax_quantize(
            slices[start:stop], block_size=block_size, rounding="stochastic",
            generator=generator, nonfinite="propagate", out=send[start:stop, :numel],
        )
        send[start:stop, numel:] = scales.view(torch.int8)  # fp32 scales as raw bytes
    if skip is not None:
        send[skip].zero_()
    return send


@torch.no_grad()
def unpack_and_sum(
    received: torch.Tensor,
    own: torch.Tensor,
    own_rank: int,
    block_size: int = DEFAULT_BLOCK_SIZE,
    *,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Sum, in fp32, the rank's own slice and every peer's dequantized segment.

    Args:
        received: ``int8 [world, segment_bytes(S)]``: row ``i`` came from rank ``i``.
        own: This rank's own ``[S]`` slice, in full precision (row ``own_rank`` of
            ``received`` is ignored).
        own_rank: This rank's index in the group.
        block_size: Values per block.
        out: Optional ``fp32 [S]`` accumulator (e.g. FSDP2's output buffer).

    Returns:
        ``fp32 [S]``: ``own + sum over peers of dequantize(segment)``, peers in rank order.
    """
    world, width = received.shape
    numel = own.numel()
    if width != segment_bytes(numel, block_size):
        raise ValueError(
            f"received segments of {width} bytes; {numel} values in blocks of {block_size} "
            f"need {segment_bytes(numel, block_size)}"
        )
    if out is None:
        out = own.to(torch.float32, copy=True)
    else:
        out.copy_(own)
    # Scales travel as raw bytes at offset S, which need not be 4-byte aligned: copy them
    # out (4 bytes a block) before viewing them as fp32.
    scales = received[:, numel:].contiguous().view(torch.float32)
    for peer in range(world):
        if peer != own_rank:  # one peer at a time: S temporary values, not world * S
            segment = received[peer: peer + 1, :numel]
            out.add_(absmax_dequantize(segment, scales[peer: peer + 1], block_size=block_size)[0])
    return out
