"""The FSDP2 all-gather wire format of :class:`~fsdp_int8.Int8Weight`.

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
"""

from __future__ import annotations

from typing import Any

import torch

from fsdp_int8.weight import Int8Weight

SCALE_BYTES = 4  # one fp32 scale per row


def padded_rows(full_rows: int, shard_world_size: int) -> int:
    """Rows every rank sends: ``ceil(full_rows / shard_world_size)`` (torch.chunk's size)."""
    return -(-full_rows // shard_world_size)


def pre_all_gather(shard: Int8Weight, mesh: Any) -> tuple[tuple[torch.Tensor, ...], Any]:
    """Pack this rank's rows and scales into the padded wire buffer."""
    width = shard.row_len + SCALE_BYTES
    rows = padded_rows(shard.full_rows, mesh.size())
    if shard.rows > rows:
        raise RuntimeError(
            f"Int8Weight shard holds {shard.rows} rows but a {mesh.size()}-way shard of "
            f"{shard.full_rows} rows has at most {rows}: full_rows was lost by an op"
        )
    wire = torch.zeros(rows, width, dtype=torch.int8, device=shard.device)
    wire[: shard.rows, : shard.row_len] = shard.int_rows()
    wire[: shard.rows, shard.row_len :] = shard.scale.view(torch.int8).view(shard.rows, SCALE_BYTES)
    return (wire,), shard.full_rows


def _scales_from(gathered: torch.Tensor, full_rows: int, row_len: int) -> torch.Tensor:
    # Always a copy: FSDP2 frees and re-allocates the tensors we hand over as our own, so
    # a view into its buffer (`.contiguous()` returns one for a single row) would shrink it.
    scales = gathered[:full_rows, row_len:].clone(memory_format=torch.contiguous_format)
    return scales.view(torch.float32).view(full_rows)


def post_all_gather(
    shard: Int8Weight,
    outputs: tuple[torch.Tensor, ...],
    full_rows: int,
    param_dtype: torch.dtype,
    *,
    out: Int8Weight | None = None,
) -> tuple[Int8Weight, tuple[torch.Tensor, ...]] | None:
    """Unpack the gathered buffer into the unsharded weight (in place when ``out`` is given)."""
    (gathered,) = outputs
    data = gathered[:full_rows, : shard.row_len]
    if out is not None:
        if out.int_data.untyped_storage().data_ptr() != gathered.untyped_storage().data_ptr():
            out.int_data.copy_(data)  # FSDP2 gave a new buffer: keep `out` current anyway
        out.scale.copy_(_scales_from(gathered, full_rows, shard.row_len))
        return None
    scale = _scales_from(gathered, full_rows, shard.row_len)
    unsharded = shard.derive(data, scale, dtype=param_dtype)
    # `data` views FSDP2's own output buffer, which it frees; `scale` is ours to hand over.
    return unsharded, (scale,)
