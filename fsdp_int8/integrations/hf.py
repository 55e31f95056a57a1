"""Hugging Face ``Trainer`` checkpoints that resume bit-exactly: ``Int8Trainer`` and ``Int8SaveMixin``.

A stock ``transformers.Trainer`` trains and saves an int8 model by itself once the model
carries fsdp_int8's quantizer (:mod:`fsdp_int8.integrations.hf_quantizer`), which
``fsdp_int8.quantize_`` (and ``shard_model``) gives every transformers model, as does
``from_pretrained(..., quantization_config=Int8TrainingHfConfig())``: ``save_model`` and every checkpoint write the
int8 rows with their fp32 scales, and ``resume_from_checkpoint`` restores them exactly.
What it cannot checkpoint is the stochastic-rounding generators of the int8 weights (and
of the int8 gradient reduce-scatter): :class:`Int8SaveMixin` adds them, for a resume that
repeats the uninterrupted run's losses. A ``TrainerCallback`` cannot do this: callbacks
are not told which checkpoint a run resumes from; ``Trainer._load_rng_state`` is, on
every rank. What works with the Trainer: docs/integrations.md.

This module imports transformers; ``import fsdp_int8`` does not import it.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import torch
from torch.distributed.fsdp import FSDPModule
from transformers import PreTrainedModel, Trainer

from fsdp_int8._dist import local_shard
from fsdp_int8._weight.tensor import Int8Weight
from fsdp_int8.checkpoint import capture_generators, restore_generators
from fsdp_int8.integrations.hf_quantizer import Int8TrainingHfQuantizer, attach_hf_quantizer

__all__ = ["Int8SaveMixin", "Int8Trainer"]

logger = logging.getLogger("fsdp_int8")


class Int8SaveMixin:
    """Mix into a ``transformers.Trainer`` subclass, first: its checkpoints hold the rounding
    state, and an optimizer stepping inside backward trains under it.

    ``class MyTrainer(Int8SaveMixin, SFTTrainer): ...``. Every checkpoint also holds each
    rank's generator states (``int8_rounding_<rank>.pth``, beside transformers'
    ``rng_state_<rank>.pth``; :func:`fsdp_int8.checkpoint.capture_generators`): it overrides
    ``Trainer._save_rng_state`` and ``_load_rng_state``, which every rank runs. A resume in
    the same layout (world size, data-parallel mesh and tensor-parallel size) rounds as the
    uninterrupted run would have and repeats its losses bit for bit; in another layout, or
    from a checkpoint without the file, the rounding keeps the stream seeded at start-up
    (unbiased all the same). At construction it attaches fsdp_int8's quantizer
    (:func:`~fsdp_int8.integrations.hf_quantizer.attach_hf_quantizer`) to a transformers
    model with int8 weights that has none, so that its saves write int8.

    With an optimizer that steps inside backward (``Int8AdamW.lean``, or any
    ``step_in_backward=True``) the gradients are applied before the Trainer would clip
    them or log their norm, and any read of them raises: ``Trainer._clip_grad_norm`` and
    ``_get_grad_norm`` then read none (the optimizer clips by its ``max_grad_norm``), and
    the logged ``grad_norm`` is the optimizer's ``grad_norm`` once its step completes. A
    model sharded before the Trainer sees it (``shard_model``) takes its optimizer in
    ``optimizers=`` under FSDP too.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        held = _optimizers_of_a_sharded_model(args, kwargs)
        super().__init__(*args, **kwargs)
        if held is not None:
            self.optimizer, self.lr_scheduler = held
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


    def create_optimizer(self, *args: Any, **kwargs: Any) -> torch.optim.Optimizer:
        """``Trainer.create_optimizer`` (which keeps an optimizer passed in ``optimizers``),
        then checks an optimizer that steps inside backward.

        Raises:
            ValueError: ``TrainingArguments.max_grad_norm > 0`` and the optimizer's
                ``max_grad_norm`` is ``None`` (set one of them; where both are set the
                optimizer's clips, with a warning if they differ); or FSDP is on and the
                model is not sharded yet (accelerate would shard it after the optimizer
                hooked its parameters: ``shard_model`` first, then ``optimizers=(optimizer, None)``).
        """
        optimizer = super().create_optimizer(*args, **kwargs)
        _check_clipping(optimizer, self.args.max_grad_norm)
        if self.is_fsdp_enabled and not isinstance(self.model, FSDPModule) and _stepping_in_backward(optimizer):
            raise ValueError(
                f"{type(optimizer).__name__}(step_in_backward=True) hooks the parameters it is given, and "
                "accelerate shards the model after the optimizer took them (FSDP2 makes new ones), so it "
                "would step nothing inside backward: shard the model before the Trainer, "
                "fsdp_int8.shard_model(model, config=...), build the optimizer on model.parameters() then, "
                "pass it in optimizers=(optimizer, None), and set fsdp_config={'fsdp_version': 2, "
                "'auto_wrap_policy': 'NO_WRAP'} (accelerate keeps an FSDP2 model as it is)"
            )
        return optimizer

    def _clip_grad_norm(self, model: torch.nn.Module) -> Any:
        if _stepping_in_backward(self.optimizer) is not None:
            return None  # clipped inside backward by the optimizer's max_grad_norm
        return super()._clip_grad_norm(model)

    def _get_grad_norm(self, model: torch.nn.Module, grad_norm: Any = None) -> Any:
        if _stepping_in_backward(self.optimizer) is not None:
            return None  # known once optimizer.step() completes: _maybe_log_save_evaluate
        return super()._get_grad_norm(model, grad_norm)

    def _maybe_log_save_evaluate(self, tr_loss: torch.Tensor, grad_norm: Any, *args: Any, **kwargs: Any) -> None:
        optimizer = _stepping_in_backward(self.optimizer)
        if optimizer is not None:
            grad_norm = optimizer.grad_norm  # the completed step's norm, before clipping
        super()._maybe_log_save_evaluate(tr_loss, grad_norm, *args, **kwargs)


