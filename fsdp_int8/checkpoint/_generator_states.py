"""The noise generators a checkpoint saves per rank, and the one rule for restoring them.

Every path that saves generator states (``save_checkpoint``, the Hugging Face ``Trainer``
mixin, Lightning's callback, torchtitan's checkpoint manager) calls :func:`capture_generators`
and, on resume, :func:`restore_generators`. A capture holds this rank's streams: the
weights' stochastic-rounding bank (its (pp, dp shard) stream and, under tensor
parallelism, the stream of this rank's tp shard), torch's CPU (and CUDA) generators, and
the quantized gradient reduce-scatter's bank; and the **layout** it was taken in
(:func:`sharding_layout`). A stream continues only in the same layout: at one world size
FSDP's 4 shards and HSDP's 2 x 2 give a rank other rows, HSDP's replicas must draw alike,
and (dp, tp) = (2, 2) and (4, 1) hold other parts of each weight. Elsewhere nothing is
restored, and the caller keeps (or reseeds) a stream seeded for the layout it runs in.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from fsdp_int8 import _dist
from fsdp_int8._quant.generators import WEIGHT_ROUNDING
from fsdp_int8._weight.tensor import Int8Weight
from fsdp_int8._weight.tensor_parallel import rounding_generator
from fsdp_int8.checkpoint.errors import CheckpointError
from fsdp_int8.gradients.install import installed_quantized_reduce_scatter

__all__ = [
    "capture_generators", "restore_generators", "sharding_layout", "layout_name", "data_parallel_mesh",
    "read_generators", "restored_everywhere",
]


def data_parallel_mesh(model: nn.Module) -> tuple[DeviceMesh | None, int]:
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


def sharding_layout(model: nn.Module) -> dict[str, Any]:
    """Which part of each weight this rank holds: the world size, the shape of the
    data-parallel mesh (``None``: not sharded) and the tensor-parallel size."""
    mesh, tensor_parallel = data_parallel_mesh(model)
    return {
        "world_size": _dist.world_size(),
        "mesh_shape": None if mesh is None else list(mesh.shape),
        "tensor_parallel": tensor_parallel,
    }


def layout_name(layout: dict[str, Any]) -> str:
    """``layout`` (:func:`sharding_layout`'s) as a short string, e.g. ``world4_dp2x2_tp1``:
    what a capture records, and a key that differs wherever streams cannot continue."""
    shape = layout.get("mesh_shape")
    dp = "unsharded" if shape is None else "dp" + "x".join(str(n) for n in shape)
    return f"world{layout['world_size']}_{dp}_tp{layout.get('tensor_parallel', 1)}"


def capture_generators(model: nn.Module) -> dict[str, Any]:
    """This rank's noise-generator states and the layout they belong to, for a checkpoint
    format of your own.

    The states: the stochastic-rounding streams of ``model``'s int8 weights (the rank's
    and, under tensor parallelism, its tp shard's), torch's CPU (and CUDA) generators, and
    the int8 gradient reduce-scatter's. :func:`save_checkpoint`, the Hugging Face
    ``Int8SaveMixin``, Lightning's ``Int8RoundingCheckpoint`` and torchtitan's
    ``Int8CheckpointManager`` all save this. Every rank calls it for itself; save each
    rank's result. The rounding generator of each device ``model`` is on is created first
    (seeded as a later one would be), so that a restore rewinds it even if it was first
    used after the capture.

    Args:
        model: The model whose streams to capture.

    Returns:
        The states, with ``"layout"``: world size, data-parallel mesh shape and
        tensor-parallel size, e.g. ``"world4_dp2x2_tp1"``.
    """
    for device in {param.device for param in model.parameters()}:  # a DTensor's: its shard's
        WEIGHT_ROUNDING.generator(device)
    for param in model.parameters():  # the streams of tensor-parallel shards, likewise
        local = _dist.local_shard(param)
        if isinstance(local, Int8Weight):
            rounding_generator(local, local.device)
    state: dict[str, Any] = {
        "layout": layout_name(sharding_layout(model)),
        "rounding": WEIGHT_ROUNDING.get_state(),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    gradients = installed_quantized_reduce_scatter(model)
    if gradients is not None:
        state["gradient_rounding"] = gradients.rng_state()
    return state


def restore_generators(state: dict[str, Any], model: nn.Module, *, saved_layout: str | None = None) -> bool:
    """Restore this rank's :func:`capture_generators` state, only if ``model`` runs in the
    layout it was captured in.

    A stream continues only there: at one world size FSDP's 4 shards and HSDP's 2 x 2 give
    a rank other rows (and HSDP replicas must draw alike), and (dp, tp) = (2, 2) and (4, 1)
    hold other parts of each weight, so restored per-rank streams would make replicas
    drift apart. Otherwise nothing changes and the run keeps the streams it was seeded
    with (``shard_model`` seeds them for its layout).

    Args:
        state: This rank's captured states.
        model: The model whose streams they are.
        saved_layout: The layout of a state that records none (:func:`load_checkpoint`
            passes its manifest's); without either, nothing is restored.

    Returns:
        Whether the states were restored (``False``: another layout, or none known; nothing
        changed, and the caller keeps or reseeds the streams it has).
    """
    if _layout_of(state, saved_layout) != layout_name(sharding_layout(model)):
        return False
    WEIGHT_ROUNDING.set_state(state["rounding"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    gradients = installed_quantized_reduce_scatter(model)
    if gradients is not None and "gradient_rounding" in state:
        gradients.set_rng_state(state["gradient_rounding"])
    return True


def _layout_of(state: dict[str, Any], saved_layout: str | None) -> str | None:
    return state.get("layout", saved_layout)


def _cause(error: Exception) -> str:
    """torch.load's error in one line, without its advice to load with
    ``weights_only=False`` (which runs whatever a damaged or foreign file holds)."""
    text = str(error)
    if "WeightsUnpickler error:" in text:
        text = text.split("WeightsUnpickler error:", 1)[1].split("Check the documentation", 1)[0]
    text = " ".join(text.split())
    return f"{type(error).__name__}: {text.split('. ')[0][:200]}"


def read_generators(file: Path) -> dict[str, Any] | None:
    """This rank's generator states saved in ``file`` (a :func:`capture_generators`
    state); ``None`` if there is no such file.

    Raises:
        CheckpointError: the file cannot be read as generator states, naming the rank and
            the file.
    """
    if not file.is_file():
        return None
    try:
        state = torch.load(file, weights_only=True)
    except Exception as error:  # a damaged file: each torch.load error is its own type
        problem = _cause(error)
    else:
        problem = None if isinstance(state, dict) and {"rounding", "torch"} <= state.keys() else (
            f"it holds a {type(state).__name__}, not the generator states save_checkpoint writes"
        )
    if problem is None:
        return state
    raise CheckpointError(
        f"rank {_dist.rank()}: the generator states in {file} cannot be read ({problem}): the "
        "file is damaged or not one save_checkpoint wrote; restore it from a copy"
    )


def restored_everywhere(
    state: dict[str, Any] | None, model: nn.Module, saved_layout: str | None, where: Path
) -> dict[str, Any] | None:
    """``state`` if every rank has generator states of this run's layout to restore, else
    ``None`` on every rank: ranks that restored their streams beside ranks that reseeded
    theirs would draw from unrelated streams. Collective. A checkpoint that holds states
    for some ranks only is warned about, naming them."""
    ours = layout_name(sharding_layout(model))
    if state is None:
        reason = "no generator states"
    elif _layout_of(state, saved_layout) != ours:
        reason = f"generator states of layout {_layout_of(state, saved_layout)}, not this run's {ours}"
    else:
        reason = None
    reasons = _dist.all_gather(reason)
    if not any(reasons):
        return state
    if not all(reasons):  # mixed: some ranks could restore
        listed = "; ".join(f"rank {rank} has {why}" for rank, why in enumerate(reasons) if why)
        warnings.warn(
            f"checkpoint {where}: {listed}, so no rank restores its generator states (every rank "
            "reseeds them): training continues from the saved weights, not bit-identically",
            stacklevel=3,
        )
    return None
