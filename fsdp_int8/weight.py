"""``Int8Weight``: an int8 weight with per-row fp32 scales that trains in place.

The outer tensor looks like a floating weight of the training dtype (FSDP2 and autograd
need a floating parameter; gradients arrive in that dtype). Underneath it holds only

* ``int_data``: ``int8``, ``[rows, K]``, or ``[rows * K]`` for the flat view FSDP2 takes;
* ``scale``: ``fp32``, ``[rows]``.

Views may also regroup the rows into more leading dims, ``int_data`` ``[*lead, K]`` with
``scale`` ``[*lead]`` (torchtitan views a fused QKV weight as ``[heads, 3, head_dim, K]``);
those can be sliced along any leading dim, and report their strides honestly.

Every aten op that reaches it is looked up in the class's op table, which
:mod:`fsdp_int8._ops` fills through :meth:`Int8Weight.implements` (``import fsdp_int8``
loads it); an op that is not there raises ``NotImplementedError`` naming itself.
``F.linear`` is routed, through :meth:`Int8Weight.implements_function`, to the autograd
function in :mod:`fsdp_int8.linear`. This module imports neither: the dependency is one-way.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any, Callable, ClassVar, Union

import torch
from torch.utils._pytree import tree_map_only

from fsdp_int8 import _dist, _hardware, _update_checks
from fsdp_int8._all_gather import flagged_shards, layout_flag, pack_rows, padded_rows, shard_rows, unpack_rows
from fsdp_int8._generators import WEIGHT_ROUNDING
from fsdp_int8.config import Int8MatmulConfig
from fsdp_int8.quant import absmax_dequantize, absmax_quantize, dequantize_rows_into

__all__ = ["Int8Weight"]

OpKey = Union[torch._ops.OpOverload, torch._ops.OpOverloadPacket]
Handler = Callable[..., Any]


class Int8Weight(torch.Tensor):
    """A floating-looking weight stored as int8 data plus one fp32 absmax scale per row.

    Args:
        int_data: ``int8`` tensor, ``[rows, row_len]`` or flat ``[rows * row_len]`` (or
            ``[*lead, row_len]``, a view regrouping the rows).
        scale: ``fp32`` tensor, ``[rows]`` (``[*lead]`` for ``[*lead, row_len]`` data).
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

    # aten op -> handler(func, *args, **kwargs); filled by fsdp_int8._ops through implements()
    _OP_TABLE: ClassVar[dict[OpKey, Handler]] = {}
    # ops refused with a reason (they would separate rows from their scales)
    _REFUSED: ClassVar[dict[OpKey, str]] = {}
    # torch-level functions handled above dispatch (F.linear); filled by fsdp_int8.linear
    _FUNCTION_TABLE: ClassVar[dict[Callable, Handler]] = {}
    # op namespace -> handler of its ops that have no rule (collectives: refusing one on one
    # rank would leave the others waiting in it); filled by fsdp_int8._ops.collectives
    _NAMESPACE_FALLBACK: ClassVar[dict[str, Handler]] = {}

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
        if int_data.dtype != torch.int8 or scale.dtype != torch.float32:
            raise TypeError(
                f"Int8Weight needs int8 data and fp32 scales, got {int_data.dtype} and {scale.dtype}"
            )
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
        self.row_len = row_len
        self.full_rows = rows if full_rows is None else full_rows
        self.stochastic_rounding = stochastic_rounding
        self.int8_matmul = int8_matmul
        return self

    # ------------------------------------------------------------------ the op table
    @staticmethod
    def _add_rules(table: dict, keys: tuple, rule: Any, taken: str, *others: dict) -> None:
        """``table[key] = rule`` for each key; a key that ``table`` or ``others`` already
        holds raises ``ValueError(taken.format(key=key))`` (two rules for one key would make
        the tables depend on import order)."""
        for key in keys:
            if key in table or any(key in other for other in others):
                raise ValueError(taken.format(key=key))
            table[key] = rule

    @classmethod
    def _registers(cls, table: dict, keys: tuple, taken: str, *others: dict) -> Callable[[Handler], Handler]:
        """A decorator adding its handler to ``table`` under each of ``keys``."""

        def register(handler: Handler) -> Handler:
            cls._add_rules(table, keys, handler, taken, *others)
            return handler

        return register

    @classmethod
    def implements(cls, *ops: OpKey) -> Callable[[Handler], Handler]:
        """Register the handler of aten ops (overloads, or whole packets such as ``aten._foreach_add_``).

        Raises:
            ValueError: if an op already has a handler (two rules for one op would make
                the table depend on import order).
        """
        return cls._registers(cls._OP_TABLE, ops, "Int8Weight already has a rule for {key}", cls._REFUSED)

    @classmethod
    def refuses(cls, *packets: OpKey, reason: str) -> None:
        """Refuse aten ops with ``reason`` (in the ``NotImplementedError`` they raise)."""
        cls._add_rules(cls._REFUSED, packets, reason, "Int8Weight already has a rule for {key}", cls._OP_TABLE)

    @classmethod
    def falls_back_in(cls, *namespaces: str) -> Callable[[Handler], Handler]:
        """Register the handler of the ops of ``namespaces`` that have no rule of their own."""
        return cls._registers(cls._NAMESPACE_FALLBACK, namespaces, "Int8Weight already has a fallback for {key}")

    @classmethod
    def implements_function(cls, *functions: Callable) -> Callable[[Handler], Handler]:
        """Register the handler of torch-level functions (``F.linear``), seen before dispatch."""
        return cls._registers(cls._FUNCTION_TABLE, functions, "Int8Weight already handles {key.__name__}")

    @classmethod
    def supported_ops(cls) -> list[str]:
        """Names of the aten ops and torch functions ``Int8Weight`` implements, sorted."""
        names = [str(op) for op in cls._OP_TABLE]
        names += [f"{f.__module__}.{f.__name__}" for f in cls._FUNCTION_TABLE]
        return sorted(names)

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
        if weight.shape[1] == 0:
            raise ValueError(
                f"cannot quantize a weight of shape {tuple(weight.shape)}: a layer with 0 input "
                "features has rows of length 0, which carry no scale. Leave it in full "
                "precision (exclude it in Int8TrainingConfig.module_filter)."
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
        return self.scale.numel()

    def int_rows(self) -> torch.Tensor:
        """The int8 data as ``[rows, row_len]`` (a view; a strided regrouped view has none)."""
        return self.int_data if self.int_data.dim() == 2 else self.int_data.view(self.rows, self.row_len)

    def read_rows(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(int8 [rows, row_len], fp32 [rows])`` of any layout, to read (a copy if strided)."""
        return self.int_data.reshape(self.rows, self.row_len), self.scale.reshape(self.rows)

    def write_rows_(
        self, int_rows: torch.Tensor, scale: torch.Tensor, non_blocking: bool = False
    ) -> "Int8Weight":
        """Copy ``int8 [rows, row_len]`` values and ``[rows]`` scales into this tensor's storage."""
        self.int_data.copy_(int_rows.reshape(self.int_data.shape), non_blocking=non_blocking)
        self.scale.copy_(scale.reshape(self.scale.shape), non_blocking=non_blocking)
        return self

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """A plain tensor of this shape: ``int_data * scale`` in ``dtype`` (default: outer)."""
        values = absmax_dequantize(*self.read_rows(), dtype=dtype or self.dtype)
        return values.view(self.shape)

    def assign_(self, values: torch.Tensor, *, stochastic: bool, step_update: bool = False) -> "Int8Weight":
        """Requantize ``values`` (this shape, any float dtype) into this tensor's storage.

        Non-finite ``values`` raise ``ValueError`` and leave the weight unchanged. An
        optimizer's update (``step_update=True``) on an accelerator is checked once per
        optimizer step instead, with every other update of the step (``_update_checks``).
        """
        deferred = step_update and _update_checks.defers(values.device)
        int_data, scale = absmax_quantize(
            values.reshape(self.rows, self.row_len),
            rounding="stochastic" if stochastic else "nearest",
            generator=WEIGHT_ROUNDING.generator(values.device) if stochastic else None,
            nonfinite="unchecked" if deferred else "raise",
            what="a weight",
        )
        if deferred:
            _update_checks.defer(torch.isfinite(scale).all(), tuple(self.shape))
        return self.write_rows_(int_data, scale)

    def numpy(self, *, force: bool = False):
        """Refused: an ``Int8Weight`` holds int8 values and per-row scales, not floats."""
        raise TypeError(
            "Int8Weight holds int8 values with per-row fp32 scales: call "
            "w.dequantize().numpy() for the float values, or w.int_data.numpy() and "
            "w.scale.numpy() for the stored ones"
        )

    def tolist(self):
        """Refused, as :meth:`numpy`: use ``w.dequantize().tolist()``."""
        raise TypeError("Int8Weight holds int8 values with per-row fp32 scales: call w.dequantize().tolist()")

    def data_ptr(self) -> int:
        """The address of the int8 data (one byte per element, not ``itemsize``).

        Frameworks key parameters by it (accelerate's FSDP2 optimizer re-mapping): a wrapper
        tensor's default, 0, would make every int8 weight collide. It identifies the
        weight; it is not ``numel * itemsize`` readable bytes of the outer dtype, which is
        why :meth:`storage` refuses raw-bytes writers.
        """
        return self.int_data.data_ptr()

    def storage(self):
        """Refused: there is no storage of the outer dtype to read bytes from.

        Raw-bytes writers (safetensors, hence Hugging Face ``save_pretrained`` and
        ``accelerator.save_model``) end up here; they would otherwise write garbage.
        """
        raise RuntimeError(
            "Int8Weight has no storage of its floating dtype (it holds int8 rows with fp32 "
            "scales), so raw-bytes writers such as safetensors cannot save it. Save the "
            "dequantized values instead: model.save_pretrained(path, "
            "state_dict=fsdp_int8.export_full_state_dict(model, dtype)) or "
            "safetensors.torch.save_file(fsdp_int8.export_full_state_dict(model, dtype), file); "
            "a transformers Trainer: use fsdp_int8.integrations.hf.Int8Trainer (or its "
            "Int8SaveMixin); for an exact int8 checkpoint use fsdp_int8.save_checkpoint."
        )

    def __deepcopy__(self, memo: dict) -> "Int8Weight":
        """A copy with its own int8 data and scales, ``requires_grad`` and attributes kept.

        Needed because this weight's :meth:`data_ptr` is not 0: ``Tensor.__deepcopy__``
        would take it for a storage-backed tensor and copy a storage it does not have.
        """
        if id(self) in memo:
            return memo[id(self)]
        copied = self.derive(copy.deepcopy(self.int_data, memo), copy.deepcopy(self.scale, memo))
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
    # could never pass on an uneven shard (the wire format and why: fsdp_int8/_all_gather.py;
    # tests/distributed fail loudly if torch stops calling it).
    def fsdp_pre_all_gather(self, mesh: Any) -> tuple[tuple[torch.Tensor, ...], tuple[int, int]]:
        """FSDP2 hook: this shard's rows and scales packed into one padded int8 buffer.

        ``mesh`` is the shard mesh: a model quantized before ``fully_shard`` learns here
        which shard this rank rounds (its own noise stream, see ``_generators``). A shard
        that is not FSDP2's dim-0 chunk of the whole weight sends a layout flag instead
        (``_all_gather``), which every rank's ``fsdp_post_all_gather`` raises on.
        Metadata: the whole weight's rows and the rows each rank sends.
        """
        if not torch.compiler.is_compiling():
            WEIGHT_ROUNDING.adopt_shard_coordinate(mesh)
        rows = padded_rows(self.full_rows, mesh.size())
        if self._is_expected_shard(mesh):
            wire = pack_rows(self.int_rows(), self.scale, rows)
        else:
            wire = layout_flag(rows, self.row_len, self.int_data.device)
        return (wire,), (self.full_rows, rows)

    def _is_expected_shard(self, mesh: Any) -> bool:
        """Whether this tensor holds the rows FSDP2's dim-0 shard of ``full_rows`` holds on
        ``mesh`` (the layout the wire format unpacks). Checked once per tensor and layout:
        asking the mesh for the coordinate costs microseconds at every all-gather."""
        layout = (self.full_rows, self.rows, mesh.size())
        if self.__dict__.get("_checked_layout") == layout:
            return True
        if self.rows != shard_rows(self.full_rows, mesh.size(), _dist.shard_coordinate(mesh)):
            return False
        self._checked_layout = layout
        return True

    def fsdp_post_all_gather(
        self,
        outputs: tuple[torch.Tensor, ...],
        metadata: tuple[int, int],
        param_dtype: torch.dtype,
        *,
        out: "torch.Tensor | None" = None,
    ) -> "tuple[torch.Tensor, tuple[torch.Tensor, ...]] | None":
        """FSDP2 hook: the unsharded weight, built from the gathered int8 rows and scales.

        Weight-only (no ``int8_matmul``): a plain ``param_dtype`` tensor, the rows
        dequantized once per unshard, so the layer's forward and backward run plain
        ``F.linear`` (no subclass dispatch, no weight rebuilt per matmul): the same values
        that ``F.linear`` on an ``Int8Weight`` multiplies by. The gathered bytes stay int8.
        Int8 matmuls: an ``Int8Weight`` over the gathered buffer (its GEMMs read the int8
        rows). Later unshards refill ``out`` in place.

        Raises:
            NotImplementedError: on every rank, at the first unshard, if a rank flagged its
                shard as not FSDP2's dim-0 chunk of the weight (tensor parallelism, say).
        """
        (gathered,) = outputs
        full_rows, rows = metadata
        if out is None:  # the first unshard: one sync per weight reads every rank's flag
            flagged = flagged_shards(gathered, rows, self.row_len)
            if flagged:
                raise NotImplementedError(_unsupported_layout(self, flagged, gathered.shape[0] // rows))
            if not torch.compiler.is_compiling():  # weight-only layers never reach F.linear's check
                _hardware.warn_if_slow(gathered.device, param_dtype, int8_matmul=False)
        data, scale = unpack_rows(gathered, full_rows, self.row_len)
        if self.int8_matmul is None:
            return _dequantized_unshard(data, scale, param_dtype, out)
        if out is not None:
            if out.int_data.untyped_storage().data_ptr() != gathered.untyped_storage().data_ptr():
                out.int_data.copy_(data)  # FSDP2 gave a new buffer: keep `out` current anyway
            out.scale.copy_(scale)
            return None
        # `data` views FSDP2's own output buffer, which it frees; `scale` is ours to hand over.
        return self.derive(data, scale, dtype=param_dtype), (scale,)

    # ------------------------------------------------------------------ dispatch
    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        handler = cls._FUNCTION_TABLE.get(func)
        if handler is not None:
            return handler(*args, **(kwargs or {}))
        # Everything else goes straight to __torch_dispatch__; skipping the default
        # __torch_function__ keeps plain results plain (it would rewrap them).
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **(kwargs or {}))

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        handler = cls._OP_TABLE.get(func) or cls._OP_TABLE.get(func.overloadpacket)
        if handler is not None:
            if torch.is_inference_mode_enabled() and func.is_view and not args[0].is_inference():
                # A view of a normal tensor must be a normal tensor (torch then shares the
                # base's version counter); made under inference mode, ours would not be.
                with torch.inference_mode(False):
                    return handler(func, *args, **(kwargs or {}))
            return handler(func, *args, **(kwargs or {}))
        reason = cls._REFUSED.get(func) or cls._REFUSED.get(func.overloadpacket)
        if reason is not None:
            raise NotImplementedError(f"Int8Weight does not support {func}: {reason}")
        fallback = cls._NAMESPACE_FALLBACK.get(func.namespace)
        if fallback is not None:
            return fallback(func, *args, **(kwargs or {}))
        raise NotImplementedError(
            f"Int8Weight does not support {func} (int8 data + fp32 row scales). Call "
            ".dequantize() to work on a plain tensor; to initialise int8 weights with a "
            "multi-step initialiser (nn.init.orthogonal_, a model's own init), run it through "
            "fsdp_int8.init_int8_weights_(model, init_fn). If FSDP2, an optimizer or a "
            "checkpoint API sent this op, please report it."
        )


# Where a tensor-parallel layout reaches an int8 weight, the error says this.
TENSOR_PARALLEL_UNSUPPORTED = (
    "torch's tensor parallelism (parallelize_module with ColwiseParallel / RowwiseParallel, "
    "distribute_tensor) does not support int8 weights yet (docs/parallelism.md). Supported: "
    "fully_shard (or fsdp_int8.shard_model) of the unsharded quantized model, on a 1-D or "
    "an HSDP mesh; or leave the layers you parallelize in full precision "
    "(Int8TrainingConfig.skip_names)."
)


def _unsupported_layout(weight: Int8Weight, flagged: list[int], shards: int) -> str:
    return (
        f"an Int8Weight of {weight.full_rows} rows x {weight.row_len} cannot be all-gathered: "
        f"shard(s) {flagged} of the {shards}-way FSDP2 shard mesh do not hold the rows of "
        "FSDP2's dim-0 shard of the whole weight (every rank raises this error). The weight "
        "was cut before fully_shard, most likely by tensor parallelism: "
        + TENSOR_PARALLEL_UNSUPPORTED
    )


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


def _dequantized_unshard(
    data: torch.Tensor, scale: torch.Tensor, param_dtype: torch.dtype, out: torch.Tensor | None
) -> "tuple[torch.Tensor, tuple[torch.Tensor, ...]] | None":
    """A weight-only unshard: ``data * scale`` in ``param_dtype``, into ``out`` when given.

    The first unshard returns the new tensor as FSDP2's unsharded parameter AND as its
    inner tensor: FSDP2 frees that storage at every reshard and re-allocates it before
    calling again with ``out`` (a view of the same storage), which is refilled in place.
    """
    if out is None:
        values = torch.empty(data.shape, dtype=param_dtype, device=data.device)
        dequantize_rows_into(data, scale, values)
        return values, (values,)
    if out.dtype != param_dtype or tuple(out.shape) != tuple(data.shape):
        raise RuntimeError(
            f"FSDP2 passed out= of {out.dtype} {tuple(out.shape)} for a weight-only unshard "
            f"of {param_dtype} {tuple(data.shape)}: the unsharded weight changed between "
            "unshards, which fsdp_int8 does not expect; please report it"
        )
    if out.is_inference():
        dequantize_rows_into(data, scale, out)
        return None
    # The same refill FSDP2 does into its own all-gather outputs: autograd saved this
    # weight in forward, FSDP2 freed it at reshard and we write the same values back for
    # backward, so the mutation is hidden from autograd's version check as FSDP2 hides its own.
    with torch.autograd._unsafe_preserve_version_counter(out):
        dequantize_rows_into(data, scale, out)
    return None


# torch.load(weights_only=True) rebuilds Int8Weights through these two names only.
torch.serialization.add_safe_globals([Int8Weight, _rebuild_int8_weight])


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
