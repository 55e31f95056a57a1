"""The noise generators a checkpoint saves per rank, so that a resume at the same world size
draws exactly the noise an uninterrupted run would: the weights' stochastic-rounding bank,
torch's CPU (and CUDA) generators, and the quantized gradient reduce-scatter's bank."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn

from fsdp_int8 import _dist
from fsdp_int8._generators import WEIGHT_ROUNDING
from fsdp_int8.gradients.install import installed_quantized_reduce_scatter


def capture(model: nn.Module) -> dict[str, Any]:
    """This rank's generator states (``model``'s gradient reduce-scatter's, if it has one).

    The rounding generator of each device ``model`` is on is created first (a new one is
    seeded as a later one would be: nothing observable changes), so that :func:`restore`
    rewinds it even if it was first used after the capture.
    """
    for device in {param.device for param in model.parameters()}:  # a DTensor's: its shard's
        WEIGHT_ROUNDING.generator(device)
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


def layout(model: nn.Module) -> list[int] | None:
    """The shape of the mesh ``model`` is sharded over (``None``: not sharded). Saved
    streams continue only on the same world size *and* layout: at 4 ranks, FSDP's 4 shards
    and HSDP's 2 x 2 give the same rank other rows (and HSDP replicas must draw alike)."""
    mesh = _dist.mesh_of(model)
    return None if mesh is None else list(mesh.shape)
