"""The FSDP2 all-gather wire format of an int8 weight (pure functions on plain tensors).

Each rank sends ONE int8 buffer of shape ``[padded_rows, K + 4]``: its rows' int8 values
followed by the 4 bytes of each row's fp32 scale, zero-padded to
``padded_rows = ceil(unsharded_rows / shard_world_size)``. Why this shape (docs/design.md):

* FSDP2's world-size-1 path forwards only the first all-gather input, so the scales must
  ride in the same tensor as the data;
* FSDP2's 5-argument hook requires every input of an unevenly sharded parameter to have
  the padded sharded size ``[padded_rows, K]``, which no scale vector can have; the
  1-argument hook skips that check, so we pad ourselves, using the ``unsharded_rows`` that
  every shard carries;
* after the gather the first ``unsharded_rows`` rows are the whole weight (``torch.chunk``
  gives every rank but the last non-empty one a full shard), so the unsharded data is a
  zero-copy strided view of the gathered buffer; only the scales (4 bytes a row) are
  copied out, into a tensor FSDP2 frees and refills with the buffer.

A shard that is not the one this format expects (its rows differ from FSDP2's dim-0
chunk of ``unsharded_rows``: the weight was cut before ``fully_shard``, e.g. by tensor
parallelism) must not be gathered into silently misplaced rows, and must not raise on its
rank alone either (the other ranks would wait in the collective). Its rank sends a
**layout flag** instead of its rows: a buffer of the same shape whose every scale slot
holds the bytes ``0xFF``, which no finite scale and no zero padding row has. Every rank
finds the flag in the gathered buffer and raises the same error.

``Int8Weight.fsdp_pre_all_gather`` / ``fsdp_post_all_gather`` are :func:`pre_all_gather`
and :func:`post_all_gather` below: the hooks live next to the format they write and read.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from fsdp_int8 import _dist, hardware
from fsdp_int8._quant.generators import WEIGHT_ROUNDING
from fsdp_int8._quant.kernels import ceil_div
from fsdp_int8._weight import end_of_step
from fsdp_int8.quant import dequantize_rows_into

if TYPE_CHECKING:  # for annotations only: Int8Weight's hooks call into this module
    from fsdp_int8._weight.tensor import Int8Weight

# Where a tensor-parallel layout reaches an int8 weight, the error says this.
TENSOR_PARALLEL_UNSUPPORTED = (
    "tensor parallelism with torch's stock styles (ColwiseParallel / RowwiseParallel, "
    "distribute_tensor) does not work on int8 weights: they do not know that an int8 weight keeps one scale per row "
    "(docs/parallelism.md). Use fsdp_int8.shard_model(model, mesh=mesh_2d, tp_plan=plan) "
    "(stock styles in the plan are converted), or fsdp_int8.parallel's Int8ColwiseParallel / "
    "Int8RowwiseParallel with parallelize_module, then fully_shard on the dp mesh; or "
    "leave the layers you parallelize in full precision (Int8TrainingConfig.skip_names)."
)

SCALE_BYTES = 4  # one fp32 scale per row
_FLAG_BYTE = -1  # 0xFF: every scale slot of a flagged shard (an fp32 NaN no computation makes)


def padded_rows(unsharded_rows: int, shard_world_size: int, rows_per_index: int = 1) -> int:
    """Rows every rank sends: torch.chunk's size along dim 0, ``ceil(unsharded_rows /
    shard_world_size)`` for a 2-D weight. A weight whose dim 0 holds ``rows_per_index``
    rows per index (a MoE weight ``[experts, out, in]``: ``out``) is chunked by whole
    indices, ``ceil(experts / shard_world_size)`` of them."""
    return ceil_div(unsharded_rows // rows_per_index, shard_world_size) * rows_per_index


def shard_rows(unsharded_rows: int, shard_world_size: int, coordinate: int, rows_per_index: int = 1) -> int:
    """Rows of FSDP2's dim-0 shard ``coordinate`` of a ``unsharded_rows``-row weight.

    ``torch.chunk``'s split: ``padded_rows`` each, the last non-empty shard what is left,
    the shards after it none.
    """
    size = padded_rows(unsharded_rows, shard_world_size, rows_per_index)
    return max(0, min(size, unsharded_rows - coordinate * size))


def rows_per_index(weight: Int8Weight) -> int:
    """Rows under one index of ``weight``'s dim 0: 1 for a 2-D weight, ``out`` for a MoE
    weight ``[experts, out, in]`` (known from the shape even for a shard of no experts)."""
    return torch.Size(weight.shape[1:-1]).numel() if weight.dim() > 2 else 1


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


def unpack_rows(gathered: torch.Tensor, unsharded_rows: int, row_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(int8 rows, fp32 scales)`` of the whole weight: a view of ``gathered`` and a copy."""
    data = gathered[:unsharded_rows, :row_len]
    # Always a copy: FSDP2 frees and re-allocates the tensors the hook hands over as its
    # own, so a view into its buffer (`.contiguous()` returns one for a single row) would
    # shrink that buffer.
    scale = gathered[:unsharded_rows, row_len:].clone(memory_format=torch.contiguous_format)
    return data, scale.view(torch.float32).view(unsharded_rows)


