"""The weight of a weight-only int8 matmul, dequantized for that matmul only.

With int8 gathered weights (``Int8TrainingConfig(int8_gathered_weights=True)``) each
matmul rebuilds its weight in the compute dtype from the int8 rows and scales, uses it,
and drops it: a transient, never kept or saved. The gradient of the input, ``grad_y @
(q * scale)``, rebuilds a large weight (an output head's: vocabulary x hidden) a slice of
input features at a time, so that its transient stays under
:data:`TRANSIENT_WEIGHT_ELEMENTS` however large the weight.
"""

from __future__ import annotations

import torch

from fsdp_int8._weight.tensor import Int8Weight
from fsdp_int8.quant import absmax_dequantize

# grad_input's transient weight is dequantized about this many elements at a time (8 MB in
# bf16): a whole output head's would be the largest temporary of its backward.
TRANSIENT_WEIGHT_ELEMENTS = 1 << 22
# Slices keep at least this many columns: narrower GEMMs may take other kernels (an AVX2
# CPU's fp32 GEMM of at most 8 columns sums in another order than a wider one's).
_MIN_SLICE_COLUMNS = 64


def weight_in(weight: Int8Weight, dtype: torch.dtype) -> torch.Tensor:
    """The whole weight in ``dtype`` for one matmul."""
    return absmax_dequantize(weight.int_rows(), weight.scale, dtype=dtype, compiled=weight.compiled)


def grad_input_weight_only(g2d: torch.Tensor, weight: Int8Weight) -> torch.Tensor:
    """``grad_y @ (q * scale)`` in ``grad_y``'s dtype, the weight dequantized a slice of
    input features at a time into its own columns of the result: each column is still one
    GEMM over all of grad_y's features, the same bits as the whole weight's on CPUs (tested)."""
    rows = weight.int_rows()
    width = max(_MIN_SLICE_COLUMNS, TRANSIENT_WEIGHT_ELEMENTS // max(1, rows.shape[0]))
    if width >= rows.shape[1]:
        return torch.matmul(g2d, weight_in(weight, g2d.dtype))
    grad_x = g2d.new_empty(g2d.shape[0], rows.shape[1])
    starts = list(range(0, rows.shape[1], width)) + [rows.shape[1]]
    if starts[-1] - starts[-2] < _MIN_SLICE_COLUMNS:
        del starts[-2]  # a narrow remainder joins the slice before it
    for start, end in zip(starts, starts[1:]):
        part = slice(start, end)
        # eager: every slice width would compile the dequantization again
        columns = absmax_dequantize(rows[:, part], weight.scale, dtype=g2d.dtype)
        torch.matmul(g2d, columns, out=grad_x[:, part])
        del columns  # before the next slice is made: one slice at a time
    return grad_x
