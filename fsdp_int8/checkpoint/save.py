"""``save_checkpoint``: every rank writes its shards and generator states into a temporary
directory; rank 0 adds the manifest and renames it into place."""

from __future__ import annotations

import os
import uuid
from pathlib import Path

import torch
import torch.nn as nn

from fsdp_int8 import _dist
from fsdp_int8.checkpoint import _dcp, _files, _generator_states

__all__ = ["save_checkpoint"]


def save_checkpoint(
    directory: str | os.PathLike,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    step: int,
    extra: dict | None = None,
    keep: int | None = None,
) -> Path:
    """Save model, optimizer and generator states as ``directory/step_<step>``, atomically.

    Call on every rank. Works for FSDP2-sharded models (each rank writes its shards) and
    for unsharded ones. ``directory`` must be visible to all ranks (a shared filesystem
    across nodes).

    Args:
        directory: The checkpoint root.
        model: The model (sharded or not).
        optimizer: Its optimizer, if its state should be saved.
        step: The training step; names the checkpoint.
        extra: JSON-serialisable data saved in the manifest (e.g. the run's arguments).
        keep: Keep only the newest ``keep`` complete checkpoints.

    Returns:
        The path of the new checkpoint.
    """
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    final = _files.step_dir(Path(directory), step)
    tmp = _files.temporary_dir(final, _dist.broadcast_from_rank0(uuid.uuid4().hex))
    rank = _dist.rank()
    if rank == 0:
        _files.create_temporary_dir(tmp)
    _dist.barrier()

    state = _dcp.training_state(model, optimizer)
    _dcp.save(state, tmp)
    rng_path = _files.rng_file(tmp, rank)
    torch.save(_generator_states.capture(model), rng_path)
    _files.fsync_file(rng_path)
    _dist.barrier()  # every rank's files are written
    gathered = _dist.gather_to_rank0(_files.describe_files(tmp, rank))
    if rank == 0:
        manifest = {
            "format": _files.FORMAT,
            "step": step,
            "world_size": _dist.world_size(),
            "int8_keys": _dcp.int8_keys(state["model"]),
            "has_optimizer": optimizer is not None,
            "extra": extra or {},
            "versions": {"torch": torch.__version__, "fsdp_int8": _package_version()},
            "files": {k: v for per_rank in gathered for k, v in per_rank.items()},
        }
        _files.write_manifest(tmp, manifest)
        _files.publish(tmp, final)
        if keep is not None:
            _files.prune(final.parent, keep)
    _dist.barrier()
    return final


def _package_version() -> str:
    from fsdp_int8 import __version__  # here: fsdp_int8 imports this module while starting up

    return __version__
