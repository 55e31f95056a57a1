"""Whether an optimizer's update of an int8 weight came out finite: read at once on the
CPU, once per optimizer step on accelerators.

int8 cannot hold NaN or Inf, so every requantizing update checks its new row scales. On
the CPU the verdict is read right away and a bad update raises before it is written
(the weight keeps its values). Reading a device flag back to the host, though, stalls an
accelerator's queue: once per weight and step that would be a stall per parameter. So on
an accelerator the update writes its result and leaves its flag (a 0-dim bool tensor its
own kernel computed) in the end-of-step queue :data:`VERDICTS`, and all held flags are
read with one sync when the step ends (:mod:`~fsdp_int8._weight.end_of_step`: after every
``torch.optim`` optimizer's ``step()``, and whenever ``VERDICTS.cap`` flags have piled up
through updates made outside an optimizer). The error then says how many updates went wrong; those weights
hold the non-finite rows, as a plain tensor would after the same update.
(``save_checkpoint`` refuses non-finite state on its own, on every rank at once.)
"""

from __future__ import annotations

from typing import Callable

import torch

from fsdp_int8._weight import end_of_step


def _read(pending: list[tuple[torch.Tensor, str]]) -> None:
    """Read held verdicts (one device sync per device); raise ``ValueError`` if any update
    was not finite."""
    by_device: dict[torch.device, list[int]] = {}
    for index, (finite, _) in enumerate(pending):
        by_device.setdefault(finite.device, []).append(index)
    bad: list[str] = []
    for indices in by_device.values():
        verdicts = torch.stack([pending[i][0] for i in indices]).tolist()  # the one sync
        bad += [pending[i][1] for i, ok in zip(indices, verdicts) if not ok]
    if bad:
        raise ValueError(
            f"{len(bad)} of {len(pending)} int8 weight updates since the last check produced "
            "non-finite values (NaN or Inf), which int8 cannot hold, in weights of shape "
            f"{', '.join(sorted(set(bad)))}: those weights now hold non-finite rows. Check "
            "the loss, gradients and learning rate; fsdp_int8.guard.guard_finite_steps(optimizer) "
            "refuses a step with non-finite gradients before it changes anything. (On "
            "accelerators this check runs once per optimizer step, not once per weight, to "
            "avoid a device sync per parameter.)"
        )


# (flag, shape) of each update whose verdict waits; the cap bounds manual update loops.
VERDICTS = end_of_step.held_work("update verdicts", _read, cap=1024)


def defers(device: torch.device) -> bool:
    """Whether updates on ``device`` leave their verdict for the step's single check."""
    return device.type != "cpu"


def check(finite: torch.Tensor, shape: tuple[int, ...], raise_error: Callable[[], None]) -> None:
    """``finite`` (0-dim bool) is the verdict of an update of a weight of ``shape``:
    ``raise_error()`` at once if it is False on the CPU, or :func:`defer` it on an accelerator."""
    if defers(finite.device):
        defer(finite, shape)
    elif not bool(finite):
        raise_error()


def defer(finite: torch.Tensor, shape: tuple[int, ...]) -> None:
    """Hold an update's verdict until the step ends (no device sync here)."""
    VERDICTS.hold((finite, str(list(shape))))
