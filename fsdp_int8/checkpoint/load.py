"""``load_checkpoint`` and ``latest_checkpoint``: find a checkpoint, check that it is whole
and fits, read it into copies (everything that can fail: the manifest, checksums, the fit,
every shard and generator state, the int8 values, the optimizer's own checks), and only
then load it (resharding) and restore or reseed the generators."""

from __future__ import annotations

import contextlib
import os
import warnings
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import torch
import torch.nn as nn
from torch.distributed.checkpoint import CheckpointException
from torch.distributed.checkpoint._nested_dict import unflatten_state_dict
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions, get_optimizer_state_dict, set_optimizer_state_dict,
)

from fsdp_int8 import _dist
from fsdp_int8._quant.generators import seed_weight_rounding
from fsdp_int8._weight.load_checks import trusted
from fsdp_int8.checkpoint import _dcp, _files, _fit
from fsdp_int8.checkpoint._generator_states import (
    capture_generators, data_parallel_mesh, layout_name, read_generators, restore_generators,
    restored_everywhere,
)
from fsdp_int8.checkpoint._optimizers import innermost_optimizer
from fsdp_int8.checkpoint.errors import CheckpointError, listing

__all__ = ["CheckpointInfo", "latest_checkpoint", "load_checkpoint"]


@dataclass
class CheckpointInfo:
    """What :func:`load_checkpoint` loaded.

    Attributes:
        path: The checkpoint's directory.
        step: Its step; ``None`` for a folder without a manifest (``allow_unverified``).
        world_size: The saving run's world size; ``None`` likewise.
        extra: The ``extra`` given to :func:`save_checkpoint`.
        rng_restored: Whether the generators were restored (False at another layout).
        converted: Float entries rounded to nearest into int8 weights.
        missing_keys: ``strict=False``: our entries the checkpoint lacks, left as they were.
        unexpected_keys: ``strict=False``: the checkpoint's entries nothing took.
    """

    path: Path
    step: int | None
    world_size: int | None
    extra: dict = field(default_factory=dict)
    rng_restored: bool = False
    converted: list[str] = field(default_factory=list)
    missing_keys: list[str] = field(default_factory=list)
    unexpected_keys: list[str] = field(default_factory=list)


def latest_checkpoint(directory: str | os.PathLike) -> Path | None:
    """The newest complete checkpoint under ``directory``, or ``None`` if there is none.

    The one ``latest`` names (or, if a re-save of its step was interrupted between its
    renames, the complete old copy set aside, ``.old-step_<step>-<id>/``, which the next
    save puts back); without a valid pointer, the most recently written ``step_*`` with a
    manifest.

    Args:
        directory: The checkpoint root :func:`save_checkpoint` writes into.
    """
    root = Path(directory)
    name = _files.latest_name(root)
    if name and _files.is_complete(found := _files.complete_copy(root / name)):
        return found  # its folder, or its old copy while a re-save of its step publishes
    complete = _files.complete_checkpoints(root) if root.is_dir() else []
    return complete[-1] if complete else None


def _resolve(directory: str | os.PathLike, step: int | None) -> Path:
    root = Path(directory)
    if step is not None:
        path = _files.complete_copy(_files.step_dir(root, step))
    elif _files.looks_like_checkpoint(root):
        path = root  # a checkpoint directory itself
    else:
        path = latest_checkpoint(root)
        if path is None:
            raise CheckpointError(f"no complete checkpoint under {root}")
    if not path.is_dir():
        raise CheckpointError(f"checkpoint {path} does not exist")
    return path


def _manifest(path: Path, allow_unverified: bool) -> dict | None:
    """The manifest; ``None`` for a folder without one, only if ``allow_unverified``."""
    manifest = _files.read_manifest(path)
    if manifest is None and not allow_unverified:
        raise CheckpointError(
            f"{path} has no {_files.MANIFEST}: it is a plain torch.distributed.checkpoint "
            "folder, not one written by save_checkpoint, so its files cannot be verified and "
            "its step and world size are unknown. Pass allow_unverified=True to load it anyway"
        )
    return manifest


@contextlib.contextmanager
def _as_checkpoint_error(path: Path, doing: str) -> Iterator[None]:
    """Any failure as a :class:`CheckpointError` naming ``path`` (dcp's ``CheckpointException``
    is a ``BaseException`` that buries the cause)."""
    try:
        yield
    except CheckpointError:
        raise
    except (Exception, CheckpointException) as error:
        raise CheckpointError(f"{doing} {path} failed: {_dcp.failure_text(error)}") from error


