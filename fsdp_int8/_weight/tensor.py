"""``Int8Weight`` (its docstring describes it). Every aten op and ``F.linear`` go through
the op table (:mod:`.op_table`, filled by :mod:`.ops` and :mod:`.linear`, never imported
here); the FSDP2 hooks are thin methods over :mod:`.all_gather`."""

from __future__ import annotations

import copy
from typing import Any

import torch

from fsdp_int8._weight import all_gather as _all_gather
from fsdp_int8._weight import cache_key as _cache_key
from fsdp_int8._weight import end_of_step
from fsdp_int8._weight import op_table as _op_table
from fsdp_int8._weight import pickle_layout as _pickle_layout
from fsdp_int8._weight import tensor_parallel as _tensor_parallel
from fsdp_int8._weight import update_checks as _update_checks
from fsdp_int8._weight.meta import NOT_PICKLED, Int8WeightMeta
from fsdp_int8._weight.tensor_parallel import ColumnWindow, TensorParallelShard
from fsdp_int8.config import Int8MatmulConfig
from fsdp_int8.quant import absmax_dequantize, absmax_quantize

__all__ = ["Int8Weight", "Int8WeightMeta"]


def _field(name: str) -> property:
    """A read-only attribute of the weight that reads its metadata's field ``name``."""
    return property(lambda self: getattr(self.meta, name), doc=f"``meta.{name}`` (read-only).")


