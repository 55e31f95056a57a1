"""The optimizer that checkpoints save and load: the innermost one behind forwarding
wrappers (accelerate's ``AcceleratedOptimizer``, Lightning's ``LightningOptimizer``, ...).

Such a wrapper holds the real optimizer in ``.optimizer`` and forwards ``param_groups``,
``state``, ``state_dict`` and ``load_state_dict`` to it; its own ``step`` adds logic that
must not run inside a load (a gradient scaler, Lightning's strategy) and its pickled
state is not an optimizer's. So every read and write goes to the optimizer inside, which
is the same state seen through fewer layers; a wrapper that does not share that state
(an optimizer of its own that merely refers to another) is refused, not guessed at.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["innermost_optimizer"]

_MAX_DEPTH = 16  # wrappers of wrappers; more means a cycle of references


def _shares_state(wrapper: Any, inner: Any) -> bool:
    """Whether ``wrapper``'s ``param_groups`` and ``state`` are ``inner``'s very objects."""
    return (
        getattr(wrapper, "param_groups", None) is inner.param_groups
        and getattr(wrapper, "state", None) is inner.state
    )


def innermost_optimizer(optimizer: Any) -> torch.optim.Optimizer:
    """The ``torch.optim.Optimizer`` that ``optimizer`` is or forwards to.

    Follows ``.optimizer`` attributes (accelerate's wrapper holds the optimizer there,
    Lightning's exposes it as a property) as long as the next object is optimizer-like
    and shares ``param_groups`` and ``state`` with the one before it.

    Raises:
        TypeError: ``optimizer`` is no ``torch.optim.Optimizer`` and does not forward to
            one, or its ``.optimizer`` holds state of its own (not forwarded).
    """
    current = optimizer
    for _ in range(_MAX_DEPTH):
        inner = getattr(current, "optimizer", None)
        if inner is None or inner is current or not hasattr(inner, "param_groups"):
            break
        if not _shares_state(current, inner):
            raise TypeError(
                f"the optimizer passed ({type(optimizer).__name__}) wraps "
                f"{type(inner).__name__} in .optimizer, but "
                f"{type(current).__name__}'s param_groups and state are not that "
                "optimizer's (a forwarding wrapper shares both): it is not clear which of "
                "the two to save or load. Pass the optimizer that holds the state"
            )
        current = inner
    else:
        raise TypeError(f"{type(optimizer).__name__}: more than {_MAX_DEPTH} nested .optimizer wrappers")
    if not isinstance(current, torch.optim.Optimizer):
        raise TypeError(
            f"expected a torch.optim.Optimizer, or a wrapper that forwards to one in "
            f".optimizer (accelerate, Lightning), got {type(optimizer).__name__}"
        )
    return current
