"""``Int8SGD``: SGD (momentum, Nesterov, L2 weight decay) with one requantization per int8
weight and step."""

from __future__ import annotations

from typing import Any

import torch
from torch.optim.optimizer import ParamsT

from fsdp_int8.optim._base import FusedInt8Optimizer, Slot
from fsdp_int8.optim._checks import check_number
from fsdp_int8._dist import local_shard

__all__ = ["Int8SGD"]


class Int8SGD(FusedInt8Optimizer):
    """SGD (momentum, Nesterov, L2 weight decay) for int8 weights, one requantization per step.

    The update of ``torch.optim.SGD`` with ``dampening=0``, in fp32, bit-identical to it
    before requantization::

        g = g + weight_decay * w
        b = g                      (first step)     b = momentum * b + g   (later steps)
        g = g + momentum * b       (nesterov)       g = b                  (otherwise)
        w = w - lr * g

    As in :class:`~fsdp_int8.Int8AdamW`: each int8 weight is dequantized once, updated in
    fp32 and requantized once with its own rounding; any mix of int8 weights, plain tensors
    and FSDP2 DTensors works, DTensors through their local tensors (no collective but the
    finite-gradient verdict); a NaN or Inf gradient raises
    :class:`~fsdp_int8.guard.NonFiniteGradientError` before anything changes; ``lr == 0``
    leaves int8 weights untouched; :attr:`grad_norm` and :attr:`max_grad_norm` read the
    clipping inside backward. State: ``momentum_buffer`` (fp32, placed like its parameter,
    ``torch.optim.SGD``'s layout) when ``momentum != 0``, none otherwise.

    Args:
        params: Parameters or parameter groups.
        lr: Learning rate, >= 0.
        momentum: Momentum factor, >= 0; 0 keeps no state.
        weight_decay: L2 penalty added to the gradient, >= 0.
        nesterov: Nesterov momentum (needs ``momentum > 0``).
        step_in_backward: Update each parameter inside backward and free its gradient
            at once (as for :class:`~fsdp_int8.Int8AdamW`).
        step_elements: The most parameter elements one update works on at once (as for
            :class:`~fsdp_int8.Int8AdamW`).
        grad_dtype: Keep gradients in this dtype until ``step()`` (as for
            :class:`~fsdp_int8.Int8AdamW`).
        max_grad_norm: Clip inside backward by the estimated global gradient norm (with
            ``step_in_backward=True`` only; as for :class:`~fsdp_int8.Int8AdamW`).

    Raises:
        ValueError: a hyperparameter out of range, ``nesterov`` without momentum,
            ``step_elements < 1``, an invalid ``grad_dtype`` or ``max_grad_norm`` (as for
            :class:`~fsdp_int8.Int8AdamW`), or a complex or non-floating parameter.
        TypeError: a hyperparameter of the wrong type (``nesterov`` not a bool).
        RuntimeError: as for :class:`~fsdp_int8.Int8AdamW` (sparse or misplaced gradients,
            plain parameters under DDP with ``step_in_backward`` or ``grad_dtype``).
        NonFiniteGradientError: from ``step()``, a gradient holds NaN or Inf on some rank.
    """

    def __init__(
        self,
        params: ParamsT,
        lr: float | torch.Tensor,
        momentum: float = 0.0,
        weight_decay: float = 0.0,
        nesterov: bool = False,
        *,
        step_in_backward: bool = False,
        step_elements: int | None = None,
        grad_dtype: torch.dtype | None = None,
        max_grad_norm: float | None = None,
    ) -> None:
        defaults = dict(lr=lr, momentum=momentum, weight_decay=weight_decay, nesterov=nesterov)
        self._check_group(defaults)
        super().__init__(params, defaults, step_in_backward=step_in_backward, step_elements=step_elements,
                         grad_dtype=grad_dtype, max_grad_norm=max_grad_norm)

    def _check_group(self, group: dict[str, Any]) -> None:
        check_number("lr", group["lr"], 0.0)
        check_number("momentum", group["momentum"], 0.0)
        check_number("weight_decay", group["weight_decay"], 0.0)
        if not isinstance(group["nesterov"], bool):
            raise TypeError(f"nesterov must be a bool, got {group['nesterov']!r}")
        if group["nesterov"] and group["momentum"] <= 0:
            raise ValueError("Nesterov momentum needs momentum > 0")

    def _init_state(self, param, local, group) -> dict:
        # torch.optim.SGD makes the buffer a copy of the first gradient: momentum * 0 + g
        # is that gradient exactly, so a zero buffer gives the same values (and lets a
        # large parameter be updated in pieces of rows)
        if float(group["momentum"]) == 0:
            return {}
        return {"momentum_buffer": self._fp32_state(param, local)}

    def _update(self, slots: list[Slot], group: dict[str, Any]) -> None:
        lr, momentum = float(group["lr"]), float(group["momentum"])
        weight_decay, nesterov = float(group["weight_decay"]), group["nesterov"]
        works = [s.work for s in slots]
        grads = [s.grad for s in slots]
        if weight_decay != 0:
            grads = torch._foreach_add(grads, works, alpha=weight_decay)
        if momentum != 0:
            bufs = [local_shard(s.state["momentum_buffer"]) for s in slots]
            torch._foreach_mul_(bufs, momentum)
            torch._foreach_add_(bufs, grads, alpha=1.0)
            grads = torch._foreach_add(grads, bufs, alpha=momentum) if nesterov else bufs
        torch._foreach_add_(works, grads, alpha=-lr)
