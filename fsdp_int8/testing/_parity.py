"""Training parity: a sharded model against an unsharded reference, compared at every step.

What the parity scenarios compare, and why the tolerances are what they are:

* The reference is an unsharded copy of the model holding the SAME subclass values
  (``from_float`` of the same floats; after the first step, ``from_float`` of the sharded
  model's values), run on each rank's own batch, with gradients all-reduced (averaged)
  by hand: what FSDP2 computes, without FSDP2.
* Forward and backward then run the same subclass code on the same values; only the
  order in which the ranks' gradients are summed differs (reduce-scatter against
  all-reduce), a few fp32 ulps. Losses must agree to 1e-5 relative, gradients to 1e-5 of
  their largest magnitude: 100x the noise, orders of magnitude below any real bug
  (wrong rows, stale weights from an ignored ``out=``, lost padding).
* After the optimizer step (plain SGD: each side moved by ``LR`` times its own gradient,
  whose difference the gradient check has just bounded) each side has rounded its update
  into the format; the two may differ by ``LR`` times the row's largest gradient
  difference (a row-scaled format rescales the row with its largest element), plus one
  rounding step (``spec.rounding_step`` of the row's largest magnitude: stochastic
  rounding draws differ between a shard and the whole weight, round-to-nearest can flip
  on a tie), plus 1e-5 of the row's magnitude for fp32. The bf16 scenario uses the same
  bound; its gradients differ by bf16 rounding, and the bound follows them.
* The reference is rebuilt from the sharded model's values before every step, so such
  one-step differences never accumulate and each step is checked from equal weights.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from fsdp_int8._dist import local_shard
from fsdp_int8.testing._harness import (
    Ctx, Shard, batch, chunk, gather_full, reference_from, row_scale, subclass_names,
)

LR = 0.1            # SGD: updates of several int8 steps, so stale weights show at once
FP32_RTOL = 1e-5    # see the module docstring
# bf16 compute against the fp32 reference (bf16 keeps 8 significant bits, 0.4% per
# rounding; a forward and backward through two blocks round a few dozen times). Seen on
# Int8Weight, the bf16 reference subclass and torchao's weight at 2 and 4 ranks: losses
# within 0.25%, gradients within 0.9% (of the whole gradient's norm). Limits at 4-5x
# that; real bugs give errors of order 1. Weights after a step need no limit of their
# own (see _compare_weights).
BF16_LOSS_RTOL = 1e-2
BF16_GRAD_RTOL = 5e-2


@dataclasses.dataclass
class _Worst:
    """The largest discrepancies seen, relative to their tolerance scales (for the report)."""

    mp: bool = False
    loss: float = 0.0
    grad: float = 0.0
    weight: float = 0.0  # in rounding steps, beyond the update's gradient difference

    def text(self, steps: int) -> str:
        grads = "of their norm" if self.mp else "of their max"
        against = " against the fp32 reference" if self.mp else ""
        return (f"{steps} steps{against}: losses within {self.loss:.1e} (rel), gradients within "
                f"{self.grad:.1e} {grads}, weights after steps within {self.weight:.2f} "
                "rounding steps (beyond LR x the gradient difference)")


def _compare_start(ctx: Ctx, model: nn.Module, reference: nn.Module, shard: Shard,
                   names: list[str]) -> None:
    """Before any step: the shards hold exactly the reference's rows (same from_float)."""
    ref = dict(reference.named_parameters())
    subclass = set(names)
    for name, param in model.named_parameters():
        local, expected, rows = local_shard(param), ref[name], chunk(param.shape[0], shard)
        mine = ctx.floats(local, name in subclass)
        theirs = ctx.floats(expected, name in subclass)[rows]
        ctx.expect(mine.shape == theirs.shape and torch.equal(mine, theirs),
                   f"{name}: the shard after fully_shard is not the weight's rows "
                   f"{rows.start}:{rows.stop} (shapes {tuple(mine.shape)} vs {tuple(theirs.shape)})")


def _compare_grads(ctx: Ctx, model: nn.Module, reference: nn.Module, shard: Shard,
                   worst: _Worst, mp: bool) -> None:
    ref = dict(reference.named_parameters())
    for name, param in model.named_parameters():
        if param.grad is None:
            ctx.problems.append(f"{name}: no gradient")
            continue
        grad = local_shard(param.grad).detach().float()
        expected = ref[name].grad[chunk(param.shape[0], shard)].float()
        if grad.shape != expected.shape:
            ctx.problems.append(
                f"{name}: gradient shard {tuple(grad.shape)}, expected {tuple(expected.shape)}")
            continue
        if not expected.numel():
            continue
        if mp:
            # Against the whole gradient's norm: the shards' errors add up (in squares) to
            # the whole tensor's, and a small shard whose gradient sums cancel is not
            # judged alone.
            err = float((grad - expected).norm() / ref[name].grad.float().norm().clamp_min(1e-30))
            worst.grad = max(worst.grad, err)
            ctx.expect(err <= BF16_GRAD_RTOL, f"{name}: gradient shard off by {err:.2e} of the "
                       f"whole gradient's norm > {BF16_GRAD_RTOL}")
            continue
        scale = float(ref[name].grad.abs().max())
        err = float((grad - expected).abs().max()) / max(scale, 1e-30)
        worst.grad = max(worst.grad, err)
        ctx.expect(err <= FP32_RTOL,
                   f"{name}: gradient off by {err:.2e} of its max |grad| > {FP32_RTOL}")


