"""Checkpoints of (sharded) int8 models: bit-exact, reshardable, atomic, verified, resumable.

Layout of a checkpoint root (see docs/checkpoints.md)::

    root/
      latest                  name of the newest complete checkpoint (replaced atomically)
      step_00000100/          one complete checkpoint
        manifest.json         written last: step, world size, format, int8 keys, file sizes + sha256
        .metadata             torch.distributed.checkpoint's index
        __0_0.distcp ...      each rank's shards (int8 data + scales, optimizer states)
        rng/rank_00000.pt     each rank's stochastic-rounding and torch generator states
      .tmp-step_00000200-*/   a save in progress (or killed): never read, removed by the next save

A save writes everything into a temporary directory and renames it into place only when
every rank has finished and the manifest is on disk, so a process killed mid-save leaves
the previous checkpoint as ``latest``.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import uuid
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.tensor import DTensor

from fsdp_int8 import _dist
from fsdp_int8._generators import WEIGHT_ROUNDING, seed_weight_rounding
from fsdp_int8.gradients.install import installed_quantized_reduce_scatter
from fsdp_int8.weight import Int8Weight, local_shard

__all__ = [
    "CheckpointError",
    "CheckpointInfo",
    "save_checkpoint",
    "load_checkpoint",
    "latest_checkpoint",
    "export_full_state_dict",
    "load_full_state_dict",
]

FORMAT = "fsdp_int8.checkpoint/1"
MANIFEST = "manifest.json"
LATEST = "latest"
_HASH_CHUNK = 1 << 22


class CheckpointError(RuntimeError):
    """A checkpoint that is missing, incomplete, corrupted or does not fit the model."""


@dataclass
class CheckpointInfo:
    """What :func:`load_checkpoint` loaded."""

    path: Path
    step: int
    world_size: int  # of the run that saved it
    extra: dict = field(default_factory=dict)
    rng_restored: bool = False  # False when resuming at another world size
    converted: list[str] = field(default_factory=list)  # float entries rounded into int8


# ---------------------------------------------------------------- process-group helpers
def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def _rank() -> int:
    return dist.get_rank() if _distributed() else 0


def _world() -> int:
    return dist.get_world_size() if _distributed() else 1


def _barrier() -> None:
    if _distributed():
        dist.barrier()


def _from_rank0(value: Any) -> Any:
    if not _distributed():
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _gather_to_rank0(value: Any) -> list[Any]:
    if not _distributed():
        return [value]
    out = [None] * _world() if _rank() == 0 else None
    dist.gather_object(value, out, dst=0)
    return out or []


@contextlib.contextmanager
def _single_process_is_intended() -> Iterator[None]:
    """dcp warns that it assumes one process without a process group: so do we."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


