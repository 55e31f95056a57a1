"""Refuse an optimizer step on non-finite gradients, before the step changes anything.

A NaN or Inf gradient applied by an optimizer poisons the weights and, through them, every
later checkpoint. The check runs once per step over every gradient at once (one fused
2-norm per device and dtype, one host sync), and every rank reaches the same verdict (a
one-element all-reduce), so all ranks raise together instead of one rank raising while the
others wait in the next collective. The step then leaves parameters, optimizer states,
step counters and generators as they were: the caller can skip the batch.

:class:`~fsdp_int8.Int8AdamW` and :class:`~fsdp_int8.Int8SGD` run this check themselves;
:func:`guard_finite_steps` adds it to any ``torch.optim`` optimizer, and every other
optimizer that holds int8 weights gets it by default (below): an int8 weight refuses to
take a non-finite value, and without a shared verdict only the rank owning that row would
refuse while the others step on, their step counters and collectives out of line.

Importing fsdp_int8 registers one global step pre-hook (``torch.optim``'s
``register_optimizer_step_pre_hook``), which looks at an optimizer's parameters once, at
its first step, and does nothing more for an optimizer that holds no int8 weight and
nothing ``quantize_`` or ``shard_model`` replaced:
- it refuses the step when the optimizer holds a parameter that ``quantize_`` or
  ``shard_model`` replaced (they mark the objects they replaced): those give the model new
  parameter objects, so an optimizer built before them would update tensors the model no
  longer reads and train nothing, silently;
- it guards the optimizer (as :func:`guard_finite_steps` does, from this step on) when it
  holds an int8 weight and checks no gradients of its own: one all-reduce and one host
  sync per step, so that a NaN on any rank refuses the step on every rank before any
  parameter or optimizer state (a ``torch.optim.AdamW``'s moments) takes it.
"""

from __future__ import annotations

import weakref
from collections import defaultdict
from typing import Any, Iterable

import torch
import torch.nn as nn
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.utils.hooks import RemovableHandle

from fsdp_int8 import _dist
from fsdp_int8._dist import local_shard
from fsdp_int8._weight.tensor import Int8Weight

__all__ = ["NonFiniteGradientError", "check_finite_gradients", "guard_finite_steps"]


class NonFiniteGradientError(ValueError):
    """An optimizer step refused because a gradient holds NaN or Inf.

    A ``ValueError``. Parameters, optimizer states, step counters and generators are as
    they were: catch it, ``zero_grad()`` and go on with the next batch.

    Example::

        try:
            optimizer.step()
        except NonFiniteGradientError:
            skipped += 1
        optimizer.zero_grad()
    """


def _all_finite(tensors: Iterable[torch.Tensor], read_with: torch.Tensor | None = None) -> tuple[bool, list[int]]:
    """Whether every tensor on every rank is finite: one fused reduction per device and
    dtype, one host sync, and (with a process group) one all-reduce of the verdict. The
    integer tensor ``read_with`` is read back in the same sync (``[]`` without it)."""
    groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = defaultdict(list)
    for tensor in tensors:
        local = local_shard(tensor)
        # Sparse gradients are the optimizer's to refuse (or handle): strided ones only.
        if local.layout == torch.strided and local.is_floating_point() and local.numel():
            groups[(local.device, local.dtype)].append(local)
    flags = [norms_finite(group) for group in groups.values()]
    if read_with is None:
        finite, values = _dist.all_ranks_true(flags), []
    else:
        finite, values = _dist.all_ranks_true_reading(flags, read_with)
    if finite:
        return True, values
    # Rare: a norm is NaN or Inf, on some rank. Every rank gets here (the verdict is
    # shared): look at the values themselves, since a norm may only have overflowed.
    flags = [torch.stack([t.isfinite().all() for t in group]).all() for group in groups.values()]
    return _dist.all_ranks_true(flags), values


def norms_finite(group: list[torch.Tensor]) -> torch.Tensor:
    """Whether every tensor of one device and dtype has a finite 2-norm: a 0-dim bool
    tensor on their device (no host sync).

    A tensor's 2-norm is NaN or Inf exactly when one of its values is, or when the sum of
    squares overflows (values ~1e19 in fp32, norms past 65504 in fp16): a False needs the
    values themselves checked. The 2-norm, not the max-norm: both are one fused call, but
    on CPU torch 2.13 vectorizes only the 2-norm (the max-norm and ``isfinite`` are about
    20x slower; docs/performance.md, "Kernel choices").
    """
    return torch.stack(torch._foreach_norm(group, 2)).isfinite().all()


