"""``load_checkpoint`` and ``latest_checkpoint``: find a checkpoint, check that it is whole
and fits the model, load it (resharding), and restore or reseed the generators."""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

from fsdp_int8 import _dist
from fsdp_int8._generators import seed_weight_rounding
from fsdp_int8.checkpoint import _dcp, _files, _generator_states
from fsdp_int8.checkpoint.errors import CheckpointError

__all__ = ["CheckpointInfo", "latest_checkpoint", "load_checkpoint"]


@dataclass
class CheckpointInfo:
    """What :func:`load_checkpoint` loaded."""

    path: Path
    step: int
    world_size: int  # of the run that saved it
    extra: dict = field(default_factory=dict)
    rng_restored: bool = False  # False when resuming at another world size
    converted: list[str] = field(default_factory=list)  # float entries rounded into int8


def latest_checkpoint(directory: str | os.PathLike) -> Path | None:
    """The newest complete checkpoint under ``directory``, or ``None`` if there is none."""
    root = Path(directory)
    pointer = root / _files.LATEST
    if pointer.is_file():
        named = root / pointer.read_text().strip()
        if _files.is_complete(named):
            return named
    complete = _files.complete_checkpoints(root) if root.is_dir() else []
    return complete[-1] if complete else None


def _resolve(directory: str | os.PathLike, step: int | None) -> Path:
    root = Path(directory)
    if step is not None:
        path = _files.step_dir(root, step)
    elif _files.looks_like_checkpoint(root):
        path = root  # a checkpoint directory itself
    else:
        path = latest_checkpoint(root)
        if path is None:
            raise CheckpointError(f"no complete checkpoint under {root}")
    if not path.is_dir():
        raise CheckpointError(f"checkpoint {path} does not exist")
    return path


def _model_prefix(stored: dict[str, Any]) -> str:
    """``"model."`` for our layout; ``""`` for ``dcp.save(get_model_state_dict(model))``."""
    return "model." if any(k.startswith("model.") for k in stored) else ""


def _check_fits(path: Path, stored: dict[str, Any], model_state: dict[str, Any], prefix: str) -> None:
    """Every model entry exists in the checkpoint with the same global shape."""
    problems = []
    for key, value in model_state.items():
        if not isinstance(value, torch.Tensor):
            continue
        meta = stored.get(f"{prefix}{key}")
        if meta is None:
            problems.append(f"{key}: not in the checkpoint")
        elif hasattr(meta, "size") and tuple(meta.size) != tuple(value.shape):
            problems.append(f"{key}: checkpoint has shape {tuple(meta.size)}, model {tuple(value.shape)}")
    if problems:
        shown = "; ".join(problems[:8]) + (f"; and {len(problems) - 8} more" if len(problems) > 8 else "")
        raise CheckpointError(f"checkpoint {path} does not fit this model: {shown}")


def load_checkpoint(
    directory: str | os.PathLike,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    step: int | None = None,
    verify: bool = True,
) -> CheckpointInfo:
    """Load a checkpoint saved by :func:`save_checkpoint`, at this or another world size.

    Call on every rank, with the model sharded (or not) as it will train. Int8 weights
    and optimizer states load bit-exactly. At the world size that saved it, the
    stochastic-rounding and torch generators are restored too, so training continues
    exactly as if never interrupted; at another world size they are reseeded from the
    step (see docs/checkpoints.md).

    A float checkpoint entry loaded into an int8 weight (a checkpoint of the unquantized
    model, or one written by plain ``torch.distributed.checkpoint``) is rounded to
    nearest, warned about, and listed in ``CheckpointInfo.converted``.

    Args:
        directory: A checkpoint root (loads ``latest``) or one checkpoint's directory.
        model: The model to load into.
        optimizer: Its optimizer, to restore its state too.
        step: Load ``step_<step>`` instead of the latest.
        verify: Check every file's size and sha256 against the manifest first.

    Raises:
        CheckpointError: missing, incomplete, truncated or corrupted checkpoints, and
            checkpoints whose entries or shapes do not fit the model.
    """
    path = _resolve(directory, step)
    manifest = _files.read_manifest(path)
    if manifest is not None and verify:
        _files.verify(path, manifest)
    state = _dcp.training_state(model, optimizer)
    stored = _dcp.stored_entries(path)
    prefix = _model_prefix(stored)
    _check_fits(path, stored, state["model"], prefix)
    if optimizer is not None and (
        not prefix or (manifest is not None and not manifest["has_optimizer"])
    ):
        raise CheckpointError(f"checkpoint {path} holds no optimizer state")
    stored_int8 = set(manifest["int8_keys"]) if manifest is not None else set()
    converted = [k for k in _dcp.int8_keys(state["model"]) if k not in stored_int8]
    if converted:
        warnings.warn(
            f"{len(converted)} float checkpoint entries are rounded to nearest into int8 "
            f"weights ({', '.join(converted[:3])}{', ...' if len(converted) > 3 else ''})",
            stacklevel=2,
        )
    try:
        _dcp.load(state if prefix else state["model"], path)
    except Exception as error:  # name the checkpoint: dcp's own messages often do not
        raise CheckpointError(f"loading {path} failed: {error}") from error
    set_model_state_dict(model, state["model"])
    if optimizer is not None:
        set_optimizer_state_dict(model, optimizer, state["optimizer"])

    saved_world = manifest["world_size"] if manifest is not None else -1
    step_loaded = manifest["step"] if manifest is not None else 0
    rng_path = _files.rng_file(path, _dist.rank())
    rng_restored = saved_world == _dist.world_size() and rng_path.is_file()
    if rng_restored:
        _generator_states.restore(torch.load(rng_path, weights_only=True), model)
    else:  # another world size: rows move between ranks, no stream can be continued
        seed_weight_rounding(step_loaded, _dist.mesh_of(model))
    return CheckpointInfo(
        path=path, step=step_loaded, world_size=saved_world,
        extra=manifest["extra"] if manifest is not None else {},
        rng_restored=rng_restored, converted=converted,
    )