def _refuse(path: Path, fit: _fit.Fit, strict: bool, what: str) -> None:
    """Raise unless the checkpoint fits ``what`` (``strict``: both ways; else: shapes only)."""
    problems = list(fit.mismatched)
    if strict:
        problems += fit.notes
        problems += [f"{key}: not in the checkpoint" for key in fit.missing]
        problems += [
            f"{key}: in the checkpoint, not in the {'optimizer' if key.startswith(_fit.STATE) else 'model'}"
            for key in fit.unexpected
        ]
    if problems:
        hint = " (strict=False loads the entries both have)" if strict and (fit.missing or fit.unexpected) else ""
        raise CheckpointError(f"checkpoint {path} does not fit {what}: {listing(problems)}{hint}")


def _optimizer_copy(model: nn.Module, optimizer: torch.optim.Optimizer, model_copy: dict) -> dict:
    """A copy of the optimizer's state dict, to read into. For a fresh optimizer torch
    makes the state with a step at lr=0 (which may requantize and draw noise): undone."""
    if optimizer.state:
        return _dcp.copy_tensors(get_optimizer_state_dict(model, optimizer))
    generators = capture_generators(model)
    try:
        return _dcp.copy_tensors(get_optimizer_state_dict(model, optimizer))
    finally:
        optimizer.state.clear()
        with trusted():  # the model's own values
            _dcp.set_model_state(model, model_copy)
        restore_generators(generators, model)


def _merged_groups(ours: list[dict], theirs: list[dict], strict: bool, path: Path) -> list[dict]:
    """Our parameter groups with the checkpoint's hyperparameters (ours fill what it lacks)."""
    if len(ours) != len(theirs):
        raise CheckpointError(
            f"checkpoint {path} does not fit this optimizer: it has {len(theirs)} parameter "
            f"groups, this optimizer {len(ours)}"
        )
    merged = []
    for index, (group, saved) in enumerate(zip(ours, theirs)):
        if strict and set(saved.get("params", ())) != set(group["params"]):
            raise CheckpointError(
                f"checkpoint {path} does not fit this optimizer: its parameter group {index} "
                "holds other parameters (in one of the two only: "
                f"{listing(sorted(set(saved.get('params', ())) ^ set(group['params'])))})"
            )
        merged.append({**group, **{k: v for k, v in saved.items() if k != "params"}})
    return merged


def _check_groups(optimizer: torch.optim.Optimizer, groups: list[dict], path: Path) -> None:
    """Let the optimizer's own ``load_state_dict`` judge ``groups``, on a stand-in."""
    stand_in = object.__new__(type(optimizer))
    stand_in.__setstate__({
        "defaults": dict(optimizer.defaults),
        "state": defaultdict(dict),
        "param_groups": [dict(group) for group in optimizer.param_groups],
    })
    first, indexed = 0, []
    for group, ours in zip(groups, optimizer.param_groups):
        indexed.append({**group, "params": list(range(first, first + len(ours["params"])))})
        first += len(ours["params"])
    try:
        stand_in.load_state_dict({"state": {}, "param_groups": indexed})
    except (ValueError, TypeError, KeyError) as error:
        raise CheckpointError(
            f"checkpoint {path} does not fit this optimizer ({type(optimizer).__name__}): {error}"
        ) from error


def _saved_layout(manifest: dict | None) -> str | None:
    """The layout the manifest records for the generator states (which record none)."""
    if manifest is None:
        return None
    return layout_name(
        {"world_size": manifest["world_size"], "mesh_shape": manifest.get("mesh_shape"),
         "tensor_parallel": manifest.get("tensor_parallel", 1)}
    )


def _read(path: Path, state: dict, verified: bool) -> dict | None:
    """Read ``state``'s entries and this rank's generator states; every rank raises the
    same error if any rank fails (a rank's file can be damaged alone)."""
    problem, generators = None, None
    try:
        with _as_checkpoint_error(path, "reading"):
            _dcp.load(state, path)
            generators = read_generators(_files.rng_file(path, _dist.rank()))
    except CheckpointError as error:
        problem = str(error)
    problems = sorted({p for p in _dist.all_gather(problem) if p})
    if problems:
        hint = "" if verified else " (verify=True checks each file's size and checksum first)"
        raise CheckpointError("; ".join(problems) + hint)
    return generators


