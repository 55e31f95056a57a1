"""Small process-group helpers that also work without one (a single process).

Every module that asks "which rank am I", waits for the others, or ships a Python object
between ranks does it through here, so single-process use never needs special cases.
"""

from __future__ import annotations

import contextlib
import time
import warnings
from datetime import timedelta
from typing import Any, Iterator

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor


def is_distributed() -> bool:
    """Whether a default process group is up."""
    return dist.is_available() and dist.is_initialized()


def rank() -> int:
    """This process's global rank (0 without a process group)."""
    return dist.get_rank() if is_distributed() else 0


def world_size() -> int:
    """The number of processes (1 without a process group)."""
    return dist.get_world_size() if is_distributed() else 1


def barrier(group: dist.ProcessGroup | None = None) -> None:
    """Wait for every rank of ``group`` (the default group; nothing to wait for in a single process)."""
    if is_distributed():
        dist.barrier(group=group)


def group_timeout(group: dist.ProcessGroup | None = None) -> timedelta | None:
    """The timeout of ``group``'s collectives (the default group's: ``init_process_group(timeout=...)``),
    ``None`` where its backend does not say (then torch's default applies)."""
    group = group or dist.group.WORLD
    try:
        return group._get_backend(collective_device()).options._timeout  # torch keeps it on the backend
    except (AttributeError, RuntimeError):
        return None


def broadcast_from_rank0(value: Any) -> Any:
    """Rank 0's ``value`` on every rank (a picklable object)."""
    if not is_distributed():
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def gather_to_rank0(value: Any, group: dist.ProcessGroup | None = None) -> list[Any]:
    """Every rank's ``value`` on rank 0, in rank order; ``[]`` on the other ranks
    (``group``: one that holds every rank, as the default group does)."""
    if not is_distributed():
        return [value]
    out = [None] * world_size() if rank() == 0 else None
    dist.gather_object(value, out, dst=0, group=group)
    return out or []


def all_gather(value: Any, group: dist.ProcessGroup | None = None) -> list[Any]:
    """Every rank's ``value`` on every rank, in rank order (``group``: one that holds
    every rank, as the default group does)."""
    if not is_distributed():
        return [value]
    out = [None] * world_size()
    dist.all_gather_object(out, value, group=group)
    return out


def mesh_of(model: nn.Module) -> DeviceMesh | None:
    """The device mesh ``model``'s parameters are sharded over (``None`` if not sharded)."""
    for param in model.parameters():
        if isinstance(param, DTensor):
            return param.device_mesh
    return None


def shard_coordinate(mesh: DeviceMesh | None) -> int:
    """This rank's index along ``mesh``'s shard dimension (its last), 0 without a mesh.

    HSDP replicas of one shard share this index; an unsharded model (every rank holds every
    row, as with DDP) is one shard, index 0.
    """
    return 0 if mesh is None else mesh.get_local_rank(mesh.ndim - 1)


# How long a caller waits for a collective backend's thread to drop its references to the
# caller's tensors: far longer than a release takes, even by a thread descheduled on a busy machine.
_RELEASE_TIMEOUT_S = 1.0
_release_waits = True  # False once a wait ran out: a backend that keeps tensors stalls no step


@contextlib.contextmanager
def released_by_backend(*tensors: torch.Tensor) -> Iterator[None]:
    """Around a blocking collective on ``tensors``: leave only once the backend's threads
    hold no reference to the CPU ones (the caller's, and its Python objects, are the last).

    gloo runs each collective on a worker thread that keeps the work, and so its tensors,
    for a moment after the caller's wait returns (often: docs/limits.md has the counts).
    If the caller drops a tensor made in Python first, that thread drops the last
    reference and needs the GIL to free the tensor's Python object. After the last step of a
    script, the interpreter may be finalizing by then: the process group and its threads
    outlive ``destroy_process_group()`` while DDP (or anything else) holds it, and a
    thread taking the GIL during finalization is ended with ``pthread_exit`` inside
    torch's ``noexcept`` release, which aborts the process ("terminate called without an
    active exception", pytorch/pytorch#190489). Accelerator tensors are left to their
    backend: NCCL's watchdog releases them on its own schedule, and waiting for it would
    stall every step.
    """
    global _release_waits
    if not (_release_waits and hasattr(torch.Tensor, "_use_count")):  # a private count of torch's
        yield
        return
    watched = [(t, t._use_count()) for t in tensors if t.device.type == "cpu"]
    yield
    deadline = time.monotonic() + _RELEASE_TIMEOUT_S
    for tensor, count in watched:
        while tensor._use_count() > count:
            if time.monotonic() > deadline:
                _release_waits = False
                warnings.warn(
                    f"the process group's backend still held a collective's tensor {_RELEASE_TIMEOUT_S:.0f} s "
                    "after the collective returned; fsdp_int8 stops waiting for such releases. If this "
                    "process aborts at exit, drop the model and optimizer and call gc.collect() before "
                    "destroy_process_group() (docs/limits.md).", stacklevel=3,
                )
                return
            time.sleep(0)  # lets the backend's thread run (and take the GIL if it must)


def _verdict(flags: list[torch.Tensor]) -> torch.Tensor:
    """Every flag, on every rank, as one int32 on the collective device (1: all true)."""
    device = collective_device()
    if flags:
        verdict = torch.stack([flag.to(device, torch.int32) for flag in flags]).min()
    else:
        verdict = torch.ones((), dtype=torch.int32, device=device)
    if is_distributed():
        with released_by_backend(verdict):
            dist.all_reduce(verdict, op=dist.ReduceOp.MIN)
    return verdict


