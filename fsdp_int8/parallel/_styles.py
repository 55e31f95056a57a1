"""Tensor-parallel styles that split int8 weights with their scales, and run local matmuls.

``Int8ColwiseParallel`` and ``Int8RowwiseParallel`` are torch's ``ColwiseParallel`` /
``RowwiseParallel`` (same arguments, same input and output layouts) with two changes for
a linear layer whose weight is an ``Int8Weight``:

* **the split**: colwise gives each rank whole rows with their scales, and a local weight
  that knows it is whole (``unsharded_rows`` = its rows: FSDP2 then shards it on the dp mesh
  as a weight of its own). Rowwise gives each rank ``in_features / tp`` elements of every
  row and the **whole row's scale** (shared by all peers, see ``fsdp_int8._weight.tensor_parallel``).
* **the matmul** runs on local tensors: ``F.linear`` of the local input and the local
  weight (an ``Int8Weight`` or, after FSDP2's weight-only unshard, its dequantized
  values), so int8 GEMMs and per-token activation scales stay per rank. Colwise returns
  its output sharded on the last dim; rowwise returns partial sums, which the output
  layout reduces (after dequantization, in the compute dtype), then adds the bias.

Layers whose weight is not int8 get torch's own styles unchanged.
"""

from __future__ import annotations

import types

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel

from fsdp_int8._dist import local_shard, released_by_backend
from fsdp_int8._quant.kernels import ceil_div
from fsdp_int8._weight.tensor import Int8Weight
from fsdp_int8._weight.tensor_parallel import TensorParallelShard

__all__ = ["Int8ColwiseParallel", "Int8RowwiseParallel", "int8_tp_plan"]


def _span(length: int, parts: int, index: int) -> tuple[int, int]:
    """``[start, stop)`` of piece ``index`` of ``torch.chunk(length, parts)`` (DTensor's split)."""
    size = ceil_div(length, parts)
    start = min(length, index * size)
    return start, min(length, start + size)


def _int8_linear(module: nn.Module) -> bool:
    return isinstance(module, nn.Linear) and isinstance(local_shard(module.weight), Int8Weight)


def _check_divisible(module: nn.Module, dim: int, mesh: DeviceMesh, style: str) -> None:
    length = module.weight.shape[dim]
    if length % mesh.size():
        what = "out_features (rows)" if dim == 0 else "in_features (columns)"
        raise ValueError(
            f"{style} cannot split a {tuple(module.weight.shape)} int8 weight {mesh.size()} ways: "
            f"its {what} = {length} is not divisible by the tp size. Pick a tp size that divides "
            "it, or leave this layer out of the plan."
        )


