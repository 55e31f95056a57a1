"""Whether an optimizer's update of an int8 tensor came out finite: read at once on the
CPU, once per optimizer step on accelerators.

int8 cannot hold NaN or Inf, so every requantizing update checks its new scales: an int8
weight's rows, and the blocks of :class:`~fsdp_int8.Int8AdamW`'s 8-bit states. On the CPU
the verdict is read right away and a bad update raises before it is written (the tensor
keeps its values). Reading a device flag back to the host, though, stalls an
accelerator's queue: once per tensor and step that would be a stall per parameter. So on
an accelerator the update writes its result and hands its flag (a 0-dim bool tensor its
own kernel computed) to the optimizer step that made it
(:mod:`~fsdp_int8._weight.end_of_step`), and all of the step's flags are read with one
sync when the step ends. The error then says how many updates went wrong; those tensors
hold the non-finite rows, as a plain tensor would after the same update.

An update made outside a step that collects verdicts (a ``torch.optim`` optimizer not
passed to :func:`fsdp_int8.optim.batch_int8_updates`, an update by hand) reads its flag at
once: correct, with a device sync per tensor, and a warning once per process that says
how to batch them. (``save_checkpoint`` refuses non-finite state on its own, on every
rank at once.)
"""

from __future__ import annotations

import warnings
from typing import Callable

import torch

from fsdp_int8._weight import end_of_step

__all__ = ["VERDICTS", "defers", "check", "describe", "defer"]


def _read(pending: list[tuple[torch.Tensor, str]]) -> None:
    """Read held verdicts (one device sync per device); raise ``ValueError`` if any update
    was not finite. Each item: ``(flag, what was updated)``."""
    by_device: dict[torch.device, list[int]] = {}
    for index, (finite, _) in enumerate(pending):
        by_device.setdefault(finite.device, []).append(index)
    bad: list[str] = []
    for indices in by_device.values():
        verdicts = torch.stack([pending[i][0] for i in indices]).tolist()  # the one sync
        bad += [pending[i][1] for i, ok in zip(indices, verdicts) if not ok]
    if bad:
        raise ValueError(
            f"{len(bad)} of {len(pending)} int8 updates since the last check produced "
            "non-finite values (NaN or Inf), which int8 cannot hold, in "
            f"{', '.join(sorted(set(bad)))}: those now hold non-finite rows. Check the loss, "
            "gradients and learning rate; fsdp_int8.guard.guard_finite_steps(optimizer) "
            "refuses a step with non-finite gradients before it changes anything. (On "
            "accelerators this check runs once per optimizer step, not once per tensor, to "
            "avoid a device sync per parameter.)"
        )


# The kind of end-of-step work the verdicts are: (flag, "weight [rows, cols]") items.
VERDICTS = end_of_step.register_kind("update verdicts", _read)


def defers(device: torch.device) -> bool:
    """Whether updates on ``device`` hand their verdict to the step's single check."""
    return device.type != "cpu"


def check(finite: torch.Tensor, what: str, raise_error: Callable[[], None]) -> None:
    """``finite`` (0-dim bool) is the verdict of an update of ``what`` (e.g. ``"weight
    [6, 32]"``): ``raise_error()`` at once if it is False on the CPU, or :func:`defer` it on
    an accelerator."""
    if defers(finite.device):
        defer(finite, what)
    elif not bool(finite):
        raise_error()


def describe(kind: str, shape: tuple[int, ...]) -> str:
    """How a verdict names what was updated: ``"weight [6, 32]"``."""
    return f"{kind} {list(shape)}"


def defer(finite: torch.Tensor, what: str) -> None:
    """Hand an update's verdict to the step collecting verdicts (no device sync here); with
    none collecting, read it at once."""
    if end_of_step.hold(VERDICTS, (finite, what)):
        return
    if defers(finite.device):
        warnings.warn(
            "fsdp_int8: an int8 update outside an optimizer step that batches its checks read "
            "its finiteness flag at once, a device sync per updated tensor. Int8AdamW and "
            "Int8SGD batch them; for a torch.optim optimizer call "
            "fsdp_int8.optim.batch_int8_updates(optimizer) once (one sync per step).",
            RuntimeWarning, stacklevel=3,
        )
    _read([(finite, what)])
