"""``Int8Weight``: an int8 weight with per-row fp32 scales that trains in place.

The outer tensor looks like a floating weight of the training dtype (FSDP2 and autograd
need a floating parameter; gradients arrive in that dtype). Underneath it holds only

* ``int_data``: ``int8``, ``[rows, K]``, or ``[rows * K]`` for the flat view FSDP2 takes;
* ``scale``: ``fp32``, ``[rows]``.

Every aten op that reaches it is looked up in :mod:`fsdp_int8._ops`; an op that is not
there raises ``NotImplementedError`` naming itself. ``F.linear`` is routed to the
autograd function in :mod:`fsdp_int8.linear`.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.nn.functional as F
from torch.utils._pytree import tree_map_only

from fsdp_int8._generators import WEIGHT_ROUNDING
from fsdp_int8.quant import absmax_dequantize, absmax_quantize
from fsdp_int8.config import Int8MatmulConfig

__all__ = ["Int8Weight"]


class Int8Weight(torch.Tensor):
    """A floating-looking weight stored as int8 data plus one fp32 absmax scale per row.

    Args:
        int_data: ``int8`` tensor, ``[rows, row_len]`` or flat ``[rows * row_len]``.
        scale: ``fp32`` tensor, ``[rows]``.
        dtype: The outer (training) dtype, a floating dtype.
        row_len: Elements per row (``in_features`` of the linear layer).
        full_rows: Rows of the whole weight this tensor belongs to. FSDP2 shards carry
            it so that the all-gather hook can pad every shard to the same size.
        stochastic_rounding: How in-place updates are written back (see
            :class:`fsdp_int8.Int8TrainingConfig`).
        int8_matmul: Which matmuls of ``F.linear`` run as int8 GEMMs (``None``: none).

    Use :meth:`from_float` to build one from a plain tensor.
    """

    int_data: torch.Tensor
    scale: torch.Tensor
    row_len: int
    full_rows: int
    stochastic_rounding: bool
    int8_matmul: Int8MatmulConfig | None

    @staticmethod
    def __new__(
        cls,
        int_data: torch.Tensor,
        scale: torch.Tensor,
        *,
        dtype: torch.dtype,
        row_len: int,
        full_rows: int | None = None,
        stochastic_rounding: bool = True,
        int8_matmul: Int8MatmulConfig | None = None,
        requires_grad: bool = False,
    ) -> "Int8Weight":
        return torch.Tensor._make_wrapper_subclass(
            cls, int_data.shape, dtype=dtype, device=int_data.device, requires_grad=requires_grad
        )

    def __init__(
        self,
        int_data: torch.Tensor,
        scale: torch.Tensor,
        *,
        dtype: torch.dtype,
        row_len: int,
        full_rows: int | None = None,
        stochastic_rounding: bool = True,
        int8_matmul: Int8MatmulConfig | None = None,
        requires_grad: bool = False,
    ) -> None:
        if int_data.dtype != torch.int8 or scale.dtype != torch.float32:
            raise TypeError(
                f"Int8Weight needs int8 data and fp32 scales, got {int_data.dtype} and {scale.dtype}"
            )
        if not dtype.is_floating_point:
            raise TypeError(f"Int8Weight's outer dtype must be floating, got {dtype}")
        if int_data.dim() not in (1, 2) or (int_data.dim() == 2 and int_data.shape[1] != row_len):
            raise ValueError(
                f"Int8Weight data must be [rows, {row_len}] or flat, got {tuple(int_data.shape)}"
            )
        rows = int_data.numel() // row_len if row_len else 0
        if rows * row_len != int_data.numel() or tuple(scale.shape) != (rows,):
            raise ValueError(
                f"Int8Weight data {tuple(int_data.shape)} does not hold whole rows of {row_len} "
                f"matching {tuple(scale.shape)} scales"
            )
        self.int_data = int_data
        self.scale = scale
        self.row_len = row_len
        self.full_rows = rows if full_rows is None else full_rows
        self.stochastic_rounding = stochastic_rounding
        self.int8_matmul = int8_matmul

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_float(
        cls,
        weight: torch.Tensor,
        *,
        stochastic_rounding: bool = True,
        int8_matmul: Int8MatmulConfig | None = None,
        dtype: torch.dtype | None = None,
    ) -> "Int8Weight":
        """Quantize a 2-D floating tensor with round-to-nearest.

        Args:
            weight: ``[out_features, in_features]`` floating tensor (meta allowed).
            stochastic_rounding: Rounding used by later in-place updates.
            int8_matmul: Which matmuls run as int8 GEMMs (``None``: weight-only).
            dtype: Outer dtype; defaults to ``weight.dtype``.
        """
        if isinstance(weight, Int8Weight):
            raise TypeError("from_float got an Int8Weight; it is already quantized")
        if weight.dim() != 2:
            raise ValueError(
                f"Int8Weight quantizes 2-D [out_features, in_features] weights, got shape "
                f"{tuple(weight.shape)}"
            )
        int_data, scale = absmax_quantize(weight.detach(), what="a weight")
        return cls(
            int_data, scale, dtype=dtype or weight.dtype, row_len=weight.shape[1],
            stochastic_rounding=stochastic_rounding, int8_matmul=int8_matmul,
        )

    def derive(
        self,
        int_data: torch.Tensor,
        scale: torch.Tensor,
        *,
        dtype: torch.dtype | None = None,
    ) -> "Int8Weight":
        """A new ``Int8Weight`` over other inner tensors, with this one's metadata."""
        return Int8Weight(
            int_data, scale, dtype=dtype or self.dtype, row_len=self.row_len,
            full_rows=self.full_rows, stochastic_rounding=self.stochastic_rounding,
            int8_matmul=self.int8_matmul,
        )

    # ------------------------------------------------------------------ reading
    @property
    def rows(self) -> int:
        """Number of rows held (``out_features`` of this shard)."""
        return self.scale.shape[0]

    def int_rows(self) -> torch.Tensor:
        """The int8 data as ``[rows, row_len]`` (a view)."""
        return self.int_data.view(self.rows, self.row_len) if self.int_data.dim() == 1 else self.int_data

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """A plain tensor of this shape: ``int_data * scale`` in ``dtype`` (default: outer)."""
        values = absmax_dequantize(self.int_rows(), self.scale, dtype=dtype or self.dtype)
        return values.view(self.shape)

    def assign_(self, values: torch.Tensor, *, stochastic: bool) -> "Int8Weight":
        """Requantize ``values`` (this shape, any float dtype) into this tensor's storage."""
        int_data, scale = absmax_quantize(
            values.reshape(self.rows, self.row_len),
            rounding="stochastic" if stochastic else "nearest",
            generator=WEIGHT_ROUNDING.generator(values.device) if stochastic else None,
            what="a weight",
        )
        self.int_rows().copy_(int_data)
        self.scale.copy_(scale)
        return self

    def storage_bytes(self) -> int:
        """Bytes of int8 data plus scales held by this tensor's own elements."""
        return self.int_data.numel() * self.int_data.element_size() + self.scale.numel() * 4

    def __repr__(self) -> str:  # never dispatches: safe inside error messages
        rounding = "stochastic" if self.stochastic_rounding else "nearest"
        matmul = "" if self.int8_matmul is None else ", int8 matmuls"
        return (
            f"Int8Weight(shape={tuple(self.shape)}, dtype={self.dtype}, device={self.device}, "
            f"int8 rows of {self.row_len} + fp32 scales, rounding={rounding}{matmul}"
            + (", requires_grad=True" if self.requires_grad else "") + ")"
        )

    # ------------------------------------------------------------------ subclass protocol
    def __tensor_flatten__(self) -> tuple[list[str], tuple]:
        return ["int_data", "scale"], (
            self.dtype, self.row_len, self.full_rows, self.stochastic_rounding, self.int8_matmul
        )

    @staticmethod
    def __tensor_unflatten__(inner: dict, ctx: tuple, outer_size: Any, outer_stride: Any) -> "Int8Weight":
        dtype, row_len, full_rows, stochastic, int8_matmul = ctx
        return Int8Weight(
            inner["int_data"], inner["scale"], dtype=dtype, row_len=row_len,
            full_rows=full_rows, stochastic_rounding=stochastic, int8_matmul=int8_matmul,
        )

    def __reduce_ex__(self, protocol: int):
        # torch.load(weights_only=True) accepts this: the rebuild function and the class
        # are registered as safe globals in fsdp_int8/__init__.py.
        return (
            _rebuild_int8_weight,
            (self.int_data.clone(), self.scale.clone(), self.dtype, self.row_len,
             self.full_rows, self.stochastic_rounding, self.requires_grad,
             getattr(self, "_is_param", False),
             None if self.int8_matmul is None else dataclasses.astuple(self.int8_matmul)),
        )

    # ------------------------------------------------------------------ FSDP2 all-gather
    # The 1-argument form: FSDP2 skips its padded-size check for it, which a per-row scale
    # could never pass on an uneven shard (see fsdp_int8/_all_gather.py and
    # tests/distributed, which fail loudly if torch stops calling it).
    def fsdp_pre_all_gather(self, mesh):
        from fsdp_int8 import _all_gather

        return _all_gather.pre_all_gather(self, mesh)

    def fsdp_post_all_gather(self, outputs, metadata, param_dtype, *, out=None):
        from fsdp_int8 import _all_gather

        return _all_gather.post_all_gather(self, outputs, metadata, param_dtype, out=out)

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.linear:
            from fsdp_int8.linear import int8_weight_linear

            return int8_weight_linear(*args, **kwargs)
        # Everything else goes straight to __torch_dispatch__; skipping the default
        # __torch_function__ keeps plain results plain (it would rewrap them).
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        from fsdp_int8 import _ops

        return _ops.dispatch(func, args, kwargs or {})


