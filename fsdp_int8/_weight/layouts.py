"""Int8 weights held in another layout than their module's, across whole models and state
dicts: GPT-2's ``Conv1D`` (``[in, out]``, held ``[out, in]``: :mod:`.conv1d`), experts
stored ``[E, in, out]`` and DBRX's ``w2`` (held as each expert's transpose:
:mod:`.transposed_experts`).

A plain tensor under such a weight's key is the module's layout (every framework's state
dict, and ``export_full_state_dict``'s output); an ``Int8Weight`` is the int8 one. This
module finds those weights in a model (:func:`transposed_weights`) and turns values and
whole state dicts from one layout into the other (:func:`in_other_layout`,
:func:`to_model_layout`, :func:`to_int8_layout`).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel

from fsdp_int8._dist import local_shard
from fsdp_int8._weight.conv1d import Int8Conv1D
from fsdp_int8._weight.tensor import Int8Weight
from fsdp_int8._weight.transposed_experts import transposed_blocks, transposed_names, transposed_value

__all__ = [
    "conv1d_layers", "stored_transposed", "transposed_weights", "in_other_layout", "to_model_layout",
    "to_int8_layout",
]

_TRANSPARENT = ("_checkpoint_wrapped_module", "_orig_mod")  # names torch's FQNs leave out


def conv1d_layers(model: nn.Module) -> dict[str, Int8Conv1D]:
    """Every :class:`Int8Conv1D` of ``model`` by its weight's key (as :func:`transposed_weights`)."""
    return {key: module for key, (module, _) in transposed_weights(model).items() if isinstance(module, Int8Conv1D)}


def stored_transposed(module: nn.Module) -> tuple[str, ...]:
    """Names of ``module``'s own int8 weights stored as the transpose of its layout (an
    :class:`Int8Conv1D`'s ``weight``, transposed experts', DBRX's ``w2``):
    :func:`in_other_layout` turns plain values of either layout into the other."""
    return ("weight",) if isinstance(module, Int8Conv1D) else transposed_names(module)


def transposed_weights(model: nn.Module) -> dict[str, tuple[nn.Module, str]]:
    """Every int8 weight of ``model`` stored as the transpose of its module's layout (as
    :func:`stored_transposed` names them), ``{key: (module, name)}`` by its key in
    torch's ``get_model_state_dict`` (activation-checkpoint, ``torch.compile`` and DDP
    wrappers left out of the names, as that function leaves them out)."""
    found: dict[str, tuple[nn.Module, str]] = {}

    def visit(module: nn.Module, path: tuple[str, ...]) -> None:
        for name in stored_transposed(module):
            found[".".join((*path, name))] = (module, name)
        for name, child in module._modules.items():
            if child is None:
                continue
            skip = name in _TRANSPARENT or (name == "module" and isinstance(module, DistributedDataParallel))
            visit(child, path if skip else (*path, name))

    visit(model, ())
    return found


def _plain(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and not isinstance(local_shard(value), Int8Weight)


def to_model_layout(model: nn.Module, state_dict: dict[str, Any]) -> dict[str, Any]:
    """``state_dict`` (plain, full tensors of ``model``) with each weight stored transposed
    (Conv1D's, transposed experts', DBRX's ``w2``) back in its module's layout, GPT-2's
    ``[in, out]`` / ``[E, in, out]`` (contiguous: safetensors writes only contiguous tensors)."""
    weights = transposed_weights(model)
    return {k: in_other_layout(v, *weights[k]) if k in weights and _plain(v) else v for k, v in state_dict.items()}


def to_int8_layout(model: nn.Module, state_dict: dict[str, Any]) -> dict[str, Any]:
    """``state_dict`` (plain, full, the modules' layout) with the *sharded* weights stored
    transposed (Conv1D's, transposed experts', DBRX's ``w2``) in their int8 layout
    (``[out, in]``; contiguous: collectives send it).

    torch's ``set_model_state_dict`` cuts a sharded parameter's rows out of the full
    value before the module's own load sees it, so the transposition must come first;
    unsharded layers get the plain value and transpose it themselves.

    Raises:
        ValueError: a plain Conv1D weight is in the int8 layout ``[out, in]`` (checked for
            every layer, so that sharded or not the same error comes first).
    """
    layers = {
        k: m for k, m in conv1d_layers(model).items()
        if k in state_dict and _plain(state_dict[k]) and not isinstance(state_dict[k], DTensor)
    }
    for key, layer in layers.items():
        problem = layer.layout_error(key, state_dict[key])
        if problem is not None:
            raise ValueError(problem)
    sharded = {
        k: owner for k, owner in transposed_weights(model).items()
        if k in state_dict and _plain(state_dict[k]) and not isinstance(state_dict[k], DTensor)
        and isinstance(owner[0]._parameters[owner[1]], DTensor)
    }
    return {k: in_other_layout(v, *sharded[k]) if k in sharded else v for k, v in state_dict.items()}


def in_other_layout(value: torch.Tensor, module: nn.Module, name: str) -> torch.Tensor:
    """``value`` of ``module``'s weight ``name`` in the other of its two layouts (the
    module's, the int8 one), contiguous: safetensors and collectives need it so."""
    return transposed_value(value, transposed_blocks(module, name)).contiguous()
