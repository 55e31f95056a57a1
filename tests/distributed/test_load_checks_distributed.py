"""Int8 weights checked on the way in, on 2 ranks: a dcp folder written elsewhere with a
NaN scale in one rank's shard is refused by ``load_checkpoint`` on every rank, a sharded
state dict with -128 in each rank's shard by ``load_state_dict``, and a torchtitan
checkpoint with a NaN scale in one rank's shard by ``Int8CheckpointManager``'s load; the
model and optimizer are left exactly as they were. One spawn; a tiny MLP and torchtitan's
debug Llama (examples/torchtitan_debug.py builds it as torchtitan's Trainer does).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict
from torch.utils._pytree import tree_map_only

import fsdp_int8
from fsdp_int8.checkpoint import CheckpointError
from fsdp_int8.testing import run_distributed
from fsdp_int8.weight import Int8LoadError, Int8Weight

from _cases import assert_identical, case, int8_params, local_of, sharded_mlp, snapshot, train_step_batches


def _refused_loads(rank, world, root):
    written, written_opt = sharded_mlp()
    train_step_batches(written, written_opt, 0, 2)
    name, _ = int8_params(written)[-1]
    model, opt = sharded_mlp()
    train_step_batches(model, opt, 0, 1)
    before = snapshot(model, opt)

    with case("load_checkpoint of a dcp folder with a NaN scale in rank 1's shard"):
        state = tree_map_only(torch.Tensor, lambda t: t.detach().clone(), {
            "model": get_model_state_dict(written), "optimizer": get_optimizer_state_dict(written, written_opt),
        })
        if rank == 1:
            local_of(state["model"][name]).scale[0] = float("nan")
        dcp.save(state, checkpoint_id=root)
        with pytest.raises(CheckpointError, match=rf"rank 1: refusing to load int8 weight {name} \(in .*\): 1 of"):
            fsdp_int8.load_checkpoint(root, model, opt, allow_unverified=True)
        assert_identical(before, snapshot(model, opt), "after the refused load_checkpoint")
        # before a plain dcp.load into the model's own tensors: the same refusal, on every rank
        with pytest.raises(Int8LoadError, match=rf"nothing was loaded: rank 1: refusing to load int8 weight model\.{name}"):
            fsdp_int8.checkpoint.check_int8_entries(root, {"model": get_model_state_dict(model)})

    with case("load_state_dict of a sharded state dict with -128 in each rank's shard"):
        state = {k: v.detach().clone() for k, v in written.state_dict().items()}
        local_of(state[name]).int_data.view(-1)[0] = -128
        with pytest.raises(Int8LoadError, match=rf"{name}: 1 int8 value\(s\) are -128"):
            model.load_state_dict(state)
        assert_identical(before, snapshot(model, opt), "after the refused load_state_dict")

    with case("the same state dict, made valid, loads"):
        local_of(state[name]).int_data.view(-1)[0] = 0
        model.load_state_dict(state)
        assert torch.equal(local_of(model.get_parameter(name)).int_data, local_of(state[name]).int_data)
    return True


def _local_copies(state: dict) -> dict:
    return tree_map_only(torch.Tensor, lambda t: local_of(t).detach().clone(), state)


def _same_values(a: dict, b: dict) -> bool:
    flat_a, flat_b = torch.utils._pytree.tree_leaves(a), torch.utils._pytree.tree_leaves(b)
    return len(flat_a) == len(flat_b) and all(
        (torch.equal(x.int_data, y.int_data) and torch.equal(x.scale, y.scale)) if isinstance(x, Int8Weight)
        else torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y
        for x, y in zip(flat_a, flat_b)
    )


def _refused_torchtitan_load(rank, world, folder):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
    import _torchtitan_common as tt
    import torchtitan_debug as example

    args = argparse.Namespace(steps=1, batch=2, seq_len=16, lr=3e-3, compile=None, lean=False)
    torch.manual_seed(0)
    written = tt.build(example._trainer_config(args, folder), world)
    tt.train(written, range(1, 2), args, rank, world)
    name = next(n for n, p in written["model"].named_parameters() if isinstance(local_of(p), Int8Weight))
    if rank == 1:  # damaged after training: torchtitan's save writes what the model holds
        local_of(written["model"].get_parameter(name)).scale[0] = float("nan")
    written["checkpointer"].save(curr_step=1)

    torch.manual_seed(1)
    fresh = tt.build(example._trainer_config(args, folder), world)
    tt.train(fresh, range(1, 2), args, rank, world)  # optimizer states to keep
    before = _local_copies({"model": fresh["model"].state_dict(), "optimizer": fresh["optimizers"].state_dict()})
    with case("Int8CheckpointManager.load of a checkpoint with a NaN scale in rank 1's shard"):
        # named by its checkpoint key (torchtitan's state dict splits the fused wqkv into wq, wk, wv)
        with pytest.raises(Int8LoadError, match=r"nothing was loaded: rank \d: refusing to load int8 weight "
                           r"layers\.0\.attention\.qkv_linear\.w[qkv]\.weight \(in .*\): 1 of \d+ row scales are NaN"):
            fresh["checkpointer"].load(step=1)
        after = _local_copies({"model": fresh["model"].state_dict(), "optimizer": fresh["optimizers"].state_dict()})
        assert _same_values(before, after), "the refused load changed the model or optimizer"
    for part in (written, fresh):
        part["checkpointer"].close()
    return True


def _both(rank, world, root):
    return _refused_loads(rank, world, f"{root}/bad") and _refused_torchtitan_load(rank, world, f"{root}/titan")


def test_refused_loads_change_nothing_on_two_ranks():
    with tempfile.TemporaryDirectory() as tmp:
        assert all(run_distributed(_both, 2, tmp))
