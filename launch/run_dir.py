"""The bookkeeping of a run's --out folder across torchrun jobs and restarts.

A run writes to --out: ``metrics.jsonl``, ``loss.png``, ``checkpoints/`` and ``run.json``,
which names the torchrun job that owns the folder. How a process starts is decided from
these files alone (:func:`start_mode`), before any process group exists and before any
rank writes, so every rank decides the same: a fresh start, a resume (``--resume``, or a
torchrun restart of the job that owns the checkpoints), or an overwrite. A new run refuses
an --out that holds another run's checkpoints unless told which.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import shutil
import sys
import time
from concurrent.futures import Future
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist

import fsdp_int8
from fsdp_int8.checkpoint import latest_checkpoint, load_checkpoint

RUN_RECORD = "run.json"  # in --out: the torchrun job whose checkpoints are there
CHECKPOINTS = "checkpoints"  # in --out
MANIFEST = "manifest.json"  # in each checkpoint: save_checkpoint's record, with the launcher's `extra`

# The flags a resume must repeat: what the checkpoint's model and optimizer states are
# (model shape, int8 or float weights and embedding, optimizer and its state bits) or how
# its weights train (precision, compute dtype, int8 GEMMs or gathered weights, the step
# inside backward, bf16 gradients, and --lean, which sets several of them). Weight decay
# is kept in the optimizer's parameter groups, which a load takes from the checkpoint.
# Every other flag (steps, batch size, learning rate, clipping, seed, layout, logging,
# checkpointing, compile) may change on a resume.
RECIPE_FLAGS = ("preset", "dim", "n_layers", "n_heads", "lean", "precision", "compute_dtype", "quantize_embeddings",
                "int8_gathered_weights", "optimizer", "step_in_backward", "bf16_grads", "weight_decay")


class RecipeMismatch(ValueError):
    """A resume with other recipe flags (:data:`RECIPE_FLAGS`) than its checkpoint's run."""


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


def save(out: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer, step: int,
         args: argparse.Namespace, pending: Future | None) -> Future | None:
    """Save checkpoint ``step`` of the run (every rank); with --checkpoint-async in the
    background, returning the save in flight. A save still in flight (``pending``) is
    waited for first, and its error raised: a save never starts before the last one is
    published."""
    if pending is not None:
        pending.result()
    saved = fsdp_int8.save_checkpoint(out / CHECKPOINTS, model, optimizer, step=step, keep=args.keep,
                                      extra={"argv": args.argv, "recipe": recipe_of(args)},
                                      async_=args.checkpoint_async)
    return saved if args.checkpoint_async else None


def finish_in_flight(pending: Future | None) -> None:
    """On the way out after an error: wait for the checkpoint still being written in the
    background (its writer needs no help from the training loop) and say on stderr
    whether it was published, so that destroying the process group never drops it."""
    if pending is None:
        return
    try:
        print(f"the checkpoint in flight was published: {pending.result()}", file=sys.stderr, flush=True)
    except Exception as error:  # its own error, already the same on every rank
        print(f"the checkpoint in flight was not saved: {error}", file=sys.stderr, flush=True)


def recipe_of(args: argparse.Namespace) -> dict[str, Any]:
    """The :data:`RECIPE_FLAGS` of a run (``args`` as ``parse_args`` and ``choose_recipe``
    left them: ``--lean`` expanded, ``auto`` resolved; the model's shape as built), which
    its checkpoints record."""
    recipe = {name: getattr(args, name) for name in RECIPE_FLAGS}
    recipe.update(dim=args.model.dim, n_layers=args.model.n_layers, n_heads=args.model.n_heads)
    return recipe


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def check_recipe(out: Path, recipe: dict[str, Any],
                 parse: Callable[[list[str]], argparse.Namespace] | None = None) -> None:
    """Refuse to resume ``out``'s latest checkpoint with other :data:`RECIPE_FLAGS` than
    the run that saved it: ``recipe`` is this run's (:func:`recipe_of`).

    The checkpoint's flags are those its manifest records under ``extra["recipe"]``; a
    checkpoint recording only its command line (``extra["argv"]``) has it read by
    ``parse`` (flags it left at ``auto`` are not compared: what they resolved to is not
    recorded). Nothing to compare (no checkpoint, no record) passes.

    Raises:
        RecipeMismatch: one line per differing flag, and what to do.
    """
    found = latest_checkpoint(out / CHECKPOINTS)
    if found is None:
        return
    try:
        extra = json.loads((found / MANIFEST).read_text()).get("extra") or {}
    except (OSError, ValueError, AttributeError):
        return  # no readable manifest: the load says what is wrong with the checkpoint
    saved, argv = extra.get("recipe"), extra.get("argv")
    if saved is None and parse is not None and isinstance(argv, list):
        saved = _recipe_in(argv, parse)
    if not isinstance(saved, dict):
        return
    differing = [name for name in RECIPE_FLAGS
                 if name in saved and saved[name] != "auto" and saved[name] != recipe[name]]
    if not differing:
        return
    lines = "\n".join(f"  {_flag(n)}: checkpoint {saved[n]}, this run {recipe[n]}" for n in differing)
    command = f" (its command line: {' '.join(argv)})" if isinstance(argv, list) else ""
    raise RecipeMismatch(
        f"{found} was saved by a run with other recipe flags than this one:\n{lines}\n"
        f"Resuming would change what its model or optimizer hold or how they train. Rerun with the "
        f"checkpoint's flags{command}, or start a fresh run: another --out, or --overwrite"
    )


def _recipe_in(argv: list[str], parse: Callable[[list[str]], argparse.Namespace]) -> dict[str, Any] | None:
    """The recipe flags of a recorded command line; ``None`` if it no longer parses."""
    try:
        with contextlib.redirect_stderr(io.StringIO()):  # argparse's usage text of a refusal
            return recipe_of(parse(argv))
    except (SystemExit, ValueError):
        return None
