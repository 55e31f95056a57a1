"""``benchmarks.memory --reduce-scatter chunks`` on 2 gloo ranks, one spawn: the same sums
as torch's ``reduce_scatter_tensor`` bit for bit, with no copy of the whole input (gloo's
all-reduces one, which is what the option leaves out of the measured peak)."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from benchmarks.memory import ReduceScatterByChunks
from fsdp_int8.testing import run_distributed

from _cases import case


class _NewStorages(TorchDispatchMode):
    """The byte sizes of the storages that ops return and their inputs did not hold."""

    def __init__(self) -> None:
        super().__init__()
        self.sizes: list[int] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN206
        seen = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        result = func(*args, **(kwargs or {}))
        self.sizes += [t.untyped_storage().nbytes() for t in tree_leaves(result)
                       if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in seen]
        return result


def _check(rank: int, world: int) -> None:
    group = dist.distributed_c10d._get_default_group()
    data = torch.Generator().manual_seed(rank)
    for op in (dist.ReduceOp.AVG, dist.ReduceOp.SUM):
        with case(f"{op}: torch's sums, no new storage the size of the input"):
            source = torch.randn(world * 50_000, generator=data)
            expected, output = torch.empty(50_000), torch.empty(50_000)
            dist.reduce_scatter_tensor(expected, source.clone(), op=op)
            with _NewStorages() as new:
                ReduceScatterByChunks()(output, source, group, op)
            assert torch.equal(output, expected), (output - expected).abs().max()
            assert all(size < source.untyped_storage().nbytes() // world for size in new.sizes), new.sizes
    with case("gloo's own reduce-scatter makes the copy the option leaves out"):
        with _NewStorages() as new:
            dist.reduce_scatter_tensor(torch.empty(50_000), torch.randn(world * 50_000))
        assert max(new.sizes) == world * 50_000 * 4, new.sizes


def test_reduce_scatter_by_chunks_sums_as_torch_without_a_copy():
    run_distributed(_check, 2)
