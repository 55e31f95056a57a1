"""Views and shard ops: keep whole rows (a row's int8 values with its scale) and share storage.

What FSDP2 and DCP send to carve shards out of a weight and reassemble it: ``view(-1)``,
``as_strided``, ``split`` / ``chunk``, ``slice`` / ``narrow``, ``cat``, padding of uneven
shards. Views may regroup the rows into leading dims (``[heads, 3, head_dim, K]``, as
torchtitan's fused-QKV state-dict hooks and init do), and such a view can be sliced,
selected, split and concatenated along any leading dim. Ops that would separate rows from
their scales (``t``, ``transpose``, ``split`` / ``chunk`` along the last dim, ...) are refused
with the reason.

One exception: ``slice`` / ``narrow`` of a 2-D weight along its columns (dim 1), which DCP
sends to reshard a weight split by columns (``RowwiseParallel``'s ``Shard(1)``) from or into
another layout. The result is a view whose ``tensor_parallel`` is a
``fsdp_int8._weight.tensor_parallel.ColumnWindow``: those columns of every row,
with the whole row's scale (shared, not copied) and ``row_len`` the window's width. Its
values read correctly, and ``copy_`` from another ``Int8Weight`` writes exact bytes and
scales through it; a write that would requantize (``copy_`` from floats, fills, optimizer
updates) is refused, since a scale computed from some columns would rescale the others.
``split`` / ``chunk`` along dim 1 stay refused: torch's stock ``RowwiseParallel`` splits
that way, and must keep failing loudly.
"""

from __future__ import annotations

from typing import Sequence

import torch

from fsdp_int8._quant.kernels import ceil_div
from fsdp_int8._weight import op_table as _op_table
from fsdp_int8._weight.all_gather import TENSOR_PARALLEL_UNSUPPORTED
from fsdp_int8._weight.ops.factories import zeros_in_rows
from fsdp_int8._weight.ops.math import dequantize_all
from fsdp_int8._weight.tensor import Int8Weight
from fsdp_int8._weight.tensor_parallel import ColumnWindow

aten = torch.ops.aten
_implements = _op_table.implements


_ROW_BREAKING = (
    "it would not keep whole int8 rows with their per-row scales. Supported views keep "
    "rows intact (view/reshape to [rows, K], [*leading dims, K] or flat, slicing and "
    "splitting along dim 0 or a leading dim). Call .dequantize() for a plain tensor. "
    "Expert weights [E, out, in] compute through fsdp_int8.weight.int8_grouped_mm(x, w, offs) "
    "(torch._grouped_mm(x, w.transpose(-2, -1), offs=offs)) or F.linear(x, w[e]). (A "
    "DTensor matmul transposes its local weight: if this weight was sharded by tensor "
    "parallelism, " + TENSOR_PARALLEL_UNSUPPORTED + ")"
)

_op_table.refuses(
    aten.t, aten.transpose, aten.permute, aten.expand, aten.unsqueeze,
    aten.squeeze, aten.unfold, aten.diagonal, aten.movedim, aten.index,
    reason=_ROW_BREAKING,
)


def _as_rows(weight: Int8Weight, start: int, stop: int, *, flat: bool) -> Int8Weight:
    """Rows ``[start, stop)`` of ``weight`` as a view, 2-D or flat."""
    data = weight.int_rows()[start:stop]
    if flat:
        data = data.view(-1)
    return weight.with_tensors(data, weight.scale.view(-1)[start:stop])


def _rows_of(weight: Int8Weight, count: int, what: str) -> int:
    """Convert ``count`` units of dim 0 to rows; flat tensors must cut between rows."""
    if weight.dim() == 2:
        return count
    if count % weight.row_len:
        raise NotImplementedError(
            f"{what} of a flat Int8Weight must cut between rows of {weight.row_len} elements "
            f"(scales are per row), got an offset or length of {count}"
        )
    return count // weight.row_len


def _row_dim(dim: int, ndim: int, op: str) -> int:
    """``dim`` normalised, if ``op`` along it keeps whole rows: dim 0 of a flat or 2-D
    weight, any dim but the last of a regrouped view."""
    if not -ndim <= dim < ndim:
        raise IndexError(f"Dimension out of range (expected to be in range of [{-ndim}, {ndim - 1}], but got {dim})")
    dim %= ndim
    if ndim <= 2 and dim != 0:
        raise NotImplementedError(
            f"Int8Weight supports {op} along dim 0 only (whole rows: each row has its own "
            f"scale), got dim={dim}. Sharding a weight on dim 1, its input features, is what "
            "RowwiseParallel and FSDP2's shard_placement_fn=Shard(1) do: "
            + TENSOR_PARALLEL_UNSUPPORTED
        )
    if ndim > 2 and dim == ndim - 1:
        raise NotImplementedError(
            f"Int8Weight supports {op} along its leading dims only, not along the last one "
            f"(the {ndim - 1}-th holds the elements of each row, which share one scale)"
        )
    return dim


