"""FLOPs by dtype of one aten op, and the shape of a 2-D GEMM: the formulas
:class:`benchmarks._op_trace.OpCounter` counts with.

torch's own formulas (``torch.utils.flop_counter.flop_registry``) plus the ones it lacks:
``torch._int_mm`` (int8 FLOPs), ``torch._grouped_mm``, the CPU's flash attention forward
and backward, and fsdp_int8's grouped int8 GEMMs of experts. A causal attention counts
half of torch's full-square figure. The dtype is the first operand's.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import torch
from torch.utils.flop_counter import flop_registry, sdpa_backward_flop_count, sdpa_flop_count

__all__ = ["flops_of", "gemm_shape", "op_name"]

aten = torch.ops.aten


def op_name(func) -> str:
    """``namespace.name`` of an op overload (``aten.mm``, ``fsdp_int8.int8_grouped_mm``)."""
    return f"{func.namespace}.{func._schema.name.split('::')[-1]}"


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _shape(t: Any) -> tuple[int, ...]:
    return tuple(t.shape)


def _int_mm_flops(a, b, *args, **kwargs) -> int:
    return 2 * a.shape[0] * a.shape[1] * b.shape[1]


def _grouped_mm_flops(a, b, *args, **kwargs) -> int:
    # 2-D x 3-D (tokens grouped by offsets, one weight per group): every token row meets
    # one group's weight: 2 * tokens * k * n; 3-D x 3-D: a batched matmul
    if a.dim() == 2 and b.dim() == 3:
        return 2 * a.shape[0] * a.shape[1] * b.shape[-1]
    if a.dim() == 3 and b.dim() == 3:
        return 2 * a.shape[0] * a.shape[1] * a.shape[2] * b.shape[-1]
    return 2 * a.shape[0] * a.shape[1] * b.shape[-1]  # 2-D x 2-D with groups along k


def _cpu_attention_flops(query, key, value, dropout_p=0.0, is_causal=False, *args, **kwargs) -> float:
    flops = sdpa_flop_count(_shape(query), _shape(key), _shape(value))
    return flops / 2 if is_causal else flops


def _cpu_attention_backward_flops(grad_out, query, key, value, out, logsumexp, dropout_p=0.0, is_causal=False,
                                  *args, **kwargs) -> float:
    flops = sdpa_backward_flop_count(_shape(grad_out), _shape(query), _shape(key), _shape(value))
    return flops / 2 if is_causal else flops


def _is_causal(func, args, kwargs) -> bool:
    schema = func._schema
    for position, argument in enumerate(schema.arguments):
        if argument.name == "is_causal":
            if argument.name in kwargs:
                return bool(kwargs[argument.name])
            return bool(args[position]) if position < len(args) else bool(argument.default_value)
    return False


EXTRA_FLOPS = {  # ops torch.utils.flop_counter has no formula for
    aten._int_mm: _int_mm_flops,
    aten._grouped_mm: _grouped_mm_flops,
    aten._scaled_dot_product_flash_attention_for_cpu: _cpu_attention_flops,
    aten._scaled_dot_product_flash_attention_for_cpu_backward: _cpu_attention_backward_flops,
}
ATTENTION = {  # torch's attention formulas count the full square; causal kernels do half
    aten._scaled_dot_product_flash_attention, aten._scaled_dot_product_efficient_attention,
    aten._scaled_dot_product_cudnn_attention, aten._scaled_dot_product_flash_attention_backward,
    aten._scaled_dot_product_efficient_attention_backward, aten._scaled_dot_product_cudnn_attention_backward,
}


def _int8_grouped_mm_flops(x, int_data, scale, offs, compiled, int8_output, keep_int8_input) -> dict[str, float]:
    # fsdp_int8's grouped GEMM over an int8 expert weight [experts, out, in]: every row of x
    # meets one expert
    flops = 2.0 * x.shape[0] * x.shape[1] * int_data.shape[1]
    return {"int8" if int8_output else _dtype_name(x.dtype): flops}


def _int8_grouped_mm_backward_flops(grad_out, saved, saved_scale, int_data, scale, offs, compiled, need_input,
                                    need_weight, int8_input, int8_weight) -> dict[str, float]:
    flops: dict[str, float] = defaultdict(float)
    each = 2.0 * grad_out.shape[0] * int_data.shape[1] * int_data.shape[2]
    if need_input:
        flops["int8" if int8_input else _dtype_name(grad_out.dtype)] += each
    if need_weight:
        flops["int8" if int8_weight else _dtype_name(grad_out.dtype)] += each
    return dict(flops)


CUSTOM_FLOPS = {  # fsdp_int8's custom ops, by name: FLOPs by dtype
    "fsdp_int8.int8_grouped_mm": _int8_grouped_mm_flops,
    "fsdp_int8.int8_grouped_mm_backward": _int8_grouped_mm_backward_flops,
}


def flops_of(func, args: tuple, kwargs: dict, out: Any) -> dict[str, float]:
    """FLOPs of one call of ``func`` by dtype name (the first operand's); empty for an op
    that does not multiply matrices."""
    packet = func.overloadpacket
    name = op_name(func)
    if name in CUSTOM_FLOPS:
        return CUSTOM_FLOPS[name](*args, **kwargs)
    if packet in EXTRA_FLOPS:
        flops = EXTRA_FLOPS[packet](*args, **kwargs)
    elif packet in flop_registry:
        flops = flop_registry[packet](*args, **kwargs, out_val=out)  # torch's formulas take tensors
        if packet in ATTENTION and _is_causal(func, args, kwargs):
            flops /= 2
    else:
        return {}
    first = next(a for a in args if isinstance(a, torch.Tensor))
    return {_dtype_name(first.dtype): float(flops)}


GEMMS = {aten.mm, aten._int_mm, aten.addmm}


def _transposed(t: torch.Tensor) -> bool:
    return t.dim() == 2 and t.stride(0) == 1 and t.shape[0] > 1 and t.stride(1) != 1


def gemm_shape(func, args: tuple) -> tuple[str, int, int, int, bool, bool] | None:
    """``(dtype, m, k, n, a transposed, b transposed)`` of a 2-D GEMM call (``mm``,
    ``_int_mm``, ``addmm``; transposed: column-major, as ``x.t()`` is), else ``None``."""
    if func.overloadpacket not in GEMMS:
        return None
    a, b = (args[1], args[2]) if func.overloadpacket is aten.addmm else (args[0], args[1])
    return _dtype_name(a.dtype), int(a.shape[0]), int(a.shape[1]), int(b.shape[1]), _transposed(a), _transposed(b)
