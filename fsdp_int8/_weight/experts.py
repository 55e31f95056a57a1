"""The compute ops of a mixture-of-experts weight: a 3-D ``Int8Weight`` ``[experts, out, in]``.

transformers 5 and torchtitan keep the experts of a MoE block as 3-D parameters, one scale
per (expert, output feature), and use them in a few forms:

* one expert, ``w[e]`` with an int or a 0-d tensor (transformers' eager loop,
  ``F.linear(x, w[e])``): a 2-D int8 view of that expert's rows and scales, which
  ``F.linear`` runs as any int8 linear layer (its int8 GEMMs included). That is the
  ``select`` op of :mod:`.ops.views`; nothing here.
* the weight as an operand of a batched or grouped matmul: transposed (``transpose``,
  ``mT``, ``permute``, ``swapaxes``; torchtitan's ``w.bfloat16().transpose(-2, -1)``),
  indexed by a tensor of expert ids (``w[ids]``, transformers' batched_mm), or passed to
  ``bmm`` / ``matmul`` / ``torch._grouped_mm`` / ``F.grouped_mm`` as it is. These run on
  the weight's values dequantized in its outer dtype (the compute dtype: torchtitan casts
  with ``.bfloat16()`` first, which keeps the int8 bytes), through :class:`_Dequantize`,
  whose gradient for the int8 weight is the gradient for those values: what the
  optimizer then writes back with stochastic rounding.
* with int8 GEMMs (``Int8MatmulConfig``), the last two dims of the weight swapped
  (``transpose(-2, -1)``, ``mT``) give an :class:`ExpertsTransposed`, which
  ``torch._grouped_mm`` / ``F.grouped_mm`` take as their right operand: each expert's
  rows of tokens then run :mod:`.linear`'s GEMMs against that expert (``torch._int_mm``,
  one call per expert with tokens; the weight gradient lands in one ``[E, out, in]``
  tensor). Anything else done with it runs on the values, as above.

The dequantized copy is a transient of the op that needs it (autograd keeps it for the
backward of a matmul, as it keeps a bf16 weight). Under FSDP2 with weight-only int8 the
all-gather already hands the block plain dequantized experts, and none of this runs.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch.utils._pytree import tree_map_only

from fsdp_int8._weight import op_table as _op_table
from fsdp_int8.config import Int8MatmulConfig
from fsdp_int8._weight.linear import grads_of, output_of
from fsdp_int8._weight.tensor import Int8Weight, Int8WeightMeta

EXPERT_DIMS = 3  # [experts, out, in]


class _Dequantize(torch.autograd.Function):
    """``weight``'s values as a plain tensor; the gradient passes through unchanged (the
    values are the weight, for autograd's purposes: dequantization is exact)."""

    @staticmethod
    def forward(ctx, weight: Int8Weight) -> torch.Tensor:
        ctx.dtype = weight.dtype
        return weight.dequantize()

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return grad.to(ctx.dtype)


def dequantized(weight: Int8Weight) -> torch.Tensor:
    """``weight``'s values in its outer dtype, differentiable with respect to ``weight``."""
    return _Dequantize.apply(weight)


def _is_experts(value: Any) -> bool:
    return isinstance(value, Int8Weight) and value.dim() >= EXPERT_DIMS


def _as_values(tree: Any) -> Any:
    """Every expert ``Int8Weight`` in ``tree`` replaced by its differentiable values."""
    return tree_map_only(Int8Weight, lambda w: dequantized(w) if _is_experts(w) else w, tree)


def _on_values(func: Callable) -> Callable:
    """A handler running ``func`` on the values of the expert weights among its arguments;
    with no expert weight there, ``func`` runs as torch's own (a 2-D weight keeps its
    rules: a transposed linear weight is refused)."""

    def handler(*args, **kwargs):
        if any(_is_experts(a) for a in (*args, *kwargs.values())):
            args, kwargs = _as_values((args, kwargs))
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)

    handler.__name__ = f"experts_{getattr(func, '__name__', 'op')}"
    return handler


def _experts_weight(int_data: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype,
                    gemms: list[bool], compiled: bool) -> Int8Weight:
    """The expert weight over ``int_data`` / ``scale`` with the matmul config ``gemms``
    holds (:func:`_gemms`): what the grouped-matmul ops below rebuild from the plain
    tensors and flags a custom op takes (a custom op cannot take the weight itself)."""
    meta = Int8WeightMeta(row_len=int_data.shape[-1], int8_matmul=Int8MatmulConfig(*gemms), compiled=compiled)
    return Int8Weight(int_data, scale, meta, dtype=dtype)


def _gemms(weight: Int8Weight) -> list[bool]:
    """Every flag of ``weight``'s ``Int8MatmulConfig``, in its fields' order."""
    return list(dataclasses.astuple(weight.int8_matmul))


