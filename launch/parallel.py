"""The launcher's device mesh (pipeline stages, data parallel, HSDP replicas, tensor
parallel) and what depends on it: which batch a rank trains on, and gradient clipping
across meshes.

Ranks are laid out as ``init_device_mesh`` does, row-major with a ``"pp"`` dim first and
the ``"tp"`` dim last: tensor-parallel peers are neighbouring ranks (one node's fast links
on GPUs) and share one data-parallel coordinate, so they must see the same batch; so must
the pipeline stages of one data-parallel coordinate (the first feeds its inputs, the last
scores its targets).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor


def layout_error(world: int, *, tp: int = 1, pp: int = 1, replicas: int = 1) -> str | None:
    """Why ``world`` ranks cannot run ``pp`` x ``tp`` x ``replicas``, or ``None`` if they can."""
    if world % (pp * tp):
        if pp == 1:
            return f"--tp {tp} does not divide the world size {world}"
        return (f"--pp {pp}" + (f" x --tp {tp} = {pp * tp}" if tp > 1 else "")
                + f" does not divide the world size {world}")
    if (world // (pp * tp)) % replicas:
        return f"--replicas {replicas} does not divide the world size {world}" + (
            f" / {pp * tp} (--pp x --tp) = {world // (pp * tp)} data-parallel ranks" if pp > 1
            else f" / --tp {tp} = {world // tp} data-parallel ranks" if tp > 1 else "")
    return None


def device_mesh(device_type: str, *, tp: int = 1, replicas: int = 1, pp: int = 1) -> DeviceMesh:
    """All ranks: ``(dp,)`` (unnamed), ``(replicate, shard)`` for HSDP, and with
    ``tp > 1`` a last ``"tp"`` dim: ``("dp", "tp")`` or ``("dp_replicate", "dp_shard", "tp")``.
    With ``pp > 1`` a first ``"pp"`` dim, and the data-parallel dims always named:
    ``("pp", "dp")``, ``("pp", "dp", "tp")``, ``("pp", "replicate", "shard")``, ...
    (:func:`stage_mesh` is what a stage shards over)."""
    world = dist.get_world_size()
    error = layout_error(world, tp=tp, replicas=replicas, pp=pp)
    if error:
        raise ValueError(error)
    dp = world // (tp * pp)
    if tp == 1:
        if replicas == 1:
            shape, names = (dp,), ("dp",) if pp > 1 else None
        else:
            shape, names = (replicas, dp // replicas), ("replicate", "shard")
    elif replicas == 1:
        shape, names = (dp, tp), ("dp", "tp")
    else:
        shape, names = (replicas, dp // replicas, tp), ("dp_replicate", "dp_shard", "tp")
    if pp > 1:
        shape, names = (pp, *shape), ("pp", *names)
    return init_device_mesh(device_type, shape, mesh_dim_names=names)


def has_tp(mesh: DeviceMesh) -> bool:
    return "tp" in (mesh.mesh_dim_names or ())


def has_pp(mesh: DeviceMesh) -> bool:
    return "pp" in (mesh.mesh_dim_names or ())


def stage_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """``mesh`` without its ``"pp"`` dim: the ranks that hold this rank's pipeline stage,
    what the stage is sharded over (the whole mesh without pipeline parallelism)."""
    if not has_pp(mesh):
        return mesh
    return mesh[tuple(name for name in mesh.mesh_dim_names if name != "pp")]


def pipeline_stage(mesh: DeviceMesh) -> tuple[int, int]:
    """``(index, count)`` of this rank's pipeline stage: ``(0, 1)`` without a ``"pp"`` dim."""
    return (mesh["pp"].get_local_rank(), mesh["pp"].size()) if has_pp(mesh) else (0, 1)


def pp_group(mesh: DeviceMesh) -> dist.ProcessGroup | None:
    """The group of this rank's pipeline stages (sums over the whole model), or ``None``."""
    return mesh["pp"].get_group() if has_pp(mesh) else None


def dp_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """``mesh`` without its ``"pp"`` and ``"tp"`` dims: where FSDP2 shards and gradients are reduced."""
    if not has_tp(mesh) and not has_pp(mesh):
        return mesh
    return mesh[tuple(name for name in mesh.mesh_dim_names if name not in ("pp", "tp"))]


def data_rank(mesh: DeviceMesh) -> tuple[int, int]:
    """``(index, count)`` of this rank's data-parallel coordinate: the batch it trains on.
    Tensor-parallel peers get the same index; the dp dims are flattened row-major."""
    dims = dp_mesh(mesh)
    index = 0
    for dim, coordinate in enumerate(dims.get_coordinate()):
        index = index * dims.size(dim) + coordinate
    return index, dims.size()


def clip_grad_norm_(parameters, max_norm: float, *, pp_group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_`` for gradients on different meshes: under tensor
    parallelism the blocks' linear weights live on the (dp, tp) mesh and the rest (embedding,
    norms, head) on the dp mesh, which torch's version cannot stack into one norm.

    Sums the squares of each local shard, all-reduces each sum over the mesh dims its
    gradient is split on (``Shard`` or FSDP2's ``_StridedShard``; a replicated dim holds
    copies), and scales every local shard in place. Under pipeline parallelism ``parameters``
    are this rank's stage's, and ``pp_group`` (the ``"pp"`` dim's group) adds up the
    stages' sums: the norm is the whole model's. Returns the total norm, on every rank."""
    grads = [p.grad for p in parameters if p.grad is not None]
    if not grads:  # (every launcher stage holds blocks: none skips the pp all-reduce)
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
    norm = torch.stack(list(sums.values())).sum()
    if pp_group is not None:
        dist.all_reduce(norm, group=pp_group)
    norm = norm.sqrt()
    scale = (max_norm / (norm + 1e-6)).clamp(max=1.0)
    local_grads = [g.to_local() if isinstance(g, DTensor) else g for g in grads]
    torch._foreach_mul_(local_grads, scale.to(local_grads[0].dtype))
    return norm
