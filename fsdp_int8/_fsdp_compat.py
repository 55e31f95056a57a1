"""Every use of FSDP2's private internals, in one place.

FSDP2 (``torch.distributed.fsdp.fully_shard``) exposes the custom reduce-scatter hook
(``FSDPModule.set_custom_reduce_scatter``) but not a way to read back which one is
installed, nor the ``ReduceScatter`` base class from a public module. What fsdp_int8 reads
of FSDP2's internals is listed here, with the torch versions it was checked on; an
unknown layout fails with a message naming what is missing instead of an ``AttributeError``
deep inside a training step.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn
from torch.distributed.fsdp import FSDPModule

# torch releases whose FSDP2 internals match what this module reads.
CHECKED_TORCH_VERSIONS = ("2.13",)

try:
    from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter
    from torch.distributed.fsdp._fully_shard._fsdp_collectives import (
        DefaultReduceScatter,
        ProcessGroupAllocReduceScatter,
    )
except ImportError as error:  # pragma: no cover - depends on the installed torch
    raise ImportError(
        f"fsdp_int8 needs FSDP2's ReduceScatter API (torch.distributed.fsdp._fully_shard), which "
        f"torch {torch.__version__} does not have in the expected place; fsdp_int8 was checked "
        f"on torch {', '.join(CHECKED_TORCH_VERSIONS)}"
    ) from error

# FSDP2's own reduce-scatter implementations (what a module uses unless customised).
BUILTIN_REDUCE_SCATTERS: tuple[type, ...] = (DefaultReduceScatter, ProcessGroupAllocReduceScatter)

__all__ = [
    "CHECKED_TORCH_VERSIONS",
    "ReduceScatter",
    "BUILTIN_REDUCE_SCATTERS",
    "fsdp_modules",
    "param_groups",
    "reduce_scatter_of",
    "set_reduce_scatter",
]


def _unknown_layout(what: str) -> RuntimeError:
    return RuntimeError(
        f"FSDP2's internals changed: {what}. fsdp_int8 reads them to manage custom "
        f"reduce-scatters and was checked on torch {', '.join(CHECKED_TORCH_VERSIONS)}; "
        f"this is torch {torch.__version__}. Please report it."
    )


def fsdp_modules(model: nn.Module) -> list[tuple[str, FSDPModule]]:
    """``(qualified name, module)`` of every ``FSDPModule`` in ``model``, root first."""
    return [(name, m) for name, m in model.named_modules() if isinstance(m, FSDPModule)]


def param_groups(module: FSDPModule) -> list[Any]:
    """The FSDP parameter groups of one FSDP module (empty when it manages no parameter)."""
    state = module._get_fsdp_state()
    if not hasattr(state, "_fsdp_param_groups"):
        raise _unknown_layout("FSDPState has no _fsdp_param_groups")
    return list(state._fsdp_param_groups or ())


def reduce_scatter_of(group: Any) -> Any:
    """The reduce-scatter object a parameter group calls (FSDP2's default or a custom one)."""
    if not hasattr(group, "_reduce_scatter_comm"):
        raise _unknown_layout("FSDPParamGroup has no _reduce_scatter_comm")
    return group._reduce_scatter_comm


def set_reduce_scatter(group: Any, comm: Any) -> None:
    """Make ``comm`` the reduce-scatter of one parameter group.

    ``FSDPModule.set_custom_reduce_scatter`` refuses a module with several groups
    (per-parameter meshes: torchtitan's experts beside a block's dense weights) as
    "ambiguous across groups with different meshes". FSDP2 hands a reduce-scatter the
    process group of each call, so one that reads its group from the call serves every
    mesh; this sets it group by group, as that method does for a module of one group."""
    reduce_scatter_of(group)  # the attribute exists in this torch
    group._reduce_scatter_comm = comm


def tied_embedding_params(group: Any) -> list[Any]:
    """The FSDP parameters of ``group`` that an ``nn.Embedding`` shares with another module
    (a table tied to an output head)."""
    tied = []
    for fsdp_param in getattr(group, "fsdp_params", None) or ():
        info = getattr(fsdp_param, "_module_info", None)
        if info is None or not hasattr(info, "shared_modules"):
            raise _unknown_layout("FSDPParam has no _module_info with shared_modules")
        modules = [info.module, *info.shared_modules]
        if len(modules) > 1 and any(isinstance(m, nn.Embedding) for m in modules):
            tied.append(fsdp_param)
    return tied


def gathered_param(fsdp_param: Any) -> torch.Tensor | None:
    """The unsharded parameter FSDP2 hands the modules (``None`` before the first gather)."""
    return getattr(fsdp_param, "_unsharded_param", None)


def reshard_param_if_group_will(group: Any, fsdp_param: Any) -> bool:
    """Reshard one parameter of ``group`` now, through FSDP2's own per-parameter transition,
    when the group reshards after this backward anyway; whether it did."""
    if not getattr(group, "reshard_after_backward", False):
        return False
    fsdp_param.to_sharded()
    return True
