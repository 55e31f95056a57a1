"""Updates requantize once, with the weight's own rounding (stochastic in training).

``add_``, ``mul_``, ``addcdiv_``, ``lerp_``, ... dequantize, compute in fp32, recompute each
row's scale and requantize; ``mul_`` / ``div_`` by a finite scalar (AdamW's weight decay)
only rescale the row scales, exactly. The fused optimizer kernels run on fp32 copies and
requantize each weight once; ``_foreach_`` forms run element by element, so each element
takes its own path.
"""

from __future__ import annotations

from typing import Any

import torch

from fsdp_int8._quant import kernels as _kernels
from fsdp_int8._weight import op_table as _op_table
from fsdp_int8._weight import tensor_parallel as _tensor_parallel
from fsdp_int8._weight import update_checks as _update_checks
from fsdp_int8._weight.ops.math import dequantize_all
from fsdp_int8._weight.tensor import Int8Weight
from fsdp_int8.quant import raise_non_finite

aten = torch.ops.aten
_implements = _op_table.implements


_UPDATE_OPS = (
    aten.add_.Tensor, aten.add_.Scalar, aten.sub_.Tensor, aten.sub_.Scalar,
    aten.mul_.Tensor, aten.mul_.Scalar, aten.div_.Tensor, aten.div_.Scalar,
    aten.addcdiv_.default, aten.addcmul_.default, aten.lerp_.Scalar, aten.lerp_.Tensor,
    aten.clamp_.default, aten.clamp_.Tensor, aten.neg_.default,
)
# Ops that only move values onto bounds or flip signs: requantized with round to nearest,
# never with stochastic noise (a value the op leaves alone must come back unchanged).
_DETERMINISTIC = {aten.clamp_.default, aten.clamp_.Tensor, aten.neg_.default}


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
    if factor != factor or factor in (float("inf"), float("-inf")):
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
        if factor == 0 and func in (aten.div_.Scalar, aten.div_.Tensor):
            raise ValueError(
                f"{func} by zero on an Int8Weight would make its values non-finite (Inf or "
                "NaN), which int8 cannot hold; the weight is left unchanged"
            )
        if factor is not None:
            _tensor_parallel.check_requantizable(target, f"{func} (a rescale of its row scales)")
            if _rescale(func, target, factor):
                return target
    if func is aten.addcdiv_.default and _fusable_addcdiv(target, args, kwargs):
        return _fused_addcdiv_(target, *args, **kwargs)
    values = target.dequantize(torch.float32)
    args, kwargs = _as_fp32(args, kwargs)
    func(values, *args, **kwargs)
    stochastic = target.stochastic_rounding and func not in _DETERMINISTIC
    return target.assign_(values, stochastic=stochastic, optimizer_update=True)


# ---------------------------------------------------------------- fused addcdiv_
# torch's AdamW ends with ``param.addcdiv_(exp_avg, denom, value=-step_size)``. With the
# compiled kernels on, that update is one compiled pass: dequantize the rows, add
# ``value * t1 / t2``, take each row's new scale and round (stochastically) to int8,
# instead of writing an fp32 copy of the weight, updating it, and reading it twice more.
# The arithmetic is the general path's (``q * scale`` in fp32; aten's CPU addcdiv
# computes ``self + value * t1 / t2`` in that order; then the weights' rounding), so the
# results are the same bit for bit. ``value`` travels as a 0-dim tensor: a Python float
# that changes every step (the learning-rate schedule) must not become a constant of
# the compiled graph.

def _addcdiv_then_round(q, scale, t1, t2, value, noise):
    values = torch.mul(q, scale.unsqueeze(1))
    values = values + value * t1.float() / t2.float()
    q, scale = _kernels.int8_rows(values, noise)
    return q, scale, torch.isfinite(scale).all()  # the check rides in the same kernel call


def _fusable_addcdiv(target: Int8Weight, args: tuple, kwargs: dict) -> bool:
    if not _kernels.use_compiled(target.compiled, target) or len(args) != 2 or set(kwargs) - {"value"}:
        return False
    window = isinstance(target.tensor_parallel, _tensor_parallel.ColumnWindow)
    if window or _tensor_parallel.shares_row_scales(target):
        return False  # shared row scales (rounded in assign_) or a column window (refused there)
    value = kwargs.get("value", 1)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    t1, t2 = args
    return (
        target.int_data.dim() <= 2
        and all(
            type(t) is torch.Tensor and t.is_floating_point() and t.shape == target.shape
            and t.device == target.device
            for t in (t1, t2)
        )
    )


def _fused_addcdiv_(target: Int8Weight, t1: torch.Tensor, t2: torch.Tensor, *, value: float = 1) -> Int8Weight:
    rows = target.int_rows()
    shape = (target.rows, target.row_len)
    operands = (rows, target.scale, t1.reshape(shape), t2.reshape(shape),
                torch.tensor(float(value), dtype=torch.float32, device=target.device))
    q, scale, finite = _kernels.run_rounding(
        _addcdiv_then_round, *operands, rows=target.rows, row_len=target.row_len,
        generator=_tensor_parallel.rounding_generator(target, target.device) if target.stochastic_rounding else None,
        stochastic=target.stochastic_rounding,
    )
    _update_checks.check(finite, _update_checks.describe("weight", tuple(target.shape)), lambda: raise_non_finite(
        target.dequantize(torch.float32).addcdiv_(t1, t2, value=value), "a weight", "int8"))
    return target.write_rows_(q, scale)


def _fp32_operand(value: Any) -> Any:
    """One operand of an update in fp32 (ops such as lerp_ refuse mixed dtypes)."""
    if isinstance(value, Int8Weight):
        return value.dequantize(torch.float32)
    if isinstance(value, torch.Tensor) and value.is_floating_point():
        return value.float()
    return value


def _as_fp32(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """The operands of an update op in fp32. They are flat (tensors and scalars): no pytree
    walk, which cost a third of a small weight's eager update in Python."""
    return tuple(map(_fp32_operand, args)), {k: _fp32_operand(v) for k, v in kwargs.items()}


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
            param.assign_(values, stochastic=param.stochastic_rounding, optimizer_update=True)
        elif values is not param:
            param.copy_(values)
    for arg, work in zip(args, work_args):
        if work is not arg:  # optimizer states and grads updated in fp32: write them back
            for original, updated in zip(arg, work):
                if updated is not original:
                    original.copy_(updated)


_FOREACH_PACKETS = tuple(
    getattr(aten, name) for name in dir(aten)
    if name.startswith("_foreach_") and hasattr(aten, name[len("_foreach_"):])
)


@_implements(*_FOREACH_PACKETS)
def _foreach(func: torch._ops.OpOverload, *args: Any, **kwargs: Any) -> Any:
    """Run a ``_foreach_`` op element by element, so each element takes its own path."""
    single = getattr(aten, func.__name__.split(".")[0][len("_foreach_"):])
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