# The grouped GEMMs are custom ops: torch.compile keeps each one opaque (one node, as it
# keeps torch._grouped_mm), so a compiled block holds the per-expert loop, whose bounds
# are read from the offsets at run time, without a graph break.
@torch.library.custom_op("fsdp_int8::int8_grouped_mm", mutates_args=())
def _grouped_output(x: torch.Tensor, int_data: torch.Tensor, scale: torch.Tensor, offs: torch.Tensor,
                    dtype: torch.dtype, gemms: list[bool], compiled: bool) -> torch.Tensor:
    """``torch._grouped_mm(x, weight.mT, offs=offs)``: each expert's rows of ``x`` through
    :func:`.linear.output_of` against that expert. Rows after the last offset are zero
    (``torch._grouped_mm`` leaves them unwritten)."""
    weight = _experts_weight(int_data, scale, dtype, gemms, compiled)
    out = x.new_zeros(x.shape[0], weight.shape[1])
    for expert, rows in _groups(offs, weight.shape[0]):
        out[rows] = output_of(x[rows], weight[expert], None)
    return out


@_grouped_output.register_fake
def _(x, int_data, scale, offs, dtype, gemms, compiled):
    return x.new_empty(x.shape[0], int_data.shape[1])


@torch.library.custom_op("fsdp_int8::int8_grouped_mm_backward", mutates_args=())
def _grouped_grads(grad_out: torch.Tensor, x: torch.Tensor, int_data: torch.Tensor, scale: torch.Tensor,
                   offs: torch.Tensor, dtype: torch.dtype, gemms: list[bool], compiled: bool,
                   need_input: bool, need_weight: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``(grad_x, grad_w)`` of :func:`_grouped_output`, each expert through
    :func:`.linear.grads_of`; an empty tensor for a gradient not needed."""
    weight = _experts_weight(int_data, scale, dtype, gemms, compiled)
    grad_x = torch.zeros_like(x) if need_input else x.new_empty(0)
    grad_w = grad_out.new_zeros(weight.shape, dtype=dtype) if need_weight else grad_out.new_empty(0)
    for expert, rows in _groups(offs, weight.shape[0]):
        x_rows = x[rows].to(grad_out.dtype) if need_weight else None
        gx, gw = grads_of(grad_out[rows], x_rows, weight[expert], need_input=need_input)
        if gx is not None:
            grad_x[rows] = gx
        if gw is not None:
            grad_w[expert] = gw
    return grad_x, grad_w


@_grouped_grads.register_fake
def _(grad_out, x, int_data, scale, offs, dtype, gemms, compiled, need_input, need_weight):
    grad_x = torch.empty_like(x) if need_input else x.new_empty(0)
    grad_w = grad_out.new_empty(int_data.shape, dtype=dtype) if need_weight else grad_out.new_empty(0)
    return grad_x, grad_w


class _Int8GroupedMM(torch.autograd.Function):
    """``torch._grouped_mm(x, weight.mT, offs=offs)`` for an expert ``Int8Weight`` with int8
    GEMMs, through the custom ops above; the weight's gradient is a plain ``[E, out, in]``
    tensor, what the optimizer writes back."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: Int8Weight, offs: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x, weight, offs)
        ctx.dtype, ctx.gemms, ctx.compiled = weight.dtype, _gemms(weight), weight.compiled
        return _grouped_output(x, weight.int_data, weight.scale, offs, weight.dtype, ctx.gemms, weight.compiled)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        x, weight, offs = ctx.saved_tensors
        need_input, need_weight = ctx.needs_input_grad[:2]
        grad_x, grad_w = _grouped_grads(grad_out, x, weight.int_data, weight.scale, offs, ctx.dtype,
                                        ctx.gemms, ctx.compiled, need_input, need_weight)
        return grad_x if need_input else None, grad_w if need_weight else None, None


def _groups(offs: torch.Tensor, experts: int) -> list[tuple[int, slice]]:
    """``(expert, its rows)`` of every expert with rows, from ``torch._grouped_mm``'s
    cumulative ``offs`` (one per expert)."""
    ends = offs.tolist()
    if len(ends) != experts:
        raise ValueError(f"grouped_mm: {len(ends)} offsets for {experts} experts")
    starts = [0, *ends[:-1]]
    return [(e, slice(a, b)) for e, (a, b) in enumerate(zip(starts, ends)) if b > a]


class ExpertsTransposed(torch.Tensor):
    """An expert ``Int8Weight`` ``[E, out, in]`` with int8 GEMMs, seen as ``[E, in, out]``:
    the right operand ``torch._grouped_mm`` takes. It holds the weight, not a copy;
    grouped matmuls run :class:`_Int8GroupedMM` on it, transposing back gives the weight,
    and every other op runs on the transposed values (a plain tensor)."""

    @staticmethod
    def __new__(cls, weight: Int8Weight) -> "ExpertsTransposed":
        shape = (*weight.shape[:-2], weight.shape[-1], weight.shape[-2])
        self = torch.Tensor._make_wrapper_subclass(cls, shape, dtype=weight.dtype, device=weight.device)
        self.weight = weight
        return self

    def __repr__(self) -> str:
        return f"ExpertsTransposed({self.weight!r})"

    def __tensor_flatten__(self) -> tuple[list[str], None]:
        return ["weight"], None

    @staticmethod
    def __tensor_unflatten__(inner: dict, ctx: None, outer_size: Any, outer_stride: Any) -> "ExpertsTransposed":
        return ExpertsTransposed(inner["weight"])

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _GROUPED and isinstance(_operand(args, kwargs, 1, "mat_b"), ExpertsTransposed):
            a, b = _operand(args, kwargs, 0, "mat_a"), _operand(args, kwargs, 1, "mat_b")
            offs = kwargs.get("offs", args[2] if len(args) > 2 else None)
            if offs is None or a.dim() != 2 or kwargs.get("bias") is not None:
                raise NotImplementedError(
                    "grouped_mm of int8 experts takes 2-D tokens, offsets and no bias: "
                    "torch._grouped_mm(x, w.transpose(-2, -1), offs=offs)")
            return _Int8GroupedMM.apply(a, b.weight, offs)
        if func in _SWAP_LAST and _swaps_last_two(func, args, kwargs):
            return args[0].weight
        if func in _METADATA or getattr(func, "__name__", "") == "__get__":
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **kwargs)
        args, kwargs = tree_map_only(ExpertsTransposed, lambda t: dequantized(t.weight).mT, (args, kwargs))
        return func(*args, **kwargs)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        raise NotImplementedError(
            f"{func} reached an ExpertsTransposed below autograd: call it on the expert "
            "weight's values (.weight.dequantize()) instead")


