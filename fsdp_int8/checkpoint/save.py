"""``save_checkpoint``: every rank checks that its state is finite, writes its shards and
generator states into a temporary directory; rank 0 adds the manifest, renames it into
place and prunes by write order. After each stage the ranks decide together whether it
worked, so a failure on one rank (a full disk) is raised on every rank at once."""

from __future__ import annotations

import io
import os
import uuid
from concurrent import futures
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.checkpoint import CheckpointException

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
    async_: bool = False,
) -> Path | Future[Path]:
    """Save model, optimizer and generator states as ``directory/step_<step>``, atomically.

    Call on every rank. Works for FSDP2-sharded models (each rank writes its shards) and
    for unsharded ones. ``directory`` must be visible to all ranks (a shared filesystem
    across nodes).

    Nothing is written if any floating parameter or optimizer state (an int8 weight's
    scales included) holds NaN or Inf on any rank: every rank raises the same
    :class:`CheckpointError`, and ``latest`` still names the previous checkpoint. So does
    a failure while writing on any rank (a full disk, dcp's own errors): every rank raises
    the same :class:`CheckpointError` naming the failing ranks, their files and the causes,
    the partial files are removed, and the process group stays usable.

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
        async_: Return as soon as the state is copied to CPU memory (int8 weights and
            DTensors stay what they are) and write it in a background thread, whose
            collectives run on a gloo group of their own, so training goes on meanwhile.
            The checks above still run before it returns; the write, the manifest and the
            atomic publish happen in the background. The next ``save_checkpoint`` waits
            for it first; wait for it yourself (``.result()``) before the process exits
            or destroys its process group. Holds a CPU copy of the rank's state while in
            flight.

    Returns:
        The path of the new checkpoint; with ``async_``, a
        ``concurrent.futures.Future`` whose ``.result()`` waits for the write and returns
        that path, or raises its :class:`CheckpointError` (on every rank alike).

    Raises:
        ValueError: ``step < 0`` or ``keep < 1``.
        TypeError: ``optimizer`` is no optimizer and forwards to none.
        CheckpointError: NaN or Inf in the state (naming the first entries); a failure
            to write on any rank.
    """
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    if keep is not None and keep < 1:
        raise ValueError(
            f"keep must be >= 1 (how many checkpoints to keep, this one included), got {keep}; "
            "pass keep=None to keep every checkpoint"
        )
    _wait_for_pending_save()  # one save at a time: its collectives never interleave with ours
    optimizer = innermost_optimizer(optimizer) if optimizer is not None else None
    state = _dcp.training_state(model, optimizer)
    _refuse_non_finite(state)
    _merge_param_groups(state)
    final = _files.step_dir(Path(directory), step)
    tmp = _files.temporary_dir(final, _dist.broadcast_from_rank0(uuid.uuid4().hex))
    _Stages(final, tmp)(f"creating {tmp}", lambda: _files.create_temporary_dir(tmp) if _dist.rank() == 0 else None)
    taken = _Taken(  # what the write needs of the model, taken now: the streams at this step
        _serialized(capture_generators(model)), sharding_layout(model), _dcp.int8_keys(state["model"]))
    if not async_:
        return _write(state, taken, final, tmp, step, extra, keep, None)
    global _pending
    staged = _dcp.cpu_copy(state)  # the training loop may change the model as soon as we return
    group = _background_group()
    _pending = _executor().submit(_write, staged, taken, final, tmp, step, extra, keep, group)
    return _pending


@dataclass
class _Taken:
    generators: bytes  # this rank's generator states, serialized
    layout: dict  # world_size, mesh_shape (the dp mesh's), tensor_parallel
    int8_keys: list[str]  # this rank's (pipeline stages hold other keys)


def _write(
    state: dict[str, Any], taken: _Taken, final: Path, tmp: Path, step: int, extra: dict | None,
    keep: int | None, group: dist.ProcessGroup | None,
) -> Path:
    """Write ``state`` and ``taken`` into ``tmp`` on every rank, then rank 0 adds the
    manifest, publishes ``tmp`` as ``final`` and prunes; collectives on ``group``."""
    rank = _dist.rank()
    stage = _Stages(final, tmp, group)
    # dcp's own collectives raise its CheckpointException on every rank alike
    stage(f"writing {tmp}/__{{rank}}_*.distcp (and .metadata on rank 0) through "
          "torch.distributed.checkpoint", lambda: _dcp.save(state, tmp, group))
    rng_path = _files.rng_file(tmp, rank)
    stage(f"writing {rng_path}", lambda: _files.write_durably(rng_path, taken.generators))
    mine = stage(f"reading back its files in {tmp}", lambda: _files.describe_files(tmp, rank))
    gathered = _dist.gather_to_rank0((mine, taken.int8_keys), group)
    stage(f"writing {tmp / _files.MANIFEST}", lambda: _files.write_manifest(
        tmp, _manifest(final, step, taken.layout, extra, gathered)) if rank == 0 else None)
    stage(f"publishing {tmp} as {final}", lambda: _files.publish(tmp, final) if rank == 0 else None)
    if rank == 0 and keep is not None:
        _files.prune(final.parent, keep, newest=final)
    _dist.barrier(group)
    return final


