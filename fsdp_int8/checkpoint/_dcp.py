"""What goes through ``torch.distributed.checkpoint`` (dcp): the training state dict, which
of its entries are int8, what a checkpoint's index holds, its keys as dcp stores them,
copies to read into, the finite-values check, and dcp's save and load with or without a
process group."""

from __future__ import annotations

import contextlib
import io
import os
import warnings
from collections import defaultdict
from concurrent.futures import Future
from pathlib import Path
from typing import Any, Iterator

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint import CheckpointException
from torch.distributed.checkpoint.filesystem import FileSystem
from torch.distributed.checkpoint.staging import AsyncStager

# dcp's own key flattening ("optimizer.state.<fqn>.<name>"): the keys its index stores.
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
)
from torch.utils._pytree import tree_map_only

from fsdp_int8 import _dist
from fsdp_int8._dist import local_shard
from fsdp_int8._weight.load_checks import Int8LoadError, check_weight
from fsdp_int8._weight.tensor import Int8Weight
from fsdp_int8.checkpoint.errors import CheckpointError
from fsdp_int8.guard import norms_finite

# A key as dcp stores it ("model.layers.0.weight") and its path in the nested state dict
# (("model", "layers.0.weight")).
FlatState = dict[str, Any]
Paths = dict[str, tuple]


def _unmapped_keys(model: nn.Module, error: AttributeError) -> CheckpointError:
    return CheckpointError(
        f"torch's get_model_state_dict / set_model_state_dict could not map a state-dict key "
        f"of {type(model).__name__} to a parameter or buffer ({error}). State-dict hooks that "
        "split or rename parameters do this (torchtitan's fused QKV saves wqkv as wq / wk / "
        "wv; it fails without int8 too), and save_checkpoint and load_checkpoint go through "
        "those functions (export_full_state_dict falls back to the model's own state dict). "
        "Checkpoint such a model through its own state dict: dcp.save(model.state_dict(), "
        "checkpoint_id=path), then dcp.load into a fresh model.state_dict() and "
        "model.load_state_dict(it) (int8 bytes round-trip exactly); in torchtitan use "
        "fsdp_int8.integrations.torchtitan.Int8CheckpointManager."
    )


def model_state_dict(model: nn.Module, options: StateDictOptions | None = None) -> dict[str, Any]:
    """torch's ``get_model_state_dict``, with a clear error for keys it cannot map."""
    try:
        return get_model_state_dict(model, options=options)
    except AttributeError as error:  # a key that is no attribute path (a hook's)
        raise _unmapped_keys(model, error) from error


def set_model_state(model: nn.Module, state: dict[str, Any], options: StateDictOptions | None = None) -> None:
    """torch's ``set_model_state_dict``, with a clear error for keys it cannot map."""
    try:
        set_model_state_dict(model, state, options=options)
    except AttributeError as error:
        raise _unmapped_keys(model, error) from error


def training_state(model: nn.Module, optimizer: torch.optim.Optimizer | None) -> dict[str, Any]:
    """``{"model": ..., "optimizer": ...}`` as dcp saves and loads it (no optimizer: no entry).

    The tensors are the model's and optimizer's own: reading into them changes both.
    """
    state: dict[str, Any] = {"model": model_state_dict(model)}
    if optimizer is not None:
        state["optimizer"] = get_optimizer_state_dict(model, optimizer)
    return state


def int8_keys(model_state: dict[str, Any]) -> list[str]:
    """The sorted keys of a model state dict's int8 weights (sharded or not)."""
    return sorted(k for k, v in model_state.items() if isinstance(local_shard(v), Int8Weight))


def stored_entries(path: Path) -> dict[str, Any]:
    """The metadata of every entry in checkpoint ``path``'s index, by key."""
    return dcp.FileSystemReader(path).read_metadata().state_dict_metadata


def stored_entries_and_files(path: Path) -> tuple[dict[str, Any], set[str]]:
    """:func:`stored_entries`, and the data files (relative names) the index refers to."""
    index = dcp.FileSystemReader(path).read_metadata()
    files = {getattr(info, "relative_path", None) for info in (index.storage_data or {}).values()}
    return index.state_dict_metadata, {name for name in files if isinstance(name, str)}


def flatten(state: dict[str, Any]) -> tuple[FlatState, Paths]:
    """``state``'s leaves by the key dcp stores them under, and each key's nested path."""
    return flatten_state_dict(state)


