"""``InPlaceReduceScatter``: FSDP2's gradient reduce-scatter without a copy of its input on
gloo (the class says how); :func:`enable_in_place_reduce_scatter` installs it, and
``Int8TrainingConfig(in_place_reduce_scatter=True)`` (part of
:meth:`~fsdp_int8.Int8TrainingConfig.lean`) makes ``shard_model`` install it."""

from __future__ import annotations

import torch
import torch.distributed as dist

from fsdp_int8._fsdp_compat import DefaultReduceScatter
from fsdp_int8.gradients._reduce_op import _op_type, op_multiplier

__all__ = ["InPlaceReduceScatter"]


def _copies_its_input(group: dist.ProcessGroup, tensor: torch.Tensor) -> bool:
    """Whether ``group``'s ``reduce_scatter_tensor`` on ``tensor`` copies the whole input (gloo)."""
    return tensor.device.type == "cpu" and dist.get_backend(group) == dist.Backend.GLOO


class InPlaceReduceScatter(DefaultReduceScatter):
    """An FSDP2 ``ReduceScatter`` that makes no copy of its input on gloo.

    gloo's ``reduce_scatter_tensor`` all-reduces a copy of the whole input: one more buffer
    the size of a parameter group's unsharded gradients in the reduce dtype (NCCL makes
    none). On a gloo group this one runs one ``dist.reduce`` per rank's chunk in place in
    FSDP2's input, copies this rank's chunk out, applies FSDP2's ``op`` and releases the
    input's storage (FSDP2 holds it only to order streams, which a synchronous CPU
    collective does not need). The same fp32 sums (bit for bit against gloo's on 2 ranks);
    on other backends, or with ``async_op=True``, FSDP2's own ``reduce_scatter_tensor``.
    What it saves: docs/memory.md, "Gloo's reduce-scatter copy".

    Install with ``fsdp_module.set_custom_reduce_scatter(InPlaceReduceScatter())`` or, for
    every module of a model, :func:`~fsdp_int8.gradients.enable_in_place_reduce_scatter`.
    """

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"

    @torch.no_grad()
    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        op: object,
        async_op: bool = False,
    ) -> dist.Work | None:
        """Reduce-scatter ``input_tensor`` (flat, rank-major) into ``output_tensor``; on gloo
        in place, releasing ``input_tensor``'s storage afterwards (FSDP2 reads it no more)."""
        if async_op or not _copies_its_input(group, input_tensor):
            return super().__call__(output_tensor, input_tensor, group, op, async_op)
        world = group.size()
        multiplier = op_multiplier(op, world)  # SUM, AVG or PREMUL_SUM: a sum, then a factor
        chunks = input_tensor.view(world, -1)
        for rank in range(world):
            dist.reduce(chunks[rank], dst=dist.get_global_rank(group, rank), op=dist.ReduceOp.SUM, group=group)
        output_tensor.copy_(chunks[group.rank()].view_as(output_tensor))
        if _op_type(op) == dist.ReduceOp.AVG:
            output_tensor.div_(world)  # gloo's average: the sum divided by the group size
        elif multiplier is not None:
            output_tensor.mul_(multiplier)
        storage = input_tensor.untyped_storage()
        if storage.nbytes() == input_tensor.numel() * input_tensor.element_size():  # FSDP2's own buffer
            storage.resize_(0)
        return None
