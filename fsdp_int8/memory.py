"""Memory accounting: the bytes each rank keeps between steps for its own parameters.

Weights, gradients and optimizer states are counted from each rank's local tensors
(the DTensor shard of an FSDP2 parameter; int8 data plus scales for an
:class:`~fsdp_int8.Int8Weight`). Numbers per layout: docs/optim.md.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn

from fsdp_int8._dist import local_shard

__all__ = ["PersistentBytes", "persistent_bytes"]


@dataclass(frozen=True)
class PersistentBytes:
    """Bytes this rank keeps between steps for its own parameter elements.

    Attributes:
        params: Local parameter elements (each rank's shard of each parameter, once).
        weights: Their storage: int8 data + fp32 scales for int8 weights, ``numel x
            element size`` for the others.
        grads: Their gradients (see :func:`persistent_bytes` for the dtype counted).
        states: Every tensor of the optimizer's state of these parameters (moments,
            scales, step counters), local shards only.
    """

    params: int
    weights: int
    grads: int
    states: int

    @property
    def total(self) -> int:
        """``weights + grads + states``."""
        return self.weights + self.grads + self.states

    @property
    def per_param(self) -> float:
        """``total / params`` (0.0 without parameters)."""
        return self.total / self.params if self.params else 0.0


def _tensor_bytes(tensor: torch.Tensor) -> int:
    """Storage bytes of this rank's part of ``tensor``, through wrapper subclasses."""
    local = local_shard(tensor)
    if hasattr(local, "__tensor_flatten__"):  # Int8Weight, or another library's subclass
        names, _ = local.__tensor_flatten__()
        return sum(_tensor_bytes(getattr(local, name)) for name in names)
    return local.numel() * local.element_size()


def persistent_bytes(
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    grad_dtype: torch.dtype | None = None,
) -> PersistentBytes:
    """Add up what this rank stores for its own parameters: weights, gradients, states.

    Counts storage bytes of each rank's local tensors (the DTensor shard of an FSDP2
    parameter; int8 data plus scales for an :class:`~fsdp_int8.Int8Weight`), each
    parameter once (tied weights too). Call it between steps, while FSDP2 parameters are
    sharded. Transient buffers (all-gathered weights, activations, the fp32 working
    copies of a step) are not persistent and not counted. Numbers per layout:
    docs/optim.md, "Bytes per parameter".

    Args:
        model: The model (sharded or not).
        optimizer: Its optimizer; ``None`` counts no state.
        grad_dtype: Count every gradient of a parameter that requires grad at this dtype
            (e.g. ``torch.bfloat16`` for the cost with bf16 gradients). ``None``: the
            existing gradient's dtype, or the parameter's dtype (the training dtype
            autograd and FSDP2 produce it in) when ``.grad`` is ``None`` (after
            ``zero_grad()``).

    Returns:
        A :class:`PersistentBytes`; ``.per_param`` is the bytes per local parameter element.

    Example::

        report = fsdp_int8.memory.persistent_bytes(model, optimizer)
        report.per_param   # bytes per parameter element this rank keeps
    """
    params = list({id(p): p for p in model.parameters()}.values())
    count = weights = grads = states = 0
    for param in params:
        local = local_shard(param)
        count += local.numel()
        weights += _tensor_bytes(param)
        if param.requires_grad:
            dtype = grad_dtype or (param.grad.dtype if param.grad is not None else param.dtype)
            grads += local.numel() * torch.empty((), dtype=dtype).element_size()
        if optimizer is not None and param in optimizer.state:
            for value in optimizer.state[param].values():
                if isinstance(value, torch.Tensor):
                    states += _tensor_bytes(value)
    return PersistentBytes(params=count, weights=weights, grads=grads, states=states)