def _compare_weights(ctx: Ctx, model: nn.Module, reference: nn.Module, shard: Shard,
                     names: list[str], worst: _Worst) -> None:
    """After the step. Plain SGD moved each side by exactly ``LR * its gradient``, so the
    two may differ by ``LR`` times the largest gradient difference in the row (bounded by
    the gradient check; the row's largest, because a row-scaled format rescales the whole
    row when its largest element moves), plus one rounding step of the format, plus fp32
    noise (1e-5 of the row's max)."""
    ref = dict(reference.named_parameters())
    subclass = set(names)
    for name, param in model.named_parameters():
        is_subclass = name in subclass
        rows = chunk(param.shape[0], shard)
        local = local_shard(param)
        mine = ctx.floats(local, is_subclass)
        full = ctx.floats(ref[name], is_subclass)
        expected = full[rows]
        if mine.shape != expected.shape:
            ctx.problems.append(
                f"{name}: shard {tuple(mine.shape)} after the step, expected {tuple(expected.shape)}")
            continue
        if not expected.numel() or param.grad is None:
            continue
        update_gap = LR * row_scale(local_shard(param.grad).float() - ref[name].grad[rows].float())
        scale = row_scale(expected)
        step = ctx.spec.rounding_step if is_subclass else 0.0
        beyond_update = ((mine - expected).abs() - update_gap).clamp_min(0)
        allowed = (step * 1.001 + FP32_RTOL) * scale + 1e-12
        if is_subclass and step > 0:
            worst.weight = max(worst.weight, float((beyond_update / (step * scale + 1e-30)).max()))
        if not bool((beyond_update <= allowed).all()):
            index = tuple(int(i) for i in torch.nonzero(beyond_update > allowed)[0])
            ctx.problems.append(
                f"{name}: after the optimizer step, element {index} is {float(mine[index]):.6g}, the "
                f"reference {float(expected[index]):.6g} (allowed: {float(update_gap[index]):.3g} from "
                f"the gradients, {step:g} rounding step and {FP32_RTOL:g} of the row's max "
                f"{float(scale[index]):.4g})"
            )


def train_compare(ctx: Ctx, model: nn.Module, reference: nn.Module | None, rows: tuple[int, ...],
                  shard: Shard, *, steps: int, mp: bool = False) -> str:
    """Train ``model`` (sharded) and the reference side by side; compare at every step.

    ``reference``: an unsharded model built from the same floats, or ``None`` to build
    it from the sharded model's values (as every later step does). Returns the largest
    discrepancies seen, for the report; raises :class:`~._harness.Failure` at the first
    point where any rank found a problem.
    """
    names = subclass_names(rows)
    opt = torch.optim.SGD(model.parameters(), lr=LR, foreach=False)  # add_ only, on every subclass
    worst = _Worst(mp=mp)
    if reference is not None:
        _compare_start(ctx, model, reference, shard, names)
        ctx.agree("after fully_shard, before training")
    for step in range(steps):
        if reference is None or step > 0:
            reference = reference_from(ctx, rows, gather_full(ctx, model, shard, names))
        ref_opt = torch.optim.SGD(reference.parameters(), lr=LR, foreach=False)
        x, y = batch(ctx, step)
        loss = F.mse_loss(model(x).float(), y)
        loss.backward()
        ref_loss = F.mse_loss(reference(x).float(), y)
        ref_loss.backward()
        for param in reference.parameters():  # the reference's data parallelism, by hand
            dist.all_reduce(param.grad, op=dist.ReduceOp.SUM, group=ctx.group)
            param.grad /= ctx.world
        err = abs(loss.item() - ref_loss.item()) / max(abs(ref_loss.item()), 1e-30)
        worst.loss = max(worst.loss, err)
        limit = BF16_LOSS_RTOL if mp else FP32_RTOL
        ctx.expect(err <= limit, f"loss {loss.item():.6g} vs reference {ref_loss.item():.6g} "
                                 f"({err:.1e} > {limit:g})")
        _compare_grads(ctx, model, reference, shard, worst, mp)
        ctx.agree(f"step {step}, before the optimizer step")
        opt.step()
        ref_opt.step()
        _compare_weights(ctx, model, reference, shard, names, worst)
        opt.zero_grad()
        ctx.agree(f"step {step}, after the optimizer step")
    return worst.text(steps)
