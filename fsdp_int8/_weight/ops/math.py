"""Out-of-place math and comparisons work on the dequantized values and return plain tensors."""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._pytree import tree_map_only

from fsdp_int8._weight import op_table as _op_table
from fsdp_int8._weight.tensor import Int8Weight

aten = torch.ops.aten


def dequantize_all(tree: Any, dtype: torch.dtype | None = None) -> Any:
    """Replace every ``Int8Weight`` in a pytree by its dequantized plain tensor."""
    return tree_map_only(Int8Weight, lambda w: w.dequantize(dtype), tree)


_PLAIN_MATH_OPS = (
    aten.add.Tensor, aten.add.Scalar, aten.sub.Tensor, aten.sub.Scalar, aten.mul.Tensor,
    aten.mul.Scalar, aten.div.Tensor, aten.div.Scalar, aten.neg.default, aten.abs.default,
    aten.sqrt.default, aten.pow.Tensor_Scalar, aten.sign.default, aten.addcmul.default,
    aten.addcdiv.default, aten.lerp.Scalar, aten.lerp.Tensor, aten.clamp.default,
    aten.maximum.default, aten.minimum.default, aten.sum.default, aten.sum.dim_IntList,
    aten.mean.default, aten.mean.dim, aten.linalg_vector_norm.default, aten.allclose.default,
    aten.isfinite.default, aten.eq.Tensor,
    # comparisons and selection give bool / plain results: nn.init.trunc_normal_ rejects
    # and redraws out-of-range values with them (then copy_ rounds the result to nearest)
    aten.eq.Scalar, aten.ne.Scalar, aten.ne.Tensor, aten.lt.Scalar, aten.lt.Tensor,
    aten.le.Scalar, aten.le.Tensor, aten.gt.Scalar, aten.gt.Tensor, aten.ge.Scalar,
    aten.ge.Tensor, aten.where.self,
)


@_op_table.implements(*_PLAIN_MATH_OPS)
def _plain_math(func, *args, **kwargs) -> Any:
    return func(*dequantize_all(args), **dequantize_all(kwargs))