# ---------------------------------------------------------------- the FSDP2 hooks
# The 1-argument pre-all-gather form: FSDP2 skips its padded-size check for it, which a
# per-row scale could never pass on an uneven shard (tests/distributed fail loudly if
# torch stops calling it).
def pre_all_gather(weight: Int8Weight, mesh: Any) -> tuple[tuple[torch.Tensor, ...], tuple[int, int]]:
    """``Int8Weight.fsdp_pre_all_gather``: the shard's rows and scales in one padded buffer.

    ``mesh`` is the shard mesh: a model quantized before ``fully_shard`` learns here which
    shard this rank rounds (its own noise stream, see ``_generators``). A shard that is not
    FSDP2's dim-0 chunk of the whole weight sends a :func:`layout_flag` instead.
    Metadata: the whole weight's rows and the rows each rank sends.
    """
    if not torch.compiler.is_compiling():
        WEIGHT_ROUNDING.adopt_shard_coordinate(mesh)
        end_of_step.flush_if_holding((weight,))
    rows = padded_rows(weight.unsharded_rows, mesh.size(), rows_per_index(weight))
    if _is_expected_shard(weight, mesh):
        wire = pack_rows(weight.int_rows(), weight.scale, rows)
    elif weight.dim() > 2:
        # Expert weights not cut into whole experts were sharded on another dim by FSDP2
        # itself (torchtitan's Shard(1)): every rank's shard is cut so, and every rank
        # raises here, before the all-gather (whose copy-out would fail on the wire format).
        raise NotImplementedError(_experts_not_whole(weight, mesh))
    else:
        wire = layout_flag(rows, weight.row_len, weight.int_data.device)
    return (wire,), (weight.unsharded_rows, rows)


def _is_expected_shard(weight: Int8Weight, mesh: Any) -> bool:
    """Whether ``weight`` holds the rows FSDP2's dim-0 shard of ``unsharded_rows`` holds on
    ``mesh``. Checked once per tensor and layout: asking the mesh for the coordinate costs
    microseconds at every all-gather."""
    layout = (weight.unsharded_rows, weight.rows, mesh.size())
    if weight.__dict__.get("_checked_layout") == layout:
        return True
    expected = shard_rows(weight.unsharded_rows, mesh.size(), _dist.shard_coordinate(mesh), rows_per_index(weight))
    if weight.rows != expected:
        return False
    weight._checked_layout = layout
    return True


