"""``F.embedding`` with an :class:`~fsdp_int8.Int8Weight`: only the looked-up rows are
dequantized.

Forward: ``out[t] = q[ids[t]] * scale[ids[t]]`` in the weight's outer dtype (the compute
dtype under FSDP2's mixed precision), a transient of the output's size; the weight is
never dequantized whole. Backward: the dense gradient torch computes for any embedding
(``embedding_dense_backward``: rows summed per id, ``padding_idx`` rows zero), plain, in
the output's dtype, which the optimizer then writes back into the int8 rows. A table tied
to an output head gets one dense gradient, not three (``tied_gradient``).

``max_norm`` (renormalises looked-up rows in place during the forward) and ``sparse``
gradients are refused: :func:`why_not_quantizable` keeps such embeddings in full
precision at :func:`fsdp_int8.quantize_`, and a call that asks for them here raises.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from fsdp_int8._weight import op_table as _op_table
from fsdp_int8._weight.linear import module_output
from fsdp_int8._weight.tensor import Int8Weight
from fsdp_int8._weight.tied_gradient import defer_lookup_rows
from fsdp_int8.quant import absmax_dequantize


def why_not_quantizable(module: nn.Embedding) -> str | None:
    """Why ``module`` cannot hold an int8 weight, or ``None`` if it can."""
    if module.max_norm is not None:
        return "max_norm renormalises rows in place in the forward"
    if module.sparse:
        return "sparse gradients"
    return None


def _lookup(weight: Int8Weight, ids: torch.Tensor) -> torch.Tensor:
    """The rows ``ids`` names, dequantized into the weight's outer dtype, shaped ``[*ids, D]``."""
    int_rows, scale = weight.read_rows()
    flat = ids.reshape(-1)
    values = absmax_dequantize(
        int_rows.index_select(0, flat), scale.index_select(0, flat), dtype=weight.dtype,
        compiled=weight.compiled,
    )
    return module_output(values, (*ids.shape, weight.row_len))


class _Int8Embedding(torch.autograd.Function):
    @staticmethod
    def forward(ctx, ids: torch.Tensor, weight: Int8Weight, padding_idx: int, scale_grad_by_freq: bool):
        ctx.save_for_backward(ids, weight)
        ctx.rows = weight.shape[0]
        ctx.padding_idx = padding_idx
        ctx.scale_grad_by_freq = scale_grad_by_freq
        return _lookup(weight, ids)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        ids, weight = ctx.saved_tensors
        grad_weight = None
        if ctx.needs_input_grad[1] and not defer_lookup_rows(
            weight, ids, grad_out, ctx.padding_idx, ctx.scale_grad_by_freq
        ):
            grad_weight = torch.ops.aten.embedding_dense_backward(
                grad_out, ids, ctx.rows, ctx.padding_idx, ctx.scale_grad_by_freq
            )
        return None, grad_weight, None, None


@_op_table.implements_function(F.embedding)
def _int8_weight_embedding(
    input: torch.Tensor,
    weight: torch.Tensor,
    padding_idx: int | None = None,
    max_norm: float | None = None,
    norm_type: float = 2.0,
    scale_grad_by_freq: bool = False,
    sparse: bool = False,
) -> torch.Tensor:
    """``F.embedding(input, weight, ...)`` when ``weight`` is an ``Int8Weight``."""
    if not isinstance(weight, Int8Weight) or isinstance(input, Int8Weight):
        raise NotImplementedError("F.embedding with an Int8Weight as the indices is not supported")
    if max_norm is not None or sparse:
        raise NotImplementedError(
            "F.embedding with an Int8Weight supports neither max_norm (it renormalises rows in "
            "place) nor sparse gradients: keep this embedding in full precision "
            "(Int8TrainingConfig.module_filter)"
        )
    if input.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"F.embedding needs int32 or int64 indices, got {input.dtype}")
    if weight.dim() != 2:
        raise RuntimeError(f"F.embedding needs a 2-D weight, got an Int8Weight of shape {tuple(weight.shape)}")
    rows = weight.shape[0]
    if padding_idx is None:
        padding_idx = -1  # aten's "no padding row"
    elif padding_idx < 0:
        padding_idx += rows
    return _Int8Embedding.apply(input, weight, padding_idx, scale_grad_by_freq)
