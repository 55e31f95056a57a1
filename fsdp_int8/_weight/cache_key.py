"""The key AOTAutograd's cache files an ``Int8Weight`` graph input under.

torch asks a traceable tensor subclass for ``_stable_hash_for_caching(self) -> str``: a
string, the same in every process, that names everything a compiled graph may depend on
in the tensor (torch's note "Tensor subclass stable hashing for AOT autograd cache";
DTensor implements it the same way). For an ``Int8Weight`` that is its outer shape, dtype
and ``requires_grad``, every field ``__tensor_unflatten__`` rebuilds it from, and the
layout of its inner tensors; never their values (a new step's weights must hit the same
entry). Python's ``hash`` varies with ``PYTHONHASHSEED``: the key is a blake2b digest.
"""

from __future__ import annotations

import dataclasses
import hashlib
from typing import TYPE_CHECKING, Any

import torch

from fsdp_int8._weight.tensor_parallel import TensorParallelShard

if TYPE_CHECKING:  # for annotations only: Int8Weight's method is this module's function
    from fsdp_int8._weight.tensor import Int8Weight

__all__ = ["stable_hash"]


def _layout(tensor: torch.Tensor) -> tuple:
    return str(tensor.dtype), tuple(tensor.shape), tuple(tensor.stride()), str(tensor.device)


def _split(split: Any) -> tuple | None:
    """A tensor-parallel split by its mesh's ranks and dim names (not the mesh object,
    whose pickle holds process-local state), this rank's coordinate and kind; a column
    window by its fields."""
    if split is None:
        return None
    if isinstance(split, TensorParallelShard):
        mesh = split.mesh
        return ("tp", mesh.device_type, mesh.mesh.tolist(), mesh.mesh_dim_names, split.coordinate,
                split.shares_row_scales)
    return (type(split).__name__, *dataclasses.astuple(split))


def _field(name: str, value: Any) -> Any:
    """A field of ``Int8Weight.meta`` as plain, process-independent values."""
    if name == "tensor_parallel":
        return _split(value)
    if dataclasses.is_dataclass(value):  # int8_matmul
        return dataclasses.astuple(value)
    return value


def stable_hash(weight: "Int8Weight") -> str:
    """``Int8Weight._stable_hash_for_caching``: its metadata's blake2b digest, in hex."""
    payload = (
        type(weight).__qualname__, tuple(weight.shape), tuple(weight.stride()), str(weight.dtype),
        weight.requires_grad, *(_field(name, value) for name, value in weight.meta.by_name().items()),
        _layout(weight.int_data), _layout(weight.scale),
    )
    return hashlib.blake2b(repr(payload).encode(), digest_size=16).hexdigest()
