"""Collectives that reach the weight itself: DTensor's gathers and full-state-dict broadcasts."""

from __future__ import annotations

import torch
import torch.distributed._functional_collectives  # noqa: F401  (registers _wrap_tensor_autograd)

from fsdp_int8.weight import Int8Weight

_implements = Int8Weight.implements


@_implements(torch.ops._c10d_functional.all_gather_into_tensor.default)
def _all_gather_into_tensor(func, weight: Int8Weight, group_size: int, group_name: str):
    # DTensor's full_tensor() and full state dicts gather shards: gather data and scales
    # separately, rows stay whole.
    wait = torch.ops._c10d_functional.wait_tensor.default
    data = wait(func(weight.int_data.contiguous(), group_size, group_name))
    scale = wait(func(weight.scale.contiguous(), group_size, group_name))
    return weight.derive(data, scale)


@_implements(
    torch.ops._c10d_functional.wait_tensor.default,
    torch.ops._c10d_functional._wrap_tensor_autograd.default,
)
def _already_complete(func, weight: Int8Weight) -> Int8Weight:
    return weight  # _all_gather_into_tensor already waited for both inner tensors


@_implements(torch.ops.c10d.broadcast_.default)
def _broadcast(func, tensors, process_group, root_rank, root_tensor, async_op=True, timeout=-1):
    # Full state dicts broadcast from rank 0 (broadcast_from_rank0=True) arrive where the
    # other ranks allocated plain tensors of the outer dtype: send the dequantized values,
    # and round them to nearest wherever an Int8Weight holds them, the root's included, so
    # that every rank ends with the same bytes (DDP's replicas must be bit-identical). That
    # round trip is exact for scales made by absmax / 127; a scale rescaled since (exact
    # weight decay) may move by one ulp, on every rank alike.
    wire = [t.dequantize() if isinstance(t, Int8Weight) else t for t in tensors]
    _, work = func(wire, process_group, root_rank, root_tensor, async_op, timeout)
    work.wait()
    for tensor, values in zip(tensors, wire):
        if isinstance(tensor, Int8Weight):
            tensor.assign_(values, stochastic=False)
    return list(tensors), work
