"""``F.linear`` with an :class:`~fsdp_int8.Int8Weight`: the matmul never keeps a dequantized weight.

Weight-only (default): ``y = x @ (q * scale)^T + b``, the weight rebuilt in the compute
dtype in one pass for this matmul only (a transient, never kept or saved: backward
rebuilds it). Backward: ``grad_x = grad_y @ (q * scale)`` and a plain
``grad_w = grad_y^T @ x`` in the compute dtype.

Int8 matmuls (``Int8MatmulConfig``): each enabled matmul quantizes its floating operand
per row on the fly (round to nearest) and runs ``torch._int_mm`` (int8 x int8 -> int32)
against the stored int8 weight; the scales are applied to the int32 result:

* output:      ``y[m, n]      = sx[m] * sw[n] * (qx @ qw^T)[m, n]``
* grad_input:  ``grad_x[m, k] = sg[m] * (qg @ qw)[m, k]`` where ``qg, sg`` quantize
  ``grad_y * sw`` (the weight's scale sits on the reduced dim, so it is folded in first);
* grad_weight: ``grad_w[n, k] = sgT[n] * sxT[k] * (qgT @ qxT^T)[n, k]``, ``grad_y`` quantized
  per output channel and ``x`` per input channel, both over the tokens (split into chunks
  so that int32 sums of 127 * 127 products cannot overflow).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from fsdp_int8.config import Int8MatmulConfig
from fsdp_int8.quant import absmax_quantize
from fsdp_int8.weight import Int8Weight

# |int32 sum| <= tokens * 127 * 127 < 2**31 holds for up to 133,144 tokens: chunk below it.
_MAX_TOKENS_PER_INT32_SUM = 1 << 17


def _quantize_eager(values: torch.Tensor, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    # No NaN check: it would synchronise with the device, and a NaN activation makes a NaN
    # output anyway.
    return absmax_quantize(values, dim=dim, nonfinite="unchecked")


def _quantize_each_row(values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return _quantize_eager(values, -1)


def _quantize_each_column(values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return _quantize_eager(values, 0)


def _dequantize_eager(acc: torch.Tensor, row_scale: torch.Tensor, col_scale: torch.Tensor | None) -> torch.Tensor:
    out = acc.float().mul_(row_scale.unsqueeze(1))
    return out if col_scale is None else out.mul_(col_scale.unsqueeze(0))


@functools.cache
def _compiled(role: str):
    # One fused pass instead of several. A separate function per role (separate code
    # objects: separate compile caches) with dynamic shapes, and contiguous inputs (see
    # _quantize_activations), so batch sizes and view layouts do not recompile.
    function = {
        "rows": _quantize_each_row, "columns": _quantize_each_column, "dequantize": _dequantize_eager,
    }[role]
    return torch.compile(function, dynamic=True)


def _quantize_activations(
    values: torch.Tensor, *, dim: int = -1, compile: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """Int8 activations or gradients with one scale per row (``dim=-1``) or per column
    (``dim=0``, no transposed copy), rounded to nearest."""
    if compile:
        return _compiled("rows" if dim == -1 else "columns")(values.contiguous())
    return _quantize_eager(values, dim)


def _dequantize(acc, row_scale, col_scale, *, compile: bool) -> torch.Tensor:
    """``acc * row_scale[:, None] * col_scale[None, :]`` in fp32 (int32 GEMM results)."""
    return (_compiled("dequantize") if compile else _dequantize_eager)(acc, row_scale, col_scale)


# CUDA's int8 GEMM (cuBLASLt) needs more than 16 rows in the left operand and a reduced
# dimension divisible by 8; the CPU kernel takes any shape.
_CUDA_MIN_ROWS = 17
_CUDA_K_MULTIPLE = 8


def _has_cuda_gemm_rules(device: torch.device) -> bool:
    return device.type == "cuda"


def _int_mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` for int8 operands, exactly, in int32.

    Where the device's GEMM has shape rules, the operands are zero-padded to meet them:
    zero rows give rows that are cut off, zeros along the reduced dimension add nothing
    to any sum, so the result is the same. (The weight-gradient GEMM reduces over tokens,
    whose count is the caller's: it is the one that needs the padding in practice.)
    """
    if not _has_cuda_gemm_rules(a.device):
        return torch._int_mm(a, b)
    rows, reduced = a.shape
    pad_rows = max(0, _CUDA_MIN_ROWS - rows)
    pad_reduced = -reduced % _CUDA_K_MULTIPLE
    if pad_rows or pad_reduced:
        a = torch.nn.functional.pad(a, (0, pad_reduced, 0, pad_rows))
        b = torch.nn.functional.pad(b, (0, 0, 0, pad_reduced))
    return torch._int_mm(a, b)[:rows]


