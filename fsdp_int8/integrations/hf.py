"""Hugging Face ``Trainer`` saves of int8 models: ``Int8Trainer`` and ``Int8SaveMixin``.

transformers writes model weights with safetensors, which copies each tensor's raw memory
as ``numel * itemsize`` bytes of its dtype. An ``Int8Weight`` has no such memory (int8 rows
plus fp32 scales), so it refuses (``Int8Weight.storage()`` raises) and ``Trainer.save_model``
fails, with or without FSDP2. The mixin hands ``save_pretrained`` the dequantized values
instead, in each weight's own dtype: ``from_pretrained`` of the saved folder gives the plain
model, and ``quantize_`` (or :func:`fsdp_int8.checkpoint.load_full_state_dict`) rounds it back to the
same int8 values.

Its checkpoints also hold the state of the stochastic-rounding generator of the int8
weights (``int8_rounding_<rank>.pth``, beside transformers' ``rng_state_<rank>.pth``), so
that ``resume_from_checkpoint`` at the same world size continues bit-exactly.

Everything else is the stock ``Trainer``: FSDP2 through accelerate (``fsdp_config`` with
``fsdp_version: 2``), its checkpoints (a ``SHARDED_STATE_DICT`` checkpoint is written by
torch.distributed.checkpoint and keeps the int8 bytes exactly; a ``FULL_STATE_DICT`` one
adds ``torch.save`` of the full state dict, exact too) and ``resume_from_checkpoint``.

Usage::

    from fsdp_int8.integrations.hf import Int8Trainer

    model = fsdp_int8.quantize_(model)          # before the Trainer wraps it
    trainer = Int8Trainer(model=model, args=args, train_dataset=data)
    trainer.train()
    trainer.save_model(path)                    # FSDP2: needs state_dict_type FULL_STATE_DICT

A Trainer subclass of your own (TRL's ``SFTTrainer``, ...) takes the mixin first:
``class MyTrainer(Int8SaveMixin, SFTTrainer): ...``.

This module imports transformers; ``import fsdp_int8`` does not import it.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from torch.distributed.tensor import DTensor
from transformers import Trainer

from fsdp_int8._generators import WEIGHT_ROUNDING
from fsdp_int8._dist import local_shard
from fsdp_int8.convert import dequantize_all
from fsdp_int8.weight import Int8Weight

__all__ = ["Int8SaveMixin", "Int8Trainer"]


def _plain_state_dict(state_dict: dict[str, Any]) -> dict[str, Any]:
    """``state_dict`` with every ``Int8Weight`` dequantized to its own dtype."""
    sharded = [k for k, v in state_dict.items() if isinstance(v, DTensor) and isinstance(local_shard(v), Int8Weight)]
    if sharded:
        raise RuntimeError(
            f"Int8Trainer got sharded int8 weights to save ({', '.join(sharded[:3])}"
            f"{' ...' if len(sharded) > 3 else ''}): a model sharded outside the Trainer's "
            "FSDP2 has no full state dict here. Shard it through the Trainer (fsdp_config "
            "with fsdp_version 2 and state_dict_type FULL_STATE_DICT), or save "
            "fsdp_int8.export_full_state_dict(model) yourself on every rank."
        )
    return dequantize_all(state_dict)


class Int8SaveMixin:
    """Mix into a ``transformers.Trainer`` (first): its saves write dequantized weights.

    Overrides ``Trainer._save``, which every model save of the Trainer goes through
    (``save_model`` and the model part of each checkpoint) on the rank that writes. Under
    FSDP2 the Trainer gathers a full state dict first (``FULL_STATE_DICT``); with
    ``SHARDED_STATE_DICT`` transformers' ``save_model`` writes no weights at all (for any
    model) and checkpoints hold them in torch.distributed.checkpoint form.
    """

    def _save(self, output_dir: str | None = None, state_dict: dict | None = None) -> None:
        if state_dict is None and self.args.should_save:
            # The stock _save would read the model's own state dict: read it here instead.
            state_dict = self.accelerator.unwrap_model(self.model, keep_torch_compile=False).state_dict()
        if state_dict is not None:
            with torch.no_grad():
                state_dict = _plain_state_dict(state_dict)
        super()._save(output_dir, state_dict=state_dict)

    def _save_rng_state(self, output_dir: str) -> None:
        super()._save_rng_state(output_dir)
        state = {"world_size": self.args.world_size, "rounding": WEIGHT_ROUNDING.get_state()}
        torch.save(state, os.path.join(output_dir, _rounding_file(self.args.process_index)))

    def _load_rng_state(self, checkpoint: str | None) -> None:
        super()._load_rng_state(checkpoint)
        path = checkpoint and os.path.join(checkpoint, _rounding_file(self.args.process_index))
        if path and os.path.isfile(path):
            state = torch.load(path, weights_only=True)
            if state["world_size"] == self.args.world_size:  # else each rank holds other rows
                WEIGHT_ROUNDING.set_state(state["rounding"])


def _rounding_file(rank: int) -> str:
    return f"int8_rounding_{rank}.pth"


class Int8Trainer(Int8SaveMixin, Trainer):
    """``transformers.Trainer`` whose model saves work with int8 weights (see the module)."""
