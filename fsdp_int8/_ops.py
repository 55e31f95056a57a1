"""The op table of :class:`~fsdp_int8.Int8Weight`: one small function per aten op.

Grouped by role, each with one rule:

* views and shard ops keep whole rows (a row's int8 values and its scale stay together)
  and share storage, as the op promises; anything else raises;
* factories: ``new_zeros`` / ``new_empty`` / ``empty_like`` / ``clone`` / ``_to_copy`` keep
  the subclass, ``zeros_like`` returns a plain tensor (optimizer states must not be int8);
* assignments (``copy_`` from a float tensor, ``fill_``, ``uniform_`` ...) quantize with
  round-to-nearest: they are initialisation or loading, not training;
* updates (``add_``, ``mul_``, ``addcdiv_`` ..., their ``_foreach_`` forms and the fused
  optimizers) dequantize, compute in fp32, and requantize once with the weight's rounding
  (stochastic in training), recomputing each row's scale;
* out-of-place math works on the dequantized values and returns plain tensors.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives  # noqa: F401  (registers _wrap_tensor_autograd)
from torch.utils._pytree import tree_map_only

from fsdp_int8.weight import Int8Weight, contiguous_strides, dequantize_all

aten = torch.ops.aten

Handler = Callable[..., Any]
_TABLE: dict[torch._ops.OpOverload, Handler] = {}


def _implements(*ops: torch._ops.OpOverload) -> Callable[[Handler], Handler]:
    def register(handler: Handler) -> Handler:
        for op in ops:
            _TABLE[op] = handler
        return handler

    return register


def supported_ops() -> list[str]:
    """Names of the aten ops ``Int8Weight`` implements (``_foreach_`` forms not listed)."""
    return sorted(str(op) for op in _TABLE)


def dispatch(func: torch._ops.OpOverload, args: tuple, kwargs: dict) -> Any:
    """Entry point from ``Int8Weight.__torch_dispatch__``."""
    handler = _TABLE.get(func)
    if handler is not None:
        return handler(func, *args, **kwargs)
    if func.__name__.startswith("_foreach_"):
        return _foreach(func, args, kwargs)
    if func.overloadpacket in _ROW_BREAKING_VIEWS:
        raise NotImplementedError(
            f"Int8Weight does not support {func}: it would not keep whole int8 rows with their "
            "per-row scales. Supported views keep rows intact (view/reshape to [rows, K] or "
            "flat, slicing and splitting along dim 0). Call .dequantize() for a plain tensor."
        )
    raise NotImplementedError(
        f"Int8Weight does not support {func} (int8 data + fp32 row scales). Call .dequantize() "
        "to work on a plain tensor; if FSDP2, an optimizer or a checkpoint API sent this op, "
        "please report it."
    )


_ROW_BREAKING_VIEWS = {
    aten.t, aten.transpose, aten.permute, aten.expand, aten.select, aten.unsqueeze,
    aten.squeeze, aten.unfold, aten.diagonal, aten.movedim, aten.index,
}


# ---------------------------------------------------------------- views and shard ops
def _as_rows(weight: Int8Weight, start: int, stop: int, *, flat: bool) -> Int8Weight:
    """Rows ``[start, stop)`` of ``weight`` as a view, 2-D or flat."""
    data = weight.int_rows()[start:stop]
    if flat:
        data = data.view(-1)
    return weight.derive(data, weight.scale[start:stop])


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


def _check_dim0(dim: int, ndim: int, op: str) -> None:
    if not -ndim <= dim < ndim:
        raise IndexError(f"Dimension out of range (expected to be in range of [{-ndim}, {ndim - 1}], but got {dim})")
    if dim % ndim != 0:
        raise NotImplementedError(
            f"Int8Weight supports {op} along dim 0 only (whole rows: each row has its own "
            f"scale), got dim={dim}"
        )


def _view_as_shape(weight: Int8Weight, size: Sequence[int]) -> Int8Weight:
    size = list(torch._prims_common.infer_size(size, weight.numel()))
    if size == list(weight.shape):
        return weight.derive(weight.int_data, weight.scale)
    if len(size) == 2 and size[1] == weight.row_len:
        return _as_rows(weight, 0, weight.rows, flat=False)
    if len(size) == 1:
        if not weight.int_rows().is_contiguous():
            raise NotImplementedError(
                "cannot view this Int8Weight as flat: its int8 rows are strided views of an "
                "all-gather buffer. Call .clone() first for a contiguous copy."
            )
        return _as_rows(weight, 0, weight.rows, flat=True)
    raise NotImplementedError(
        f"cannot view an Int8Weight of shape {tuple(weight.shape)} as {size}: a view must keep "
        f"whole rows of {weight.row_len} elements with their scales ([rows, {weight.row_len}] "
        "or flat). Call .dequantize() for a plain tensor."
    )


@_implements(aten.detach.default, aten.alias.default)
def _alias(func, weight: Int8Weight) -> Int8Weight:
    return weight.derive(weight.int_data, weight.scale)


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


@_implements(aten.split.Tensor)
def _split(func, weight: Int8Weight, split_size: int, dim: int = 0) -> list[Int8Weight]:
    _check_dim0(dim, weight.dim(), "split")
    length = weight.shape[0]
    sizes = [min(split_size, length - start) for start in range(0, length, split_size)] or [0]
    return _split_rows(weight, sizes)


@_implements(aten.split_with_sizes.default)
def _split_with_sizes(func, weight: Int8Weight, split_sizes, dim: int = 0) -> list[Int8Weight]:
    _check_dim0(dim, weight.dim(), "split_with_sizes")
    return _split_rows(weight, split_sizes)


@_implements(aten.slice.Tensor)
def _slice(func, weight: Int8Weight, dim: int = 0, start=None, end=None, step: int = 1):
    _check_dim0(dim, weight.dim(), "slicing")
    if step != 1:
        raise NotImplementedError(f"Int8Weight supports slicing with step 1 only, got step={step}")
    start, end, _ = slice(start, end).indices(weight.shape[0])
    end = max(start, end)
    first = _rows_of(weight, start, "a slice")
    last = first + _rows_of(weight, end - start, "a slice")
    return _as_rows(weight, first, last, flat=weight.dim() == 1)


@_implements(aten.cat.default)
def _cat(func, tensors: Sequence[torch.Tensor], dim: int = 0) -> Int8Weight:
    if not all(isinstance(t, Int8Weight) for t in tensors):
        raise NotImplementedError("cat of an Int8Weight with plain tensors is not supported")
    first = tensors[0]
    _check_dim0(dim, first.dim(), "cat")
    if any(t.row_len != first.row_len or t.dim() != first.dim() for t in tensors):
        raise NotImplementedError("cat needs Int8Weights of one row length and one rank")
    joined = first.derive(
        torch.cat([t.int_data for t in tensors]), torch.cat([t.scale for t in tensors])
    )
    joined.full_rows = max(first.full_rows, joined.rows)
    return joined


@_implements(aten.constant_pad_nd.default)
def _pad_rows(func, weight: Int8Weight, pad: Sequence[int], value: float = 0.0) -> Int8Weight:
    # DTensor pads uneven shards with zero rows at the end before gathering them.
    extra = pad[-1] if len(pad) == 2 * weight.dim() else None
    if extra is None or value != 0 or any(pad[:-1]) or extra < 0:
        raise NotImplementedError(
            f"Int8Weight can only be padded with zero rows at the end of dim 0, got pad={list(pad)}"
        )
    rows = _rows_of(weight, extra, "padding")
    zeros = _zeros_in_rows(weight, [rows, weight.row_len], None, None)
    return _cat(func, [weight, zeros if weight.dim() == 2 else zeros.view(-1)])


@_implements(torch.ops._c10d_functional.all_gather_into_tensor.default)
def _all_gather_into_tensor(func, weight: Int8Weight, group_size: int, group_name: str):
    # DTensor's full_tensor() and full state dicts gather shards: gather data and scales
    # separately, rows stay whole.
    wait = torch.ops._c10d_functional.wait_tensor.default
    data = wait(func(weight.int_data.contiguous(), group_size, group_name))
    scale = wait(func(weight.scale.contiguous(), group_size, group_name))
    return weight.derive(data, scale)


@_implements(
    torch.ops._c10d_functional.wait_tensor.default,
    torch.ops._c10d_functional._wrap_tensor_autograd.default,
)
def _already_complete(func, weight: Int8Weight) -> Int8Weight:
    return weight  # _all_gather_into_tensor already waited for both inner tensors


@_implements(torch.ops.c10d.broadcast_.default)
def _broadcast(func, tensors, process_group, root_rank, root_tensor, async_op=True, timeout=-1):
    # Full state dicts broadcast from rank 0 (broadcast_from_rank0=True) arrive where the
    # other ranks allocated plain tensors of the outer dtype: send the dequantized values,
    # and round them to nearest where an Int8Weight receives them (an exact round trip).
    sending = dist.ProcessGroup.unbox(process_group).rank() == root_rank
    wire = [t.dequantize() if isinstance(t, Int8Weight) else t for t in tensors]
    _, work = func(wire, process_group, root_rank, root_tensor, async_op, timeout)
    work.wait()
    for tensor, values in zip(tensors, wire):
        if isinstance(tensor, Int8Weight) and not sending:
            tensor.assign_(values, stochastic=False)
    return list(tensors), work


# ---------------------------------------------------------------- factories
def _zeros_in_rows(weight: Int8Weight, size: Sequence[int], dtype, device) -> Int8Weight:
    size = list(size)
    numel = torch.Size(size).numel()
    if not (len(size) == 2 and size[1] == weight.row_len) and not (
        len(size) == 1 and numel % weight.row_len == 0
    ):
        raise NotImplementedError(
            f"cannot make an Int8Weight of shape {size}: it must hold whole rows of "
            f"{weight.row_len} elements ([rows, {weight.row_len}] or flat)"
        )
    device = device or weight.device
    int_data = torch.zeros(size, dtype=torch.int8, device=device)
    scale = torch.zeros(numel // weight.row_len, dtype=torch.float32, device=device)
    return weight.derive(int_data, scale, dtype=dtype)


def _wants_plain(dtype) -> bool:
    return dtype is not None and not dtype.is_floating_point


@_implements(aten.new_zeros.default, aten.new_empty.default)
def _new_zeros(func, weight, size, dtype=None, layout=None, device=None, pin_memory=None):
    # new_empty is served with zeros too: a garbage scale could dequantize to NaN.
    if _wants_plain(dtype):
        return torch.zeros(size, dtype=dtype, device=device or weight.device)
    return _zeros_in_rows(weight, size, dtype, device)


@_implements(aten.empty_like.default)
def _empty_like(func, weight, dtype=None, layout=None, device=None, pin_memory=None,
                memory_format=None):
    if _wants_plain(dtype):
        return torch.zeros(weight.shape, dtype=dtype, device=device or weight.device)
    return _zeros_in_rows(weight, weight.shape, dtype, device)


@_implements(aten.zeros_like.default)
def _zeros_like(func, weight, dtype=None, layout=None, device=None, pin_memory=None,
                memory_format=None):
    # Optimizers build their states with zeros_like: those must stay full precision.
    return torch.zeros(weight.shape, dtype=dtype or weight.dtype, device=device or weight.device)


@_implements(aten.clone.default)
def _clone(func, weight: Int8Weight, memory_format=None) -> Int8Weight:
    return weight.derive(
        weight.int_data.clone(memory_format=torch.contiguous_format), weight.scale.clone()
    )


@_implements(aten._to_copy.default)
def _to_copy(func, weight: Int8Weight, dtype=None, layout=None, device=None, pin_memory=None,
             non_blocking=False, memory_format=None) -> Int8Weight:
    if _wants_plain(dtype):
        raise NotImplementedError(
            f"cannot convert an Int8Weight to {dtype}: its outer dtype must be floating. Use "
            ".int_data for the raw int8 values or .dequantize() for a plain tensor."
        )
    device = device or weight.device
    moved = [
        t.to(device, non_blocking=non_blocking, copy=True, memory_format=torch.contiguous_format)
        for t in (weight.int_data, weight.scale)
    ]
    if pin_memory:
        moved = [t.pin_memory() for t in moved]
    return weight.derive(*moved, dtype=dtype)


@_implements(aten.is_pinned.default)
def _is_pinned(func, weight: Int8Weight, device=None) -> bool:
    return weight.int_data.is_pinned() and weight.scale.is_pinned()


@_implements(aten._pin_memory.default)
def _pin_memory(func, weight: Int8Weight, device=None) -> Int8Weight:
    return weight.derive(weight.int_data.pin_memory(), weight.scale.pin_memory())


@_implements(aten.equal.default)
def _equal(func, a: torch.Tensor, b: torch.Tensor) -> bool:
    if isinstance(a, Int8Weight) and isinstance(b, Int8Weight):
        return (
            a.shape == b.shape
            and torch.equal(a.int_rows(), b.int_rows())
            and torch.equal(a.scale, b.scale)
        )
    return torch.equal(*dequantize_all((a, b)))


# ---------------------------------------------------------------- assignments (round to nearest)
@_implements(aten.copy_.default)
def _copy(func, dst: torch.Tensor, src: torch.Tensor, non_blocking: bool = False):
    if not isinstance(dst, Int8Weight):  # plain <- Int8Weight: write the values
        return dst.copy_(src.dequantize(dst.dtype if dst.is_floating_point() else None))
    if isinstance(src, Int8Weight):
        if src.numel() != dst.numel() or src.row_len != dst.row_len:
            raise RuntimeError(
                f"copy_ between Int8Weights of different layouts: {tuple(src.shape)} rows of "
                f"{src.row_len} into {tuple(dst.shape)} rows of {dst.row_len}"
            )
        dst.int_rows().copy_(src.int_rows(), non_blocking=non_blocking)
        dst.scale.copy_(src.scale, non_blocking=non_blocking)
        return dst
    if not src.is_floating_point():
        raise TypeError(f"copy_ into an Int8Weight needs floating values, got {src.dtype}")
    return dst.assign_(src.to(dst.device).expand(dst.shape), stochastic=False)


@_implements(aten.zero_.default)
def _zero(func, weight: Int8Weight) -> Int8Weight:
    weight.int_data.zero_()
    weight.scale.zero_()
    return weight


@_implements(aten.fill_.Scalar, aten.uniform_.default, aten.normal_.default)
def _fill_random(func, weight: Int8Weight, *args, **kwargs) -> Int8Weight:
    # Initialisation: draw in fp32 exactly as for a plain tensor, then round to nearest.
    values = torch.empty(weight.shape, dtype=torch.float32, device=weight.device)
    func(values, *args, **kwargs)
    return weight.assign_(values, stochastic=False)


# ---------------------------------------------------------------- updates (requantize once)
_UPDATE_OPS = (
    aten.add_.Tensor, aten.add_.Scalar, aten.sub_.Tensor, aten.sub_.Scalar,
    aten.mul_.Tensor, aten.mul_.Scalar, aten.div_.Tensor, aten.div_.Scalar,
    aten.addcdiv_.default, aten.addcmul_.default, aten.lerp_.Scalar, aten.lerp_.Tensor,
    aten.clamp_.default, aten.neg_.default,
)


_SCALINGS = {aten.mul_.Scalar, aten.mul_.Tensor, aten.div_.Scalar, aten.div_.Tensor}


def _python_scalar(value: Any) -> float | None:
    """``value`` as a float if it is a scalar known on the host (never a device sync)."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    if (
        isinstance(value, torch.Tensor) and not isinstance(value, Int8Weight)
        and value.device.type == "cpu" and value.numel() == 1 and value.dim() == 0
    ):
        return float(value)
    return None