def _copies_and_fit(
    stored: dict[str, Any], model: nn.Module, optimizer: torch.optim.Optimizer | None, has_manifest: bool
) -> tuple[dict[str, Any], str, _fit.Fit, set[str]]:
    """Copies of the model's (and optimizer's) state dicts to read into, the model-key
    prefix, the fit, and the model keys read. Changes nothing."""
    model_copy = _dcp.copy_tensors(_dcp.model_state_dict(model))
    prefix = _fit.model_prefix(stored, list(model_copy), has_manifest)
    fit = _fit.model_fit(stored, model_copy, prefix)
    loaded = {key[len(prefix):] for key in fit.read}  # the model's entries only, so far
    copies: dict[str, Any] = {"model": model_copy}
    if optimizer is not None:
        copies["optimizer"] = _optimizer_copy(model, optimizer, model_copy)
        ours, _ = _dcp.flatten({"optimizer": copies["optimizer"]})
        fit.add(_fit.optimizer_fit(stored, ours, loaded))
    return copies, prefix, fit, loaded


def _to_read(copies: dict[str, Any], prefix: str, fit: _fit.Fit, stored: dict[str, Any]) -> dict[str, Any]:
    """The nested state dict dcp reads into: the copies' entries ``fit`` selected and the
    checkpoint's optimizer hyperparameters."""
    flat, paths = _dcp.flatten(copies if prefix else copies["model"])
    to_read = {key: flat[key] for key in fit.read}
    if "optimizer" in copies:
        for index, names in _fit.stored_groups(stored).items():
            for name in names:
                key = f"{_fit.GROUPS}{index}.{name}"
                to_read[key], paths[key] = None, ("optimizer", "param_groups", index, name)
    return unflatten_state_dict(to_read, {key: paths[key] for key in to_read})


def _optimizer_state(
    optimizer: torch.optim.Optimizer, ours: dict, read: dict, loaded: set[str], fresh: bool, strict: bool, path: Path
) -> dict:
    """The state dict to load into the optimizer: the states read (and, unless it was
    fresh, its own for parameters not read), with the checkpoint's hyperparameters."""
    theirs = read.get("optimizer", {}).get("param_groups", [])
    groups = _merged_groups(ours["param_groups"], theirs, strict, path)
    _check_groups(optimizer, groups, path)
    state = ours["state"]
    if fresh:  # parameters not read keep no state, as before the load
        state = {fqn: per_param for fqn, per_param in state.items() if fqn in loaded}
    return {"state": state, "param_groups": groups}


def _converted(model_copy: dict, loaded: set[str], manifest: dict | None, path: Path) -> list[str]:
    """The int8 weights read from entries not saved as int8 (without a manifest: all), warned about."""
    stored_int8 = set(manifest["int8_keys"]) if manifest is not None else set()
    converted = [k for k in _dcp.int8_keys(model_copy) if k in loaded and k not in stored_int8]
    keys = ", ".join(converted[:3]) + (", ..." if len(converted) > 3 else "")
    if manifest is None:
        warnings.warn(
            f"{path} is loaded without verification (no manifest: no sizes or checksums, its "
            f"step and world size unknown), and it does not say which entries are int8: float "
            f"entries among {len(converted)} int8 weights ({keys}) are rounded to nearest into int8",
            stacklevel=3,
        )
    elif converted:
        warnings.warn(
            f"{len(converted)} float checkpoint entries are rounded to nearest into int8 weights ({keys})",
            stacklevel=3,
        )
    return converted


def _commit(
    model: nn.Module, optimizer: torch.optim.Optimizer | None, model_copy: dict,
    optimizer_state: dict | None, generators: dict | None, saved_layout: str | None, step: int | None,
    strict: bool,
) -> bool:
    """Load what was read into place (nothing here is expected to fail); whether the saved
    generator streams continue."""
    with trusted():  # the int8 entries were checked when read: the load_state_dict hooks skip them
        if optimizer is not None:  # first: priming a fresh optimizer may touch the weights
            set_optimizer_state_dict(model, optimizer, optimizer_state, options=StateDictOptions(strict=strict))
        _dcp.set_model_state(model, model_copy)
    if generators is not None and restore_generators(generators, model, saved_layout=saved_layout):
        return True
    # another layout: rows moved between ranks, no stream can continue
    seed_weight_rounding(step or 0, data_parallel_mesh(model)[0])
    return False