# ---------------------------------------------------------------- saves in the background
_pending: Future | None = None
_background: dict[str, Any] = {}  # the writer thread, and the process group of its collectives


def _wait_for_pending_save() -> None:
    """Wait until the save that ``save_checkpoint(..., async_=True)`` left in flight (if
    any) is written and published. Its error, if it failed, stays with its handle."""
    if _pending is not None:
        futures.wait([_pending])


def _executor() -> ThreadPoolExecutor:
    if "executor" not in _background:
        _background["executor"] = ThreadPoolExecutor(1, thread_name_prefix="fsdp_int8-checkpoint")
    return _background["executor"]


def _background_group() -> dist.ProcessGroup | None:
    """A gloo group of every rank for the writer thread's collectives: the training loop's
    run on the default group meanwhile, and one group's collectives must come in the same
    order on every rank. Made once per default group (a collective: every rank saves)."""
    if not _dist.is_distributed():
        return None
    world = dist.group.WORLD
    if _background.get("world") is not world:
        _background["world"], _background["group"] = world, dist.new_group(backend="gloo")
    return _background["group"]


def _manifest(final: Path, step: int, layout: dict, extra: dict | None, gathered: list) -> dict:
    """The manifest of checkpoint ``final`` (on rank 0): ``gathered`` holds each rank's
    files and int8 keys."""
    return {
        "format": _files.FORMAT,
        "step": step,
        "sequence": _files.next_sequence(final.parent),  # write order, for keep
        **layout,
        "int8_keys": sorted({key for _, keys in gathered for key in keys}),
        "extra": extra or {},
        "versions": {"torch": torch.__version__, "fsdp_int8": __version__},
        "files": {k: v for files, _ in gathered for k, v in files.items()},
    }


def _serialized(value: Any) -> bytes:
    """``torch.save``'s bytes of ``value``: written by :func:`_files.write_durably`, a full
    disk raises ``OSError`` (ENOSPC), not torch's archive writer's own message."""
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return buffer.getvalue()


class _Stages:
    """Runs each stage of a save on every rank and decides together whether it worked.

    One gather after each stage: a stage that fails on any rank (a full disk while one rank
    writes its generator states, while rank 0 writes the manifest, or inside dcp) raises
    the same :class:`CheckpointError` on every rank, naming each failing rank, its file
    and the cause, and no rank waits in a collective the others skipped. The temporary
    directory is removed (space back on a full disk); ``latest`` and every published
    checkpoint stay as they were, and the process group stays usable.
    """

    def __init__(self, final: Path, tmp: Path, group: dist.ProcessGroup | None = None) -> None:
        self.final, self.tmp, self.group = final, tmp, group

    def __call__(self, doing: str, action: Callable[[], Any]) -> Any:
        """``action()``'s result; ``doing`` says what it does (``{rank}``: a rank's number)."""
        result, problem = None, None
        try:
            result = action()
        except (Exception, CheckpointException) as error:  # dcp's is a BaseException
            problem = _failures(error, doing)
        problems = sorted({p for p in _dist.all_gather(problem, self.group) if p})
        if problems:
            if _dist.rank() == 0:
                _files.remove_checkpoint(self.tmp)
            _dist.barrier(self.group)  # the removal is done before any rank raises
            raise CheckpointError(
                f"checkpoint {self.final} was not saved: {'; '.join(problems)}. Nothing was "
                "published: latest and the existing checkpoints are unchanged, and the partial "
                "files are removed. Free disk space (ENOSPC, errno 28: the disk or a quota is "
                "full) or fix the cause, then save again"
            )
        return result


def _failures(error: BaseException, doing: str) -> str:
    """Each failing rank, what it was doing and why: dcp's ``CheckpointException`` holds
    every rank's cause (the same on every rank), any other error is this rank's own."""
    if isinstance(error, CheckpointException):
        causes = {rank: cause for rank, (cause, _) in error.failures.items()}
    else:
        causes = {_dist.rank(): error}
    return "; ".join(
        f"rank {rank}: {doing.replace('{rank}', str(rank))}: {type(cause).__name__}: {cause}"
        for rank, cause in sorted(causes.items())
    )


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
