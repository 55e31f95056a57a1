"""A checkpoint's files: where each goes, atomic and durable writes, and the manifest that
lists every file with its size and sha256 (the layout is in the package docstring)."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import uuid
from pathlib import Path

from fsdp_int8 import _dist
from fsdp_int8.checkpoint.errors import CheckpointError

FORMAT = "fsdp_int8.checkpoint/1"
MANIFEST = "manifest.json"
LATEST = "latest"
_ASIDE = ".old-"  # the old copy of a step being re-saved, until the new one is in place
_HASH_CHUNK = 1 << 22


# ---------------------------------------------------------------- durable writes
def sha256(path: Path) -> str:
    """The hex sha256 of a file's bytes, read in chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_HASH_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def write_durably(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` and flush it to disk: a full disk raises ``OSError``
    (ENOSPC) here, at the write or at the flush."""
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def fsync_dir(path: Path) -> None:
    """Flush a directory's entries (creations, renames) to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomically(path: Path, text: str) -> None:
    """Replace ``path`` with ``text``: readers see the old file or the new one, never half."""
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")
    try:
        write_durably(tmp, text.encode())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)  # no half-written or unplaced file left beside the real one
        raise
    fsync_dir(path.parent)


# ---------------------------------------------------------------- names
def step_dir(root: Path, step: int) -> Path:
    """Where the checkpoint of ``step`` lives under ``root``."""
    return root / f"step_{step:08d}"


def rng_file(path: Path, rank: int) -> Path:
    """The file holding ``rank``'s generator states in checkpoint ``path``."""
    return path / "rng" / f"rank_{rank:05d}.pt"


def _files_of_rank(path: Path, rank: int) -> list[Path]:
    mine = sorted(path.glob(f"__{rank}_*.distcp")) + [rng_file(path, rank)]
    if rank == 0:
        mine.append(path / ".metadata")
    return [p for p in mine if p.exists()]


def check_every_rank_wrote(files_by_rank: list[dict[str, dict]], world_size: int, final: Path) -> None:
    """Refuse to publish ``final`` unless each of the ``world_size`` ranks read back its
    generator file (and rank 0 the dcp index): the manifest must not list a part of a save.

    Raises:
        CheckpointError: naming the ranks and files that are missing.
    """
    missing = _missing_rank_files(set().union(*files_by_rank) if files_by_rank else set(), world_size)
    if len(files_by_rank) != world_size or missing:
        raise CheckpointError(
            f"{len(files_by_rank)} of {world_size} ranks took part in the save; missing: "
            + ", ".join(missing or [f"the files of ranks {len(files_by_rank)}..{world_size - 1}"])
        )


def _missing_rank_files(names: set[str], world_size: int) -> list[str]:
    """The files every checkpoint of ``world_size`` ranks holds that ``names`` lacks."""
    needed = [".metadata"] + [str(rng_file(Path(), rank)) for rank in range(world_size)]
    return [name for name in needed if name not in names]


def check_complete(path: Path, manifest: dict, indexed: set[str]) -> None:
    """Refuse checkpoint ``path`` unless its manifest names a generator file for every
    rank of the run that saved it and every data file its dcp index refers to
    (``indexed``), and each of those is there (sizes and checksums are :func:`verify`'s).

    Raises:
        CheckpointError: naming each missing file (and its rank).
    """
    listed = set(manifest["files"])
    problems = [f"{name}: not in the manifest" for name in _missing_rank_files(listed, manifest["world_size"])]
    problems += [f"{name}: in the dcp index, not in the manifest" for name in sorted(indexed - listed)]
    problems += [f"{name}: missing" for name in sorted(listed | indexed) if not (path / name).is_file()]
    if problems:
        raise CheckpointError(
            f"checkpoint {path} is incomplete (saved by {manifest['world_size']} "
            f"rank{'s' if manifest['world_size'] != 1 else ''}): "
            + "; ".join(problems) + ". It cannot be loaded; load an earlier checkpoint"
        )


def describe_files(path: Path, rank: int) -> dict[str, dict]:
    """Size and sha256 of each file ``rank`` wrote into ``path``, keyed by relative name."""
    return {
        str(p.relative_to(path)): {"bytes": p.stat().st_size, "sha256": sha256(p)}
        for p in _files_of_rank(path, rank)
    }


def is_complete(path: Path) -> bool:
    """Whether ``path`` holds a manifest: the last thing a save writes."""
    return (path / MANIFEST).is_file()


def sequence(path: Path) -> int:
    """When checkpoint ``path`` was written, as the save counter its manifest records
    (0 for checkpoints written before the counter existed, or with an unreadable manifest)."""
    try:
        return int(json.loads((path / MANIFEST).read_text()).get("sequence", 0))
    except (OSError, ValueError, TypeError, AttributeError):
        return 0


def complete_checkpoints(root: Path) -> list[Path]:
    """Complete checkpoints under ``root`` in the order they were written, oldest first.

    Write order, not step order: a new run (or one rolled back to an earlier step) writes
    lower steps after higher ones, and its checkpoints are still the newest.
    """
    found = [p for p in root.glob("step_*") if is_complete(p)]
    return sorted(found, key=lambda p: (sequence(p), p.name))


def latest_name(root: Path) -> str | None:
    """The checkpoint name that ``root``'s ``latest`` pointer holds, if there is one."""
    pointer = root / LATEST
    return pointer.read_text().strip() if pointer.is_file() else None


def looks_like_checkpoint(path: Path) -> bool:
    """Whether ``path`` is one checkpoint's directory (ours, or plain dcp's) rather than a root."""
    return is_complete(path) or (path / ".metadata").is_file() or any(path.glob("__*.distcp"))