def _source_weight(weight: Int8Weight, mesh: DeviceMesh, src_data_rank: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The whole weight's int8 rows and scales, as tp rank ``src_data_rank`` holds them
    (torch's styles scatter from that rank too: peers may have initialised differently)."""
    data, scale = weight.read_rows()
    data, scale = data.contiguous(), scale.contiguous()
    if src_data_rank is not None and mesh.size() > 1 and not data.is_meta:
        group = mesh.get_group()
        source = dist.get_global_rank(group, src_data_rank)
        with released_by_backend(data, scale):
            dist.broadcast(data, source, group=group)
            dist.broadcast(scale, source, group=group)
    return data, scale


def _int8_parameter(local: Int8Weight, like: torch.Tensor, mesh: DeviceMesh, placement, requires_grad: bool) -> nn.Parameter:
    dtensor = DTensor.from_local(
        local, mesh, [placement], run_check=False, shape=like.shape, stride=like.stride()
    )
    return nn.Parameter(dtensor, requires_grad=requires_grad)


def _split(module: nn.Linear, mesh: DeviceMesh, src_data_rank: int | None, *, by_columns: bool) -> None:
    """Replace ``module``'s int8 weight (and bias) by this tp rank's part: whole rows with
    their scales, or (``by_columns``) every row's columns with the whole row's scale."""
    weight = module.weight
    dim = 1 if by_columns else 0
    _check_divisible(module, dim, mesh, "Int8RowwiseParallel" if by_columns else "Int8ColwiseParallel")
    data, scale = _source_weight(weight, mesh, src_data_rank)
    coordinate = mesh.get_local_rank()
    start, stop = _span(weight.shape[dim], mesh.size(), coordinate)
    split = TensorParallelShard(mesh, coordinate, shares_row_scales=by_columns)
    if by_columns:  # every row's scale is the whole row's: the same on every peer
        local = weight.with_tensors(data[:, start:stop].contiguous(), scale.clone(), row_len=stop - start,
                              tensor_parallel=split)
    else:  # unsharded_rows = its own rows: FSDP2 shards it as a weight of its own
        local = weight.with_tensors(data[start:stop].clone(), scale[start:stop].clone(), unsharded_rows=None,
                              tensor_parallel=split)
    module.register_parameter("weight", _int8_parameter(local, weight, mesh, Shard(dim), weight.requires_grad))
    if module.bias is not None:
        bias = distribute_tensor(module.bias, mesh, [Replicate() if by_columns else Shard(0)],
                                 src_data_rank=src_data_rank)
        module.register_parameter("bias", nn.Parameter(bias, requires_grad=module.bias.requires_grad))


def _local(parameter: torch.Tensor | None) -> torch.Tensor | None:
    """A parameter's local tensor, differentiably (its gradient keeps the placement)."""
    return parameter.to_local() if isinstance(parameter, DTensor) else parameter


# The styles bind these as methods, not as ``functools.partial`` objects: torch.compile
# guards a partial by its identity, a bound method by its function. With one partial per
# layer each compiled block would compile again, and the ninth block of a
# ``fullgraph=True`` model would raise (dynamo's recompile limit, 8).
def _colwise_forward(module: nn.Linear, x: DTensor) -> DTensor:
    # x is replicated on the tp mesh: its gradient from this rank's rows is a partial sum.
    y = F.linear(x.to_local(grad_placements=[Partial()]), _local(module.weight), _local(module.bias))
    return DTensor.from_local(y, x.device_mesh, [Shard(y.dim() - 1)], run_check=False)


def _rowwise_forward(module: nn.Linear, x: DTensor) -> DTensor:
    # x is sharded on its last dim like the weight's columns: partial sums of the output.
    y = F.linear(x.to_local(), _local(module.weight))
    out = DTensor.from_local(y, x.device_mesh, [Partial()], run_check=False)
    if module.bias is not None:
        out = out.redistribute(placements=[Replicate()]) + module.bias
    return out


class _Int8Split:
    """What both int8 styles change in torch's: an int8 linear layer is split by
    :func:`_split` (rows, or columns with whole-row scales) and runs its local matmul;
    any other layer is left to the stock style."""

    _by_columns: bool
    _int8_forward: staticmethod

    def _partition_linear_fn(self, name: str, module: nn.Module, device_mesh: DeviceMesh) -> None:
        if not _int8_linear(module):
            return super()._partition_linear_fn(name, module, device_mesh)
        _split(module, device_mesh, self.src_data_rank, by_columns=self._by_columns)
        module.forward = types.MethodType(self._int8_forward, module)


class Int8ColwiseParallel(_Int8Split, ColwiseParallel):
    """``ColwiseParallel`` for int8 linear layers: whole rows and their scales per rank.

    Same keyword arguments as :class:`torch.distributed.tensor.parallel.ColwiseParallel`
    (``input_layouts``, ``output_layouts``, ``use_local_output``). Each tp rank holds
    ``out_features / tp`` whole rows with their scales, taken from tp rank
    ``src_data_rank`` (a broadcast, as the stock style scatters from it). The matmul runs
    on local tensors, so int8 GEMMs and per-token activation scales stay per rank; the
    output is sharded on its last dim. A layer whose weight is not an ``Int8Weight`` is
    parallelized exactly as the stock style does. docs/parallelism.md.

    Raises:
        ValueError: when the tp size does not divide ``out_features`` (at
            ``parallelize_module``).
    """

    _by_columns = False
    _int8_forward = staticmethod(_colwise_forward)


class Int8RowwiseParallel(_Int8Split, RowwiseParallel):
    """``RowwiseParallel`` for int8 linear layers: every row's columns split, its scale shared.

    Same keyword arguments as :class:`torch.distributed.tensor.parallel.RowwiseParallel`.
    Each tp rank holds ``in_features / tp`` elements of every row and the whole row's
    absmax scale, the same on every peer. Every write keeps the peers' scales equal:
    optimizer updates (torch optimizers, ``Int8AdamW``, ``Int8SGD``) are rounded after the
    step with one ``all_reduce(MAX)`` per tp group; loads, initialisers and ``copy_``
    reduce at once. The matmul runs on local tensors; the output layout reduces the
    partial sums (after dequantization, in the compute dtype), then the bias is added. A
    layer whose weight is not an ``Int8Weight`` is parallelized exactly as the stock style
    does. docs/parallelism.md.

    Raises:
        ValueError: when the tp size does not divide ``in_features`` (at
            ``parallelize_module``).
    """

    _by_columns = True
    _int8_forward = staticmethod(_rowwise_forward)


def _converted(style: ParallelStyle) -> ParallelStyle:
    """The int8-aware style with ``style``'s settings (other styles as they are)."""
    for stock, int8 in ((ColwiseParallel, Int8ColwiseParallel), (RowwiseParallel, Int8RowwiseParallel)):
        if type(style) is stock:
            converted = int8.__new__(int8)
            converted.__dict__.update(vars(style))
            return converted
    return style


def int8_tp_plan(plan: dict[str, ParallelStyle]) -> dict[str, ParallelStyle]:
    """A copy of ``plan`` with torch's ``ColwiseParallel`` / ``RowwiseParallel`` replaced by
    their int8-aware equivalents (same settings); other styles (``SequenceParallel``,
    ``PrepareModuleInput``, ...) and subclasses are kept as given. For tensor parallelism by
    hand; ``shard_model(tp_plan=...)`` calls it.

    Args:
        plan: A ``parallelize_module`` plan: module names (relative to the module it is
            applied to, ``*`` wildcards allowed) to ``ParallelStyle`` objects.

    Returns:
        The converted plan (a new dict).

    Raises:
        TypeError: when ``plan`` is not a dict of ``ParallelStyle``s.

    Example:
        Tensor parallelism inside each block, then FSDP2 on the dp mesh::

            fsdp_int8.quantize_(model)
            for block in model.layers:
                parallelize_module(block, mesh["tp"], int8_tp_plan(plan))
                fully_shard(block, mesh=mesh["dp"])
            fully_shard(model, mesh=mesh["dp"])
    """
    if not isinstance(plan, dict):
        raise TypeError(f"a tensor-parallel plan is a dict of module names to ParallelStyles, got {type(plan).__name__}")
    for name, style in plan.items():
        if not isinstance(style, ParallelStyle):
            raise TypeError(f"tp plan entry {name!r} is {style!r}, not a torch ParallelStyle")
    return {name: _converted(style) for name, style in plan.items()}

