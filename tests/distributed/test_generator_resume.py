"""Rounding generators across a change of layout, through the core and every integration.

4 ranks, one spawn. A model trains as FSDP over 4 ranks and saves its generator states
through each path that saves them: ``save_checkpoint``, the Hugging Face ``Trainer``
mixin's rng-state hooks, Lightning's ``Int8RoundingCheckpoint`` and torchtitan's
checkpoint manager (dcp). It resumes as HSDP 2 x 2 at the same world size. There each rank
holds other rows than it saved, and the two replicas of a shard must draw the same noise;
a path that restored the per-rank streams of the FSDP run would make the replicas round
their next update differently and drift apart. After each path's restore, one stochastic
AdamW step runs and every int8 shard must be bit-identical on both of its replicas.

At the same layout each path must restore the saved streams exactly (the control that a
path which never restored anything would fail). CI runs the core path; the exhaustive
matrix (``FSDP_INT8_FULL_MATRIX=1``) every path.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.device_mesh import init_device_mesh

import fsdp_int8
from fsdp_int8 import Int8Weight
from fsdp_int8.testing import device_type_for, run_distributed

from _cases import FULL_MATRIX, case, replicas_differ, sharded_mlp, train_step_batches

# CI runs the core path (every integration saves and restores through it: the one
# capture_generators / restore_generators); the exhaustive matrix adds each integration,
# whose same-layout resumes the examples test too (tests/distributed/test_examples.py).
PATHS = ("core", "hf", "lightning", "torchtitan") if FULL_MATRIX else ("core",)


def _rounding_state() -> dict[str, torch.Tensor]:
    from fsdp_int8._quant.generators import WEIGHT_ROUNDING

    return WEIGHT_ROUNDING.get_state()


def _disturb_rounding(model) -> None:
    """Draw from every rounding stream, so that a restore has something to undo."""
    from fsdp_int8._quant.generators import WEIGHT_ROUNDING

    for param in model.parameters():
        local = param._local_tensor
        if isinstance(local, Int8Weight):
            torch.empty(64, dtype=torch.int64).random_(generator=WEIGHT_ROUNDING.generator(local.device))


class _TrainerStandIn:
    """What ``Int8SaveMixin`` chains to: ``transformers.Trainer``'s rng-state hooks."""

    def _save_rng_state(self, output_dir: str) -> None:
        pass

    def _load_rng_state(self, checkpoint: str | None) -> None:
        pass


def _hf_trainer(model):
    from fsdp_int8.integrations.hf import Int8SaveMixin

    class Trainer(Int8SaveMixin, _TrainerStandIn):
        def __init__(self) -> None:  # the Trainer's own state the hooks read
            self.model = model
            self.args = SimpleNamespace(world_size=dist.get_world_size(), process_index=dist.get_rank())

    return Trainer()


def _lightning_callback(model):
    from fsdp_int8.integrations.lightning import Int8RoundingCheckpoint

    callback = Int8RoundingCheckpoint()
    callback.setup(None, model, "fit")
    return callback


def _titan_streams(model):
    from fsdp_int8.integrations.torchtitan import ROUNDING_STATES, Int8CheckpointManager, _RoundingStreams

    manager = object.__new__(Int8CheckpointManager)  # what dcp_load reads of the manager
    manager.states, manager.sd_adapter = {}, None
    return manager, {ROUNDING_STATES: _RoundingStreams([model])}


def _save(path: str, model, opt, root: Path, saved: dict) -> None:
    """Save this rank's generator states through ``path``."""
    if path == "core":
        fsdp_int8.save_checkpoint(root / "core", model, opt, step=2)
    elif path == "hf":
        (root / "hf").mkdir(exist_ok=True)
        dist.barrier()
        _hf_trainer(model)._save_rng_state(str(root / "hf"))
    elif path == "lightning":
        saved["lightning"] = _lightning_callback(model).state_dict()  # rank 0 would write it
    else:
        _, states = _titan_streams(model)
        dcp.save(states, checkpoint_id=str(root / "torchtitan"))


def _restore(path: str, model, opt, root: Path, saved: dict) -> None:
    """Resume through ``path`` (the weights come from the core checkpoint for every path)."""
    if path == "core":
        return  # load_checkpoint restored or reseeded the generators itself
    if path == "hf":
        _hf_trainer(model)._load_rng_state(str(root / "hf"))
    elif path == "lightning":
        _lightning_callback(model).load_state_dict(saved["lightning"])
    else:
        manager, states = _titan_streams(model)
        manager.dcp_load(states, str(root / "torchtitan"), False, False)


def _fsdp_then_hsdp(rank: int, world: int, root: str) -> None:
    root = Path(root)
    saved: dict = {}
    model, opt = sharded_mlp(hidden=32)  # FSDP over the 4 ranks
    train_step_batches(model, opt, 0, 2)
    at_save = _rounding_state()
    for path in PATHS:
        _save(path, model, opt, root, saved)
    for path in PATHS:
        with case(f"{path}: the same layout restores the saved streams"):
            _disturb_rounding(model)
            assert any(not torch.equal(v, at_save[k]) for k, v in _rounding_state().items())
            if path == "core":
                fresh, fresh_opt = sharded_mlp(hidden=32)
                assert fsdp_int8.load_checkpoint(root / "core", fresh, fresh_opt).rng_restored
            else:
                _restore(path, model, opt, root, saved)
            now = _rounding_state()
            assert now.keys() >= at_save.keys()
            assert all(torch.equal(now[k], at_save[k]) for k in at_save), "streams not restored"

    mesh = init_device_mesh(device_type_for(world), (2, 2), mesh_dim_names=("dp_replicate", "dp_shard"))
    for path in PATHS:
        with case(f"{path}: FSDP 4 -> HSDP 2 x 2 keeps the replicas identical"):
            model, opt = sharded_mlp(mesh, hidden=32)
            info = fsdp_int8.load_checkpoint(root / "core", model, opt)
            assert not info.rng_restored  # the rows moved: the core reseeds
            _restore(path, model, opt, root, saved)
            train_step_batches(model, opt, 2, 1)  # one stochastic step shows a drift
            differ = replicas_differ(model, mesh, "dp_replicate")
            assert not differ, f"HSDP replicas drifted apart in {differ}"


def test_generators_follow_the_layout_through_every_resume_path():
    with tempfile.TemporaryDirectory() as root:
        run_distributed(_fsdp_then_hsdp, 4, root, timeout=300)
