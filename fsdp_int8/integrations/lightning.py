"""Lightning: fsdp_int8's stochastic-rounding generators in Lightning's checkpoints.

Install with ``pip install "fsdp_int8[lightning]"``; this module imports Lightning, so
``import fsdp_int8`` never imports it. Verified against lightning 2.6.6.

Lightning saves a callback's ``state_dict`` in the checkpoint's metadata, which rank 0
alone writes (``meta.pt`` next to the shards with ``ModelParallelStrategy``). Each rank
rounds its own rows with its own generator, so :class:`Int8RoundingCheckpoint` gathers
every rank's generator states into that one entry, and on resume each rank takes its own
back (:func:`fsdp_int8.checkpoint.restore_generators`) when the run is in the layout they
were saved in. Without it a resumed run draws its rounding noise from the seed again
(unbiased, but not the uninterrupted run's bytes).
"""

from __future__ import annotations

import logging
from typing import Any

import lightning.pytorch as pl

from fsdp_int8 import _dist
from fsdp_int8.checkpoint import capture_generators, restore_generators

__all__ = ["Int8RoundingCheckpoint"]

logger = logging.getLogger("fsdp_int8")


class Int8RoundingCheckpoint(pl.Callback):
    """Save and restore every rank's stochastic-rounding generators with the checkpoint.

    Add it to the trainer (``L.Trainer(callbacks=[Int8RoundingCheckpoint()], ...)``) of a
    model made int8 by ``shard_model`` or ``quantize_``: a run resumed with
    ``fit(ckpt_path=...)`` in the same layout (world size, data-parallel mesh and
    tensor-parallel size) then rounds exactly as the uninterrupted run would have. In
    another layout the rows moved between ranks, so no stream can continue: the entry is
    skipped (logged) and the rounding keeps the stream seeded at start-up.
    """

    def __init__(self) -> None:
        self._module: pl.LightningModule | None = None

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        """Lightning's hook: remembers the module whose generators are checkpointed."""
        self._module = pl_module

    def _trained_module(self, method: str) -> pl.LightningModule:
        if self._module is None:
            raise RuntimeError(f"Int8RoundingCheckpoint.{method} runs inside a Trainer, after setup")
        return self._module

    def state_dict(self) -> dict[str, Any]:
        """Every rank's generator states, in rank order, for the checkpoint rank 0 writes.

        A collective: Lightning calls it on every rank.

        Raises:
            RuntimeError: outside a Trainer (before :meth:`setup`).
        """
        return {"ranks": _dist.all_gather(capture_generators(self._trained_module("state_dict")))}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore this rank's states from :meth:`state_dict`'s, if saved in this run's layout.

        Raises:
            RuntimeError: outside a Trainer (before :meth:`setup`).
        """
        ranks, rank = state_dict.get("ranks", []), _dist.rank()
        mine = ranks[rank] if rank < len(ranks) else {}
        if not restore_generators(mine, self._trained_module("load_state_dict")):
            logger.info("fsdp_int8: the checkpoint's rounding generators are from another layout; "
                        "the rounding keeps its start-up stream")
