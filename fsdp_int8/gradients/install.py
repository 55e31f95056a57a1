"""Putting a :class:`QuantizedReduceScatter` or an :class:`InPlaceReduceScatter` on every
FSDP module of a model, and finding the quantized one.

FSDP2 offers the setter (``FSDPModule.set_custom_reduce_scatter``) but no getter: what is
installed is read through :mod:`fsdp_int8._fsdp_compat`.
"""

from __future__ import annotations

from typing import Any, Callable

import torch.nn as nn

from fsdp_int8._fsdp_compat import (
    BUILTIN_REDUCE_SCATTERS,
    fsdp_modules,
    param_groups,
    reduce_scatter_of,
    set_reduce_scatter,
)
from fsdp_int8.gradients._wire import DEFAULT_BLOCK_SIZE
from fsdp_int8.gradients.in_place import InPlaceReduceScatter
from fsdp_int8.gradients.reduce_scatter import QuantizedReduceScatter

__all__ = ["enable_in_place_reduce_scatter", "enable_quantized_reduce_scatter", "installed_quantized_reduce_scatter"]

# What the enable_* functions may replace without asking (a foreign custom reduce-scatter
# is refused: silently dropping it would change the user's training).
_REPLACEABLE = (*BUILTIN_REDUCE_SCATTERS, QuantizedReduceScatter, InPlaceReduceScatter)


def enable_quantized_reduce_scatter(
    model: nn.Module, *, block_size: int = DEFAULT_BLOCK_SIZE, seed: int = 0
) -> int:
    """Install a :class:`QuantizedReduceScatter` on every ``FSDPModule`` of ``model``.

    Call it after ``fully_shard`` / :func:`fsdp_int8.shard_model` and before the first
    backward: FSDP2's gradient reduce-scatter then sends int8 blocks. Only the
    reduce-scatter over the shard dimension changes: with HSDP, FSDP2's all-reduce over
    the replicate dimension still runs in full precision (reduce dtype), and a shard
    dimension of size 1 calls no reduce-scatter at all. A module with several parameter
    groups (per-parameter meshes from ``fully_shard``'s ``shard_placement_fn``: torchtitan's
    experts on their own mesh) gets it on every group, each reducing over its own mesh.
    Calling it again, or after :func:`enable_in_place_reduce_scatter`, replaces the
    installed one.

    Args:
        model: A model sharded with ``fully_shard`` (the root or any module containing
            FSDP modules).
        block_size: Values per fp32 scale (see :class:`QuantizedReduceScatter`).
        seed: Seed of the rounding noise (each process mixes in its global rank).

    Returns:
        How many FSDP modules (with parameters) now use the quantized reduce-scatter.

    Raises:
        ValueError: ``model`` holds no FSDP module, or a module already uses another
            custom reduce-scatter.

    Example::

        fsdp_int8.shard_model(model)
        fsdp_int8.gradients.enable_quantized_reduce_scatter(model, seed=0)
    """
    comm = QuantizedReduceScatter(block_size, seed=seed)  # one instance serves every group
    return _install(model, lambda group: comm, "the quantized reduce-scatter")


def enable_in_place_reduce_scatter(model: nn.Module) -> int:
    """Install an :class:`InPlaceReduceScatter` on every ``FSDPModule`` of ``model``: on gloo
    process groups no copy of each reduce-scatter's input, and its buffer released once
    reduced; on other backends FSDP2's own reduce-scatter. The same fp32 sums.

    Call it after ``fully_shard`` / :func:`fsdp_int8.shard_model` (which calls it for
    ``Int8TrainingConfig(in_place_reduce_scatter=True)``, set by
    :meth:`~fsdp_int8.Int8TrainingConfig.lean`) and before the first backward. It replaces
    a :class:`QuantizedReduceScatter` installed before, and the other way round.

    Args:
        model: A model sharded with ``fully_shard`` (the root or any module containing
            FSDP modules).

    Returns:
        How many FSDP modules (with parameters) now use it.

    Raises:
        ValueError: as :func:`enable_quantized_reduce_scatter`.
    """
    return _install(model, _in_place_for, "the in-place reduce-scatter")


def _in_place_for(group: Any) -> InPlaceReduceScatter:
    """An in-place reduce-scatter told the dtype of ``group``'s unsharded gradients. Not
    on one rank: FSDP2 then copies (and divides) the input into the output itself, in the
    input's dtype."""
    ranks = getattr(getattr(group, "mesh_info", None), "shard_mesh_size", 1)
    return InPlaceReduceScatter(getattr(group.mp_policy, "param_dtype", None) if ranks > 1 else None)


def _install(model: nn.Module, comm_for: Callable[[Any], object], what: str) -> int:
    """Set ``comm_for(group)`` as the reduce-scatter of every parameter group of every FSDP
    module of ``model`` (``what`` names it)."""
    modules = fsdp_modules(model)
    if not modules:
        raise ValueError(
            f"{type(model).__name__} holds no FSDP module: shard it first "
            f"(fsdp_int8.shard_model or torch.distributed.fsdp.fully_shard), then enable {what}"
        )
    installed = 0
    for name, module in modules:
        groups = param_groups(module)
        for group in groups:
            current = reduce_scatter_of(group)
            if current is not None and not isinstance(current, _REPLACEABLE):
                raise ValueError(
                    f"FSDP module {name or '<root>'!r} already uses a custom reduce-scatter "
                    f"({type(current).__name__}); {what} would replace it"
                )
        for group in groups:  # each group's own mesh: FSDP2 passes its process group per call
            set_reduce_scatter(group, comm_for(group))
        installed += bool(groups)
    return installed


def installed_quantized_reduce_scatter(model: nn.Module) -> QuantizedReduceScatter | None:
    """The :class:`QuantizedReduceScatter` serving ``model``'s FSDP modules, if any."""
    for _, module in fsdp_modules(model):
        for group in param_groups(module):
            comm = reduce_scatter_of(group)
            if isinstance(comm, QuantizedReduceScatter):
                return comm
    return None