def _rescale(func, target: Int8Weight, factor: float) -> bool:
    """Scaling every value by a finite scalar scales each row's absmax by the same amount:
    multiply the scales (negating the int8 values for a negative factor), exactly, with no
    requantization and no rounding noise. This is AdamW's decoupled weight decay."""
    if factor != factor or factor in (float("inf"), float("-inf")) or (
        func in (aten.div_.Scalar, aten.div_.Tensor) and factor == 0
    ):
        return False  # the general path raises on the non-finite result
    if factor < 0:
        target.int_data.neg_()  # the range is symmetric: -(-127) fits
    magnitude = abs(factor)
    if func in (aten.div_.Scalar, aten.div_.Tensor):
        target.scale.div_(magnitude)
    else:
        target.scale.mul_(magnitude)
    return True


@_implements(*_UPDATE_OPS)
def _update(func, target: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    if not isinstance(target, Int8Weight):  # plain tensor updated with an Int8Weight operand
        return func(target, *dequantize_all(args), **dequantize_all(kwargs))
    if func in _SCALINGS and not kwargs:
        factor = _python_scalar(args[0])
        if factor is not None and _rescale(func, target, factor):
            return target
    values = target.dequantize(torch.float32)
    func(values, *_as_fp32(args), **_as_fp32(kwargs))
    return target.assign_(values, stochastic=target.stochastic_rounding)


def _as_fp32(tree: Any) -> Any:
    """Operands of an update in fp32 (ops such as lerp_ refuse mixed dtypes)."""
    tree = dequantize_all(tree, torch.float32)
    return tree_map_only(
        torch.Tensor, lambda t: t.float() if t.is_floating_point() else t, tree
    )


_FUSED_OPTIMIZER_OPS = tuple(
    overload
    for name in ("_fused_adam_", "_fused_adamw_", "_fused_sgd_")
    if hasattr(aten, name)
    for overload in (getattr(getattr(aten, name), o) for o in getattr(aten, name).overloads())
)


@_implements(*_FUSED_OPTIMIZER_OPS)
def _fused_optimizer_step(func, params, *args, **kwargs) -> None:
    # The fused kernels update every parameter in one call: run them on fp32 copies, then
    # requantize each Int8Weight once. A kernel call holds one dtype, so when an int8
    # weight's outer dtype is not fp32 (e.g. bf16) every list goes through fp32 copies.
    count = len(params)
    widen = any(isinstance(p, Int8Weight) and p.dtype != torch.float32 for p in params)

    def is_list(arg) -> bool:
        return isinstance(arg, (list, tuple)) and len(arg) == count and count > 0 and all(
            isinstance(t, torch.Tensor) for t in arg
        )

    work_params = [
        p.dequantize(torch.float32) if isinstance(p, Int8Weight) else (p.float() if widen else p)
        for p in params
    ]
    work_args = [
        [t.float() for t in arg] if widen and is_list(arg) else arg for arg in args
    ]
    func(work_params, *work_args, **kwargs)
    for param, values in zip(params, work_params):
        if isinstance(param, Int8Weight):
            param.assign_(values, stochastic=param.stochastic_rounding)
        elif values is not param:
            param.copy_(values)
    for arg, work in zip(args, work_args):
        if work is not arg:  # optimizer states and grads updated in fp32: write them back
            for original, updated in zip(arg, work):
                if updated is not original:
                    original.copy_(updated)


# ---------------------------------------------------------------- out-of-place math (plain result)
_PLAIN_MATH_OPS = (
    aten.add.Tensor, aten.add.Scalar, aten.sub.Tensor, aten.sub.Scalar, aten.mul.Tensor,
    aten.mul.Scalar, aten.div.Tensor, aten.div.Scalar, aten.neg.default, aten.abs.default,
    aten.sqrt.default, aten.pow.Tensor_Scalar, aten.sign.default, aten.addcmul.default,
    aten.addcdiv.default, aten.lerp.Scalar, aten.lerp.Tensor, aten.clamp.default,
    aten.maximum.default, aten.minimum.default, aten.sum.default, aten.sum.dim_IntList,
    aten.mean.default, aten.mean.dim, aten.linalg_vector_norm.default, aten.allclose.default,
    aten.isfinite.default, aten.eq.Tensor,
)


@_implements(*_PLAIN_MATH_OPS)
def _plain_math(func, *args, **kwargs) -> Any:
    return func(*dequantize_all(args), **dequantize_all(kwargs))


# ---------------------------------------------------------------- _foreach_ forms
def _foreach(func: torch._ops.OpOverload, args: tuple, kwargs: dict) -> Any:
    """Run a ``_foreach_`` op element by element, so each element takes its own path."""
    single = getattr(aten, func.__name__.split(".")[0][len("_foreach_"):], None)
    if single is None:
        raise NotImplementedError(f"Int8Weight does not support {func}")
    count = len(args[0])
    args = list(args)
    if func._overloadname == "Tensor" and len(args) == 4:  # addcdiv_/addcmul_ scalars tensor
        args[3] = args[3].tolist()

    def element(value: Any, index: int) -> Any:
        if isinstance(value, (list, tuple)) and len(value) == count:
            return value[index]
        return value

    # Foreach schemas pass scalars positionally where the single op takes them by keyword
    # (addcdiv_'s ``value``): move the extras onto the single op's keyword-only names.
    schema = next(
        getattr(single, name)._schema for name in single.overloads()
        if len(getattr(single, name)._schema.arguments) >= len(args)
    )
    positional = [a for a in schema.arguments if not a.kwarg_only]
    keyword_only = [a.name for a in schema.arguments if a.kwarg_only]
    moved = dict(zip(keyword_only, args[len(positional):]))
    args = args[: len(positional)]
    results = [
        single(
            *(element(a, i) for a in args),
            **{k: element(v, i) for k, v in {**moved, **kwargs}.items()},
        )
        for i in range(count)
    ]
    return None if func.__name__.split(".")[0].endswith("_") else results
