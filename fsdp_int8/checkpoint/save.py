"""``save_checkpoint``: every rank collects its state, checks that it is finite, writes its
shards and generator states into a temporary directory and reads them back; rank 0 checks
that every rank's files are there, adds the manifest, renames the directory into place and
prunes by write order. After each stage the ranks decide together whether it worked, so a
failure on one rank (a full disk, a generator that cannot be serialized) is raised on every
rank at once, and a rank whose process group is gone publishes nothing."""

from __future__ import annotations

import errno
import io
import os
import uuid
import warnings
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
from fsdp_int8.checkpoint._fit import shape_attributes
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

    The generators saved include the int8 weights' stochastic-rounding streams, so a load
    at the same world size resumes exactly (layout on disk and resume rules:
    docs/checkpoints.md).

    Call on every rank. Works for FSDP2-sharded models (each rank writes its shards) and
    for unsharded ones. ``directory`` must be visible to all ranks (a shared filesystem
    across nodes).

    A checkpoint is published only once every rank's files are written and read back, and
    its manifest lists each of them (size and sha256). Nothing is written if any floating
    parameter or optimizer state (an int8 weight's scales included) holds NaN or Inf on any
    rank: every rank raises the same :class:`CheckpointError`, and ``latest`` still names
    the previous checkpoint. So does a failure at any stage on any rank (collecting the
    state, serializing the generators, the CPU copy, dcp's write, a full disk, the manifest,
    the publish): every rank raises the same :class:`CheckpointError` naming the failing
    ranks, their files and the causes, the partial files are removed, and the process group
    stays usable. A failure while pruning (``keep``) is raised the same way, saying that the
    new checkpoint is published.

    Args:
        directory: The checkpoint root.
        model: The model (sharded or not).
        optimizer: Its optimizer, if its state should be saved; or a wrapper that forwards
            ``param_groups`` and ``state`` to the optimizer in ``.optimizer`` (accelerate's
            ``AcceleratedOptimizer``, Lightning's ``LightningOptimizer``, your own): the
            optimizer inside is saved.
        step: The training step (an ``int`` >= 0); names the checkpoint.
        extra: JSON-serialisable data saved in the manifest (e.g. the run's arguments).
        keep: Keep only the ``keep`` (an ``int`` >= 1) most recently *written* complete
            checkpoints, this one included; ``None`` keeps all. Write order, not step: a new
            or rolled-back run's checkpoints are the newest even at lower steps. The new
            checkpoint and the one ``latest`` names are never removed.
        async_: Return as soon as the state is copied to CPU memory (int8 weights and
            DTensors stay what they are) and write it in a background thread, whose
            collectives run on a gloo group of their own (with the default group's
            timeout), so training goes on meanwhile. The checks and the copy run before it
            returns; the write, the manifest and the atomic publish happen in the
            background. The next ``save_checkpoint`` waits for it first; wait for it yourself
            (``.result()``) before the process exits or destroys its process group: a
            writer whose process group is destroyed stops, publishes nothing, warns and
            fails its handle. Holds a CPU copy of the rank's state while in flight.

    Returns:
        The path of the new checkpoint; with ``async_``, a
        ``concurrent.futures.Future`` whose ``.result()`` waits for the write and returns
        that path, or raises its :class:`CheckpointError` (on every rank alike).

    Raises:
        TypeError: ``step`` or ``keep`` is not an ``int`` (``bool`` included);
            ``optimizer`` is no optimizer and forwards to none, or is a wrapper with a state
            of its own (Lookahead: its ``param_groups`` and ``state`` are not its
            ``.optimizer``'s).
        ValueError: ``step < 0`` or ``keep < 1``.
        CheckpointError: NaN or Inf in the state (naming the first entries); a failure
            at any stage on any rank.
    """
    _check_count("step", step, minimum=0, meaning="the training step that names the checkpoint")
    if keep is not None:
        _check_count("keep", keep, minimum=1, meaning=(
            "how many checkpoints to keep, this one included; pass keep=None to keep every checkpoint"))
    _wait_for_pending_save()  # one save at a time: its collectives never interleave with ours
    optimizer = innermost_optimizer(optimizer) if optimizer is not None else None
    final = _files.step_dir(Path(directory), step)
    tmp = _files.temporary_dir(final, _dist.broadcast_from_rank0(uuid.uuid4().hex))
    stage = _Stages(final, tmp, _Ranks.of_default_group())
    state = stage("collecting its model and optimizer state", lambda: _dcp.training_state(model, optimizer))
    _refuse_non_finite(stage("checking its state for NaN and Inf", lambda: _dcp.non_finite_keys(state), share=True))
    _merge_param_groups(state, stage("listing its optimizer's parameter names", lambda: _group_names(state), share=True))
    taken = stage("serializing its generator states", lambda: _Taken(  # taken now: the streams at this step
        _serialized(capture_generators(model)), sharding_layout(model), _dcp.int8_keys(state["model"]),
        shape_attributes(model)))
    stage(f"creating {tmp}", lambda: _files.create_temporary_dir(tmp) if _dist.rank() == 0 else None)
    if not async_:
        return _write(state, taken, step, extra, keep, stage)
    global _pending
    staged = stage("copying its state to CPU memory", lambda: _dcp.cpu_copy(state))  # the loop may change the model
    writer = _Stages(final, tmp, _Ranks.of_default_group(_background_group()))
    _pending = _executor().submit(_write, staged, taken, step, extra, keep, writer)
    return _pending


def _check_count(name: str, value: Any, *, minimum: int, meaning: str) -> None:
    """Refuse ``value`` unless it is an ``int`` (not a ``bool``) of at least ``minimum``."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int ({meaning}), got {type(value).__name__} {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum} ({meaning}), got {value}")


@dataclass
class _Taken:
    generators: bytes  # this rank's generator states, serialized
    layout: dict  # world_size, mesh_shape (the dp mesh's), tensor_parallel
    int8_keys: list[str]  # this rank's (pipeline stages hold other keys)
    shape_attributes: dict[str, int]  # this rank's modules' head counts and the like


def _write(state: dict[str, Any], taken: _Taken, step: int, extra: dict | None, keep: int | None,
           stage: "_Stages") -> Path:
    """Write ``state`` and ``taken`` into ``stage.tmp`` on every rank, then rank 0 checks
    that every rank's files are there, adds the manifest, publishes ``stage.tmp`` as
    ``stage.final`` and prunes; every stage decided together on ``stage.ranks``."""
    final, tmp, rank = stage.final, stage.tmp, stage.ranks.rank
    # dcp's own collectives raise its CheckpointException on every rank alike
    stage(f"writing {tmp}/__{{rank}}_*.distcp (and .metadata on rank 0) through "
          "torch.distributed.checkpoint", lambda: _dcp.save(state, tmp, stage.ranks.group, no_dist=stage.ranks.world is None))
    rng_path = _files.rng_file(tmp, rank)
    stage(f"writing {rng_path}", lambda: _files.write_durably(rng_path, taken.generators))
    everyone = stage(f"reading back its files in {tmp}", lambda: (
        _files.describe_files(tmp, rank), taken.int8_keys, taken.shape_attributes), share=True)
    stage(f"writing {tmp / _files.MANIFEST}", lambda: _files.write_manifest(
        tmp, _manifest(final, step, taken.layout, extra, everyone)) if rank == 0 else None)
    stage(f"publishing {tmp} as {final}", lambda: _files.publish(tmp, final) if rank == 0 else None)
    stage.published = True
    if keep is not None:
        stage(f"removing the checkpoints under {final.parent} beyond keep={keep}",
              lambda: _files.prune(final.parent, keep, newest=final) if rank == 0 else None)
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
    order on every rank. Made once per default group (a collective: every rank saves),
    with the default group's timeout: a peer that never arrives fails the save as soon as
    it would fail training."""
    if not _dist.is_distributed():
        return None
    world = dist.group.WORLD
    if _background.get("world") is not world:
        _background["world"] = world
        _background["group"] = dist.new_group(backend="gloo", timeout=_dist.group_timeout(world))
    return _background["group"]


def _manifest(final: Path, step: int, layout: dict, extra: dict | None, everyone: list) -> dict:
    """The manifest of checkpoint ``final`` (on rank 0): ``everyone`` holds each rank's
    files, int8 keys and shape attributes, in rank order."""
    _files.check_every_rank_wrote([files for files, _, _ in everyone], layout["world_size"], final)
    return {
        "format": _files.FORMAT,
        "step": step,
        "sequence": _files.next_sequence(final.parent),  # write order, for keep
        **layout,
        "int8_keys": sorted({key for _, keys, _ in everyone for key in keys}),
        "shape_attributes": {k: v for _, _, attributes in everyone for k, v in sorted(attributes.items())},
        "extra": extra or {},
        "versions": {"torch": torch.__version__, "fsdp_int8": __version__},
        "files": {k: v for files, _, _ in everyone for k, v in files.items()},
    }


def _serialized(value: Any) -> bytes:
    """``torch.save``'s bytes of ``value``: written by :func:`_files.write_durably`, a full
    disk raises ``OSError`` (ENOSPC), not torch's archive writer's own message."""
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return buffer.getvalue()


@dataclass(frozen=True)
class _Ranks:
    """Who takes part in a save, fixed when ``save_checkpoint`` is called: a background
    writer must not take a destroyed process group for a single process."""

    rank: int
    size: int
    group: dist.ProcessGroup | None  # the collectives' group (None: the default group)
    world: dist.ProcessGroup | None  # the default group at the call (None: a single process)

    @classmethod
    def of_default_group(cls, group: dist.ProcessGroup | None = None) -> "_Ranks":
        world = dist.group.WORLD if _dist.is_distributed() else None
        return cls(_dist.rank(), _dist.world_size(), group, world)

    def alive(self) -> bool:
        """Whether the process group of the call is still up (always, in a single process)."""
        return self.world is None or (dist.is_initialized() and dist.group.WORLD is self.world)

    def all_gather(self, value: Any) -> list[Any]:
        if self.world is None:
            return [value]
        out = [None] * self.size
        dist.all_gather_object(out, value, group=self.group)
        return out

    def barrier(self) -> None:
        if self.world is not None:
            dist.barrier(group=self.group)


class _Stages:
    """Runs each stage of a save on every rank and decides together whether it worked.

    One gather after each stage: a stage that fails on any rank raises the same
    :class:`CheckpointError` on every rank, naming each failing rank, what it was doing
    and the cause, and no rank waits in a collective the others skipped. Before
    publishing, the temporary directory is removed (space back on a full disk) and
    ``latest`` and every published checkpoint stay as they were; the process group stays
    usable. A rank whose process group is gone stops before its next stage.
    """

    def __init__(self, final: Path, tmp: Path, ranks: _Ranks) -> None:
        self.final, self.tmp, self.ranks = final, tmp, ranks
        self.published = False  # set once ``final`` holds the new checkpoint

    def __call__(self, doing: str, action: Callable[[], Any], *, share: bool = False) -> Any:
        """``action()``'s result (``share``: every rank's, in rank order); ``doing`` says
        what it does (``{rank}``: a rank's number)."""
        self._stop_if_group_gone(doing)
        result, own, fallback = None, None, None
        try:
            result = action()
        except (Exception, CheckpointException) as error:  # dcp's is a BaseException
            own, fallback = _failures(error, doing, self.ranks.rank)
        self._stop_if_group_gone(doing)
        try:
            everyone = self.ranks.all_gather((own, fallback, result if share else None))
        except Exception as error:  # a peer left: its process ended, or it destroyed its group
            self._stop_if_group_gone(doing)
            self._fail([f"rank {self.ranks.rank}: the collective after {doing.replace('{rank}', 'each rank')} "
                        f"failed ({type(error).__name__}: {error}): another rank ended or destroyed "
                        "its process group"], agreed=False)
        problems = sorted({text for text, _, _ in everyone if text}) or sorted(
            {text for _, text, _ in everyone if text})
        if problems:
            self._fail(problems, agreed=True)
        return [shared for _, _, shared in everyone] if share else result

    def _fail(self, problems: list[str], *, agreed: bool) -> None:
        """Raise ``problems`` as a :class:`CheckpointError` (``agreed``: on every rank, after
        the partial files are removed)."""
        if not self.published and self.ranks.rank == 0:
            _files.remove_checkpoint(self.tmp)
        if agreed:
            self.ranks.barrier()  # the removal is done before any rank raises
        causes = "; ".join(problems)
        if self.published:
            raise CheckpointError(
                f"checkpoint {self.final} was saved and published (latest names it), but {causes}. "
                "Fix the cause: the checkpoints that were not removed are complete")
        advice = ("Free disk space (ENOSPC, errno 28: the disk or a quota is full), then save again"
                  if "ENOSPC" in causes or os.strerror(errno.ENOSPC) in causes else "Fix the cause, then save again")
        raise CheckpointError(
            f"checkpoint {self.final} was not saved: {causes}. Nothing was published: latest and the "
            f"existing checkpoints are unchanged, and the partial files are removed. {advice}")

    def _stop_if_group_gone(self, doing: str) -> None:
        if self.ranks.alive():
            return
        message = (
            f"checkpoint {self.final} was not saved: rank {self.ranks.rank}'s process group was destroyed "
            f"while the save was in flight (before {doing.replace('{rank}', str(self.ranks.rank))}), so the "
            "ranks cannot agree that every rank's files are written, and nothing was published. Call "
            ".result() on save_checkpoint's handle before destroy_process_group()")
        warnings.warn(message, RuntimeWarning, stacklevel=2)  # the handle may never be read
        raise CheckpointError(message)


def _failures(error: BaseException, doing: str, me: int) -> tuple[str | None, str]:
    """What this rank reports of a failed stage: its own causes (or ``None``: dcp's
    ``CheckpointException`` holds every rank's, each rank reports its own), and every
    cause the error knows, for when no rank has its own."""
    if isinstance(error, CheckpointException):
        causes = {rank: cause for rank, (cause, _) in error.failures.items()}
    else:
        causes = {me: error}
    text = {rank: f"rank {rank}: {doing.replace('{rank}', str(rank))}: {_dcp.cause_text(cause)}"
            for rank, cause in sorted(causes.items())}
    return text.get(me), "; ".join(text.values())


def _group_names(state: dict[str, Any]) -> list[list[str]]:
    """The parameter names of each of ``state``'s optimizer groups, on this rank."""
    return [list(group["params"]) for group in state.get("optimizer", {}).get("param_groups", [])]


def _merge_param_groups(state: dict[str, Any], everyone: list[list[list[str]]]) -> None:
    """Give every optimizer group the parameter names of that group on every rank.

    dcp stores one copy of the (non-tensor) param groups. Pipeline stages hold other
    parameters in the same group, so without the union a checkpoint of all stages would
    name only one stage's parameters and could not load strictly at pp = 1. Without
    pipelining every rank has the same names and nothing changes.
    """
    groups = state.get("optimizer", {}).get("param_groups", [])
    for index, group in enumerate(groups):
        names = list(group["params"])
        seen = set(names)
        for theirs in everyone:
            for name in theirs[index] if index < len(theirs) else ():
                if name not in seen:
                    seen.add(name)
                    names.append(name)
        group["params"] = names


def _refuse_non_finite(everyone: list[list[str]]) -> None:
    """Raise (on every rank alike) if any rank's state holds NaN or Inf: ``everyone``
    holds each rank's non-finite keys."""
    bad = sorted({key for per_rank in everyone for key in per_rank})
    if bad:
        raise CheckpointError(
            f"not saving: NaN or Inf in {len(bad)} entries ({listing(bad)}); nothing was "
            "written and the previous checkpoints are unchanged. Training has diverged: resume "
            "from the last good checkpoint, with a lower learning rate or gradient clipping"
        )