def _int8_output(x2d: torch.Tensor, weight: Int8Weight, config: Int8MatmulConfig) -> torch.Tensor:
    qx, sx = _quantize_activations(x2d, compile=config.compile)
    # The GEMM runs about twice as fast with a contiguous right operand; the transposed
    # int8 copy costs one byte per weight, transiently (it is not a dequantized copy).
    acc = _int_mm(qx, weight.int_rows().t().contiguous())
    return _dequantize(acc, sx, weight.scale, compile=config.compile).to(x2d.dtype)


def _int8_grad_input(g2d: torch.Tensor, weight: Int8Weight, config: Int8MatmulConfig) -> torch.Tensor:
    qg, sg = _quantize_activations(g2d.float() * weight.scale.unsqueeze(0), compile=config.compile)
    acc = _int_mm(qg, weight.int_rows().contiguous())  # FSDP2's rows are strided views
    return _dequantize(acc, sg, None, compile=config.compile).to(g2d.dtype)


def _int8_grad_weight(g2d: torch.Tensor, x2d: torch.Tensor, config: Int8MatmulConfig) -> torch.Tensor:
    grad = None
    for start in range(0, g2d.shape[0], _MAX_TOKENS_PER_INT32_SUM):
        chunk = slice(start, start + _MAX_TOKENS_PER_INT32_SUM)
        # scales per output channel of grad_y and per input channel of x, over the tokens
        qg, sg = _quantize_activations(g2d[chunk], dim=0, compile=config.compile)
        qx, sx = _quantize_activations(x2d[chunk], dim=0, compile=config.compile)
        part = _dequantize(_int_mm(qg.t().contiguous(), qx), sg, sx, compile=config.compile)
        grad = part if grad is None else grad.add_(part)
    return grad.to(g2d.dtype)


class _Int8WeightLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: Int8Weight, bias: torch.Tensor | None):
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        config = weight.int8_matmul
        x2d = x.reshape(-1, x.shape[-1])
        if config is not None and config.output:
            out = _int8_output(x2d, weight, config)
        else:  # a transient weight in the compute dtype, built in one pass and not kept
            out = torch.matmul(x2d, weight.dequantize(x.dtype).t())
        if bias is not None:
            out = out.add_(bias.to(x.dtype))
        return out.view(*x.shape[:-1], out.shape[-1])

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        x, weight = ctx.saved_tensors
        config = weight.int8_matmul
        g2d = grad_out.reshape(-1, grad_out.shape[-1])
        grad_x = grad_w = grad_b = None
        if ctx.needs_input_grad[0]:
            if config is not None and config.grad_input:
                grad_x = _int8_grad_input(g2d, weight, config)
            else:
                grad_x = torch.matmul(g2d, weight.dequantize(g2d.dtype))
            grad_x = grad_x.view(*grad_out.shape[:-1], grad_x.shape[-1])
        if ctx.needs_input_grad[1]:
            x2d = x.reshape(-1, x.shape[-1]).to(g2d.dtype)
            if config is not None and config.grad_weight:
                grad_w = _int8_grad_weight(g2d, x2d, config)
            else:
                grad_w = g2d.t().matmul(x2d)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_b = g2d.sum(0)
        return grad_x, grad_w, grad_b


@Int8Weight.implements_function(F.linear)
def _int8_weight_linear(
    input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """``F.linear(input, weight, bias)`` when any of them is an ``Int8Weight``."""
    if not isinstance(weight, Int8Weight) or isinstance(input, Int8Weight) or isinstance(bias, Int8Weight):
        raise NotImplementedError("F.linear with an Int8Weight as input or bias is not supported")
    if not input.is_floating_point():
        raise TypeError(f"F.linear with an Int8Weight needs a floating input, got {input.dtype}")
    if input.shape[-1] != weight.row_len or weight.dim() != 2:
        raise RuntimeError(
            f"F.linear: input of shape {tuple(input.shape)} cannot multiply an Int8Weight of "
            f"shape {tuple(weight.shape)}"
        )
    if weight.int8_matmul is not None and input.device.type == "cuda" and (
        weight.shape[0] % 8 or weight.shape[1] % 8
    ):
        raise ValueError(
            f"int8 matmuls on CUDA need in and out features divisible by 8, got a weight of "
            f"shape {tuple(weight.shape)}: exclude this layer with Int8TrainingConfig.module_filter"
        )
    return _Int8WeightLinear.apply(input, weight, bias)
