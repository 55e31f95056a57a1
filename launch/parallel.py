"""The launcher's device mesh (data parallel, HSDP replicas, tensor parallel) and what
depends on it: which batch a rank trains on, and gradient clipping across meshes.

Ranks are laid out as ``init_device_mesh`` does, row-major with the ``"tp"`` dim last:
tensor-parallel peers are neighbouring ranks (one node's fast links on GPUs) and share
one data-parallel coordinate, so they must see the same batch.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor

PIPELINE_NOT_IN_LAUNCHER = (
    "--pp {pp}: pipeline parallelism is available through the library API (shard each "
    "torch.distributed.pipelining stage with fsdp_int8.shard_model on its dp sub-mesh of a "
    "('pp', 'dp') mesh; see docs/parallelism.md) but not in the demo launcher yet: use --pp 1"
)


def layout_error(world: int, *, tp: int = 1, pp: int = 1, replicas: int = 1) -> str | None:
    """Why ``world`` ranks cannot run ``tp`` x ``replicas`` (x ``pp``), or ``None`` if they can."""
    if pp != 1:
        return PIPELINE_NOT_IN_LAUNCHER.format(pp=pp)
    if world % tp:
        return f"--tp {tp} does not divide the world size {world}"
    if (world // tp) % replicas:
        return f"--replicas {replicas} does not divide the world size {world}" + (
            f" / --tp {tp} = {world // tp} data-parallel ranks" if tp > 1 else "")
    return None


def device_mesh(device_type: str, *, tp: int = 1, replicas: int = 1) -> DeviceMesh:
    """All ranks: ``(dp,)`` (unnamed, as before), ``(replicate, shard)`` for HSDP, and with
    ``tp > 1`` a last ``"tp"`` dim: ``("dp", "tp")`` or ``("dp_replicate", "dp_shard", "tp")``."""
    world = dist.get_world_size()
    error = layout_error(world, tp=tp, replicas=replicas)
    if error:
        raise ValueError(error)
    dp = world // tp
    if tp == 1:
        if replicas == 1:
            return init_device_mesh(device_type, (world,))
        return init_device_mesh(device_type, (replicas, dp // replicas), mesh_dim_names=("replicate", "shard"))
    if replicas == 1:
        return init_device_mesh(device_type, (dp, tp), mesh_dim_names=("dp", "tp"))
    return init_device_mesh(device_type, (replicas, dp // replicas, tp),
                            mesh_dim_names=("dp_replicate", "dp_shard", "tp"))


def has_tp(mesh: DeviceMesh) -> bool:
    return "tp" in (mesh.mesh_dim_names or ())


def dp_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """``mesh`` without its ``"tp"`` dim: where FSDP2 shards and gradients are reduced."""
    if not has_tp(mesh):
        return mesh
    return mesh[tuple(name for name in mesh.mesh_dim_names if name != "tp")]


def data_rank(mesh: DeviceMesh) -> tuple[int, int]:
    """``(index, count)`` of this rank's data-parallel coordinate: the batch it trains on.
    Tensor-parallel peers get the same index; the dp dims are flattened row-major."""
    dims = dp_mesh(mesh)
    index = 0
    for dim, coordinate in enumerate(dims.get_coordinate()):
        index = index * dims.size(dim) + coordinate
    return index, dims.size()


def clip_grad_norm_(parameters, max_norm: float) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_`` for gradients on different meshes: under tensor
    parallelism the blocks' linear weights live on the (dp, tp) mesh and the rest (embedding,
    norms, head) on the dp mesh, which torch's version cannot stack into one norm.

    Sums the squares of each local shard, all-reduces each sum over the mesh dims its
    gradient is split on (``Shard`` or FSDP2's ``_StridedShard``; a replicated dim holds
    copies), and scales every local shard in place. Returns the total norm, on every rank."""
    grads = [p.grad for p in parameters if p.grad is not None]
    if not grads:
        return torch.zeros(())
    sums: dict[tuple, torch.Tensor] = {}
    for grad in grads:
        key, local = (None, ()), grad
        if isinstance(grad, DTensor):
            if any(p.is_partial() for p in grad.placements):
                raise ValueError(f"gradient with a partial placement {grad.placements}: reduce it first")
            key = (grad.device_mesh, tuple(d for d, p in enumerate(grad.placements) if not p.is_replicate()))
            local = grad.to_local()
        square = local.detach().float().square().sum()
        sums[key] = sums[key] + square if key in sums else square
    for (mesh, dims), total in sums.items():
        for dim in dims:
            dist.all_reduce(total, group=mesh.get_group(dim))
    norm = torch.stack(list(sums.values())).sum().sqrt()
    scale = (max_norm / (norm + 1e-6)).clamp(max=1.0)
    local_grads = [g.to_local() if isinstance(g, DTensor) else g for g in grads]
    torch._foreach_mul_(local_grads, scale.to(local_grads[0].dtype))
    return norm
