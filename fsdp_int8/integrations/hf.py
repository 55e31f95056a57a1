"""Hugging Face ``Trainer`` checkpoints that resume bit-exactly: ``Int8Trainer`` and ``Int8SaveMixin``.

A stock ``transformers.Trainer`` trains and saves an int8 model by itself once the model
carries fsdp_int8's quantizer (:mod:`fsdp_int8.integrations.hf_quantizer`), which
``fsdp_int8.quantize_`` (and ``shard_model``) gives every transformers model, as does
``from_pretrained(..., quantization_config=Int8TrainingHfConfig())``: ``save_model`` and every checkpoint write the
int8 rows with their fp32 scales, and ``resume_from_checkpoint`` restores them exactly.

What transformers cannot know about is the stochastic-rounding generators of the int8
weights (and of the int8 gradient reduce-scatter). The mixin adds their states to every
checkpoint (``int8_rounding_<rank>.pth``, beside transformers' ``rng_state_<rank>.pth``;
:func:`fsdp_int8.checkpoint.capture_generators`), so that a resume in the same layout
(world size, data-parallel mesh and tensor-parallel size) rounds exactly as the
uninterrupted run would have, and repeats its losses bit for bit. In another layout, or
from a file that records none, the rounding keeps the stream seeded at start-up: unbiased
all the same.
A ``TrainerCallback`` cannot do this: callbacks are not told which checkpoint a run
resumes from; ``Trainer._load_rng_state`` is, on every rank.

Usage::

    from fsdp_int8.integrations.hf import Int8Trainer

    model = fsdp_int8.quantize_(model)          # before the Trainer wraps it
    trainer = Int8Trainer(model=model, args=args, train_dataset=data)
    trainer.train()                             # checkpoints: int8 weights + rounding state
    trainer.save_model(path)                    # FSDP2: needs state_dict_type FULL_STATE_DICT

``Int8Trainer`` attaches the quantizer to a model that ``quantize_`` quantized without it.
A Trainer subclass of your own (TRL's ``SFTTrainer``, ...) takes the mixin first:
``class MyTrainer(Int8SaveMixin, SFTTrainer): ...``.

This module imports transformers; ``import fsdp_int8`` does not import it.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import torch
from transformers import PreTrainedModel, Trainer

from fsdp_int8._dist import local_shard
from fsdp_int8._weight.tensor import Int8Weight
from fsdp_int8.checkpoint import capture_generators, restore_generators
from fsdp_int8.integrations.hf_quantizer import Int8TrainingHfQuantizer, attach_hf_quantizer

__all__ = ["Int8SaveMixin", "Int8Trainer"]

logger = logging.getLogger("fsdp_int8")


class Int8SaveMixin:
    """Mix into a ``transformers.Trainer`` (first): its checkpoints hold the rounding state.

    Overrides ``Trainer._save_rng_state`` and ``Trainer._load_rng_state``, which every rank
    runs for every checkpoint and every resume. At construction it attaches fsdp_int8's
    quantizer (:func:`~fsdp_int8.integrations.hf_quantizer.attach_hf_quantizer`) to a
    transformers model with int8 weights that has none, so that its saves write int8.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        model = self.model
        if (
            isinstance(model, PreTrainedModel)
            and not isinstance(getattr(model, "hf_quantizer", None), Int8TrainingHfQuantizer)
            and any(isinstance(local_shard(p), Int8Weight) for p in model.parameters())
        ):
            attach_hf_quantizer(model)

    def _save_rng_state(self, output_dir: str) -> None:
        super()._save_rng_state(output_dir)
        path = os.path.join(output_dir, _rounding_file(self.args.process_index))
        torch.save(capture_generators(self.model), path)

    def _load_rng_state(self, checkpoint: str | None) -> None:
        super()._load_rng_state(checkpoint)
        path = checkpoint and os.path.join(checkpoint, _rounding_file(self.args.process_index))
        if path and os.path.isfile(path):
            if not restore_generators(torch.load(path, weights_only=True), self.model):
                logger.info("fsdp_int8: %s is from another layout; the rounding keeps its start-up stream", path)


def _rounding_file(rank: int) -> str:
    return f"int8_rounding_{rank}.pth"


class Int8Trainer(Int8SaveMixin, Trainer):
    """``transformers.Trainer`` whose checkpoints also hold the int8 rounding state (see the module)."""