def check_finite_gradients(optimizer: torch.optim.Optimizer, *, read_with: torch.Tensor | None = None) -> list[int]:
    """Raise :class:`NonFiniteGradientError` if any gradient of ``optimizer``'s parameters,
    on any rank, holds NaN or Inf.

    Call it on every rank: with a process group initialised it all-reduces the verdict.
    Sparse gradients are not checked.

    Args:
        optimizer: Any ``torch.optim.Optimizer``; its parameters' ``.grad`` are checked.
        read_with: A 1-D integer tensor read back in the same host sync as the verdict
            (:class:`~fsdp_int8.Int8AdamW` / :class:`~fsdp_int8.Int8SGD` read their rounding
            seeds so: one device sync for both).

    Returns:
        ``read_with``'s values as a list (``[]`` without it).

    Raises:
        NonFiniteGradientError: a gradient holds NaN or Inf on this or another rank.
    """
    grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
    finite, values = _all_finite(grads, read_with)
    if not finite:
        raise NonFiniteGradientError(
            f"{type(optimizer).__name__}.step() refused: a gradient holds NaN or Inf (on this or "
            "another rank). Parameters, optimizer states and generators are unchanged; skip "
            "this batch (zero_grad) or lower the learning rate / enable gradient clipping."
        )
    return values


def guard_finite_steps(optimizer: torch.optim.Optimizer) -> RemovableHandle:
    """Make ``optimizer.step()`` refuse non-finite gradients before it changes anything.

    Registers :func:`check_finite_gradients` as a step pre-hook, so a NaN or Inf gradient
    raises :class:`NonFiniteGradientError` on every rank and the step applies nothing. For
    ``torch.optim`` optimizers; :class:`~fsdp_int8.Int8AdamW` and :class:`~fsdp_int8.Int8SGD`
    check on their own. An optimizer holding int8 weights that does not check its
    gradients itself has this guard by default from its first step (:mod:`fsdp_int8.guard`);
    calling this on it does not check twice.

    Args:
        optimizer: Any ``torch.optim.Optimizer``.

    Returns:
        The hook's handle (``handle.remove()`` takes the guard off).

    Example::

        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        fsdp_int8.guard.guard_finite_steps(optimizer)
    """

    def hook(opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        check_finite_gradients(opt)

    _explicitly_guarded.add(optimizer)  # the default guard does not check a second time
    _guarded_by_default.discard(optimizer)
    return optimizer.register_step_pre_hook(hook)


# An optimizer class that checks its gradients itself (Int8AdamW, Int8SGD) sets this.
CHECKS_OWN_GRADIENTS = "checks_finite_gradients"
_REPLACED_BY = "_fsdp_int8_replaced_by"  # on a parameter object: the function that replaced it
_checked_optimizers: "weakref.WeakSet[torch.optim.Optimizer]" = weakref.WeakSet()  # first step passed
_guarded_by_default: "weakref.WeakSet[torch.optim.Optimizer]" = weakref.WeakSet()
_explicitly_guarded: "weakref.WeakSet[torch.optim.Optimizer]" = weakref.WeakSet()


def refuse_steps_on_replaced(original: Iterable[torch.Tensor], model: nn.Module, by: str) -> None:
    """Mark each of ``original`` (``model``'s parameters before ``by`` ran) that ``model`` no
    longer holds, so that an optimizer holding one is refused at its first step."""
    kept = {id(param) for param in model.parameters()}
    for param in original:
        if id(param) not in kept:
            setattr(param, _REPLACED_BY, by)


def _before_each_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    """At an optimizer's first step: refuse replaced parameters, decide whether to guard
    it. At every step of a guarded one: :func:`check_finite_gradients`."""
    if optimizer not in _checked_optimizers:
        _refuse_replaced(optimizer)
        if _needs_default_guard(optimizer):
            _guarded_by_default.add(optimizer)
        _checked_optimizers.add(optimizer)
    if optimizer in _guarded_by_default:
        check_finite_gradients(optimizer)


def _needs_default_guard(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer`` holds an int8 weight and checks its gradients neither itself nor
    through :func:`guard_finite_steps`."""
    if getattr(optimizer, CHECKS_OWN_GRADIENTS, False) or optimizer in _explicitly_guarded:
        return False
    return any(
        isinstance(local_shard(param), Int8Weight) for group in optimizer.param_groups for param in group["params"]
    )


def _refuse_replaced(optimizer: torch.optim.Optimizer) -> None:
    """Raise if ``optimizer`` holds a parameter marked as replaced."""
    for group in optimizer.param_groups:
        for param in group["params"]:
            by = getattr(param, _REPLACED_BY, None)
            if by is not None:
                name = type(optimizer).__name__
                raise RuntimeError(
                    f"{name}.step() refused: the optimizer holds parameters that {by} replaced "
                    f"(shape {tuple(param.shape)}, ...). {by} gives the model new parameter objects, "
                    "so this optimizer would update tensors the model no longer uses and train "
                    f"nothing. Build the optimizer after {by}: {by}(model, ...), then "
                    f"{name}(model.parameters(), ...)."
                )


_GLOBAL_HOOK = register_optimizer_step_pre_hook(_before_each_step)  # once per process, at import
