"""The lean call's distributed parts on 2 gloo ranks, one spawn.

``fsdp_int8.gradients.InPlaceReduceScatter``: the same sums as torch's
``reduce_scatter_tensor`` bit for bit, with no copy of the whole input (gloo's all-reduces
one) and the input released once reduced, also from a bf16 input into fp32; and
``Int8TrainingConfig.lean()``, which installs it through ``shard_model``, trains to the
same bytes as without it. ``reshard_early``: the last block resharded after forward and a
table tied to the head freed after the head's backward (not under
``set_reshard_after_backward(False)``), training to the same bytes as without it."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import fsdp_int8
from fsdp_int8._fsdp_compat import fsdp_modules, param_groups, reduce_scatter_of
from fsdp_int8.gradients import InPlaceReduceScatter
from fsdp_int8.testing import run_distributed

from _cases import assert_identical, case, snapshot
from _nets import tiny_transformer
from launch.model import next_token_loss


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


def _lean_model(tied: bool = False, **changes):
    """The launcher's tiny Transformer under the lean call (its head tied to the embedding)."""
    model = tiny_transformer(seed=0, vocab_size=64, dim=32)
    if tied:
        model.output.weight = model.tok_embeddings.weight
    return fsdp_int8.shard_model(model, config=fsdp_int8.Int8TrainingConfig.lean(**{"compute_dtype": None, **changes}))


def _train_lean(rank: int, tied: bool = False, **changes) -> dict:
    """Three steps of the lean call on the launcher's tiny Transformer; its bytes afterwards."""
    model = _lean_model(tied, **changes)
    optimizer = fsdp_int8.Int8AdamW.lean(model.parameters(), lr=1e-2, block_size=16)
    data = torch.Generator().manual_seed(rank)
    for _ in range(3):
        tokens = torch.randint(0, 64, (2, 17), generator=data)
        next_token_loss(model, tokens[:, :-1], tokens[:, 1:]).backward()
        optimizer.step()
        optimizer.zero_grad()
    comms = {(type(comm), getattr(comm, "gradient_dtype", None))
             for _, m in fsdp_modules(model) for comm in map(reduce_scatter_of, param_groups(m))}
    return dict(snapshot(model, optimizer), comms=comms)


