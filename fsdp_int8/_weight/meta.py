"""``Int8WeightMeta``: everything an ``Int8Weight`` carries besides its outer dtype and its
two inner tensors, as one frozen object.

It is the one description of a weight's metadata: the constructor takes it, a view or a
copy is a :meth:`Int8WeightMeta.replace` of its source's, the subclass protocol
(flatten / unflatten) carries it whole, and pickling and the compile cache key read it
field by field. Frozen: nothing changes a weight's metadata after construction.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from fsdp_int8._weight.tensor_parallel import ColumnWindow, TensorParallelShard
from fsdp_int8.config import Int8MatmulConfig

__all__ = ["Int8WeightMeta", "NOT_PICKLED"]

NOT_PICKLED = ("tensor_parallel",)  # this process's placement, not the weight's


@dataclasses.dataclass(frozen=True)
class Int8WeightMeta:
    """The metadata of an ``Int8Weight``: everything it carries besides its dtype and tensors.

    One frozen object; the weight reads each field as an attribute (``w.row_len``). Nothing
    changes it after construction: a view or a copy with other metadata is
    ``Int8Weight.with_tensors``, whose ``changes`` are a :meth:`replace`.

    Attributes:
        row_len: Elements per row (``in_features`` of the linear layer).
        unsharded_rows: Rows of the whole weight this tensor belongs to (FSDP2 shards carry it
            so that the all-gather hook pads every shard to the same size); ``None``: the
            rows the weight holds, filled in by the weight's constructor; 0: a piece that
            is no dim-0 shard of any weight (its all-gather is refused).
        stochastic_rounding: How in-place updates are written back (see
            :class:`fsdp_int8.Int8TrainingConfig`).
        int8_matmul: Which matmuls of ``F.linear`` run as int8 GEMMs (``None``: none).
        int8_gathered_weights: FSDP2's all-gather gives an ``Int8Weight`` over the gathered
            int8 rows and scales (each matmul and lookup dequantizes a transient copy)
            instead of the whole weight dequantized once per unshard. Int8 GEMMs read the
            gathered int8 rows whatever this says.
        compiled: Whether this weight's quantization kernels (updates, dequantization,
            activation quantization) run ``torch.compile``d: ``Int8TrainingConfig.compile``
            resolved for this weight's row length.
        tensor_parallel: This rank's part of a weight split by tensor parallelism
            (``fsdp_int8.parallel``'s styles set it); a window of columns (a slice along
            dim 1, as DCP takes to reshard), which reads right and takes ``copy_`` from
            another ``Int8Weight`` but refuses writes that would requantize its rows
            (``NotImplementedError``); or ``None``. Never pickled.
    """

    row_len: int
    unsharded_rows: int | None = None
    stochastic_rounding: bool = True
    int8_matmul: Int8MatmulConfig | None = None
    int8_gathered_weights: bool = False
    compiled: bool = False
    tensor_parallel: TensorParallelShard | ColumnWindow | None = None

    def replace(self, **changes: Any) -> "Int8WeightMeta":
        """This metadata with ``changes`` (field names) applied."""
        return dataclasses.replace(self, **changes) if changes else self

    def by_name(self) -> dict[str, Any]:
        """Each field's value by name (an ``Int8MatmulConfig`` stays one)."""
        return {field.name: getattr(self, field.name) for field in dataclasses.fields(self)}
