"""``F.linear`` with an :class:`~fsdp_int8.Int8Weight`: the matmul never keeps a dequantized weight.

Forward: ``y = (x @ q^T) * scale + b``, with ``q`` the int8 values cast to the compute
dtype for the matmul only (exact: |q| <= 127 fits every float format's mantissa) and the
per-row scale applied to the output columns. Backward: ``grad_x = (grad_y * scale) @ q``
and a plain ``grad_w = grad_y^T @ x`` in the compute dtype. Only ``x`` and the int8
weight are saved for backward.
"""

from __future__ import annotations

import torch

from fsdp_int8.weight import Int8Weight

__all__ = ["int8_weight_linear"]


class _Int8WeightLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: Int8Weight, bias: torch.Tensor | None):
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        q = weight.int_rows().to(x.dtype)
        out = torch.matmul(x, q.t()).mul_(weight.scale.to(x.dtype))
        if bias is not None:
            out = out.add_(bias.to(x.dtype))
        return out

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        x, weight = ctx.saved_tensors
        grad_x = grad_w = grad_b = None
        if ctx.needs_input_grad[0]:
            scaled = grad_out * weight.scale.to(grad_out.dtype)
            grad_x = torch.matmul(scaled, weight.int_rows().to(grad_out.dtype))
        if ctx.needs_input_grad[1]:
            grad_w = grad_out.reshape(-1, grad_out.shape[-1]).t().matmul(
                x.reshape(-1, x.shape[-1]).to(grad_out.dtype)
            )
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_b = grad_out.reshape(-1, grad_out.shape[-1]).sum(0)
        return grad_x, grad_w, grad_b


def int8_weight_linear(
    input: torch.Tensor, weight: Int8Weight, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """``F.linear(input, weight, bias)`` for an int8 weight (what ``F.linear`` routes to)."""
    if not isinstance(weight, Int8Weight):
        raise TypeError(f"int8_weight_linear needs an Int8Weight, got {type(weight).__name__}")
    if isinstance(input, Int8Weight) or isinstance(bias, Int8Weight):
        raise NotImplementedError("F.linear with an Int8Weight as input or bias is not supported")
    if not input.is_floating_point():
        raise TypeError(f"F.linear with an Int8Weight needs a floating input, got {input.dtype}")
    if input.shape[-1] != weight.row_len or weight.dim() != 2:
        raise RuntimeError(
            f"F.linear: input of shape {tuple(input.shape)} cannot multiply an Int8Weight of "
            f"shape {tuple(weight.shape)}"
        )
    return _Int8WeightLinear.apply(input, weight, bias)
