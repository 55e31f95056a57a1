"""Out-of-place math works on the dequantized values and returns plain tensors."""

from __future__ import annotations

from typing import Any

import torch

from fsdp_int8.weight import Int8Weight, dequantize_all

aten = torch.ops.aten


_PLAIN_MATH_OPS = (
    aten.add.Tensor, aten.add.Scalar, aten.sub.Tensor, aten.sub.Scalar, aten.mul.Tensor,
    aten.mul.Scalar, aten.div.Tensor, aten.div.Scalar, aten.neg.default, aten.abs.default,
    aten.sqrt.default, aten.pow.Tensor_Scalar, aten.sign.default, aten.addcmul.default,
    aten.addcdiv.default, aten.lerp.Scalar, aten.lerp.Tensor, aten.clamp.default,
    aten.maximum.default, aten.minimum.default, aten.sum.default, aten.sum.dim_IntList,
    aten.mean.default, aten.mean.dim, aten.linalg_vector_norm.default, aten.allclose.default,
    aten.isfinite.default, aten.eq.Tensor,
)


@Int8Weight.implements(*_PLAIN_MATH_OPS)
def _plain_math(func, *args, **kwargs) -> Any:
    return func(*dequantize_all(args), **dequantize_all(kwargs))
