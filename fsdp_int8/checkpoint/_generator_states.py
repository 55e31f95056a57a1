"""The noise generators a checkpoint saves per rank, so that a resume at the same world size
and layout draws exactly the noise an uninterrupted run would: the weights'
stochastic-rounding bank (its (pp, dp shard) stream and, under tensor parallelism, the
stream of this rank's tp shard), torch's CPU (and CUDA) generators, and the quantized
gradient reduce-scatter's bank. Also: which layout a model is sharded in (the data-parallel
mesh and the tensor-parallel size), which decides whether saved streams can continue."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from fsdp_int8 import _dist
from fsdp_int8._generators import WEIGHT_ROUNDING
from fsdp_int8._tensor_parallel import rounding_stream
from fsdp_int8.gradients.install import installed_quantized_reduce_scatter
from fsdp_int8.weight import Int8Weight


def capture(model: nn.Module) -> dict[str, Any]:
    """This rank's generator states (``model``'s gradient reduce-scatter's, if it has one).

    The rounding generator of each device ``model`` is on is created first (a new one is
    seeded as a later one would be: nothing observable changes), so that :func:`restore`
    rewinds it even if it was first used after the capture.
    """
    for device in {param.device for param in model.parameters()}:  # a DTensor's: its shard's
        WEIGHT_ROUNDING.generator(device)
    for param in model.parameters():  # the streams of tensor-parallel shards, likewise
        local = _dist.local_shard(param)
        stream = rounding_stream(local) if isinstance(local, Int8Weight) else None
        if stream is not None:
            WEIGHT_ROUNDING.generator(local.device, stream)
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


def sharding(model: nn.Module) -> tuple[DeviceMesh | None, int]:
    """``(the data-parallel mesh model is sharded over, its tensor-parallel size)``:
    ``(None, 1)`` unsharded. A parameter split by tensor parallelism lives on a mesh with a
    ``"tp"`` dim (FSDP2's dp x tp mesh): the dp mesh is the rest of it."""
    first = None
    for param in model.parameters():
        if not isinstance(param, DTensor):
            continue
        mesh = param.device_mesh
        names = mesh.mesh_dim_names or ()
        if _dist.TENSOR_PARALLEL_DIM in names:
            return _dist.without_tensor_parallel(mesh), mesh.size(names.index(_dist.TENSOR_PARALLEL_DIM))
        first = first or mesh
    return first, 1


def layout(model: nn.Module) -> list[int] | None:
    """The shape of the data-parallel mesh ``model`` is sharded over (``None``: not
    sharded). Saved streams continue only on the same world size *and* layout: at 4
    ranks, FSDP's 4 shards and HSDP's 2 x 2 give the same rank other rows (and HSDP
    replicas must draw alike); see :func:`tensor_parallel_size` for the tp dim."""
    mesh, _ = sharding(model)
    return None if mesh is None else list(mesh.shape)


def tensor_parallel_size(model: nn.Module) -> int:
    """How many ways tensor parallelism splits ``model``'s blocks (1: not at all). At one
    world size, (dp, tp) = (2, 2) and (4, 1) hold other parts of each weight per rank."""
    return sharding(model)[1]
