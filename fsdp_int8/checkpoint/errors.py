"""The one exception that saving and loading checkpoints raise for what they cannot do."""

from __future__ import annotations

from typing import Iterable

__all__ = ["CheckpointError"]


class CheckpointError(RuntimeError):
    """A checkpoint that is missing, incomplete, corrupted or does not fit the model and
    optimizer; or a state that must not be saved (non-finite values)."""


def listing(items: Iterable[str], limit: int = 8) -> str:
    """``items`` joined by ``"; "``, the first ``limit`` only (then "and N more")."""
    items = list(items)
    shown = "; ".join(items[:limit])
    return shown + (f"; and {len(items) - limit} more" if len(items) > limit else "")
