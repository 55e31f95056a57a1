"""Sharded checkpoints across processes: bit-exact loads at other world sizes, exact resume,
full-precision export and import under FSDP2, HSDP replicas that stay identical.

The rows (33) never divide the world sizes used (2, 4): every shard load is uneven.
"""

from __future__ import annotations

import tempfile

import torch
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    set_model_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule

import fsdp_int8
import fsdp_int8.checkpoint
from fsdp_int8 import Int8Weight
from fsdp_int8.testing import device_type_for, run_distributed

from _cases import assert_identical, case, replicas_differ, sharded_mlp, snapshot, train_step_batches
from _nets import MLPNet

def _save_then_continue(rank, world, root):
    """3 steps, save, 3 more: the snapshots after 3 and after 6 uninterrupted steps."""
    model, opt = sharded_mlp()
    train_step_batches(model, opt, 0, 3)
    fsdp_int8.save_checkpoint(root, model, opt, step=3, extra={"run": "test"})
    at_save = snapshot(model, opt)
    train_step_batches(model, opt, 3, 3)
    return at_save, snapshot(model, opt)


def _load_at_one_rank_then_save(rank, world, root, root_from_one):
    model, opt = sharded_mlp()
    info = fsdp_int8.load_checkpoint(root, model, opt)
    assert info.step == 3 and info.world_size == 2 and not info.rng_restored
    loaded = snapshot(model, opt)
    fsdp_int8.save_checkpoint(root_from_one, model, opt, step=3)
    return loaded


def _resume_at_two_ranks(rank, world, root, root_from_one):
    out = {}
    with case("1 -> 2 load"):
        model, opt = sharded_mlp()
        info = fsdp_int8.load_checkpoint(root_from_one, model, opt)
        assert info.world_size == 1 and not info.rng_restored
        out["from_one"] = snapshot(model, opt)
    with case("2 -> 2 resume"):
        model, opt = sharded_mlp()
        info = fsdp_int8.load_checkpoint(root, model, opt)
        assert info.step == 3 and info.rng_restored and info.extra == {"run": "test"}
        out["loaded"] = snapshot(model, opt)
        train_step_batches(model, opt, info.step, 3)
        out["resumed"] = snapshot(model, opt)
    with case("export to full precision, import back"):
        exported = fsdp_int8.export_full_state_dict(model, dtype=torch.float32)
        assert (len(exported) > 0) == (rank == 0)
        x = torch.randn(4, 32, generator=torch.Generator().manual_seed(9))
        with torch.no_grad():
            int8_output = model(x)  # a collective: every rank runs it
        for module in model.modules():  # the root and last block stay gathered after forward
            if isinstance(module, FSDPModule):
                module.reshard()
        if rank == 0:
            plain = MLPNet(hidden=33)
            plain.load_state_dict(exported)  # the unquantized model takes it as is
            # the same dequantized values, multiplied in another order: fp32 rounding only
            torch.testing.assert_close(plain(x), int8_output, rtol=1e-5, atol=1e-5)
        fresh, _ = sharded_mlp()
        fsdp_int8.checkpoint.load_full_state_dict(fresh, exported)  # rank 0 has it, others pass {}
        for (name, a), b in zip(model.named_parameters(), fresh.parameters()):
            a_local, b_local = a._local_tensor, b._local_tensor
            if isinstance(a_local, Int8Weight):  # dequantize + round to nearest is exact
                assert torch.equal(a_local.int_rows(), b_local.int_rows()), name
                assert torch.equal(a_local.scale, b_local.scale), name
            else:
                assert torch.equal(a_local, b_local), name
    with case("a full int8 state dict broadcast from rank 0"):
        full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        fresh, _ = sharded_mlp()
        set_model_state_dict(
            fresh, full if rank == 0 else {},
            options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True),
        )
        for (name, a), b in zip(model.named_parameters(), fresh.parameters()):
            a_full, b_full = a.full_tensor(), b.full_tensor()
            if isinstance(a_full, Int8Weight):  # rank 1 received values: round to nearest is exact
                assert torch.equal(a_full.int_data, b_full.int_data), name
                assert torch.equal(a_full.scale, b_full.scale), name
            else:
                assert torch.equal(a_full, b_full), name
    return out


def _load_at_four_ranks(rank, world, root, four_root):
    model, opt = sharded_mlp()
    fsdp_int8.load_checkpoint(root, model, opt)
    loaded = snapshot(model, opt)
    train_step_batches(model, opt, 3, 1)  # and it trains on
    mesh = init_device_mesh(device_type_for(world), (2, 2), mesh_dim_names=("replicate", "shard"))
    with case("4-way FSDP -> 2 x 2 HSDP (same world size): reseeded by shard, replicas stay identical"):
        fsdp_int8.save_checkpoint(four_root, model, opt, step=4)
        model, opt = sharded_mlp(mesh)
        info = fsdp_int8.load_checkpoint(four_root, model, opt)
        assert info.world_size == 4 and not info.rng_restored  # each rank holds other rows now
        train_step_batches(model, opt, 4, 2)  # stochastic rounding
        assert not replicas_differ(model, mesh, "replicate"), "HSDP replicas differ"
    with case("2 x 2 HSDP -> 2 x 2 HSDP: exact resume, replicas stay identical"):
        fsdp_int8.save_checkpoint(four_root, model, opt, step=6)
        train_step_batches(model, opt, 6, 1)
        uninterrupted = snapshot(model, opt)
        model, opt = sharded_mlp(mesh)
        assert fsdp_int8.load_checkpoint(four_root, model, opt).rng_restored
        train_step_batches(model, opt, 6, 1)
        assert not replicas_differ(model, mesh, "replicate"), "HSDP replicas differ"
        assert_identical(uninterrupted, snapshot(model, opt), "HSDP save at 6, resume, 1 more")
    return loaded


def test_checkpoints_across_world_sizes_and_exact_resume():
    with tempfile.TemporaryDirectory() as tmp:
        root, root_from_one = f"{tmp}/two", f"{tmp}/one"
        at_save, uninterrupted = run_distributed(_save_then_continue, 2, root)[0]
        from_two_at_one = run_distributed(_load_at_one_rank_then_save, 1, root, root_from_one)[0]
        assert_identical(at_save, from_two_at_one, "2 -> 1 load")
        two = run_distributed(_resume_at_two_ranks, 2, root, root_from_one)[0]
        assert_identical(at_save, two["from_one"], "1 -> 2 load")
        assert_identical(at_save, two["loaded"], "2 -> 2 load")
        assert_identical(uninterrupted, two["resumed"], "save at 3, restart, 3 more == 6 steps")
        from_two_at_four = run_distributed(_load_at_four_ranks, 4, root, f"{tmp}/four")[0]
        assert_identical(at_save, from_two_at_four, "2 -> 4 load")
