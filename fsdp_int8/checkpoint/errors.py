"""The one exception that checkpoint loading raises for a checkpoint it cannot use."""

from __future__ import annotations

__all__ = ["CheckpointError"]


class CheckpointError(RuntimeError):
    """A checkpoint that is missing, incomplete, corrupted or does not fit the model."""