def _optimizers_of_a_sharded_model(args: tuple, kwargs: dict[str, Any]) -> tuple | None:
    """``kwargs``' ``optimizers``, taken out of them, when the model is sharded already.

    transformers refuses ``optimizers=`` under FSDP because it would shard the model after
    the optimizer took its parameters; a model that ``shard_model`` (or ``fully_shard``)
    sharded keeps them (accelerate leaves an FSDP2 module as it is), so the mixin hands
    them to the Trainer after its checks."""
    model = kwargs.get("model", args[0] if args else None)
    optimizers = kwargs.get("optimizers", (None, None))
    if not isinstance(model, FSDPModule) or tuple(optimizers) == (None, None) or "optimizer_cls_and_kwargs" in kwargs:
        return None
    return tuple(kwargs.pop("optimizers"))


def _stepping_in_backward(optimizer: Any) -> Any:
    """The optimizer inside ``optimizer`` (accelerate's ``AcceleratedOptimizer`` holds it in
    ``.optimizer``) if it steps inside backward, else ``None``."""
    inner = getattr(optimizer, "optimizer", optimizer)
    return inner if getattr(inner, "step_in_backward", False) is True else None


def _check_clipping(optimizer: Any, max_grad_norm: float) -> None:
    """Refuse ``TrainingArguments.max_grad_norm`` that an optimizer stepping inside backward
    would not honour; say which value clips when both are set and differ."""
    inner = _stepping_in_backward(optimizer)
    if inner is None or not max_grad_norm > 0:
        return
    name = type(inner).__name__
    if inner.max_grad_norm is None:
        raise ValueError(
            f"TrainingArguments(max_grad_norm={max_grad_norm}) asks the Trainer to clip the "
            f"gradients after backward, but {name}(step_in_backward=True) applies each one inside "
            f"backward and does not clip: give the optimizer max_grad_norm={max_grad_norm} (it "
            "clips inside backward by the step's norm as estimated when each gradient arrives; "
            f"{name}.lean does, at 1.0), or pass TrainingArguments(max_grad_norm=0) to train "
            "without clipping"
        )
    if inner.max_grad_norm != max_grad_norm:
        logger.warning("fsdp_int8: %s clips inside backward at its max_grad_norm=%s; "
                       "TrainingArguments.max_grad_norm=%s is not used", name, inner.max_grad_norm, max_grad_norm)


def _rounding_file(rank: int) -> str:
    return f"int8_rounding_{rank}.pth"


class Int8Trainer(Int8SaveMixin, Trainer):
    """``transformers.Trainer`` with :class:`Int8SaveMixin`: the same constructor and
    behaviour, and checkpoints that resume bit for bit.

    Example::

        from fsdp_int8.integrations.hf import Int8Trainer

        model = fsdp_int8.quantize_(model)          # before the Trainer wraps it
        trainer = Int8Trainer(model=model, args=args, train_dataset=data)
        trainer.train()                             # checkpoints: int8 weights + rounding state
        trainer.save_model("out")                   # from_pretrained("out"); FSDP2: FULL_STATE_DICT
    """