def copy_tensors(state: Any) -> Any:
    """``state`` with every tensor replaced by a copy (DTensors and int8 weights stay what
    they are): something to read into without touching the model or optimizer."""
    return tree_map_only(torch.Tensor, lambda t: t.detach().clone(), state)


def cpu_copy(state: Any) -> Any:
    """``state`` with every tensor replaced by a copy in CPU memory (DTensors and int8
    weights stay what they are, on their meshes): what a background write reads while
    the training loop changes the originals."""
    return tree_map_only(torch.Tensor, lambda t: t.detach().to("cpu", copy=True), state)


class CpuCopyStager(AsyncStager):
    """A ``torch.distributed.checkpoint`` ``AsyncStager`` for state dicts with int8 weights.

    :meth:`stage` copies every tensor into CPU memory with ``.to("cpu", copy=True)``, so
    int8 weights stay ``Int8Weight`` s (int8 rows and scales), DTensors stay DTensors, and
    the write reloads bit-exactly. The copies are not pinned. dcp's default stager cannot
    copy an int8 weight: it copies a storage of the tensor's dtype (``new_empty([])``, then
    ``set_`` to a copy of ``untyped_storage()``), which an int8 weight does not have
    (docs/limits.md). torchtitan's ``Int8CheckpointManager`` stages its ``async`` and
    ``async_with_pinned_mem`` checkpoints with it.

    Args:
        as_future: :meth:`stage` returns a finished ``Future``, so that ``async_save``
            returns its ``AsyncSaveResponse`` (torchtitan's ``async_with_pinned_mem`` mode
            expects one).

    Example::

        dcp.async_save(state_dict, checkpoint_id=path, async_stager=CpuCopyStager())
    """

    _synchronize_after_execute = False

    def __init__(self, *, as_future: bool = False) -> None:
        self.as_future = as_future

    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any] | Future:
        """A CPU copy of ``state_dict`` (in a finished ``Future`` with ``as_future``)."""
        copied = cpu_copy(state_dict)
        if not self.as_future:
            return copied
        staged: Future = Future()
        staged.set_result(copied)
        return staged

    def synchronize_staging(self) -> None:
        """Nothing to wait for: :meth:`stage` returns the copies made."""

    def close(self) -> None:
        """Nothing to release."""


def _values_to_check(value: Any) -> torch.Tensor | None:
    """The floating values of one entry: an int8 weight's scales (its int8 data is always
    finite), a float tensor itself (this rank's shard), nothing for other entries."""
    if not isinstance(value, torch.Tensor):
        return None
    local = local_shard(value)
    if isinstance(local, Int8Weight):
        return local.scale
    return local if local.is_floating_point() else None


def non_finite_keys(state: dict[str, Any]) -> list[str]:
    """The keys of entries holding NaN or Inf on this rank: one fused 2-norm check and
    one host sync per device and dtype (``guard.norms_finite``)."""
    flat, _ = flatten(state)
    groups: dict[tuple[torch.device, torch.dtype], list[tuple[str, torch.Tensor]]] = defaultdict(list)
    for key, value in flat.items():
        values = _values_to_check(value)
        if values is not None and values.numel():
            groups[(values.device, values.dtype)].append((key, values))
    bad = []
    for entries in groups.values():
        if not bool(norms_finite([values for _, values in entries])):  # rare: only then look closer
            bad += [key for key, values in entries if not bool(values.isfinite().all())]
    return sorted(bad)


def refused_int8_entries(model_state: dict[str, Any], keys: set[str], path: Path) -> list[str]:
    """Why the int8 weights read under ``keys`` (this rank's shards) cannot be loaded:
    scales not finite or negative, int8 values outside -127..127 (``load_checks``); every
    rank gets every rank's refusals, so all raise together. Empty: all valid."""
    problem = None
    try:
        for key in int8_keys(model_state):
            if key in keys:
                check_weight(key, model_state[key], source=str(path))
    except Int8LoadError as error:
        problem = f"rank {_dist.rank()}: {error}" if _dist.world_size() > 1 else str(error)
    return sorted({p for p in _dist.all_gather(problem) if p})