def _flat_view(weight: Int8Weight) -> Int8Weight:
    try:
        return weight.with_tensors(weight.int_data.view(-1), weight.scale.view(-1))
    except RuntimeError:
        raise NotImplementedError(
            "cannot view this Int8Weight as flat: its int8 rows are strided views (of an "
            "all-gather buffer, or a slice of a regrouped view). Call .clone() first for a "
            "contiguous copy."
        ) from None


def _view_as_shape(weight: Int8Weight, size: Sequence[int]) -> Int8Weight:
    size = list(torch._prims_common.infer_size(size, weight.numel()))
    if size == list(weight.shape):
        return weight.with_tensors(weight.int_data, weight.scale)
    if len(size) >= 2 and size[-1] == weight.row_len:  # rows regrouped: [*leading, K]
        return weight.with_tensors(weight.int_data.view(size), weight.scale.view(size[:-1]))
    if len(size) == 1:
        return _flat_view(weight)
    raise NotImplementedError(
        f"cannot view an Int8Weight of shape {tuple(weight.shape)} as {size}: a view must keep "
        f"whole rows of {weight.row_len} elements with their scales ([rows, {weight.row_len}], "
        f"[*leading dims, {weight.row_len}] or flat). Call .dequantize() for a plain tensor."
    )


def _along(weight: Int8Weight, dim: int, take) -> Int8Weight:
    """A regrouped view's data and scales, both cut by ``take(tensor, dim)`` (leading dim).
    A piece cut along a leading dim other than 0 is no dim-0 shard of any weight
    (``unsharded_rows`` 0): FSDP2 sharding experts that way (torchtitan's ``Shard(1)``) is then
    refused at their all-gather, whose wire format holds whole dim-0 entries."""
    changes = {} if dim == 0 else {"unsharded_rows": 0}
    return weight.with_tensors(take(weight.int_data, dim), take(weight.scale, dim), **changes)


@_implements(aten.detach.default, aten.alias.default)
def _alias(func, weight: Int8Weight) -> Int8Weight:
    return weight.with_tensors(weight.int_data, weight.scale)


@_implements(aten.view.default, aten._unsafe_view.default, aten.reshape.default)
def _view(func, weight: Int8Weight, size: Sequence[int]) -> Int8Weight:
    return _view_as_shape(weight, size)