def all_ranks_true(flags: list[torch.Tensor]) -> bool:
    """Whether every flag is true on every rank: one all-reduce (with a process group) and
    one host sync, whatever the number of flags and devices."""
    return bool(_verdict(flags))


def all_ranks_true_reading(flags: list[torch.Tensor], values: torch.Tensor) -> tuple[bool, list[int]]:
    """:func:`all_ranks_true`, and this rank's integer ``values`` (1-D, any device) read
    back in the same host sync: ``(verdict, values as a list)``."""
    verdict = _verdict(flags)
    read = torch.cat([verdict.to(torch.int64).view(1), values.to(verdict.device, torch.int64)]).tolist()
    return bool(read[0]), read[1:]


TENSOR_PARALLEL_DIM = "tp"  # the mesh dim tensor parallelism splits on (torchtitan's name)


def without_tensor_parallel(mesh: DeviceMesh) -> DeviceMesh:
    """``mesh`` without its ``"tp"`` dim: the data-parallel part of a (dp, tp) mesh."""
    names = mesh.mesh_dim_names or ()
    if TENSOR_PARALLEL_DIM not in names or mesh.ndim == 1:
        return mesh
    return mesh[tuple(name for name in names if name != TENSOR_PARALLEL_DIM)]


def rounding_coordinate(mesh: DeviceMesh | None) -> int:
    """This rank's (pp, dp shard) index for the weights' stochastic-rounding streams.

    ``mesh`` is the data-parallel mesh (FSDP's shard mesh, or the HSDP mesh), or a
    parameter's mesh under tensor parallelism (its ``"tp"`` dim is left out: tp shards have
    streams of their own). Its last dim gives the dp shard (:func:`shard_coordinate`).
    Pipeline stages hold different layers, so a root mesh dim named ``"pp"`` (torchtitan's
    name) is mixed in; with one stage the index is the dp shard's. Replicas (HSDP's
    replicate dim, DDP) share it.
    """
    if mesh is None:
        return 0
    if getattr(mesh, "mesh_dim_names", None):
        mesh = without_tensor_parallel(mesh)
    shard = shard_coordinate(mesh)
    root = mesh._get_root_mesh() if hasattr(mesh, "_get_root_mesh") else mesh
    if "pp" in (getattr(root, "mesh_dim_names", None) or ()) and "pp" not in (mesh.mesh_dim_names or ()):
        return root.get_local_rank("pp") * mesh.size(mesh.ndim - 1) + shard
    return shard


def collective_device() -> torch.device:
    """Where the default process group's collectives take tensors: the current accelerator
    for an accelerator backend (NCCL and friends), else the CPU (gloo)."""
    backend = dist.get_backend() if is_distributed() else "gloo"
    if backend == "gloo" or not torch.accelerator.is_available():
        return torch.device("cpu")
    accelerator = torch.accelerator.current_accelerator()
    return torch.device(accelerator.type, torch.accelerator.current_device_index())


def local_shard(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's local tensor of an FSDP2 (DTensor) parameter, or the tensor itself."""
    return tensor._local_tensor if isinstance(tensor, DTensor) else tensor


def device_type_for(world_size: int = 1) -> str:
    """The accelerator's device type (``"cuda"``, ...) when this machine has at least
    ``world_size`` of its devices (one per rank), else ``"cpu"``.

    The one rule the library uses to pick a device (``shard_model`` on a meta model, the
    test kit, the launcher, the benchmarks); use it to place models and data.

    Args:
        world_size: The ranks that each need a device of their own on this machine.
    """
    if torch.accelerator.is_available() and torch.accelerator.device_count() >= world_size:
        return torch.accelerator.current_accelerator().type
    return "cpu"


def is_sharded(model: torch.nn.Module) -> bool:
    """Whether ``fully_shard`` (FSDP2) or another DTensor API has touched ``model``."""
    from torch.distributed.fsdp import FSDPModule

    return any(isinstance(m, FSDPModule) for m in model.modules()) or any(
        isinstance(p, DTensor) for p in model.parameters()
    )


PIPELINE_DIM = "pp"  # the mesh dim pipeline parallelism splits on (torchtitan's name)


def root_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """The device mesh ``mesh`` was sliced or flattened from (``mesh`` itself if none)."""
    return mesh._get_root_mesh() if hasattr(mesh, "_get_root_mesh") else mesh


def idle_mesh_dims(mesh: DeviceMesh) -> list[tuple[str, int]]:
    """``(name, size)`` of each dim of ``mesh``'s root mesh that ``mesh`` leaves out.

    A root dim is left out when none of the other ranks on this rank's line along it
    (the ranks whose root coordinates differ from this rank's in that dim alone) is in
    ``mesh``: a slice ``root["dp"]`` leaves out every other dim, a flattened
    ``root[("dp", "cp")]._flatten()`` none of ``dp`` and ``cp``. Dims of size 1 are
    skipped (they hold one rank). A dim without a name is reported as ``"dim <i>"``.
    """
    root = root_mesh(mesh)
    if root is mesh or root.ndim == 0:
        return []
    coordinate = root.get_coordinate()
    if coordinate is None:
        return []
    mine = set(mesh.mesh.flatten().tolist())
    me = dist.get_rank()
    names = root.mesh_dim_names or tuple(f"dim {i}" for i in range(root.ndim))
    idle = []
    for dim in range(root.ndim):
        index = list(coordinate)
        index[dim] = slice(None)
        line = set(root.mesh[tuple(index)].flatten().tolist()) - {me}
        if line and not line & mine:
            idle.append((names[dim], root.size(dim)))
    return idle
