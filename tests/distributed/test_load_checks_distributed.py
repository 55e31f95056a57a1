"""Int8 weights checked on the way in, on 2 ranks: a dcp folder written elsewhere with a
NaN scale in one rank's shard is refused by ``load_checkpoint`` on every rank, and a
sharded state dict with -128 in each rank's shard by ``load_state_dict``; the model and
optimizer are left exactly as they were. One spawn; a tiny MLP.
"""

from __future__ import annotations

import tempfile

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict
from torch.utils._pytree import tree_map_only

import fsdp_int8
from fsdp_int8.checkpoint import CheckpointError
from fsdp_int8.testing import run_distributed
from fsdp_int8.weight import Int8LoadError

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


def test_refused_loads_change_nothing_on_two_ranks():
    with tempfile.TemporaryDirectory() as tmp:
        assert all(run_distributed(_refused_loads, 2, f"{tmp}/bad"))
