"""Gradients kept in a narrower dtype between backward and ``step()``.

Stepping after backward, every parameter's gradient lives from its reduce-scatter to the
step: under FSDP2 in the group's original dtype (fp32 when blocks hold fp32 norms), the
largest part of the peak (docs/memory.md). A post-accumulate-grad hook on each parameter
casts its gradient to the optimizer's ``grad_dtype`` the moment it is final (FSDP2 calls
it right after the reduce-scatter, autograd after accumulation), so the fp32 buffer is
freed before the next group's gradients arrive. The update reads the narrow gradient into
its fp32 work pieces, so only the gradient's own rounding differs from fp32 gradients.

Each watched parameter's ``grad_dtype`` attribute is set to ``None`` (any dtype): FSDP2
and autograd first assign the gradient in the parameter's dtype, the hook then replaces it.
"""

from __future__ import annotations

from typing import Any

import torch

from fsdp_int8._dist import local_shard
from fsdp_int8.optim._hooks import watch_new
from fsdp_int8.optim._in_backward import check_hook_sees_reduced_gradient

# What a gradient may be kept in: floating dtypes no wider than the fp32 the update reads.
GRAD_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def check_grad_dtype(grad_dtype: Any, step_in_backward: bool) -> None:
    """Raise if ``grad_dtype`` is not an optimizer's valid ``grad_dtype`` argument."""
    if grad_dtype is None:
        return
    if not isinstance(grad_dtype, torch.dtype) or grad_dtype not in GRAD_DTYPES:
        raise ValueError(
            f"grad_dtype must be None or one of {', '.join(str(d) for d in GRAD_DTYPES)}, got {grad_dtype!r}"
        )
    if step_in_backward:
        raise ValueError(
            "grad_dtype keeps gradients until step(); with step_in_backward=True each gradient is "
            "applied and freed as it arrives, so there is none to keep. Drop one of the two."
        )


class GradientCast:
    """Casts each watched parameter's final gradient to one dtype, on arrival."""

    def __init__(self, optimizer_name: str, dtype: torch.dtype) -> None:
        self._optimizer_name = optimizer_name
        self.dtype = dtype
        self._names: dict[int, str] = {}

    def watch(self, params: list[torch.Tensor], group_index: int) -> None:
        """Cast the gradients of ``params`` (of parameter group ``group_index``) on arrival."""
        for param in watch_new(self, self._names, params, group_index, GradientCast._on_gradient):
            param.grad_dtype = None

    @torch.no_grad()
    def _on_gradient(self, param: torch.Tensor) -> None:
        grad = param.grad
        if grad is None or grad.dtype == self.dtype:
            return
        check_hook_sees_reduced_gradient(
            param, f"{self._optimizer_name}(grad_dtype={self.dtype})", self._names[id(param)],
            "use grad_dtype=None",
        )
        if local_shard(grad).is_sparse:
            return  # the step refuses sparse gradients, naming the optimizer
        param.grad = grad.to(self.dtype)
