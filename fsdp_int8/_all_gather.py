"""The FSDP2 all-gather wire format of an int8 weight (pure functions on plain tensors).

Each rank sends ONE int8 buffer of shape ``[padded_rows, K + 4]``: its rows' int8 values
followed by the 4 bytes of each row's fp32 scale, zero-padded to
``padded_rows = ceil(full_rows / shard_world_size)``. Why this shape (docs/design.md):

* FSDP2's world-size-1 path forwards only the first all-gather input, so the scales must
  ride in the same tensor as the data;
* FSDP2's 5-argument hook requires every input of an unevenly sharded parameter to have
  the padded sharded size ``[padded_rows, K]``, which no scale vector can have; the
  1-argument hook skips that check, so we pad ourselves, using the ``full_rows`` that
  every shard carries;
* after the gather the first ``full_rows`` rows are the whole weight (``torch.chunk``
  gives every rank but the last non-empty one a full shard), so the unsharded data is a
  zero-copy strided view of the gathered buffer; only the scales (4 bytes a row) are
  copied out, into a tensor FSDP2 frees and refills with the buffer.

A shard that is not the one this format expects (its rows differ from FSDP2's dim-0
chunk of ``full_rows``: the weight was cut before ``fully_shard``, e.g. by tensor
parallelism) must not be gathered into silently misplaced rows, and must not raise on its
rank alone either (the other ranks would wait in the collective). Its rank sends a
**layout flag** instead of its rows: a buffer of the same shape whose every scale slot
holds the bytes ``0xFF``, which no finite scale and no zero padding row has. Every rank
finds the flag in the gathered buffer and raises the same error.

The hooks themselves are methods of :class:`~fsdp_int8.Int8Weight`.
"""

from __future__ import annotations

import torch

from fsdp_int8.quant import ceil_div

SCALE_BYTES = 4  # one fp32 scale per row
_FLAG_BYTE = -1  # 0xFF: every scale slot of a flagged shard (an fp32 NaN no computation makes)


def padded_rows(full_rows: int, shard_world_size: int) -> int:
    """Rows every rank sends: ``ceil(full_rows / shard_world_size)`` (torch.chunk's size)."""
    return ceil_div(full_rows, shard_world_size)


def shard_rows(full_rows: int, shard_world_size: int, coordinate: int) -> int:
    """Rows of FSDP2's dim-0 shard ``coordinate`` of a ``full_rows``-row weight.

    ``torch.chunk``'s split: ``padded_rows`` each, the last non-empty shard what is left,
    the shards after it none.
    """
    size = padded_rows(full_rows, shard_world_size)
    return max(0, min(size, full_rows - coordinate * size))


def layout_flag(rows: int, row_len: int, device: torch.device) -> torch.Tensor:
    """What a rank sends instead of rows that are not its expected shard (see above)."""
    wire = torch.zeros(rows, row_len + SCALE_BYTES, dtype=torch.int8, device=device)
    wire[:, row_len:] = _FLAG_BYTE
    return wire


def flagged_shards(gathered: torch.Tensor, rows: int, row_len: int) -> list[int]:
    """Shard coordinates whose ``rows``-row block of ``gathered`` is a :func:`layout_flag`.

    Reads the scale bytes back to the host: one device sync.
    """
    if rows == 0:
        return []
    scale_bytes = gathered[:, row_len:].reshape(-1, rows * SCALE_BYTES)
    flagged = (scale_bytes == _FLAG_BYTE).all(dim=1)
    return [index for index, is_flagged in enumerate(flagged.tolist()) if is_flagged]


def pack_rows(int_rows: torch.Tensor, scale: torch.Tensor, rows: int) -> torch.Tensor:
    """``int8 [rows, K + 4]``: each row's values, then its scale's bytes; zero rows after."""
    held, row_len = int_rows.shape
    wire = torch.empty(rows, row_len + SCALE_BYTES, dtype=torch.int8, device=int_rows.device)
    # one pass writes both parts; only the padding rows are zeroed
    torch.cat((int_rows, scale.view(torch.int8).view(held, SCALE_BYTES)), dim=1, out=wire[:held])
    wire[held:].zero_()
    return wire


def unpack_rows(gathered: torch.Tensor, full_rows: int, row_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(int8 rows, fp32 scales)`` of the whole weight: a view of ``gathered`` and a copy."""
    data = gathered[:full_rows, :row_len]
    # Always a copy: FSDP2 frees and re-allocates the tensors the hook hands over as its
    # own, so a view into its buffer (`.contiguous()` returns one for a single row) would
    # shrink that buffer.
    scale = gathered[:full_rows, row_len:].clone(memory_format=torch.contiguous_format)
    return data, scale.view(torch.float32).view(full_rows)
