"""A small reference tensor subclass for the FSDP2 conformance suite: bf16 on the wire.

``BF16WireWeight`` looks like an fp32 parameter but stores its values in bf16, so FSDP2's
all-gather moves 2 bytes per element. It is written independently of ``Int8Weight`` to
show that ``fsdp_int8.testing.check_fsdp2_conformance`` is generic:

* its layout is element-wise (one bf16 value per element), so every view, slice and
  split is the same op applied to the inner tensor;
* in-place updates compute in fp32 and round back to bf16 (round to nearest);
* the all-gather uses the 5-argument hook, pads uneven shards itself (FSDP2 requires
  the padded shard size there) and unshards into a PLAIN tensor of the compute dtype,
  refreshed in place on the ``out=`` path.

The ``Broken*`` subclasses each break one thing on purpose; the mutation tests check that
the suite names the right scenario.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._pytree import tree_map_only

aten = torch.ops.aten

# Ops that only re-index elements: applied to the inner bf16 tensor, the result re-wrapped.
_LAYOUT_OPS = {
    aten.detach.default, aten.alias.default, aten.view.default, aten._unsafe_view.default,
    aten.reshape.default, aten.as_strided.default, aten.slice.Tensor, aten.split.Tensor,
    aten.split_with_sizes.default, aten.clone.default, aten.t.default,
    aten.constant_pad_nd.default,
    torch.ops._c10d_functional.all_gather_into_tensor.default,
    torch.ops._c10d_functional.wait_tensor.default,
}
# In-place updates: fp32 math on the values, rounded back into the bf16 storage.
_UPDATE_OPS = {
    aten.add_.Tensor, aten.sub_.Tensor, aten.mul_.Tensor, aten.mul_.Scalar, aten.div_.Tensor,
    aten.div_.Scalar, aten.addcdiv_.default, aten.addcmul_.default, aten.lerp_.Scalar,
    aten.lerp_.Tensor, aten.zero_.default, aten.fill_.Scalar, aten.normal_.default,
    aten.uniform_.default,
}


class BF16WireWeight(torch.Tensor):
    """An fp32-looking weight stored (and all-gathered) as bf16.

    Args:
        inner: the bf16 values, any shape.
        dtype: the outer (training) dtype.
    """

    inner: torch.Tensor

    @staticmethod
    def __new__(cls, inner: torch.Tensor, *, dtype: torch.dtype = torch.float32,
                requires_grad: bool = False):
        return torch.Tensor._make_wrapper_subclass(
            cls, inner.shape, strides=inner.stride(), storage_offset=inner.storage_offset(),
            dtype=dtype, device=inner.device, requires_grad=requires_grad,
        )

    def __init__(self, inner: torch.Tensor, *, dtype: torch.dtype = torch.float32,
                 requires_grad: bool = False) -> None:
        if inner.dtype != torch.bfloat16:
            raise TypeError(f"{type(self).__name__} stores bf16, got {inner.dtype}")
        self.inner = inner

    @classmethod
    def from_float(cls, tensor: torch.Tensor) -> "BF16WireWeight":
        return cls(tensor.detach().to(torch.bfloat16), dtype=tensor.dtype)

    def values(self) -> torch.Tensor:
        """A plain tensor of the outer dtype with the stored values."""
        return self.inner.to(self.dtype)

    def _wrap(self, inner: torch.Tensor, dtype: torch.dtype | None = None) -> "BF16WireWeight":
        return type(self)(inner, dtype=dtype or self.dtype)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(shape={tuple(self.shape)}, dtype={self.dtype})"

    def __tensor_flatten__(self):
        return ["inner"], (self.dtype,)

    @classmethod
    def __tensor_unflatten__(cls, inner: dict, ctx, outer_size, outer_stride):
        return cls(inner["inner"], dtype=ctx[0])

    def __reduce_ex__(self, protocol):
        # torch.save / dcp: rebuild from the inner tensor (registered as a safe global).
        return _rebuild, (type(self), self.inner, self.dtype)

    # ---------------------------------------------------------------- FSDP2 all-gather
    def fsdp_pre_all_gather(self, mesh, outer_size, outer_stride, module, mp_policy):
        # FSDP2 requires every input of an unevenly sharded parameter to have the padded
        # shard size: ceil(rows / shard world) rows, as torch.chunk splits them.
        padded = -(-outer_size[0] // mesh.size())
        data = self.inner
        if data.shape[0] != padded:
            data = torch.cat([data, data.new_zeros(padded - data.shape[0], *data.shape[1:])])
        return (data.contiguous(),), outer_size[0]

    def fsdp_post_all_gather(self, outputs, rows, param_dtype, *, out=None):
        (gathered,) = outputs
        if out is not None:
            # FSDP2 re-allocated `out` and expects it refilled in place. Through `.data`:
            # `out` is a leaf parameter that autograd may have saved for backward, so the
            # refill must neither count as an in-place op on it nor bump its version.
            out.data.copy_(gathered[:rows])
            return None
        unsharded = gathered[:rows].to(param_dtype)  # a copy unless param_dtype is bf16
        return unsharded, (unsharded,)

    # ---------------------------------------------------------------- ops
    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _LAYOUT_OPS:
            return _layout(func, args, kwargs)
        if func in _UPDATE_OPS:
            target = args[0]
            values = func(target.values(), *_plain(args[1:]), **_plain(kwargs))
            target.inner.copy_(values)
            return target
        handler = _HANDLERS.get(func)
        if handler is not None:
            return handler(*args, **kwargs)
        if func.name().startswith("aten::") and not func.is_view and not _mutates(func):
            return func(*_plain(args), **_plain(kwargs))  # out-of-place math: plain results
        raise NotImplementedError(f"{cls.__name__} does not support {func}")


def _rebuild(cls, inner, dtype):
    return cls(inner, dtype=dtype)


def _mutates(func) -> bool:
    return any(a.alias_info is not None and a.alias_info.is_write for a in func._schema.arguments)


def _plain(tree: Any) -> Any:
    return tree_map_only(BF16WireWeight, lambda w: w.values(), tree)


def _layout(func, args, kwargs):
    source = args[0] if isinstance(args[0], BF16WireWeight) else None
    inner = func(*tree_map_only(BF16WireWeight, lambda w: w.inner, args), **kwargs)
    return tree_map_only(torch.Tensor, lambda t: source._wrap(t), inner)


def _new_zeros(weight, size, dtype=None, layout=None, device=None, pin_memory=None):
    inner = torch.zeros(size, dtype=torch.bfloat16, device=device or weight.device)
    return weight._wrap(inner, dtype)


def _empty_like(weight, dtype=None, layout=None, device=None, pin_memory=None, memory_format=None):
    return _new_zeros(weight, weight.shape, dtype, device=device)


def _zeros_like(weight, dtype=None, layout=None, device=None, pin_memory=None, memory_format=None):
    # Optimizer states are plain tensors of the outer dtype.
    return torch.zeros(weight.shape, dtype=dtype or weight.dtype, device=device or weight.device)


def _to_copy(weight, dtype=None, layout=None, device=None, pin_memory=None, non_blocking=False,
             memory_format=None):
    inner = weight.inner.to(device or weight.device, copy=True, non_blocking=non_blocking)
    return weight._wrap(inner.pin_memory() if pin_memory else inner, dtype)


def _copy(dst, src, non_blocking=False):
    if isinstance(dst, BF16WireWeight):
        dst.inner.copy_(src.inner if isinstance(src, BF16WireWeight) else src, non_blocking=non_blocking)
    else:
        dst.copy_(src.values(), non_blocking=non_blocking)
    return dst


def _cat(tensors, dim=0):
    first = next(t for t in tensors if isinstance(t, BF16WireWeight))
    inners = [t.inner if isinstance(t, BF16WireWeight) else t.to(torch.bfloat16) for t in tensors]
    return first._wrap(torch.cat(inners, dim))


def _broadcast(tensors, process_group, root_rank, root_tensor, async_op=True, timeout=-1):
    inners = [t.inner if isinstance(t, BF16WireWeight) else t for t in tensors]
    _, work = torch.ops.c10d.broadcast_.default(inners, process_group, root_rank, root_tensor,
                                                async_op, timeout)
    return list(tensors), work


_HANDLERS = {
    aten.new_zeros.default: _new_zeros,
    aten.new_empty.default: _new_zeros,
    aten.empty_like.default: _empty_like,
    aten.zeros_like.default: _zeros_like,
    aten._to_copy.default: _to_copy,
    aten.copy_.default: _copy,
    aten.cat.default: _cat,
    aten.is_pinned.default: lambda w, device=None: w.inner.is_pinned(),
    aten._pin_memory.default: lambda w, device=None: w._wrap(w.inner.pin_memory()),
    aten.equal.default: lambda a, b: torch.equal(*_plain((a, b))),
    torch.ops.c10d.broadcast_.default: _broadcast,
}

torch.serialization.add_safe_globals([BF16WireWeight, _rebuild])


# ---------------------------------------------------------------- deliberately broken
class BrokenOutWeight(BF16WireWeight):
    """``fsdp_post_all_gather`` ignores ``out=``: every re-gather leaves stale memory."""

    def fsdp_post_all_gather(self, outputs, rows, param_dtype, *, out=None):
        if out is not None:
            return None
        return super().fsdp_post_all_gather(outputs, rows, param_dtype)


class BrokenViewWeight(BF16WireWeight):
    """``view(-1)`` keeps the 2-D shape (as a view that ignores its size argument would)."""

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        if func is aten.view.default and list(args[1]) == [-1]:
            return args[0]._wrap(args[0].inner)
        return super().__torch_dispatch__(func, types, args, kwargs)


class BrokenWireWeight(BF16WireWeight):
    """``fsdp_pre_all_gather`` sends fp32 (4 bytes per element) instead of the declared bf16."""

    def fsdp_pre_all_gather(self, mesh, outer_size, outer_stride, module, mp_policy):
        (data,), rows = super().fsdp_pre_all_gather(mesh, outer_size, outer_stride, module, mp_policy)
        return (data.float(),), rows


torch.serialization.add_safe_globals([BrokenOutWeight, BrokenViewWeight, BrokenWireWeight])
