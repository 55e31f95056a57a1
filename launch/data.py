"""Byte-level tokens from a directory of text files; by default the Python standard library.

Nothing is downloaded: the default corpus is the ``.py`` sources of the running Python's
standard library (``sysconfig.get_paths()["stdlib"]``, site-packages excluded), about
30 MB on CPython 3.11. Files are sorted by path and every ``VALIDATION_EVERY``-th file
goes to validation, so the split is the same on every machine with the same Python.
"""

from __future__ import annotations

import os
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import torch

VALIDATION_EVERY = 20  # 5% of the files
TEXT_SUFFIXES = (".py", ".txt", ".md", ".rst", ".c", ".h", ".json", ".toml", ".cfg", ".ini")


def stdlib_source_dir() -> Path:
    """The directory of this Python's standard library."""
    return Path(sysconfig.get_paths()["stdlib"])


def text_files(root: Path) -> list[Path]:
    """Sorted text files under ``root`` (site-packages and hidden folders skipped)."""
    if root.is_file():
        return [root]
    if not root.is_dir():
        raise FileNotFoundError(f"data path {root} does not exist")
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(
            d for d in dirnames if not d.startswith(".") and d not in ("site-packages", "dist-packages", "__pycache__")
        )
        files.extend(Path(dirpath) / f for f in filenames if f.endswith(TEXT_SUFFIXES))
    return sorted(files)


@dataclass
class Corpus:
    """Train and validation bytes as ``uint8`` tensors."""

    train: torch.Tensor
    val: torch.Tensor
    files: int
    source: str

    @property
    def bytes(self) -> int:
        return self.train.numel() + self.val.numel()


def load_corpus(path: str | os.PathLike | None = None, max_bytes: int | None = None) -> Corpus:
    """Read every text file under ``path`` (default: the standard library) as bytes.

    Args:
        path: A directory or a single file.
        max_bytes: Stop reading after this many bytes (a quick demo need not read all).

    Raises:
        FileNotFoundError / ValueError: a missing path, or one with no text in it.
    """
    root = Path(path) if path is not None else stdlib_source_dir()
    files = text_files(root)
    if not files:
        raise ValueError(f"no text files ({', '.join(TEXT_SUFFIXES)}) under {root}")
    train, val, total = [], [], 0
    for index, file in enumerate(files):
        data = file.read_bytes()
        (val if len(files) > 1 and index % VALIDATION_EVERY == VALIDATION_EVERY - 1 else train).append(data)
        total += len(data)
        if max_bytes is not None and total >= max_bytes:
            break
    if len(files) == 1 or not val:  # one file: its last 5% validates
        blob = b"".join(train + val)
        cut = len(blob) - max(len(blob) // VALIDATION_EVERY, 1)
        train, val = [blob[:cut]], [blob[cut:]]
    as_tensor = lambda parts: torch.frombuffer(bytearray(b"".join(parts)), dtype=torch.uint8)
    corpus = Corpus(as_tensor(train), as_tensor(val), len(files), str(root))
    if corpus.train.numel() < 2 or corpus.val.numel() < 2:
        raise ValueError(f"the text under {root} is too short to train on ({corpus.bytes} bytes)")
    return corpus


def sample_batch(
    data: torch.Tensor, batch_size: int, seq_len: int, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """Random windows of ``seq_len + 1`` bytes: inputs and next-byte targets (``int64``)."""
    if data.numel() <= seq_len + 1:
        raise ValueError(f"{data.numel()} bytes cannot hold a window of {seq_len + 1}")
    starts = torch.randint(0, data.numel() - seq_len - 1, (batch_size,), generator=generator)
    windows = torch.stack([data[s : s + seq_len + 1] for s in starts.tolist()]).long()
    return windows[:, :-1], windows[:, 1:]
