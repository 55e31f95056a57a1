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

    With ``gradient_dtype`` (the dtype of the group's unsharded gradients: its
    ``MixedPrecisionPolicy.param_dtype``, bf16 or fp16) narrower than an fp32 reduce
    dtype, FSDP2's input buffer on the CPU is made in ``gradient_dtype`` (it holds the
    gradients' own values: no rounding) and each rank adds the chunks it receives into its
    fp32 output, one peer at a time into its own spent chunk: half the input's bytes and
    no receive buffer, the same fp32 sums (bit for bit on 2 ranks; with more, in another
    order than gloo's). FSDP2 makes the input, then the output, of each reduce-scatter
    with :meth:`allocate`; a call whose dtypes do not match that order raises.

    Install with ``fsdp_module.set_custom_reduce_scatter(InPlaceReduceScatter())`` or, for
    every module of a model, :func:`~fsdp_int8.gradients.enable_in_place_reduce_scatter`
    (which passes each group's gradient dtype).

    Args:
        gradient_dtype: The dtype of the unsharded gradients FSDP2 reduces (bf16, fp16 or
            fp32); ``None`` (default): inputs are made in the reduce dtype.

    Raises:
        ValueError: ``gradient_dtype`` is not ``None``, bf16, fp16 or fp32.
    """

    def __init__(self, gradient_dtype: torch.dtype | None = None) -> None:
        if gradient_dtype not in (None, torch.bfloat16, torch.float16, torch.float32):
            raise ValueError(f"gradient_dtype must be None, bf16, fp16 or fp32, got {gradient_dtype}")
        self.gradient_dtype = gradient_dtype
        self._next_is_input = True  # FSDP2 allocates each call's input, then its output

    def __repr__(self) -> str:
        return f"{type(self).__name__}(gradient_dtype={self.gradient_dtype})"

    def allocate(self, size, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """FSDP2's buffers: the input in ``gradient_dtype`` where that is narrower than an
        fp32 reduce dtype on the CPU, everything else as asked."""
        is_input, self._next_is_input = self._next_is_input, not self._next_is_input
        narrow = self.gradient_dtype in (torch.bfloat16, torch.float16)
        if is_input and narrow and dtype == torch.float32 and torch.device(device).type == "cpu":
            dtype = self.gradient_dtype
        return torch.empty(*size, dtype=dtype, device=device)

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
        self._next_is_input = True
        narrow_input = input_tensor.dtype != output_tensor.dtype
        if narrow_input and (output_tensor.dtype != torch.float32 or input_tensor.dtype != self.gradient_dtype):
            raise RuntimeError(
                f"{self!r} got a {input_tensor.dtype} input and a {output_tensor.dtype} output: FSDP2 "
                "allocated its reduce-scatter buffers in another order than this torch's "
                "(input, then output). Use Int8TrainingConfig(in_place_reduce_scatter=False)"
            )
        if async_op or not _copies_its_input(group, input_tensor):
            if narrow_input:  # the backend's own collective reduces in the output's dtype
                input_tensor = input_tensor.to(output_tensor.dtype)
            return super().__call__(output_tensor, input_tensor, group, op, async_op)
        world, rank = group.size(), group.rank()
        chunks = input_tensor.view(world, -1)
        if narrow_input:
            _sum_chunks_into(output_tensor.view(-1), chunks, group)
        else:
            for peer in range(world):
                dist.reduce(chunks[peer], dst=dist.get_global_rank(group, peer), op=dist.ReduceOp.SUM, group=group)
            output_tensor.copy_(chunks[rank].view_as(output_tensor))
        multiplier = op_multiplier(op, world)  # SUM, AVG or PREMUL_SUM: a sum, then a factor
        if _op_type(op) == dist.ReduceOp.AVG:
            output_tensor.div_(world)  # gloo's average: the sum divided by the group size
        elif multiplier is not None:
            output_tensor.mul_(multiplier)
        storage = input_tensor.untyped_storage()
        if storage.nbytes() == input_tensor.numel() * input_tensor.element_size():  # FSDP2's own buffer
            storage.resize_(0)
        return None


def _sum_chunks_into(output: torch.Tensor, chunks: torch.Tensor, group: dist.ProcessGroup) -> None:
    """``output`` (fp32) = the sum over ranks of each rank's chunk for this rank, in fp32.

    This rank's chunk is widened into ``output``; then, peer by peer, this rank sends a
    peer its chunk and receives into its own (spent) chunk the chunk of the peer as many
    ranks before it, and adds it. ``chunks`` is ``[world, n]`` (overwritten)."""
    world, rank = group.size(), group.rank()
    mine = chunks[rank]
    output.copy_(mine)
    for step in range(1, world):
        to_peer, from_peer = (rank + step) % world, (rank - step) % world
        works = [
            dist.isend(chunks[to_peer], dst=dist.get_global_rank(group, to_peer), group=group),
            dist.irecv(mine, src=dist.get_global_rank(group, from_peer), group=group),
        ]
        for work in works:
            work.wait()
        output.add_(mine)