def post_all_gather(
    weight: Int8Weight,
    outputs: tuple[torch.Tensor, ...],
    metadata: tuple[int, int],
    param_dtype: torch.dtype,
    out: torch.Tensor | None,
) -> "tuple[torch.Tensor, tuple[torch.Tensor, ...]] | None":
    """``Int8Weight.fsdp_post_all_gather``: the unsharded weight from the gathered buffer.

    Weight-only (no ``int8_matmul``): a plain ``param_dtype`` tensor, dequantized once per
    unshard. Int8 matmuls: an ``Int8Weight`` over the gathered buffer. Later unshards
    refill ``out`` in place. Raises ``NotImplementedError`` on every rank, at the first
    unshard, if any rank flagged its shard.
    """
    (gathered,) = outputs
    unsharded_rows, rows = metadata
    out = _dist.local_shard(out)  # a tensor-parallel weight's unsharded parameter is a DTensor
    if out is None:  # the first unshard: one sync per weight reads every rank's flag
        flagged = flagged_shards(gathered, rows, weight.row_len)
        if flagged:
            raise NotImplementedError(_unsupported_layout(weight, flagged, gathered.shape[0] // rows))
        if not torch.compiler.is_compiling():  # weight-only layers never reach F.linear's check
            hardware.warn_if_slow(gathered.device, param_dtype, int8_matmul=False)
    data, scale = unpack_rows(gathered, unsharded_rows, weight.row_len)
    if weight.dim() > 2:  # a MoE weight: rows regrouped as [experts, out, in] (views)
        data = data.view(-1, *weight.shape[1:])
        scale = scale.view(data.shape[:-1])
    if weight.int8_matmul is None and not weight.int8_gathered_weights:
        return _dequantized_unshard(data, scale, param_dtype, out, compiled=weight.compiled)
    if out is not None:
        # A refill, as in _dequantized_unshard: a compiled block's graph saved these inner
        # tensors for backward (eager autograd saves the weight itself), FSDP2 resharded
        # after forward, and the same values are written back; hidden from autograd's
        # version check as FSDP2 hides the refill of its own all-gather outputs.
        if out.int_data.untyped_storage().data_ptr() != gathered.untyped_storage().data_ptr():
            with torch.autograd._unsafe_preserve_version_counter(out.int_data):
                out.int_data.copy_(data)  # FSDP2 gave a new buffer: keep `out` current anyway
        with torch.autograd._unsafe_preserve_version_counter(out.scale):
            out.scale.copy_(scale)
        return None
    # `data` views FSDP2's own output buffer, which it frees; `scale` is ours to hand over.
    return weight.with_tensors(data, scale, dtype=param_dtype), (scale,)


def _experts_not_whole(weight: Int8Weight, mesh: Any) -> str:
    return (
        f"an int8 expert weight shard of shape {tuple(weight.shape)} on a {mesh.size()}-way FSDP2 "
        "shard mesh does not hold whole experts: FSDP2 shards int8 experts on dim 0 only (each "
        "expert's rows travel with their scales in one buffer whose layout FSDP2's dim-1 "
        "copy-out cannot read). torchtitan shards experts on dim 1 when its FSDP degree for them "
        "(efsdp x ep with expert parallelism) exceeds the number of experts: train with at "
        "least as many experts as that (docs/moe.md), or keep the experts in full precision "
        "(Int8TrainingConfig.module_filter)."
    )


def _unsupported_layout(weight: Int8Weight, flagged: list[int], shards: int) -> str:
    return (
        f"an Int8Weight of {weight.unsharded_rows} rows x {weight.row_len} cannot be all-gathered: "
        f"shard(s) {flagged} of the {shards}-way FSDP2 shard mesh do not hold the rows of "
        "FSDP2's dim-0 shard of the whole weight (every rank raises this error). The weight "
        "was cut before fully_shard, most likely by tensor parallelism: "
        + TENSOR_PARALLEL_UNSUPPORTED
    )


def _dequantized_unshard(
    data: torch.Tensor, scale: torch.Tensor, param_dtype: torch.dtype, out: torch.Tensor | None, *, compiled: bool
) -> "tuple[torch.Tensor, tuple[torch.Tensor, ...]] | None":
    """A weight-only unshard: ``data * scale`` in ``param_dtype``, into ``out`` when given.

    The first unshard returns the new tensor as FSDP2's unsharded parameter AND as its
    inner tensor: FSDP2 frees that storage at every reshard and re-allocates it before
    calling again with ``out`` (a view of the same storage), which is refilled in place.
    """
    if out is None:
        values = torch.empty(data.shape, dtype=param_dtype, device=data.device)
        dequantize_rows_into(data, scale, values, compiled=compiled)
        return values, (values,)
    if out.dtype != param_dtype or tuple(out.shape) != tuple(data.shape):
        raise RuntimeError(
            f"FSDP2 passed out= of {out.dtype} {tuple(out.shape)} for a weight-only unshard "
            f"of {param_dtype} {tuple(data.shape)}: the unsharded weight changed between "
            "unshards, which fsdp_int8 does not expect; please report it"
        )
    if out.is_inference():
        dequantize_rows_into(data, scale, out, compiled=compiled)
        return None
    # The same refill FSDP2 does into its own all-gather outputs: autograd saved this
    # weight in forward, FSDP2 freed it at reshard and we write the same values back for
    # backward, so the mutation is hidden from autograd's version check as FSDP2 hides its own.
    with torch.autograd._unsafe_preserve_version_counter(out):
        dequantize_rows_into(data, scale, out, compiled=compiled)
    return None