def _check(rank: int, world: int) -> None:
    group = dist.distributed_c10d._get_default_group()
    data = torch.Generator().manual_seed(rank)
    for op in (dist.ReduceOp.AVG, dist.ReduceOp.SUM):
        with case(f"{op}: torch's sums, no new storage the size of the input, the input released"):
            source = torch.randn(world * 50_000, generator=data)
            expected, output = torch.empty(50_000), torch.empty(50_000)
            dist.reduce_scatter_tensor(expected, source.clone(), op=op)
            with _NewStorages() as new:
                InPlaceReduceScatter()(output, source, group, op)
            assert torch.equal(output, expected), (output - expected).abs().max()
            assert all(size < world * 50_000 * 4 // world for size in new.sizes), new.sizes
            assert source.untyped_storage().nbytes() == 0  # FSDP2 only keeps it alive for stream order
    for op in (dist.ReduceOp.AVG, dist.ReduceOp.SUM):
        with case(f"{op}: a bf16 input into an fp32 output sums as torch's fp32 reduce-scatter, no buffer"):
            comm = InPlaceReduceScatter(torch.bfloat16)
            source = comm.allocate((world * 50_000,), dtype=torch.float32, device=torch.device("cpu"))
            output = comm.allocate((50_000,), dtype=torch.float32, device=torch.device("cpu"))
            assert (source.dtype, output.dtype) == (torch.bfloat16, torch.float32)
            source.copy_(torch.randn(world * 50_000, generator=data))
            expected = torch.empty(50_000)
            dist.reduce_scatter_tensor(expected, source.float(), op=op)
            with _NewStorages() as new:
                comm(output, source, group, op)
            # 2 ranks: each sum is one fp32 addition, in any order the same bits
            assert torch.equal(output, expected), (output - expected).abs().max()
            assert all(size < world * 50_000 * 2 // world for size in new.sizes), new.sizes
            assert source.untyped_storage().nbytes() == 0
    with case("buffers made in another order than FSDP2's (output, then input) are refused"):
        comm = InPlaceReduceScatter(torch.bfloat16)
        output = comm.allocate((50_000,), dtype=torch.float32, device=torch.device("cpu"))
        source = comm.allocate((world * 50_000,), dtype=torch.float32, device=torch.device("cpu"))
        with pytest.raises(RuntimeError, match="another order"):
            comm(source[:50_000].to(torch.bfloat16), torch.zeros(world * 50_000), group, dist.ReduceOp.SUM)
    with case("gloo's own reduce-scatter makes the copy the in-place one leaves out"):
        with _NewStorages() as new:
            dist.reduce_scatter_tensor(torch.empty(50_000), torch.randn(world * 50_000))
        assert max(new.sizes) == world * 50_000 * 4, new.sizes
    with case("lean() installs it through shard_model and trains to the same bytes as FSDP2's own"):
        lean, own = _train_lean(rank), _train_lean(rank, in_place_reduce_scatter=False)
        assert lean.pop("comms") == {(InPlaceReduceScatter, None)}
        assert all(kind is not InPlaceReduceScatter for kind, _ in own.pop("comms"))
        assert_identical(lean, own, "in-place vs FSDP2's reduce-scatter")
    with case("with bf16 compute, its bf16 inputs train to the same bytes as FSDP2's fp32 ones"):
        lean = _train_lean(rank, compute_dtype=torch.bfloat16)
        own = _train_lean(rank, compute_dtype=torch.bfloat16, in_place_reduce_scatter=False)
        assert lean.pop("comms") == {(InPlaceReduceScatter, torch.bfloat16)}  # bf16 inputs
        assert all(kind is not InPlaceReduceScatter for kind, _ in own.pop("comms"))
        assert_identical(lean, own, "bf16-input in-place vs FSDP2's fp32 reduce-scatter")


def _gathered_while_blocks_run_backward(model, tokens: torch.Tensor) -> dict[str, bool]:
    """One forward and backward: whether the last block is gathered between them, and the
    tied table while the first block runs its backward (the last to) and after."""
    seen = {}

    def gathered(module) -> bool:
        return not isinstance(module.weight, DTensor)  # FSDP2 hands modules the sharded DTensor otherwise

    def probe(*_):
        seen["table during the blocks' backward"] = gathered(model.tok_embeddings)

    handle = model.layers[0].register_full_backward_pre_hook(probe)
    loss = next_token_loss(model, tokens[:, :-1], tokens[:, 1:])
    seen["last block after forward"] = gathered(model.layers[-1].attention.wq)
    loss.backward()
    handle.remove()
    return seen


def _check_reshard_early(rank: int) -> None:
    tokens = torch.randint(0, 64, (2, 17), generator=torch.Generator().manual_seed(rank))
    with case("reshard_early: the last block resharded after forward, the tied table during the blocks' backward"):
        early = _gathered_while_blocks_run_backward(_lean_model(tied=True), tokens)
        assert early == {"last block after forward": False, "table during the blocks' backward": False}, early
        kept = _gathered_while_blocks_run_backward(_lean_model(tied=True, reshard_early=False), tokens)
        assert kept == {"last block after forward": True, "table during the blocks' backward": True}, kept
    with case("reshard_early: a root kept gathered after backward keeps its table"):
        model = _lean_model(tied=True)
        model.set_reshard_after_backward(False, recurse=False)
        seen = _gathered_while_blocks_run_backward(model, tokens)
        assert seen["table during the blocks' backward"], seen
    with case("reshard_early: the same bytes as keeping the last block and the tied table gathered"):
        assert_identical(_train_lean(rank, tied=True), _train_lean(rank, tied=True, reshard_early=False),
                         "reshard_early vs not")


def _check_all(rank: int, world: int) -> None:
    _check(rank, world)
    _check_reshard_early(rank)


def test_the_lean_calls_reduce_scatter_and_early_resharding_train_to_the_same_bytes():
    run_distributed(_check_all, 2)