def _operand(args: tuple, kwargs: dict, index: int, name: str):
    return args[index] if len(args) > index else kwargs.get(name)


def _swaps_last_two(func, args: tuple, kwargs: dict) -> bool:
    """Whether ``func(*args)`` swaps exactly the last two dims (``transpose(-2, -1)``, ``mT``)."""
    if func in (torch.Tensor.mT.__get__,):
        return True
    dims = [d % 3 for d in (*args[1:3], *kwargs.values()) if isinstance(d, int)]
    return sorted(dims) == [1, 2]


_GROUPED = {torch._grouped_mm, *([F.grouped_mm] if hasattr(F, "grouped_mm") else [])}
_SWAP_LAST = {torch.transpose, torch.Tensor.transpose, torch.Tensor.mT.__get__}
_METADATA = {torch.Tensor.size, torch.Tensor.dim, torch.Tensor.stride, torch.Tensor.numel,
             torch.Tensor.is_contiguous, torch.Tensor.__len__, torch.Tensor.data_ptr,
             torch.Tensor.element_size, torch.Tensor.storage_offset}


def _transposed(weight: Int8Weight) -> torch.Tensor:
    """``weight`` with its last two dims swapped: an :class:`ExpertsTransposed` where its
    GEMMs are int8, else its values, transposed."""
    if weight.dim() == EXPERT_DIMS and weight.int8_matmul is not None:
        return ExpertsTransposed(weight)
    return dequantized(weight).mT


def _transpose_handler(func: Callable) -> Callable:
    on_values = _on_values(func)

    def handler(*args, **kwargs):
        if func in _SWAP_LAST and _is_experts(args[0]) and _swaps_last_two(func, args, kwargs):
            return _transposed(args[0])
        return on_values(*args, **kwargs)

    return handler


_MATMULS = [torch.bmm, torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__,
            torch.Tensor.__rmatmul__, torch.Tensor.bmm, torch._grouped_mm]
if hasattr(F, "grouped_mm"):
    _MATMULS.append(F.grouped_mm)
_TRANSPOSES = [torch.transpose, torch.Tensor.transpose, torch.Tensor.mT.__get__, torch.Tensor.mH.__get__,
               torch.permute, torch.Tensor.permute, torch.swapaxes, torch.Tensor.swapaxes,
               torch.Tensor.swapdims, torch.swapdims, torch.movedim, torch.Tensor.movedim]

for _func in _MATMULS:
    _op_table.implements_function(_func)(_on_values(_func))
for _func in _TRANSPOSES:
    _op_table.implements_function(_func)(_transpose_handler(_func))


def _indexes_by_tensor(index: Any) -> bool:
    """Whether ``index`` picks along a dim with a tensor or a list (advanced indexing), as
    ``w[expert_ids]`` does; a 0-d tensor picks one expert, like an int."""
    parts = index if isinstance(index, tuple) else (index,)
    return any((isinstance(p, torch.Tensor) and p.dim() > 0) or isinstance(p, list) for p in parts)


@_op_table.implements_function(torch.Tensor.__getitem__)
def _getitem(weight: torch.Tensor, index: Any) -> torch.Tensor:
    """``w[ids]`` of an expert weight: the values of those experts (a plain tensor); any
    other index of any Int8Weight: torch's indexing, served by the op table's views."""
    if _is_experts(weight) and _indexes_by_tensor(index):
        weight = dequantized(weight)
    with torch._C.DisableTorchFunctionSubclass():
        return torch.Tensor.__getitem__(weight, index)