def refused_int8_entries_in(path: Path, model_state: dict[str, Any]) -> list[str]:
    """Why the int8 weights of ``model_state`` (nested as given to ``dcp.load``) that
    folder ``path`` holds cannot be loaded, found before anything is loaded: they are
    read into copies (this rank's shards, once more than the load itself reads them) and
    checked as :func:`refused_int8_entries` does. Collective: every rank calls it with the
    same keys, and gets every refusal."""
    stored = stored_entries(path)
    flat, _ = flatten(model_state)  # the keys dcp stores entries under ("model.<fqn>" when nested)
    keys = [key for key in int8_keys(flat) if key in stored]
    copies = {key: copy_tensors(flat[key]) for key in keys}
    if copies:
        load(copies, path)
    return refused_int8_entries(copies, set(keys), path)


@contextlib.contextmanager
def _single_process_is_intended() -> Iterator[None]:
    """dcp warns that it assumes one process without a process group: so do we."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def save(state: dict[str, Any], path: Path, group: dist.ProcessGroup | None = None, *,
         no_dist: bool | None = None) -> None:
    """Write this rank's part of ``state`` into ``path`` (dcp's collectives on ``group``;
    ``no_dist``: a single process, by default when no process group is up).

    torch's archive writer reports a write that fails (a full disk) as ``unexpected pos``;
    the files are written through :class:`_RecordingFile`, and this rank's entry of dcp's
    ``CheckpointException`` names the ``OSError`` underneath (``ENOSPC``) instead.
    """
    no_dist = not _dist.is_distributed() if no_dist is None else no_dist
    writer = dcp.FileSystemWriter(path)
    writer.fs = _RecordingFileSystem()
    try:
        with _single_process_is_intended():
            dcp.save(state, storage_writer=writer, no_dist=no_dist, process_group=group)
    except CheckpointException as error:
        if writer.fs.errors:
            rank = 0 if no_dist else dist.get_rank(group)
            _, trace = error.failures.get(rank, (None, None))
            error.failures[rank] = (writer.fs.errors[0], trace)
        raise


class _RecordingFile(io.BufferedWriter):
    """A file opened for writing that keeps the ``OSError`` of a failed write or flush
    (torch's archive writer drops it) in ``errors``, with the file's name."""

    def __init__(self, path: Path, errors: list[OSError]) -> None:
        super().__init__(io.FileIO(path, "wb"))
        self._path, self._errors = path, errors

    def write(self, data: Any) -> int:
        try:
            return super().write(data)
        except OSError as error:
            self._record(error)
            raise

    def flush(self) -> None:
        try:
            super().flush()
        except OSError as error:
            self._record(error)
            raise

    def _record(self, error: OSError) -> None:
        self._errors.append(OSError(error.errno, f"{error.strerror} (writing {self._path})"))


class _RecordingFileSystem(FileSystem):
    """dcp's local file system, writing through :class:`_RecordingFile`."""

    def __init__(self) -> None:
        super().__init__()
        self.errors: list[OSError] = []

    @contextlib.contextmanager
    def create_stream(self, path: str | os.PathLike, mode: str) -> Iterator[io.IOBase]:
        if mode != "wb":
            with super().create_stream(path, mode) as stream:
                yield stream
            return
        with _RecordingFile(Path(path), self.errors) as stream:
            yield stream


def load(state: dict[str, Any], path: Path) -> None:
    """Fill ``state``'s tensors in place from ``path``, resharding as they are placed."""
    with _single_process_is_intended():
        dcp.load(state, checkpoint_id=path, no_dist=not _dist.is_distributed())


def failure_text(error: BaseException) -> str:
    """What went wrong, for an error message: dcp's ``CheckpointException`` (a
    ``BaseException`` that wraps each rank's error with its traceback) as each rank's
    underlying error."""
    if isinstance(error, CheckpointException):
        return "; ".join(f"rank {rank}: {cause_text(cause)}" for rank, (cause, _) in sorted(error.failures.items()))
    return cause_text(error)


def cause_text(cause: BaseException) -> str:
    """``"<type>: <message>"`` of one error; torch's archive writer's ``unexpected pos``
    (a write that stopped short) with what it most likely means."""
    text = f"{type(cause).__name__}: {cause}"
    if "unexpected pos" in str(cause):
        text += (" (torch's archive writer wrote fewer bytes than it was given: most likely the disk "
                 "or a quota is full, ENOSPC)")
    return text
