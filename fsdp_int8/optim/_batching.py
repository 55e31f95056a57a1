"""End-of-step work for a ``torch.optim`` optimizer: :func:`batch_int8_updates`.

:class:`~fsdp_int8.Int8AdamW` and :class:`~fsdp_int8.Int8SGD` hold the work their updates
of int8 weights leave for the end of their step (:mod:`fsdp_int8._weight.end_of_step`).
A ``torch.optim`` optimizer knows nothing of it: its updates reach the weights through the
op table one op at a time, and each does its work at once. That is correct everywhere,
but on an accelerator each update then reads its finiteness flag back (a device sync per
weight and step), and each update of a weight split by columns with tensor parallelism
runs its own ``all_reduce``. :func:`batch_int8_updates` gives the optimizer an end-of-step
of its own: one read and one ``all_reduce`` per step.
"""

from __future__ import annotations

import types
from typing import Any

import torch

from fsdp_int8._weight.end_of_step import EndOfStep

__all__ = ["batch_int8_updates", "BatchedUpdates"]


class BatchedUpdates:
    """The handle :func:`batch_int8_updates` returns (not built by hand); :meth:`remove`
    undoes it.

    Args:
        optimizer: The optimizer whose steps hold the work.
        original_step: The ``step`` attribute of the instance that the wrapper replaced,
            ``None`` where ``step`` came from the class.

    Attributes:
        active: Whether the optimizer's steps hold the work (False after :meth:`remove`).
    """

    def __init__(self, optimizer: torch.optim.Optimizer, original_step: Any) -> None:
        self._optimizer = optimizer
        self._original_step = original_step  # an instance attribute replaced, or None
        self.active = True
        self.wrapper: Any = None

    def remove(self) -> None:
        """Stop holding the work: the optimizer's ``step`` is its own again (or passes
        straight through, where another wrapper was put around it since)."""
        self.active = False
        if vars(self._optimizer).get("step") is self.wrapper:
            del self._optimizer.step
            if self._original_step is not None:
                self._optimizer.step = self._original_step
        self._optimizer._fsdp_int8_batched = None


def batch_int8_updates(optimizer: torch.optim.Optimizer) -> BatchedUpdates:
    """Hold the end-of-step work of ``optimizer``'s updates of int8 weights until each
    ``step()`` ends.

    Within ``step()``, the finiteness verdicts of the updates (on accelerators) and the
    updates of tensor-parallel weights that share row scales wait; when ``step()`` returns
    they are flushed: one device sync and one ``all_reduce`` per process group per step,
    not one per weight. If ``step()`` raises, the held work is dropped (a tensor-parallel
    weight whose update waited keeps its values from before the step). Without it each
    update does that work at once: correct, but on an accelerator one sync per weight, and
    a ``RuntimeWarning`` (once) names this function. Calling it again on the same
    optimizer returns the same handle; an LR scheduler made before or after wraps the
    batched ``step`` as usual.

    Args:
        optimizer: A ``torch.optim.Optimizer`` whose parameters include ``Int8Weight`` s.

    Returns:
        A :class:`BatchedUpdates` handle whose ``remove()`` gives the optimizer its own
        ``step`` back.

    Raises:
        TypeError: ``optimizer`` is no ``torch.optim.Optimizer``, or is an
            :class:`~fsdp_int8.Int8AdamW` / :class:`~fsdp_int8.Int8SGD` (they hold this
            work themselves).

    Example::

        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        fsdp_int8.optim.batch_int8_updates(optimizer)
    """
    from fsdp_int8.optim._base import FusedInt8Optimizer

    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"batch_int8_updates takes a torch.optim.Optimizer, got {type(optimizer).__name__}")
    if isinstance(optimizer, FusedInt8Optimizer):
        raise TypeError(
            f"{type(optimizer).__name__} holds its int8 updates' end-of-step work itself: "
            "batch_int8_updates is for torch.optim optimizers"
        )
    existing = getattr(optimizer, "_fsdp_int8_batched", None)
    if existing is not None:
        return existing
    work = EndOfStep()
    step = optimizer.step  # the class's, or a wrapper installed before (an LR scheduler's)
    handle = BatchedUpdates(optimizer, vars(optimizer).get("step"))

    def step_holding_int8_work(self: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
        if not handle.active:
            return step(*args, **kwargs)
        with work.collecting():
            return step(*args, **kwargs)

    # a bound method, as torch's LR schedulers expect of optimizer.step when they wrap it
    handle.wrapper = optimizer.step = types.MethodType(step_holding_int8_work, optimizer)
    optimizer._fsdp_int8_batched = handle
    return handle