class Int8Weight(torch.Tensor):
    """A floating-looking weight stored as int8 data plus one fp32 absmax scale per row.

    The outer dtype is floating (autograd and FSDP2 need a floating parameter; gradients
    arrive in it); underneath are only int8 values in ``[-127, 127]`` and one scale per row,
    ``scale[r] = amax(|row r|) / 127``: no fp32 copy, no cached dequantized weight.
    ``F.linear`` with it runs fsdp_int8's int8 linear layer (weight-only, or int8 GEMMs per
    ``int8_matmul``). Other aten ops go through the op table (:meth:`supported_ops`;
    docs/design.md): in-place updates dequantize, compute in fp32 and requantize with each
    row's new scale. Usually built by :func:`fsdp_int8.quantize_` or :meth:`from_float`.

    Refused, so that raw-bytes writers (safetensors, accelerate's ``save_model``) fail at
    once instead of writing wrong bytes: ``numpy()``, ``tolist()`` (``TypeError``) and
    ``storage()`` (``RuntimeError``). Give them
    :func:`fsdp_int8.integrations.hf_quantizer.int8_safetensors_state_dict` or
    :func:`fsdp_int8.export_full_state_dict`'s result. ``torch.save`` / ``pickle`` and
    ``copy.deepcopy`` keep the subclass and its metadata (but ``tensor_parallel``);
    ``torch.load(..., weights_only=True)`` accepts it; a pickled ``nn.Parameter`` comes
    back as one. ``fsdp_pre_all_gather`` / ``fsdp_post_all_gather`` are FSDP2's hooks.

    Args:
        int_data: ``int8``, ``[rows, row_len]``, flat ``[rows * row_len]`` (as FSDP2 takes
            it) or ``[*lead, row_len]`` (a view regrouping the rows: torchtitan's fused QKV).
        scale: ``fp32``, ``[rows]`` (``[*lead]`` for ``[*lead, row_len]`` data).
        meta: Everything else it carries, frozen (:class:`Int8WeightMeta`); a view or copy
            with other metadata is :meth:`with_tensors`.
        dtype: The outer (training) dtype, a floating dtype.
        requires_grad: As for any tensor.

    Raises:
        TypeError: when ``meta`` is not an ``Int8WeightMeta``, ``int_data`` is not int8,
            ``scale`` is not fp32, or ``dtype`` is not floating.
        ValueError: when ``int_data`` is neither 1-D nor ``[..., row_len]``, or does not
            hold whole rows of ``row_len`` matching ``scale``'s shape.

    Attributes:
        int_data: The int8 values, as above.
        scale: fp32, one absmax scale per row (0 for an all-zero row).
        meta: Its :class:`Int8WeightMeta`, whose fields read as read-only attributes:
            ``row_len``, ``unsharded_rows``, ``stochastic_rounding``, ``int8_matmul``,
            ``int8_gathered_weights``, ``compiled``, ``tensor_parallel``.
    """

    int_data: torch.Tensor
    scale: torch.Tensor
    meta: Int8WeightMeta
    row_len = _field("row_len")
    unsharded_rows = _field("unsharded_rows")
    stochastic_rounding = _field("stochastic_rounding")
    int8_matmul = _field("int8_matmul")
    int8_gathered_weights = _field("int8_gathered_weights")
    compiled = _field("compiled")
    tensor_parallel = _field("tensor_parallel")

    @staticmethod
    def __new__(
        cls,
        int_data: torch.Tensor,
        scale: torch.Tensor,
        meta: Int8WeightMeta,
        *,
        dtype: torch.dtype,
        requires_grad: bool = False,
    ) -> "Int8Weight":
        if not isinstance(meta, Int8WeightMeta):
            raise TypeError(f"Int8Weight takes its metadata as an Int8WeightMeta, got {type(meta).__name__}")
        row_len = meta.row_len
        if int_data.dtype != torch.int8 or scale.dtype != torch.float32:
            raise TypeError(f"Int8Weight needs int8 data and fp32 scales, got {int_data.dtype} and {scale.dtype}")
        if not dtype.is_floating_point:
            raise TypeError(f"Int8Weight's outer dtype must be floating, got {dtype}")
        if int_data.dim() == 0 or (int_data.dim() >= 2 and int_data.shape[-1] != row_len):
            raise ValueError(
                f"Int8Weight data must be [rows, {row_len}] or flat, got {tuple(int_data.shape)}"
            )
        rows = int_data.numel() // row_len if row_len else 0
        scale_shape = (rows,) if int_data.dim() == 1 else tuple(int_data.shape[:-1])
        if rows * row_len != int_data.numel() or tuple(scale.shape) != scale_shape:
            raise ValueError(
                f"Int8Weight data {tuple(int_data.shape)} does not hold whole rows of {row_len} "
                f"matching {tuple(scale.shape)} scales"
            )
        # Weights (flat or 2-D) always look contiguous to FSDP2, even when their rows are
        # strided views of the all-gather buffer; regrouped views tell their real strides,
        # so that reshape and contiguous() copy them where a plain tensor would be copied.
        strides = int_data.stride() if int_data.dim() > 2 else None
        self = torch.Tensor._make_wrapper_subclass(
            cls, int_data.shape, strides=strides, dtype=dtype, device=int_data.device,
            requires_grad=requires_grad,
        )
        self.int_data = int_data
        self.scale = scale
        self.meta = meta if meta.unsharded_rows is not None else meta.replace(unsharded_rows=rows)
        return self

    @staticmethod
    def supported_ops() -> list[str]:
        """Names of the aten ops and torch functions ``Int8Weight`` implements, sorted.

        The table is complete once ``fsdp_int8`` is imported, and internal: it cannot be
        extended from outside. A missing op raises ``NotImplementedError`` naming it.
        """
        return _op_table.supported_ops()

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_float(
        cls,
        weight: torch.Tensor,
        *,
        stochastic_rounding: bool = True,
        int8_matmul: Int8MatmulConfig | None = None,
        int8_gathered_weights: bool = False,
        compiled: bool = False,
        dtype: torch.dtype | None = None,
    ) -> "Int8Weight":
        """Quantize a 2-D or 3-D floating tensor row by row, rounding to nearest.

        Args:
            weight: ``[out_features, in_features]`` floating tensor (meta allowed), or a
                mixture-of-experts weight ``[experts, out_features, in_features]`` (one
                scale per expert and output feature: scales ``[experts, out_features]``;
                docs/moe.md).
            stochastic_rounding: How later in-place updates round (this quantization
                always rounds to nearest).
            int8_matmul: Which matmuls of ``F.linear`` run as int8 GEMMs (``None``:
                weight-only).
            int8_gathered_weights: FSDP2's gathered weight stays int8 (:class:`Int8WeightMeta`).
            compiled: Quantize, now and in later updates, with the ``torch.compile``d
                kernels (same bits).
            dtype: Outer dtype; defaults to ``weight.dtype``.

        Returns:
            A new ``Int8Weight`` (``requires_grad=False``) carrying these settings.

        Raises:
            TypeError: when ``weight`` is already an ``Int8Weight`` or is not floating.
            ValueError: when ``weight`` is not 2-D or 3-D, has 0 columns, or holds NaN
                or Inf.
        """
        if isinstance(weight, Int8Weight):
            raise TypeError("from_float got an Int8Weight; it is already quantized")
        if weight.dim() not in (2, 3):
            raise ValueError(
                "Int8Weight quantizes 2-D [out_features, in_features] weights and 3-D expert "
                f"weights [experts, out_features, in_features], got shape {tuple(weight.shape)}"
            )
        if weight.shape[-1] == 0:
            raise ValueError(
                f"cannot quantize a weight of shape {tuple(weight.shape)}: a layer with 0 input "
                "features has rows of length 0, which carry no scale. Leave it in full "
                "precision (exclude it in Int8TrainingConfig.module_filter)."
            )
        row_len = weight.shape[-1]
        int_data, scale = absmax_quantize(weight.detach().reshape(-1, row_len), what="a weight", compiled=compiled)
        if weight.dim() == 3:  # experts: [E, out, in] rows with [E, out] scales
            int_data, scale = int_data.view(weight.shape), scale.view(weight.shape[:-1])
        meta = Int8WeightMeta(row_len=row_len, stochastic_rounding=stochastic_rounding, int8_matmul=int8_matmul,
                              int8_gathered_weights=int8_gathered_weights, compiled=compiled)
        return cls(int_data, scale, meta, dtype=dtype or weight.dtype)

    def with_tensors(
        self,
        int_data: torch.Tensor,
        scale: torch.Tensor,
        *,
        dtype: torch.dtype | None = None,
        **changes: Any,
    ) -> "Int8Weight":
        """A new ``Int8Weight`` over other inner tensors with this one's metadata, but for
        ``dtype`` and ``changes`` (fields of :class:`Int8WeightMeta`: ``unsharded_rows=0``,
        ...). Raises as the constructor does, and ``TypeError`` for an unknown field."""
        return Int8Weight(int_data, scale, self.meta.replace(**changes), dtype=dtype or self.dtype)

    # ------------------------------------------------------------------ reading
    @property
    def rows(self) -> int:
        """Rows held by this tensor (``scale.numel()``: ``out_features`` of this shard)."""
        return self.scale.numel()

    def int_rows(self) -> torch.Tensor:
        """The int8 data as ``[rows, row_len]``: ``int_data`` itself or a view of it (a
        strided regrouped view has none: use :meth:`read_rows`)."""
        return self.int_data if self.int_data.dim() == 2 else self.int_data.view(self.rows, self.row_len)

    def read_rows(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(int8 [rows, row_len], fp32 [rows])`` of any layout, to read: views where the
        layout allows, copies of a strided regrouped view."""
        end_of_step.flush_if_holding((self,))
        return self.int_data.reshape(self.rows, self.row_len), self.scale.reshape(self.rows)

    def write_rows_(
        self, int_rows: torch.Tensor, scale: torch.Tensor, non_blocking: bool = False
    ) -> "Int8Weight":
        """Copy ``int8 [rows, row_len]`` values and fp32 ``[rows]`` scales into this tensor's
        own storage as they are (no rounding, no check); returns ``self``."""
        self.int_data.copy_(int_rows.reshape(self.int_data.shape), non_blocking=non_blocking)
        self.scale.copy_(scale.reshape(self.scale.shape), non_blocking=non_blocking)
        return self

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """A new plain tensor of this shape: ``int_data * scale`` computed in fp32, cast to
        ``dtype`` (default: the outer dtype)."""
        values = absmax_dequantize(*self.read_rows(), dtype=dtype or self.dtype, compiled=self.compiled)
        return values.view(self.shape)

    def assign_(self, values: torch.Tensor, *, stochastic: bool, optimizer_update: bool = False) -> "Int8Weight":
        """Requantize ``values`` (this shape, any float dtype) into this tensor's storage.

        New scales from each row's absmax, then rounding stochastically (``stochastic=True``:
        the process's stochastic-rounding generator) or to nearest; returns ``self``. An
        optimizer's update (``optimizer_update=True``) on an accelerator joins the step's one
        deferred NaN / Inf check instead of syncing here (it raises when ``step()`` returns;
        docs/limits.md).

        Raises:
            ValueError: when ``values`` holds NaN or Inf (the weight is left unchanged).
            NotImplementedError: when this weight is a window of columns (a dim-1 slice).
        """
        _tensor_parallel.check_requantizable(self, "requantizing")
        generator = _tensor_parallel.rounding_generator(self, values.device) if stochastic else None
        if _tensor_parallel.shares_row_scales(self):
            _tensor_parallel.write_shared_rows(
                self, values.reshape(self.rows, self.row_len), stochastic=stochastic,
                generator=generator, optimizer_update=optimizer_update,
            )
            return self
        deferred = optimizer_update and _update_checks.defers(values.device)
        int_data, scale = absmax_quantize(
            values.reshape(self.rows, self.row_len), rounding="stochastic" if stochastic else "nearest",
            generator=generator, nonfinite="unchecked" if deferred else "raise", what="a weight",
            compiled=self.compiled,
        )
        if deferred:
            _update_checks.defer(torch.isfinite(scale).all(), _update_checks.describe("weight", tuple(self.shape)))
        return self.write_rows_(int_data, scale)

    def numpy(self, *, force: bool = False):
        """Refused: an ``Int8Weight`` holds int8 values and per-row scales, not floats."""
        raise TypeError(
            "Int8Weight holds int8 values with per-row fp32 scales: call w.dequantize().numpy() "
            "for the float values, or w.int_data.numpy() and w.scale.numpy() for the stored ones"
        )

    def tolist(self):
        """Refused, as :meth:`numpy`: use ``w.dequantize().tolist()``."""
        raise TypeError("Int8Weight holds int8 values with per-row fp32 scales: call w.dequantize().tolist()")

    def data_ptr(self) -> int:
        """The address of the int8 data, unique per weight (frameworks key parameters by it:
        accelerate's FSDP2 optimizer re-mapping); not ``numel * itemsize`` readable bytes."""
        return self.int_data.data_ptr()

    def storage(self):
        """Refused (``RuntimeError``): there is no storage of the outer dtype to read bytes
        from, and raw-bytes writers would otherwise write garbage."""
        raise RuntimeError(
            "Int8Weight has no storage of its floating dtype (it holds int8 rows with fp32 "
            "scales), so raw-bytes writers such as safetensors cannot save it. A transformers "
            "model saves its int8 rows and scales through fsdp_int8's quantizer, which "
            "fsdp_int8.quantize_ / shard_model attach (a model made int8 another way: "
            "fsdp_int8.integrations.hf_quantizer.attach_hf_quantizer(model)); then "
            "save_pretrained and the Trainer work, and instead of accelerator.save_model "
            "call accelerator.unwrap_model(model)."
            "save_pretrained(path, state_dict=accelerator.get_state_dict(model)) on every rank "
            "(unsharded save_state: safe_serialization=False). Dequantized values: "
            "fsdp_int8.export_full_state_dict(model, dtype); an exact int8 checkpoint of any "
            "model: fsdp_int8.save_checkpoint."
        )

    def __deepcopy__(self, memo: dict) -> "Int8Weight":
        """A copy with its own int8 data and scales, ``requires_grad`` and attributes kept
        (``Tensor.__deepcopy__`` would copy a storage it does not have: :meth:`data_ptr` is not 0)."""
        if id(self) in memo:
            return memo[id(self)]
        copied = self.with_tensors(copy.deepcopy(self.int_data, memo), copy.deepcopy(self.scale, memo))
        memo[id(self)] = copied
        own = set(vars(copied))
        extra = {k: v for k, v in vars(self).items() if k not in own}  # _is_param, framework tags
        vars(copied).update(copy.deepcopy(extra, memo))
        if self.requires_grad:
            copied.requires_grad_(True)
        if self.grad is not None:
            copied.grad = copy.deepcopy(self.grad, memo)
        return copied

    def storage_bytes(self) -> int:
        """Bytes of this tensor's own data: one per int8 value plus 4 per scale."""
        return self.int_data.numel() * self.int_data.element_size() + self.scale.numel() * 4

    def __repr__(self) -> str:  # never dispatches: safe inside error messages
        rounding = "stochastic" if self.stochastic_rounding else "nearest"
        matmul = (", int8 matmuls" if self.int8_matmul is not None else
                  ", gathered int8" if self.int8_gathered_weights else "") + (", compiled" if self.compiled else "")
        return (
            f"Int8Weight(shape={tuple(self.shape)}, dtype={self.dtype}, device={self.device}, "
            f"int8 rows of {self.row_len} + fp32 scales, rounding={rounding}{matmul}"
            + (", requires_grad=True" if self.requires_grad else "") + ")"
        )

    # ------------------------------------------------------------------ subclass protocol
    def __tensor_flatten__(self) -> tuple[list[str], tuple]:
        return ["int_data", "scale"], (self.dtype, self.meta)

    _stable_hash_for_caching = _cache_key.stable_hash  # AOTAutograd's cache key: metadata, no values

    @staticmethod
    def __tensor_unflatten__(inner: dict, ctx: tuple, outer_size: Any, outer_stride: Any) -> "Int8Weight":
        dtype, meta = ctx
        return Int8Weight(inner["int_data"], inner["scale"], meta, dtype=dtype)

    def __reduce_ex__(self, protocol: int):
        # Both names are weights_only safe globals (end of module); the layout: _pickle_layout.
        return (
            _rebuild_int8_weight,
            (self.int_data.clone(), self.scale.clone(), self.dtype,
             _pickle_layout.pickled_fields(self.meta.by_name(), exclude=NOT_PICKLED), self.requires_grad,
             getattr(self, "_is_param", False)),
        )

    # ------------------------------------------------------------------ FSDP2 all-gather
    def fsdp_pre_all_gather(self, mesh: Any) -> tuple[tuple[torch.Tensor, ...], tuple[int, int]]:
        """FSDP2 hook: this shard's rows and scales packed into one padded int8 buffer
        (the wire format and why: :mod:`fsdp_int8._weight.all_gather`)."""
        return _all_gather.pre_all_gather(self, mesh)

    def fsdp_post_all_gather(
        self,
        outputs: tuple[torch.Tensor, ...],
        metadata: tuple[int, int],
        param_dtype: torch.dtype,
        *,
        out: "torch.Tensor | None" = None,
    ) -> "tuple[torch.Tensor, tuple[torch.Tensor, ...]] | None":
        """FSDP2 hook: the unsharded weight from the gathered int8 rows and scales: a plain
        ``param_dtype`` tensor (weight-only), or an ``Int8Weight`` over the gathered buffer
        (``int8_matmul`` or ``int8_gathered_weights``). Raises ``NotImplementedError`` on
        every rank if one flagged its shard as not FSDP2's dim-0 chunk of the weight."""
        return _all_gather.post_all_gather(self, outputs, metadata, param_dtype, out)

    # ------------------------------------------------------------------ dispatch
    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        handler = _op_table.function_handler(func)
        if handler is not None:
            return handler(*args, **(kwargs or {}))
        # Everything else goes straight to __torch_dispatch__; skipping the default
        # __torch_function__ keeps plain results plain (it would rewrap them).
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **(kwargs or {}))

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        return _op_table.dispatch(func, args, kwargs or {})


def _rebuild_int8_weight(int_data, scale, dtype, fields, *args):
    """An Int8Weight from its pickle (any layout :mod:`._pickle_layout` reads)."""
    fields, requires_grad, is_param = _pickle_layout.read(fields, args)
    weight = Int8Weight(int_data, scale, Int8WeightMeta(**fields), dtype=dtype)
    if is_param:  # a pickled module's parameter comes back as a parameter
        return torch.nn.Parameter(weight, requires_grad=requires_grad)
    return weight.requires_grad_(requires_grad) if requires_grad else weight


# Pickles, reprs and allow-lists name the public home, which private moves never change.
Int8Weight.__module__ = _rebuild_int8_weight.__module__ = "fsdp_int8.weight"
# torch.load(weights_only=True) rebuilds Int8Weights through these two names only.
torch.serialization.add_safe_globals([Int8Weight, _rebuild_int8_weight])
