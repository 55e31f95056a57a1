"""What an ``Int8Weight`` knows of a tensor-parallel split, and how writes keep row scales shared.

A weight split by rows (``ColwiseParallel``: whole rows per rank) needs nothing special:
each rank's rows carry their own scales. A weight split by columns (``RowwiseParallel``:
each rank holds ``in_features / tp`` elements of every row) keeps **one scale per row for
the whole row**: the row's absmax over all tensor-parallel peers. So the stored format is
1-D's, and a checkpoint reshards across any ``tp``. Every write of such a weight takes the
row absmax over the peers (an ``all_reduce(MAX)`` of ``[rows]`` fp32) before it rounds:

* an optimizer's update (``optimizer_update``) made inside a step that holds such work
  (``Int8AdamW`` / ``Int8SGD`` after backward, or a ``torch.optim`` optimizer given to
  :func:`fsdp_int8.optim.batch_int8_updates`) is **deferred**: its fp32 values wait in
  that step's :class:`~fsdp_int8._weight.end_of_step.EndOfStep`, which rounds every
  deferred weight after one ``all_reduce`` per process group when the step ends, or
  before an op of the same step reads a waiting weight;
* any other write (a load, an initialiser, ``copy_``, an update outside such a step, the
  step inside backward) reduces at once.

The scale is fixed before the noise is drawn and bounds every value of the row, so
stochastic rounding stays unbiased and nothing is clipped. A non-finite value on any peer
makes the reduced absmax infinite on every peer, so all of them raise together.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from fsdp_int8._dist import released_by_backend
from fsdp_int8._quant.generators import WEIGHT_ROUNDING, active_update_stream
from fsdp_int8._weight import end_of_step, update_checks
from fsdp_int8.quant import absmax_quantize, raise_non_finite, signed_row_absmax

__all__ = [
    "TensorParallelShard", "ColumnWindow", "shares_row_scales", "rounding_generator", "check_requantizable",
    "shared_row_absmax", "write_shared_rows", "UPDATES",
]


if TYPE_CHECKING:  # for annotations only: Int8Weight's writes call into this module
    from fsdp_int8._weight.tensor import Int8Weight


@dataclasses.dataclass(frozen=True)
class TensorParallelShard:
    """This rank's part of a weight split by tensor parallelism.

    Attributes:
        mesh: The 1-D tensor-parallel mesh.
        coordinate: This rank's index on ``mesh``.
        shares_row_scales: ``True`` for a split along the input features (every peer holds
            part of every row, and all share the row's scale).
    """

    mesh: DeviceMesh
    coordinate: int
    shares_row_scales: bool

    @property
    def size(self) -> int:
        return self.mesh.size()


@dataclasses.dataclass(frozen=True)
class ColumnWindow:
    """A view of columns ``[start, stop)`` of rows of ``row_len`` elements (a slice along
    dim 1, as DCP takes to reshard a weight split by columns), holding the whole rows'
    scales. It reads right, and ``copy_`` from another ``Int8Weight`` writes exact bytes
    and scales; a write that requantizes is refused (:func:`check_requantizable`)."""

    start: int
    stop: int
    row_len: int


def shares_row_scales(weight: Int8Weight) -> bool:
    """Whether ``weight``'s tensor-parallel peers share its row scales (a column split)."""
    split = weight.tensor_parallel
    return isinstance(split, TensorParallelShard) and split.shares_row_scales


def rounding_generator(weight: Int8Weight, device: torch.device) -> "torch.Generator | None":
    """The generator of ``weight``'s stochastic rounding on ``device``: its tensor-parallel
    shard's own stream, or the rank's (``None`` on meta); inside an optimizer's update of
    one weight, that update's own stream (``fsdp_int8._quant.generators.update_stream``)."""
    update = active_update_stream()
    if update is not None and device.type != "meta":
        return update
    split = weight.tensor_parallel
    return WEIGHT_ROUNDING.generator(device, split if isinstance(split, TensorParallelShard) else None)


def check_requantizable(weight: Int8Weight, what: str) -> None:
    """Raise if ``what`` (a write that recomputes or rescales row scales) would reach
    columns outside ``weight``: it is a :class:`ColumnWindow`."""
    window = weight.tensor_parallel
    if isinstance(window, ColumnWindow):
        raise NotImplementedError(
            f"{what} on this Int8Weight is refused: it is a window of columns "
            f"[{window.start}, {window.stop}) of rows of {window.row_len} elements (a slice "
            "along dim 1, as DCP takes to reshard a weight split by columns). It shares the "
            "whole rows' scales, so it can be read, and written only by copy_ from another "
            "Int8Weight (exact bytes and scales); a write that requantizes or rescales it "
            "would change the columns outside the window. Write the whole weight, or "
            ".dequantize() the window for a plain tensor."
        )


def shared_row_absmax(values: list[torch.Tensor], mesh: DeviceMesh) -> list[torch.Tensor]:
    """Each ``[rows, K]`` tensor's row absmax, maximised over ``mesh``'s ranks in ONE
    ``all_reduce``. NaN becomes +Inf first: every peer then sees a non-finite scale."""
    local = [signed_row_absmax(v.float()) for v in values]
    if not local:
        return []
    packed = torch.cat(local).nan_to_num_(nan=float("inf"))
    if mesh.size() > 1 and not packed.is_meta:
        with released_by_backend(packed):
            dist.all_reduce(packed, op=dist.ReduceOp.MAX, group=mesh.get_group())
    return list(packed.split([t.numel() for t in local]))


def _round_into(weight: Int8Weight, values: torch.Tensor, amax: torch.Tensor, stochastic: bool, generator) -> None:
    if not values.is_meta:  # read at once on the CPU, with the step's other verdicts on accelerators
        update_checks.check(
            torch.isfinite(amax).all(), update_checks.describe("tensor-parallel weight", tuple(weight.shape)),
            lambda: raise_non_finite(values, "a tensor-parallel weight (on this rank or a peer)", "int8"),
        )
    int_data, scale = absmax_quantize(
        values, rounding="stochastic" if stochastic else "nearest", generator=generator,
        nonfinite="unchecked", amax=amax, what="a weight",
    )
    weight.write_rows_(int_data, scale)


def _round_held(waiting: list[tuple[Int8Weight, torch.Tensor, bool, "torch.Generator | None"]]) -> None:
    """Round deferred updates: one ``all_reduce(MAX)`` per tensor-parallel group."""
    by_mesh: dict[DeviceMesh, list[int]] = {}
    for index, (weight, *_rest) in enumerate(waiting):
        by_mesh.setdefault(weight.tensor_parallel.mesh, []).append(index)
    failed: ValueError | None = None
    for mesh, indices in by_mesh.items():
        amaxes = shared_row_absmax([waiting[i][1] for i in indices], mesh)
        for index, amax in zip(indices, amaxes):
            weight, values, stochastic, generator = waiting[index]
            try:
                _round_into(weight, values, amax, stochastic, generator)
            except ValueError as error:  # round the others: every peer fails alike
                failed = failed or error
    if failed is not None:
        raise failed


# Deferred optimizer updates: (weight, fp32 values [rows, K], stochastic, generator), in
# write order, held by the optimizer step that made them.
UPDATES = end_of_step.register_kind("tensor-parallel updates", _round_held)


def write_shared_rows(
    weight: Int8Weight, values: torch.Tensor, *, stochastic: bool, generator, optimizer_update: bool
) -> None:
    """Round ``values`` (``[rows, K]`` fp32) into ``weight`` with row scales shared by its
    tensor-parallel peers: when the step ends for an optimizer update made inside a step
    that holds them, at once otherwise."""
    if optimizer_update:
        end_of_step.flush_if_holding((weight,))  # a second update of one weight in a step: the first lands first
        if end_of_step.hold(UPDATES, (weight, values.detach().float(), stochastic, generator), weight):
            return
    end_of_step.flush_active(through=UPDATES)  # keep the peers' collectives in one order
    (amax,) = shared_row_absmax([values], weight.tensor_parallel.mesh)
    _round_into(weight, values, amax, stochastic, generator)
