"""Lightning: fsdp_int8's stochastic-rounding generators in Lightning's checkpoints.

Install with ``pip install "fsdp_int8[lightning]"``; this module imports Lightning, so
``import fsdp_int8`` never imports it. Verified against lightning 2.6.6.

Lightning saves a callback's ``state_dict`` in the checkpoint's metadata, which rank 0
alone writes (``meta.pt`` next to the shards with ``ModelParallelStrategy``). Each rank
rounds its own rows with its own generator, so :class:`Int8RoundingCheckpoint` gathers
every rank's generator states into that one entry, and on resume each rank takes its own
back. Without it a resumed run draws its rounding noise from the seed again (unbiased,
but not the uninterrupted run's bytes).
"""

from __future__ import annotations

import logging
from typing import Any

import lightning.pytorch as pl

from fsdp_int8 import _dist
from fsdp_int8.checkpoint import _generator_states

__all__ = ["Int8RoundingCheckpoint"]

logger = logging.getLogger("fsdp_int8")


class Int8RoundingCheckpoint(pl.Callback):
    """Save and restore every rank's stochastic-rounding generators with the checkpoint.

    Add it to the trainer (``L.Trainer(callbacks=[Int8RoundingCheckpoint()], ...)``) of a
    model made int8 by ``shard_model`` or ``quantize_``: a run resumed with
    ``fit(ckpt_path=...)`` at the same world size then rounds exactly as the uninterrupted
    run would have. At another world size the rows moved between ranks, so no stream can
    continue: the entry is skipped and the rounding keeps the stream seeded at start-up.
    """

    def __init__(self) -> None:
        self._module: pl.LightningModule | None = None

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._module = pl_module

    def _trained_module(self, method: str) -> pl.LightningModule:
        if self._module is None:
            raise RuntimeError(f"Int8RoundingCheckpoint.{method} runs inside a Trainer, after setup")
        return self._module

    def state_dict(self) -> dict[str, Any]:
        """Every rank's generator states, in rank order (a collective: every rank calls it)."""
        states = _generator_states.capture(self._trained_module("state_dict"))
        return {"world_size": _dist.world_size(), "ranks": _dist.all_gather(states)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """This rank's states from :meth:`state_dict`'s, if saved at this world size."""
        if state_dict.get("world_size") != _dist.world_size():
            logger.info(
                "fsdp_int8: the checkpoint's rounding generators are from %s ranks, this run has %s; "
                "the rounding keeps its start-up stream", state_dict.get("world_size"), _dist.world_size(),
            )
            return
        _generator_states.restore(state_dict["ranks"][_dist.rank()], self._trained_module("load_state_dict"))