def load_checkpoint(
    directory: str | os.PathLike,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    step: int | None = None,
    verify: bool = True,
    strict: bool = True,
    allow_unverified: bool = False,
) -> CheckpointInfo:
    """Load a checkpoint saved by :func:`save_checkpoint`, at this or another world size.

    Call on every rank, with the model sharded (or not) as it will train. Int8 weights and
    optimizer states load bit-exactly, across tensor-parallel layouts too. In the layout
    that saved it (world size, mesh shape, tp size) the generators are restored (exact
    resume); otherwise reseeded from the step and shard coordinate (docs/checkpoints.md).

    Everything is checked and read into copies first (the local state is held twice
    meanwhile): a load that fails on any rank raises the same :class:`CheckpointError` on
    every rank and leaves model, optimizer and generators exactly as they were. A float
    entry loaded into an int8 weight (a checkpoint of the unquantized model, or of plain
    ``torch.distributed.checkpoint``) is rounded to nearest, warned about, and listed in
    ``CheckpointInfo.converted``.

    Args:
        directory: A checkpoint root (loads ``latest``) or one checkpoint's directory.
        model: The model to load into.
        optimizer: Its optimizer, to restore its state too (it may be fresh); or a
            forwarding wrapper, as for :func:`save_checkpoint`: the optimizer inside.
        step: Load ``step_<step>`` instead of the latest.
        verify: Check every file's size and sha256 against the manifest first.
        strict: The checkpoint and the model (and optimizer) must hold the same entries.
            ``False`` loads the entries both hold (shapes must match) and lists the others
            in ``CheckpointInfo.missing_keys`` and ``unexpected_keys``.
        allow_unverified: Load a folder without a manifest (plain dcp): nothing to verify,
            ``CheckpointInfo.step`` and ``world_size`` are ``None``.

    Returns:
        A :class:`CheckpointInfo`.

    Raises:
        CheckpointError: missing, incomplete (a rank's files not in the manifest or not on
            disk), truncated or corrupted checkpoints, folders without a manifest (unless
            ``allow_unverified``), checkpoints whose entries or shapes do not fit the model
            or optimizer or (``strict``) whose model split its tensors into other heads or
            top-k, int8 weights with NaN, infinite or negative scales or values of -128,
            and any failure while reading (dcp's ``CheckpointException`` with each rank's
            cause).
        TypeError: ``optimizer`` is no optimizer and forwards to none, or is a wrapper with
            a state of its own (before anything changes).

    Example::

        start = 0
        if fsdp_int8.checkpoint.latest_checkpoint("ckpt") is not None:
            start = fsdp_int8.load_checkpoint("ckpt", model, optimizer).step + 1
    """
    optimizer = innermost_optimizer(optimizer) if optimizer is not None else None
    path = _resolve(directory, step)
    manifest = _manifest(path, allow_unverified)
    if manifest is not None and verify:
        _files.verify(path, manifest)
    with _as_checkpoint_error(path, "reading the index of"):
        stored, indexed_files = _dcp.stored_entries_and_files(path)
    if manifest is not None:
        _files.check_complete(path, manifest, indexed_files)
        _fit.refuse_other_splits(path, manifest.get("shape_attributes", {}), model, strict)
    if optimizer is not None and not any(key.startswith("optimizer.") for key in stored):
        raise CheckpointError(f"checkpoint {path} holds no optimizer state")
    fresh = optimizer is not None and not optimizer.state
    with _as_checkpoint_error(path, "preparing to read"):
        copies, prefix, fit, loaded = _copies_and_fit(stored, model, optimizer, manifest is not None)
    _refuse(path, fit, strict, "this model" if optimizer is None else "this model and optimizer")
    read = _to_read(copies, prefix, fit, stored)
    generators = _read(path, read, verified=manifest is not None and verify)
    generators = restored_everywhere(generators, model, _saved_layout(manifest), path)  # on all ranks or none
    refused = _dcp.refused_int8_entries(copies["model"], loaded, path)  # scales, -127..127
    if refused:
        raise CheckpointError(f"checkpoint {path} holds invalid int8 weights: {listing(refused)}")
    optimizer_state = None
    if optimizer is not None:
        optimizer_state = _optimizer_state(optimizer, copies["optimizer"], read, loaded, fresh, strict, path)

    # Everything is read and checked: from here on, only loading into place.
    converted = _converted(copies["model"], loaded, manifest, path)
    step_loaded = manifest["step"] if manifest is not None else None
    rng_restored = _commit(
        model, optimizer, copies["model"], optimizer_state, generators, _saved_layout(manifest), step_loaded, strict
    )
    return CheckpointInfo(
        path=path,
        step=step_loaded,
        world_size=manifest["world_size"] if manifest is not None else None,
        extra=manifest["extra"] if manifest is not None else {},
        rng_restored=rng_restored,
        converted=converted,
        missing_keys=fit.missing,
        unexpected_keys=fit.unexpected,
    )
