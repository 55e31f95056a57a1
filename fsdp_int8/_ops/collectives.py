"""Collectives that reach the weight itself: DTensor's gathers and full-state-dict broadcasts."""

from __future__ import annotations

import warnings

import torch
import torch.distributed as dist
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


def _rows_changed_in_transit(weight: Int8Weight, wire: torch.Tensor) -> int:
    """How many rows a receiver rounding ``wire`` to nearest would not get back bit-exactly."""
    received = weight.clone()
    received.assign_(wire, stochastic=False)
    same = (received.int_rows() == weight.int_rows()).all(dim=1) & (received.scale == weight.scale)
    return int((~same).sum())


@_implements(torch.ops.c10d.broadcast_.default)
def _broadcast(func, tensors, process_group, root_rank, root_tensor, async_op=True, timeout=-1):
    # Full state dicts broadcast from rank 0 (broadcast_from_rank0=True) arrive where the
    # other ranks allocated plain tensors of the outer dtype (torch allocates them, not
    # us), so the wire must carry values of that dtype: send the dequantized values, and
    # round them to nearest wherever an Int8Weight holds them, the root's included, so that
    # every rank ends with the same bytes (DDP's replicas must be bit-identical). That
    # round trip is exact for fp32 weights as quantized; a bf16 / fp16 wire, or scales
    # rescaled in training (weight decay), can move a row by an ulp of its scale or a step,
    # on every rank alike. The sender checks and warns (it cannot refuse: the receivers
    # already wait in the collective).
    sending = dist.ProcessGroup.unbox(process_group).rank() == root_rank
    wire = [t.dequantize() if isinstance(t, Int8Weight) else t for t in tensors]
    if sending:
        changed = sum(
            _rows_changed_in_transit(t, w) for t, w in zip(tensors, wire) if isinstance(t, Int8Weight)
        )
        if changed:
            warnings.warn(
                f"broadcast of Int8Weight values: {changed} rows will not round-trip bit-exactly "
                f"(the wire carries {wire[0].dtype} values, not int8 + scales); every rank, this "
                "one included, keeps them rounded to nearest, alike. For exact copies "
                "use fsdp_int8.save_checkpoint / load_checkpoint, or broadcast .int_data and "
                ".scale yourself.",
                stacklevel=2,
            )
    _, work = func(wire, process_group, root_rank, root_tensor, async_op, timeout)
    work.wait()
    for tensor, values in zip(tensors, wire):
        if isinstance(tensor, Int8Weight):
            tensor.assign_(values, stochastic=False)
    return list(tensors), work
