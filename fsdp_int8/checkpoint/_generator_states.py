"""The noise generators a checkpoint saves per rank, so that a resume at the same world size
draws exactly the noise an uninterrupted run would: the weights' stochastic-rounding bank,
torch's CPU (and CUDA) generators, and the quantized gradient reduce-scatter's bank."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn

from fsdp_int8._generators import WEIGHT_ROUNDING
# The one import of the gradient reduce-scatter: retarget it here when that module moves.
from fsdp_int8.gradients.install import installed_quantized_reduce_scatter


def capture(model: nn.Module) -> dict[str, Any]:
    """This rank's generator states (``model``'s gradient reduce-scatter's, if it has one)."""
    state: dict[str, Any] = {"rounding": WEIGHT_ROUNDING.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    gradients = installed_quantized_reduce_scatter(model)
    if gradients is not None:
        state["gradient_rounding"] = gradients.rng_state()
    return state


def restore(state: dict[str, Any], model: nn.Module) -> None:
    """Restore states returned by :func:`capture` (each part only where it can go)."""
    WEIGHT_ROUNDING.set_state(state["rounding"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    gradients = installed_quantized_reduce_scatter(model)
    if gradients is not None and "gradient_rounding" in state:
        gradients.set_rng_state(state["gradient_rounding"])
