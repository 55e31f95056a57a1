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
  ``torch._grouped_mm`` / ``F.grouped_mm`` take as their right operand: the grouped
  matmul is then :func:`.grouped_mm.int8_grouped_mm` (one grouped int8 GEMM per pass,
  the offsets kept on the device; the weight gradient lands in one ``[E, out, in]``
  tensor). Anything else done with it runs on the values, as above.

The dequantized copy is a transient of the op that needs it (autograd keeps it for the
backward of a matmul, as it keeps a bf16 weight). Under FSDP2 with weight-only int8 the
all-gather already hands the block plain dequantized experts, and none of this runs.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch.utils._pytree import tree_map_only

from fsdp_int8._weight import op_table as _op_table
from fsdp_int8._weight.grouped_mm import int8_grouped_mm
from fsdp_int8._weight.tensor import Int8Weight

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


class ExpertsTransposed(torch.Tensor):
    """An expert ``Int8Weight`` ``[E, out, in]`` with int8 GEMMs, seen as ``[E, in, out]``:
    the right operand ``torch._grouped_mm`` takes. It holds the weight, not a copy;
    grouped matmuls run :func:`.grouped_mm.int8_grouped_mm` on it, transposing back gives the weight,
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
            return int8_grouped_mm(a, b.weight, offs)
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