# ---------------------------------------------------------------- files
def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_HASH_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_atomically(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def _rng_file(path: Path, rank: int) -> Path:
    return path / "rng" / f"rank_{rank:05d}.pt"


def _files_of_rank(path: Path, rank: int) -> list[Path]:
    mine = sorted(path.glob(f"__{rank}_*.distcp")) + [_rng_file(path, rank)]
    if rank == 0:
        mine.append(path / ".metadata")
    return [p for p in mine if p.exists()]


# ---------------------------------------------------------------- state
def _int8_keys(model_state: dict[str, Any]) -> list[str]:
    return sorted(k for k, v in model_state.items() if isinstance(local_shard(v), Int8Weight))


def _training_state(model: nn.Module, optimizer: torch.optim.Optimizer | None) -> dict[str, Any]:
    state: dict[str, Any] = {"model": get_model_state_dict(model)}
    if optimizer is not None:
        state["optimizer"] = get_optimizer_state_dict(model, optimizer)
    return state


def _rng_state(model: nn.Module) -> dict[str, Any]:
    state: dict[str, Any] = {"rounding": WEIGHT_ROUNDING.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    gradients = installed_quantized_reduce_scatter(model)
    if gradients is not None:
        state["gradient_rounding"] = gradients.rng_state()
    return state


def _restore_rng(state: dict[str, Any], model: nn.Module) -> None:
    WEIGHT_ROUNDING.set_state(state["rounding"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    gradients = installed_quantized_reduce_scatter(model)
    if gradients is not None and "gradient_rounding" in state:
        gradients.set_rng_state(state["gradient_rounding"])


# ---------------------------------------------------------------- save
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
    root = Path(directory)
    name = f"step_{step:08d}"
    tmp = root / f".tmp-{name}-{_from_rank0(uuid.uuid4().hex)}"
    rank, world = _rank(), _world()
    if rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        for stale in root.glob(".tmp-*"):  # left by a killed save: never complete
            shutil.rmtree(stale, ignore_errors=True)
        (tmp / "rng").mkdir(parents=True)
    _barrier()

    state = _training_state(model, optimizer)
    with _single_process_is_intended():
        dcp.save(state, checkpoint_id=tmp, no_dist=not _distributed())
    rng_path = _rng_file(tmp, rank)
    torch.save(_rng_state(model), rng_path)
    with open(rng_path, "rb+") as f:
        os.fsync(f.fileno())
    _barrier()  # every rank's files are written
    files = {
        str(p.relative_to(tmp)): {"bytes": p.stat().st_size, "sha256": _sha256(p)}
        for p in _files_of_rank(tmp, rank)
    }
    gathered = _gather_to_rank0(files)
    final = root / name
    if rank == 0:
        manifest = {
            "format": FORMAT,
            "step": step,
            "world_size": world,
            "int8_keys": _int8_keys(state["model"]),
            "has_optimizer": optimizer is not None,
            "extra": extra or {},
            "versions": {"torch": torch.__version__, "fsdp_int8": _package_version()},
            "files": {k: v for per_rank in gathered for k, v in per_rank.items()},
        }
        _write_atomically(tmp / MANIFEST, json.dumps(manifest, indent=1, sort_keys=True))
        _fsync_dir(tmp)
        if final.exists():  # re-saving a step: move the old one aside first
            old = root / f".tmp-old-{name}-{uuid.uuid4().hex}"
            os.rename(final, old)
            os.rename(tmp, final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(tmp, final)
        _write_atomically(root / LATEST, name + "\n")
        if keep is not None:
            for stale in _complete_checkpoints(root)[:-keep] if keep > 0 else []:
                shutil.rmtree(stale, ignore_errors=True)
    _barrier()
    return final


def _package_version() -> str:
    from fsdp_int8 import __version__

    return __version__


# ---------------------------------------------------------------- find
def _complete_checkpoints(root: Path) -> list[Path]:
    """Complete checkpoints under ``root``, oldest first."""
    found = [p for p in root.glob("step_*") if (p / MANIFEST).is_file()]
    return sorted(found, key=lambda p: p.name)


def latest_checkpoint(directory: str | os.PathLike) -> Path | None:
    """The newest complete checkpoint under ``directory``, or ``None`` if there is none."""
    root = Path(directory)
    pointer = root / LATEST
    if pointer.is_file():
        named = root / pointer.read_text().strip()
        if (named / MANIFEST).is_file():
            return named
    complete = _complete_checkpoints(root) if root.is_dir() else []
    return complete[-1] if complete else None


def _looks_like_checkpoint(path: Path) -> bool:
    return (path / MANIFEST).is_file() or (path / ".metadata").is_file() or any(path.glob("__*.distcp"))


def _resolve(directory: str | os.PathLike, step: int | None) -> Path:
    root = Path(directory)
    if step is not None:
        path = root / f"step_{step:08d}"
    elif _looks_like_checkpoint(root):
        path = root  # a checkpoint directory itself
    else:
        path = latest_checkpoint(root)
        if path is None:
            raise CheckpointError(f"no complete checkpoint under {root}")
    if not path.is_dir():
        raise CheckpointError(f"checkpoint {path} does not exist")
    return path


# ---------------------------------------------------------------- load
def _read_manifest(path: Path) -> dict | None:
    manifest_path = path / MANIFEST
    if not manifest_path.is_file():
        if (path / ".metadata").is_file():
            return None  # written by plain torch.distributed.checkpoint: load, unverified
        raise CheckpointError(
            f"{path} is not a complete checkpoint (no {MANIFEST}: the save was interrupted?)"
        )
    try:
        manifest = json.loads(manifest_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise CheckpointError(f"{manifest_path} is corrupted: {error}") from error
    if manifest.get("format") != FORMAT:
        raise CheckpointError(f"{path}: unknown checkpoint format {manifest.get('format')!r}")
    return manifest


def _verify(path: Path, manifest: dict) -> None:
    """Each rank checks a share of the files (size, then sha256); any failure fails all."""
    problems = []
    for index, (name, expected) in enumerate(sorted(manifest["files"].items())):
        if index % _world() != _rank():
            continue
        file = path / name
        if not file.is_file():
            problems.append(f"{name}: missing")
        elif file.stat().st_size != expected["bytes"]:
            problems.append(f"{name}: {file.stat().st_size} bytes, expected {expected['bytes']} (truncated?)")
        elif _sha256(file) != expected["sha256"]:
            problems.append(f"{name}: checksum mismatch (corrupted)")
    everyone = [p for per_rank in _all_gather_objects(problems) for p in per_rank]
    if everyone:
        raise CheckpointError(f"checkpoint {path} is damaged: " + "; ".join(everyone))


def _all_gather_objects(value: Any) -> list[Any]:
    if not _distributed():
        return [value]
    out = [None] * _world()
    dist.all_gather_object(out, value)
    return out


def _model_prefix(path: Path) -> str:
    """``"model."`` for our layout; ``""`` for ``dcp.save(get_model_state_dict(model))``."""
    stored = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    return "model." if any(k.startswith("model.") for k in stored) else ""


def _check_fits(path: Path, model_state: dict[str, Any], prefix: str) -> None:
    """Every model entry exists in the checkpoint with the same global shape."""
    stored = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
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
    manifest = _read_manifest(path)
    if manifest is not None and verify:
        _verify(path, manifest)
    state = _training_state(model, optimizer)
    prefix = _model_prefix(path)
    _check_fits(path, state["model"], prefix)
    if optimizer is not None and (
        not prefix or (manifest is not None and not manifest["has_optimizer"])
    ):
        raise CheckpointError(f"checkpoint {path} holds no optimizer state")
    stored_int8 = set(manifest["int8_keys"]) if manifest is not None else set()
    converted = [k for k in _int8_keys(state["model"]) if k not in stored_int8]
    if converted:
        warnings.warn(
            f"{len(converted)} float checkpoint entries are rounded to nearest into int8 "
            f"weights ({', '.join(converted[:3])}{', ...' if len(converted) > 3 else ''})",
            stacklevel=2,
        )
    try:
        with _single_process_is_intended():
            dcp.load(state if prefix else state["model"], checkpoint_id=path, no_dist=not _distributed())
    except Exception as error:  # name the checkpoint: dcp's own messages often do not
        raise CheckpointError(f"loading {path} failed: {error}") from error
    set_model_state_dict(model, state["model"])
    if optimizer is not None:
        set_optimizer_state_dict(model, optimizer, state["optimizer"])

    saved_world = manifest["world_size"] if manifest is not None else -1
    step_loaded = manifest["step"] if manifest is not None else 0
    rng_path = _rng_file(path, _rank())
    rng_restored = saved_world == _world() and rng_path.is_file()
    if rng_restored:
        _restore_rng(torch.load(rng_path, weights_only=True), model)
    else:  # another world size: rows move between ranks, no stream can be continued
        seed_weight_rounding(step_loaded, _dist.mesh_of(model))
    return CheckpointInfo(
        path=path, step=step_loaded, world_size=saved_world,
        extra=manifest["extra"] if manifest is not None else {},
        rng_restored=rng_restored, converted=converted,
    )


# ---------------------------------------------------------------- full-precision export / import
def export_full_state_dict(
    model: nn.Module, dtype: torch.dtype = torch.bfloat16
) -> dict[str, torch.Tensor]:
    """A plain, full, dequantized state dict on rank 0 (``{}`` on other ranks), on CPU.

    Its keys and shapes are those of the unquantized model, so it loads into it with
    ``load_state_dict`` (or a Hugging Face model's ``save_pretrained``). Call on every rank.

    Args:
        model: A quantized model, sharded or not.
        dtype: Floating dtype of every floating entry.
    """
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    full = get_model_state_dict(model, options=options)
    plain = {}
    for key, value in full.items():
        if isinstance(value, Int8Weight):
            value = value.dequantize(dtype)
        elif isinstance(value, torch.Tensor) and value.is_floating_point():
            value = value.to(dtype)
        plain[key] = value
    return plain if _rank() == 0 or not _distributed() else {}


def load_full_state_dict(model: nn.Module, state_dict: dict[str, torch.Tensor]) -> None:
    """Load a plain full state dict (any float dtype) into a quantized model.

    Int8 weights round the values to nearest (never stochastically). Under FSDP2, rank 0
    passes the state dict and the other ranks pass ``{}``: rank 0 broadcasts it.
    """
    distributed = _distributed() and any(isinstance(p, DTensor) for p in model.parameters())
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=distributed)
    set_model_state_dict(model, state_dict, options=options)
