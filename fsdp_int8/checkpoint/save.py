"""``save_checkpoint``: every rank checks that its state is finite, writes its shards and
generator states into a temporary directory; rank 0 adds the manifest, renames it into
place and prunes by write order."""

from __future__ import annotations

import os
import uuid
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from fsdp_int8 import _dist
from fsdp_int8._version import __version__
from fsdp_int8.checkpoint import _dcp, _files
from fsdp_int8.checkpoint._generator_states import capture_generators, sharding_layout
from fsdp_int8.checkpoint._optimizers import innermost_optimizer
from fsdp_int8.checkpoint.errors import CheckpointError, listing

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

    Nothing is written if any floating parameter or optimizer state (an int8 weight's
    scales included) holds NaN or Inf on any rank: every rank raises the same
    :class:`CheckpointError`, and ``latest`` still names the previous checkpoint.

    Args:
        directory: The checkpoint root.
        model: The model (sharded or not).
        optimizer: Its optimizer, if its state should be saved; or a wrapper that forwards
            to it in ``.optimizer`` (accelerate, Lightning): the optimizer inside is saved.
        step: The training step; names the checkpoint.
        extra: JSON-serialisable data saved in the manifest (e.g. the run's arguments).
        keep: Keep only the ``keep`` (>= 1) most recently *written* complete checkpoints,
            this one included; ``None`` keeps all. Write order, not step: a new or
            rolled-back run's checkpoints are the newest even at lower steps. The new
            checkpoint and the one ``latest`` names are never removed.

    Returns:
        The path of the new checkpoint.

    Raises:
        ValueError: ``step < 0`` or ``keep < 1``.
        TypeError: ``optimizer`` is no optimizer and forwards to none.
        CheckpointError: NaN or Inf in the state (naming the first entries).
    """
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    if keep is not None and keep < 1:
        raise ValueError(
            f"keep must be >= 1 (how many checkpoints to keep, this one included), got {keep}; "
            "pass keep=None to keep every checkpoint"
        )
    optimizer = innermost_optimizer(optimizer) if optimizer is not None else None
    state = _dcp.training_state(model, optimizer)
    _refuse_non_finite(state)
    _merge_param_groups(state)
    final = _files.step_dir(Path(directory), step)
    tmp = _files.temporary_dir(final, _dist.broadcast_from_rank0(uuid.uuid4().hex))
    rank = _dist.rank()
    if rank == 0:
        _files.create_temporary_dir(tmp)
    _dist.barrier()

    _dcp.save(state, tmp)
    rng_path = _files.rng_file(tmp, rank)
    torch.save(capture_generators(model), rng_path)
    _files.fsync_file(rng_path)
    _dist.barrier()  # every rank's files are written
    # each rank's files and int8 keys (pipeline stages hold other keys)
    gathered = _dist.gather_to_rank0((_files.describe_files(tmp, rank), _dcp.int8_keys(state["model"])))
    if rank == 0:
        manifest = {
            "format": _files.FORMAT,
            "step": step,
            "sequence": _files.next_sequence(final.parent),  # write order, for keep
            **sharding_layout(model),  # world_size, mesh_shape (the dp mesh's), tensor_parallel
            "int8_keys": sorted({key for _, keys in gathered for key in keys}),
            "extra": extra or {},
            "versions": {"torch": torch.__version__, "fsdp_int8": __version__},
            "files": {k: v for files, _ in gathered for k, v in files.items()},
        }
        _files.write_manifest(tmp, manifest)
        _files.publish(tmp, final)
        if keep is not None:
            _files.prune(final.parent, keep, newest=final)
    _dist.barrier()
    return final


def _merge_param_groups(state: dict[str, Any]) -> None:
    """Give every optimizer group the parameter names of that group on every rank.

    dcp stores one copy of the (non-tensor) param groups. Pipeline stages hold other
    parameters in the same group, so without the union a checkpoint of all stages would
    name only one stage's parameters and could not load strictly at pp = 1. Without
    pipelining every rank has the same names and nothing changes.
    """
    groups = state.get("optimizer", {}).get("param_groups", [])
    if not groups:
        return
    everyone = _dist.all_gather([list(group["params"]) for group in groups])
    for index, group in enumerate(groups):
        names = list(group["params"])
        seen = set(names)
        for theirs in everyone:
            for name in theirs[index] if index < len(theirs) else ():
                if name not in seen:
                    seen.add(name)
                    names.append(name)
        group["params"] = names


def _refuse_non_finite(state: dict[str, Any]) -> None:
    """Raise on every rank if any rank's state holds NaN or Inf (one gather: the same
    verdict everywhere, so no rank waits in a collective the others skip)."""
    bad = sorted({key for per_rank in _dist.all_gather(_dcp.non_finite_keys(state)) for key in per_rank})
    if bad:
        raise CheckpointError(
            f"not saving: NaN or Inf in {len(bad)} entries ({listing(bad)}); nothing was "
            "written and the previous checkpoints are unchanged. Training has diverged: resume "
            "from the last good checkpoint, with a lower learning rate or gradient clipping"
        )
