"""Collectives that reach the weight itself.

* DTensor's gathers (``full_tensor()``, full state dicts) move int8 rows and their scales:
  ``_c10d_functional.all_gather_into_tensor``.
* Every other collective moves **values of the outer dtype** ("the wire carries values"):
  an ``Int8Weight`` argument is replaced by its dequantized values, and whatever the
  collective writes into it comes back rounded to nearest (as ``copy_`` from a float
  tensor does). That is what the other ranks expect: in a full-state-dict broadcast or a
  ``distribute_tensor`` scatter (accelerate's ``cpu_ram_efficient_loading``) only the
  source holds an ``Int8Weight``; the receivers allocated plain tensors of the outer
  dtype (torch allocates them, not us) and never call into this module.

No collective may fail on one rank only: the others would wait in it until the backend's
timeout. So a rank that cannot put its values on the wire (an error while dequantizing, or
a collective op this table does not know) still takes part, sending NaN, and raises after
the collective; a peer that writes those values into an int8 weight (here, or through the
requantizing ``load_state_dict`` hook of :func:`fsdp_int8.quantize_`) raises at once on the
non-finite values instead of waiting.
"""

from __future__ import annotations

import warnings
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives  # noqa: F401  (registers _wrap_tensor_autograd)
from torch.utils._pytree import tree_map, tree_map_only

from fsdp_int8._weight import op_table as _op_table
from fsdp_int8._weight.tensor import Int8Weight

_implements = _op_table.implements
_c10d = torch.ops.c10d
_functional = torch.ops._c10d_functional
_WAIT = _functional.wait_tensor.default

# Namespaces whose ops are collectives: one of them refused on one rank would hang the others.
COLLECTIVE_NAMESPACES = frozenset({"c10d", "_c10d_functional", "_c10d_functional_autograd", "c10d_functional"})


@_implements(_functional.all_gather_into_tensor.default)
def _all_gather_into_tensor(func, weight: Int8Weight, group_size: int, group_name: str):
    # DTensor's full_tensor() and full state dicts gather shards: gather data and scales
    # separately, rows stay whole.
    data = _WAIT(func(weight.int_data.contiguous(), group_size, group_name))
    scale = _WAIT(func(weight.scale.contiguous(), group_size, group_name))
    return weight.with_tensors(data, scale)


@_implements(_WAIT, _functional._wrap_tensor_autograd.default)
def _already_complete(func, weight: Int8Weight) -> Int8Weight:
    return weight  # _all_gather_into_tensor already waited for both inner tensors


# ---------------------------------------------------------------- values on the wire
# c10d ops write into their first argument (the in-place allreduce_ / broadcast_ / reduce_
# / recv_, the output lists of the gathers and scatters) and read the others.
_C10D_OPS = (
    "allreduce_", "allreduce_coalesced_", "broadcast_", "reduce_", "scatter_", "gather_",
    "allgather_", "_allgather_base_", "allgather_coalesced_", "allgather_into_tensor_coalesced_",
    "reduce_scatter_", "_reduce_scatter_base_", "reduce_scatter_tensor_coalesced_", "alltoall_",
    "alltoall_base_", "recv_", "recv_any_source_", "send",
)
_FUNCTIONAL_OPS = (
    "all_reduce", "all_reduce_", "all_reduce_coalesced", "all_reduce_coalesced_", "broadcast",
    "broadcast_", "reduce_scatter_tensor", "reduce_scatter_tensor_out",
    "reduce_scatter_tensor_coalesced", "all_gather_into_tensor_out",
    "all_gather_into_tensor_coalesced", "all_to_all_single", "isend", "irecv", "batch_p2p_ops",
)
# Roots that send an Int8Weight's values to receivers that will round them back to int8.
# op -> (position of the root rank, of the argument it sends); the group comes just before.
_ROOT_ARGUMENT = {"broadcast_": (2, 0), "scatter_": (3, 1)}


def _written(func) -> set[int]:
    """Positions of the arguments ``func`` writes into."""
    if func.namespace == "c10d":
        return set() if func._opname == "send" else {0}
    return {
        i for i, a in enumerate(func._schema.arguments)
        if a.alias_info is not None and a.alias_info.is_write
    }


def _argument(func, args: tuple, kwargs: dict, index: int) -> Any:
    if index < len(args):
        return args[index]
    return kwargs.get(func._schema.arguments[index].name)


def _rows_changed_in_transit(weight: Int8Weight, wire: torch.Tensor) -> int:
    """How many rows a receiver rounding ``wire`` to nearest would not get back bit-exactly."""
    received = weight.clone()
    received.assign_(wire, stochastic=False)
    (got_rows, got_scale), (rows, scale) = received.read_rows(), weight.read_rows()
    same = (got_rows == rows).all(dim=1) & (got_scale == scale)
    return int((~same).sum())