def _rebuild_int8_weight(
    int_data, scale, dtype, row_len, full_rows, stochastic, requires_grad, is_param=False,
    int8_matmul=None,
):
    weight = Int8Weight(
        int_data, scale, dtype=dtype, row_len=row_len, full_rows=full_rows,
        stochastic_rounding=stochastic,
        int8_matmul=None if int8_matmul is None else Int8MatmulConfig(*int8_matmul),
    )
    if is_param:  # a pickled module's parameter comes back as a parameter
        return torch.nn.Parameter(weight, requires_grad=requires_grad)
    return weight.requires_grad_(requires_grad) if requires_grad else weight


def local_shard(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's local tensor of an FSDP2 (DTensor) parameter, or the tensor itself."""
    from torch.distributed.tensor import DTensor

    return tensor._local_tensor if isinstance(tensor, DTensor) else tensor


def dequantize_all(tree: Any, dtype: torch.dtype | None = None) -> Any:
    """Replace every ``Int8Weight`` in a pytree by its dequantized plain tensor."""
    return tree_map_only(Int8Weight, lambda w: w.dequantize(dtype), tree)


def contiguous_strides(shape: torch.Size | list[int] | tuple[int, ...]) -> tuple[int, ...]:
    """Row-major strides of ``shape``."""
    strides, running = [], 1
    for size in reversed(list(shape)):
        strides.append(running)
        running *= max(size, 1)
    return tuple(reversed(strides))
