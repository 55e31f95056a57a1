"""How the launcher runs a training step and a validation batch: on the whole model, or
(--pp) through pipeline stages.

With ``--pp N`` each rank holds one stage of the model (:meth:`Transformer.keep_stage`,
sharded by FSDP2 on its stage's mesh) and a ``torch.distributed.pipelining`` schedule
runs the batch through the stages in ``--microbatches`` pieces: the first stage feeds the
inputs, the last scores the targets, the ones between pass activations (and gradients)
on. Both runners return the batch's mean loss on every rank, so rank 0 (on the first
stage) logs it as without pipelining.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

from launch import parallel
from launch.model import Transformer, load_balance_loss, logits_loss, next_token_loss

SCHEDULES = {"1f1b": Schedule1F1B, "gpipe": ScheduleGPipe}


class WholeModel:
    """No pipeline: the model's forward and backward on this rank's batch."""

    def __init__(self, model: Transformer) -> None:
        self.model = model

    def train_step(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Forward and backward of one batch (a MoE model's load-balancing loss included);
        its next-token loss."""
        loss = next_token_loss(self.model, inputs, targets)
        (loss + load_balance_loss(self.model)).backward()
        return loss.detach()

    def eval_loss(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return next_token_loss(self.model, inputs, targets)


class Pipeline:
    """One pipeline stage and its schedule (``--pp-schedule``: 1F1B or GPipe)."""

    def __init__(self, stage_module: Transformer, mesh: DeviceMesh, device: torch.device, *,
                 microbatches: int, schedule: str) -> None:
        pp = mesh["pp"]
        index, count = pp.get_local_rank(), pp.size()
        self.group = pp.get_group()
        self.first, self.last = index == 0, index == count - 1
        self.device = device
        stage = PipelineStage(stage_module, index, count, device, group=self.group)
        # The loss of each microbatch is scaled by 1 / microbatches before its backward
        # (scale_grads): the gradients are those of the batch's mean loss, as without pp.
        self.schedule = SCHEDULES[schedule](stage, n_microbatches=microbatches, loss_fn=logits_loss)

    def train_step(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Forward and backward of one batch through all stages; its loss, on every stage."""
        return self._run(self.schedule.step, inputs, targets)

    def eval_loss(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Forward only (the schedule's ``eval``); the batch's loss, on every stage."""
        return self._run(self.schedule.eval, inputs, targets)

    def _run(self, run, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        losses: list[torch.Tensor] = []
        if self.first:
            run(inputs, return_outputs=False)
        elif self.last:
            run(target=targets, losses=losses, return_outputs=False)
        else:
            run(return_outputs=False)
        # The last stage's microbatch losses (equal sizes: their mean is the batch's), sent
        # to the other stages by a sum in which they add zeros.
        loss = torch.stack(losses).detach().mean() if self.last else torch.zeros((), device=self.device)
        dist.all_reduce(loss, group=self.group)
        return loss


def runner(model: Transformer, mesh: DeviceMesh, device: torch.device, *, microbatches: int,
           schedule: str) -> WholeModel | Pipeline:
    """A :class:`Pipeline` of this rank's stage when ``mesh`` has a ``"pp"`` dim, else the whole model's."""
    if parallel.has_pp(mesh):
        return Pipeline(model, mesh, device, microbatches=microbatches, schedule=schedule)
    return WholeModel(model)