def _warn_if_inexact(func, args: tuple, kwargs: dict, images: dict[int, list]) -> None:
    """On the root of a broadcast or scatter: say if receivers will not get its int8 rows back."""
    if func.namespace != "c10d" or func._opname not in _ROOT_ARGUMENT:
        return
    root_index, sent = _ROOT_ARGUMENT[func._opname]
    if not images.get(sent):
        return
    group = dist.ProcessGroup.unbox(_argument(func, args, kwargs, root_index - 1))
    if group.rank() != _argument(func, args, kwargs, root_index):
        return
    changed = sum(_rows_changed_in_transit(weight, wire) for weight, wire in images[sent])
    if changed:
        wire_dtype = images[sent][0][1].dtype
        warnings.warn(
            f"{func._opname.rstrip('_')} of Int8Weight values: {changed} rows will not "
            f"round-trip bit-exactly (the wire carries {wire_dtype} values, not int8 + scales); "
            "every receiving int8 weight, this rank's included, keeps them rounded to nearest, "
            "alike. For exact copies use fsdp_int8.save_checkpoint / load_checkpoint, or "
            "broadcast .int_data and .scale yourself.",
            stacklevel=4,
        )


def _swap_weights(args: tuple, kwargs: dict, make: Callable[[Int8Weight], torch.Tensor]):
    """``args`` / ``kwargs`` with every Int8Weight replaced by ``make(weight)``, and the
    ``(weight, image)`` pairs by argument position (keyword arguments under their name)."""
    pairs: dict[Any, list[tuple[Int8Weight, torch.Tensor]]] = {}

    def replace(key):
        def swap(weight: Int8Weight) -> torch.Tensor:
            image = make(weight)
            pairs.setdefault(key, []).append((weight, image))
            return image
        return swap

    wire_args = tuple(tree_map_only(Int8Weight, replace(i), a) for i, a in enumerate(args))
    wire_kwargs = {k: tree_map_only(Int8Weight, replace(k), v) for k, v in kwargs.items()}
    return wire_args, wire_kwargs, pairs


def _nan_like(weight: Int8Weight) -> torch.Tensor:
    return torch.full(weight.shape, float("nan"), dtype=weight.dtype, device=weight.device)


def _complete(func, result: Any, written: list[torch.Tensor]) -> None:
    """Wait for the collective: what it wrote is read at once (a c10d op returns its work,
    a functional one pending tensors; waiting twice for one is a no-op)."""
    if func.namespace == "c10d":
        work = result[1] if isinstance(result, tuple) else result
        if isinstance(work, torch.ScriptObject) or hasattr(work, "wait"):
            work.wait()
    else:
        for tensor in written:
            _WAIT(tensor)


def _values_on_the_wire(func, *args, **kwargs) -> Any:
    error: BaseException | None = None
    try:
        wire_args, wire_kwargs, images = _swap_weights(args, kwargs, lambda w: w.dequantize())
        _warn_if_inexact(func, args, kwargs, images)
    except Exception as caught:  # take part anyway: the other ranks are in this collective
        error = caught
        wire_args, wire_kwargs, images = _swap_weights(args, kwargs, _nan_like)
    result = func(*wire_args, **wire_kwargs)
    names = [a.name for a in func._schema.arguments]
    positions = _written(func)
    written = [
        pair for key, pairs in images.items() for pair in pairs
        if (key if isinstance(key, int) else names.index(key)) in positions
    ]
    _complete(func, result, [image for _, image in written])
    if error is not None:
        raise RuntimeError(
            f"{func} could not send this rank's Int8Weight values ({type(error).__name__}: "
            f"{error}); it sent NaN instead, so that no other rank waits in the collective"
        ) from error
    for weight, image in written:
        weight.assign_(image, stochastic=False)
    originals = {id(image): weight for pairs in images.values() for weight, image in pairs}
    # In-place ops return their arguments: hand back the int8 weights, not their images.
    return tree_map(lambda x: originals.get(id(x), x), result)


@_op_table.falls_back_in(*COLLECTIVE_NAMESPACES)
def _refuse_collective(func, *args, **kwargs) -> None:
    """A collective this table does not know: take part sending NaN, then refuse it."""
    wire_args, wire_kwargs, images = _swap_weights(args, kwargs, _nan_like)
    result = func(*wire_args, **wire_kwargs)
    pending = [t for t in torch.utils._pytree.tree_leaves(result) if isinstance(t, torch.Tensor)]
    _complete(func, result, pending + [i for pairs in images.values() for _, i in pairs])
    raise NotImplementedError(
        f"Int8Weight does not support the collective {func}. This rank took part sending NaN, "
        "so that no other rank waits in it (an int8 weight receiving those values raises). "
        "Send .dequantize() values, or .int_data and .scale, yourself."
    )


for _name in _C10D_OPS:
    if hasattr(_c10d, _name):
        _implements(getattr(_c10d, _name).default)(_values_on_the_wire)
for _name in _FUNCTIONAL_OPS:
    if hasattr(_functional, _name):
        _implements(getattr(_functional, _name).default)(_values_on_the_wire)