# ---------------------------------------------------------------- saving
def remove_checkpoint(path: Path) -> None:
    """Delete checkpoint ``path``, its manifest first: one interrupted here no longer looks
    complete."""
    (path / MANIFEST).unlink(missing_ok=True)
    shutil.rmtree(path, ignore_errors=True)


def temporary_dir(final: Path, token: str) -> Path:
    """The directory a save of ``final`` writes into (``token`` must be the same on every rank)."""
    return final.parent / f".tmp-{final.name}-{token}"


def create_temporary_dir(tmp: Path) -> None:
    """Create ``tmp`` and its root (on one rank), first repairing what an interrupted
    publish left (:func:`recover`) and removing what killed saves left."""
    root = tmp.parent
    root.mkdir(parents=True, exist_ok=True)
    recover(root)
    for stale in root.glob(".tmp-*"):  # a save that never published: never named by latest
        remove_checkpoint(stale)
    for stale in root.glob(f".{LATEST}.*.tmp"):  # a pointer a crash left unwritten
        stale.unlink(missing_ok=True)
    rng_file(tmp, 0).parent.mkdir(parents=True)


def write_manifest(path: Path, manifest: dict) -> None:
    """Write the manifest of checkpoint ``path``: after it, the checkpoint is complete."""
    write_atomically(path / MANIFEST, json.dumps(manifest, indent=1, sort_keys=True))


def _aside_dirs(root: Path, name: str = "step_*") -> list[Path]:
    """The folders a re-save of checkpoint ``name`` set its previous copy aside in."""
    return sorted(root.glob(f"{_ASIDE}{name}-*"))


def publish(tmp: Path, final: Path) -> None:
    """Rename the finished ``tmp`` to ``final`` and point ``latest`` at it.

    Re-saving a step that exists moves the old copy aside first (a folder cannot be
    renamed over a full one) and removes it only after the new one is in place and
    ``latest`` is written. A crash between the renames leaves ``final`` missing and its
    complete old copy aside: :func:`complete_copy` finds it there (so ``latest`` still
    resolves to a complete checkpoint) and the next save's :func:`recover` puts it back.
    """
    fsync_dir(tmp)
    root = final.parent
    old = root / f"{_ASIDE}{final.name}-{uuid.uuid4().hex}" if final.exists() else None
    if old is not None:
        os.rename(final, old)
    os.rename(tmp, final)
    try:
        write_atomically(root / LATEST, final.name + "\n")  # also flushes the renames to disk
    except BaseException:
        # Unpublish: ``final`` back to ``tmp`` (the caller removes it) and the old copy back in
        # place, so that no new checkpoint is found by latest_checkpoint's fallback either.
        os.rename(final, tmp)
        if old is not None:
            os.rename(old, final)
        fsync_dir(root)
        raise
    if old is not None:
        remove_checkpoint(old)


def complete_copy(path: Path) -> Path:
    """Where checkpoint ``path`` is complete: ``path`` itself or, after a re-save of its
    step was interrupted between its renames, the old copy it set aside (``path`` if
    neither is: callers report it)."""
    if is_complete(path):
        return path
    aside = [p for p in _aside_dirs(path.parent, path.name) if is_complete(p)]
    return max(aside, key=sequence) if aside else path


def recover(root: Path) -> None:
    """Put back (on one rank, before a save) each complete copy an interrupted re-save set
    aside whose checkpoint is not complete in place; remove the copies a finished re-save
    replaced. No complete checkpoint that ``latest`` can resolve to is removed."""
    for old in sorted(_aside_dirs(root), key=sequence, reverse=True):  # the newest copy wins
        final = root / old.name[len(_ASIDE):].rsplit("-", 1)[0]
        if is_complete(old) and not is_complete(final):
            remove_checkpoint(final)  # what is there holds no manifest: never complete
            os.rename(old, final)
            fsync_dir(root)
        else:
            remove_checkpoint(old)


def next_sequence(root: Path) -> int:
    """The save counter of the next checkpoint under ``root``: after every existing one."""
    return 1 + max((sequence(p) for p in root.glob("step_*") if is_complete(p)), default=0)


def prune(root: Path, keep: int, newest: Path) -> None:
    """Remove the complete checkpoints under ``root`` written before the last ``keep``.

    Never removes ``newest`` (the checkpoint just written) nor the one ``latest`` names,
    whatever their steps.
    """
    protected = {newest.name, latest_name(root)}
    for stale in complete_checkpoints(root)[:-keep]:
        if stale.name not in protected:
            remove_checkpoint(stale)


# ---------------------------------------------------------------- loading
def read_manifest(path: Path) -> dict | None:
    """Checkpoint ``path``'s manifest; ``None`` for a plain dcp checkpoint (no manifest).

    Raises:
        CheckpointError: no manifest and no dcp index (an interrupted save), an unreadable
            manifest, or an unknown format.
    """
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


def verify(path: Path, manifest: dict) -> None:
    """Each rank checks a share of the files (size, then sha256); any failure fails all.

    Raises:
        CheckpointError: naming every missing, truncated or corrupted file.
    """
    problems = []
    for index, (name, expected) in enumerate(sorted(manifest["files"].items())):
        if index % _dist.world_size() != _dist.rank():
            continue
        file = path / name
        if not file.is_file():
            problems.append(f"{name}: missing")
        elif file.stat().st_size != expected["bytes"]:
            problems.append(f"{name}: {file.stat().st_size} bytes, expected {expected['bytes']} (truncated?)")
        elif sha256(file) != expected["sha256"]:
            problems.append(f"{name}: checksum mismatch (corrupted)")
    everyone = [p for per_rank in _dist.all_gather(problems) for p in per_rank]
    if everyone:
        raise CheckpointError(f"checkpoint {path} is damaged: " + "; ".join(everyone))