@_implements(aten.as_strided.default)
def _as_strided(func, weight: Int8Weight, size, stride, storage_offset=None) -> Int8Weight:
    # FSDP2 calls as_strided(t, t.shape, contiguous strides, 0) on the unsharded weight:
    # that must alias the inner tensors as they are, whatever their strides (they may be
    # views into the all-gather buffer). Other requests are read as a contiguous window
    # over this tensor's elements, which must cover whole rows.
    offset = storage_offset or 0
    numel = torch.Size(size).numel()
    if tuple(stride) != contiguous_strides(size) and numel > 1:
        raise NotImplementedError(
            f"Int8Weight supports as_strided with contiguous strides only, got size={list(size)} "
            f"stride={list(stride)}"
        )
    if offset % weight.row_len or numel % weight.row_len or offset + numel > weight.numel():
        raise NotImplementedError(
            f"as_strided(size={list(size)}, offset={offset}) on an Int8Weight of shape "
            f"{tuple(weight.shape)} does not cover whole rows of {weight.row_len} elements"
        )
    first = offset // weight.row_len
    window = _as_rows(weight, first, first + numel // weight.row_len, flat=weight.dim() == 1)
    return _view_as_shape(window, size)


def _split_rows(weight: Int8Weight, sizes: Sequence[int]) -> list[Int8Weight]:
    pieces, start = [], 0
    flat = weight.dim() == 1
    for size in sizes:
        rows = _rows_of(weight, size, "split")
        pieces.append(_as_rows(weight, start, start + rows, flat=flat))
        start += rows
    return pieces


def _split_sizes(length: int, split_size: int) -> list[int]:
    return [min(split_size, length - start) for start in range(0, length, split_size)] or [0]


def _offsets(sizes: Sequence[int]) -> list[int]:
    offsets, running = [], 0
    for size in sizes:
        offsets.append(running)
        running += size
    return offsets


def _split_along(weight: Int8Weight, sizes: Sequence[int], dim: int) -> list[Int8Weight]:
    """Pieces of ``sizes`` along ``dim`` (a row dim), as views."""
    if weight.dim() <= 2:
        return _split_rows(weight, sizes)
    return [
        _along(weight, dim, lambda t, d, a=start, n=size: t.narrow(d, a, n))
        for start, size in zip(_offsets(sizes), sizes)
    ]


@_implements(aten.split.Tensor)
def _split(func, weight: Int8Weight, split_size: int, dim: int = 0) -> list[Int8Weight]:
    dim = _row_dim(dim, weight.dim(), "split")
    return _split_along(weight, _split_sizes(weight.shape[dim], split_size), dim)


@_implements(aten.chunk.default)
def _chunk(func, weight: Int8Weight, chunks: int, dim: int = 0) -> list[Int8Weight]:
    # DTensor's Replicate -> Shard redistribution calls torch.chunk itself. Outside
    # inference mode aten.chunk decomposes into split before dispatch; inside it, it
    # arrives here whole.
    dim = _row_dim(dim, weight.dim(), "chunk")
    length = weight.shape[dim]
    return _split_along(weight, _split_sizes(length, max(1, ceil_div(length, chunks))), dim)


@_implements(aten.split_with_sizes.default)
def _split_with_sizes(func, weight: Int8Weight, split_sizes, dim: int = 0) -> list[Int8Weight]:
    dim = _row_dim(dim, weight.dim(), "split_with_sizes")
    return _split_along(weight, split_sizes, dim)


def _column_window(weight: Int8Weight, start: int, end: int) -> Int8Weight:
    """Columns ``[start, end)`` of a 2-D weight, with its (whole rows') scales, as a view."""
    if start == 0 and end == weight.row_len:
        return weight.with_tensors(weight.int_data, weight.scale)
    outer = weight.tensor_parallel  # a window of a window: columns of the same whole rows
    offset, row_len = (outer.start, outer.row_len) if isinstance(outer, ColumnWindow) else (0, weight.row_len)
    return weight.with_tensors(
        weight.int_data[:, start:end], weight.scale, row_len=end - start,
        tensor_parallel=ColumnWindow(offset + start, offset + end, row_len),
    )


@_implements(aten.slice.Tensor)
def _slice(func, weight: Int8Weight, dim: int = 0, start=None, end=None, step: int = 1):
    if step != 1:
        raise NotImplementedError(f"Int8Weight supports slicing with step 1 only, got step={step}")
    if weight.dim() == 2 and dim in (1, -1):
        start, end, _ = slice(start, end).indices(weight.shape[1])
        return _column_window(weight, start, max(start, end))
    dim = _row_dim(dim, weight.dim(), "slicing")
    start, end, _ = slice(start, end).indices(weight.shape[dim])
    end = max(start, end)
    if weight.dim() > 2:
        return _along(weight, dim, lambda t, d: t[(slice(None),) * d + (slice(start, end),)])
    first = _rows_of(weight, start, "a slice")
    last = first + _rows_of(weight, end - start, "a slice")
    return _as_rows(weight, first, last, flat=weight.dim() == 1)


@_implements(aten.select.int)
def _select(func, weight: Int8Weight, dim: int, index: int) -> Int8Weight:
    # One index of a leading dim of a regrouped view (torchtitan's w[:, heads_per_kv]), or
    # one row of a weight as a flat one-row view (an embedding's padding row: w[pad].zero_());
    # a flat weight's element, or a column, would cut rows.
    if weight.dim() == 2 and dim in (0, -2):
        row = index + weight.shape[0] if index < 0 else index
        if not 0 <= row < weight.shape[0]:
            raise IndexError(f"index {index} is out of bounds for dimension 0 with size {weight.shape[0]}")
        return _as_rows(weight, row, row + 1, flat=True)
    if weight.dim() <= 2:
        raise NotImplementedError(f"Int8Weight does not support {func}: {_ROW_BREAKING}")
    dim = _row_dim(dim, weight.dim(), "select")
    return _along(weight, dim, lambda t, d: t.select(d, index))


@_implements(aten.narrow.default)
def _narrow(func, weight: Int8Weight, dim: int, start: int, length: int) -> Int8Weight:
    # DTensor narrows a gathered, padded tensor back to its true length.
    return _slice(func, weight, dim, start, start + length)


def _joins_whole_rows(tensors: Sequence[torch.Tensor]) -> bool:
    """Whether ``tensors`` are Int8Weights of one row length and one rank (an int8 result)."""
    first = tensors[0]
    return all(
        isinstance(t, Int8Weight) and t.row_len == first.row_len and t.dim() == first.dim()
        for t in tensors
    )


@_implements(aten.cat.default)
def _cat(func, tensors: Sequence[torch.Tensor], dim: int = 0) -> torch.Tensor:
    whole_rows = _joins_whole_rows(tensors)
    if not whole_rows and all(t.dim() == 1 for t in tensors):
        # A flat bucket of values (torch's flatten_dense_tensors: DDP's parameter
        # broadcast) mixing int8 weights with plain tensors or other row lengths: its
        # values, plain. Whoever unpacks it copies them back (rounding to nearest).
        return func(dequantize_all(list(tensors)), dim)
    if not all(isinstance(t, Int8Weight) for t in tensors):
        raise NotImplementedError(
            "cat of an Int8Weight with plain tensors is not supported: the plain rows have "
            "no scales. Quantize them first (Int8Weight.from_float) for an int8 result, or "
            "call .dequantize() on the Int8Weight for a plain one."
        )
    first = tensors[0]
    if whole_rows and first.dim() == 2 and dim in (1, -1) and all(t.rows == first.rows for t in tensors):
        return _cat_columns(tensors)  # pieces of other rows: refused as along dim 0 only
    dim = _row_dim(dim, first.dim(), "cat")
    if not whole_rows:
        raise NotImplementedError("cat needs Int8Weights of one row length and one rank")
    scale = torch.cat([t.scale for t in tensors], dim)
    return first.with_tensors(torch.cat([t.int_data for t in tensors], dim), scale,
                        unsharded_rows=max(first.unsharded_rows, scale.numel()))


def _cat_columns(tensors: Sequence[Int8Weight]) -> Int8Weight:
    """Pieces of the same rows side by side: what gathering a weight split by its columns
    (``Int8RowwiseParallel``, whose peers share each row's scale) makes. Only pieces with
    the same scales join: other scales would need a requantization, which a gather must
    not do silently."""
    first = tensors[0]
    if any(t.rows != first.rows or not torch.equal(t.scale, first.scale) for t in tensors[1:]):
        raise NotImplementedError(
            "cat along dim 1 joins Int8Weight pieces of the same rows only when they share "
            "their row scales (a tensor-parallel split by fsdp_int8.parallel does); these "
            "differ. Call .dequantize() on each piece for a plain result. " + _ROW_BREAKING
        )
    return first.with_tensors(
        torch.cat([t.int_rows() for t in tensors], 1), first.scale.clone(),
        row_len=sum(t.row_len for t in tensors), unsharded_rows=None, tensor_parallel=None,
    )


def _pad_rows(weight: Int8Weight, pad: Sequence[int], value: float) -> Int8Weight:
    """``weight`` with zero rows appended: how DTensor pads an uneven shard before gathering
    it (every rank with a short shard pads; refusing here would leave the others waiting)."""
    pad = list(pad) + [0] * (2 * weight.dim() - len(pad))
    extra = pad[-1]
    if value != 0 or any(pad[:-1]) or extra < 0:
        raise NotImplementedError(
            f"Int8Weight can only be padded with zero rows at the end of dim 0, got pad={pad} "
            f"and value={value}"
        )
    if weight.dim() > 2:  # whole zero entries of dim 0 (experts of a MoE weight)
        return _cat(aten.cat.default, [weight, zeros_in_rows(weight, [extra, *weight.shape[1:]], None, None)])
    rows = _rows_of(weight, extra, "padding")
    zeros = zeros_in_rows(weight, [rows, weight.row_len], None, None)
    return _cat(aten.cat.default, [weight, zeros if weight.dim() == 2 else zeros.view(-1)])


@_implements(aten.constant_pad_nd.default)
def _constant_pad(func, weight: Int8Weight, pad: Sequence[int], value: float = 0.0) -> Int8Weight:
    return _pad_rows(weight, pad, value)


@_implements(aten.pad.default)
def _pad(func, weight: Int8Weight, pad: Sequence[int], mode: str = "constant", value=None) -> Int8Weight:
    if mode != "constant":
        raise NotImplementedError(f"Int8Weight can only be padded with zeros, got mode={mode!r}")
    return _pad_rows(weight, pad, value or 0.0)


def contiguous_strides(shape: torch.Size | list[int] | tuple[int, ...]) -> tuple[int, ...]:
    """Row-major strides of ``shape``."""
    strides, running = [], 1
    for size in reversed(list(shape)):
        strides.append(running)
        running *= max(size, 1)
    return tuple(reversed(strides))
