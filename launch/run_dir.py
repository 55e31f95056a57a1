"""The bookkeeping of a run's --out folder across torchrun jobs and restarts.

A run writes to --out: ``metrics.jsonl``, ``loss.png``, ``checkpoints/`` and ``run.json``,
which names the torchrun job that owns the folder. How a process starts is decided from
these files alone (:func:`start_mode`), before any process group exists and before any
rank writes, so every rank decides the same: a fresh start, a resume (``--resume``, or a
torchrun restart of the job that owns the checkpoints), or an overwrite. A new run refuses
an --out that holds another run's checkpoints unless told which.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from fsdp_int8.checkpoint import latest_checkpoint, load_checkpoint

RUN_RECORD = "run.json"  # in --out: the torchrun job whose checkpoints are there
CHECKPOINTS = "checkpoints"  # in --out


def restarted_by_torchrun() -> bool:
    """Whether this is a torchrun restart (an attempt after the first) of its job."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0)) > 0


def torchrun_job() -> str | None:
    """torchrun's id of this job: the same in each of its restarts, new for each torchrun
    on one node (a uuid); on several nodes it is --rdzv-id (None if left at "none")."""
    job = os.environ.get("TORCHELASTIC_RUN_ID", "")
    return None if job in ("", "none") else job


def init_process_group(device: torch.device) -> tuple[int, int]:
    """The default process group from torchrun's environment; this process's rank and the world size.

    After a torchrun restart the agent's store still holds the previous attempt's keys,
    and gloo would read the dead ranks' addresses from them: each attempt gets its own
    prefix of the store.
    """
    store, rank, world = next(dist.rendezvous("env://"))
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    dist.init_process_group(
        backend=dist.get_default_backend_for_device(device),
        store=dist.PrefixStore(f"launch.train/attempt_{attempt}", store),
        rank=rank, world_size=world,
    )
    return rank, world


def _owned_by_this_job(out: Path) -> bool:
    """Whether --out's checkpoints were written by this torchrun job (in an earlier
    attempt). Without a job id there is no telling: they are taken as this job's."""
    job = torchrun_job()
    if job is None:
        return True
    try:
        return json.loads((out / RUN_RECORD).read_text()).get("torchrun_job") == job
    except (OSError, ValueError, AttributeError):
        return False


def start_mode(out: Path, *, resume: bool, overwrite: bool) -> str:
    """How this process starts: ``"fresh"``, ``"resume"`` or ``"overwrite"``.

    Decided from the files alone, before any process group exists and before any rank
    writes to ``out``, so every rank decides the same.

    Raises:
        ValueError: ``out`` holds checkpoints of another run, and neither ``resume`` nor
            ``overwrite`` says what to do with them.
    """
    found = latest_checkpoint(out / CHECKPOINTS)
    if resume or (restarted_by_torchrun() and (found is None or _owned_by_this_job(out))):
        return "resume"
    if restarted_by_torchrun():
        raise ValueError(
            f"this torchrun restart found checkpoints of another run in {out / CHECKPOINTS} "
            f"(newest: {found.name}) and will not resume them: pass --resume to continue that "
            "run, --overwrite to delete its checkpoints, or use another --out"
        )
    if found is None:
        return "fresh"
    if overwrite:
        return "overwrite"
    raise ValueError(
        f"{out / CHECKPOINTS} already holds checkpoints of another run (newest: {found.name}): "
        "pass --resume to continue that run, --overwrite to delete them and start over, or "
        "use another --out"
    )


def claim_output(out: Path, mode: str) -> None:
    """Make ``out`` this job's (for its restarts); ``"overwrite"`` deletes the old checkpoints."""
    if mode == "overwrite":
        shutil.rmtree(out / CHECKPOINTS, ignore_errors=True)
    out.mkdir(parents=True, exist_ok=True)
    record = {"torchrun_job": torchrun_job(), "argv": sys.argv[1:], "started": time.time()}
    (out / RUN_RECORD).write_text(json.dumps(record) + "\n")


def prepare(out: Path, mode: str) -> None:
    """On every rank: rank 0 of a job's first attempt claims ``out``, and every rank waits
    for that (and for an overwrite's deletion) before any reads it."""
    if dist.get_rank() == 0 and not restarted_by_torchrun():
        claim_output(out, mode)
    dist.barrier()


def resume(out: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer, *, strict: bool = True) -> int:
    """Load ``out``'s latest checkpoint into the model and optimizer; the step it was
    saved at (0 when there is none yet: a restart before the first checkpoint).

    ``strict=False`` for a pipeline stage: the checkpoint also holds the other stages'
    entries. Every entry of the stage must still be there (a ``ValueError`` otherwise)."""
    if latest_checkpoint(out / CHECKPOINTS) is None:
        return 0
    info = load_checkpoint(out / CHECKPOINTS, model, optimizer, strict=strict)
    if info.missing_keys:
        raise ValueError(f"the checkpoint in {out / CHECKPOINTS} lacks {len(info.missing_keys)} of this "
                         f"model's entries, e.g. {info.missing_keys[:3]}")
    return info.step
