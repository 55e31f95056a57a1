"""Plain full-precision state dicts in and out of a quantized (possibly sharded) model: for
the unquantized model, a Hugging Face ``save_pretrained``, or a fresh quantized run."""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import StateDictOptions
from torch.distributed.tensor import DTensor

from fsdp_int8 import _dist
from fsdp_int8._weight.layouts import conv1d_layers, to_int8_layout, to_model_layout
from fsdp_int8._weight.tensor import Int8Weight
from fsdp_int8.checkpoint._dcp import model_state_dict, set_model_state
from fsdp_int8.checkpoint.errors import CheckpointError

__all__ = ["export_full_state_dict", "load_full_state_dict"]


def export_full_state_dict(
    model: nn.Module, dtype: torch.dtype = torch.bfloat16
) -> dict[str, torch.Tensor]:
    """A plain, full, dequantized state dict on rank 0 (``{}`` on other ranks), on CPU.

    Its keys and shapes are those of the unquantized model, so it loads into it with
    ``load_state_dict`` (or a Hugging Face model's ``save_pretrained`` writes it): the
    weights of GPT-2 ``Conv1D`` layers (int8 as ``[out, in]``) are written in GPT-2's
    ``[in, out]``, contiguous. A model whose state-dict hooks rename keys (torchtitan's
    fused ``wqkv``, saved as ``wq`` / ``wk`` / ``wv``), which torch's
    ``get_model_state_dict`` cannot map, is exported through its own ``state_dict()``,
    gathered whole onto rank 0 one entry at a time: in those keys, which the unconverted
    model loads with ``strict=True``. Call on every rank.

    Args:
        model: A quantized model, sharded or not.
        dtype: Floating dtype of every floating entry.

    Returns:
        The state dict on rank 0, ``{}`` on the others.

    Example::

        state = fsdp_int8.export_full_state_dict(model, torch.bfloat16)   # every rank
        if dist.get_rank() == 0:
            model.save_pretrained("out", state_dict=state)                # full precision
    """
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    try:
        full = model_state_dict(model, options)
    except CheckpointError:  # keys made by a state-dict hook: every rank fails alike, before any collective
        full = _own_full_state_dict(model)
    plain = {}
    for key, value in full.items():
        if isinstance(value, Int8Weight):
            value = value.dequantize(dtype)
        elif isinstance(value, torch.Tensor) and value.is_floating_point():
            value = value.to(dtype)
        plain[key] = value
    return to_model_layout(model, plain) if _dist.rank() == 0 else {}


def _own_full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """``model.state_dict()`` (its hooks' keys), each entry whole, on CPU on rank 0 (``{}``
    elsewhere): gathered one entry at a time, so rank 0 holds one whole weight at most
    beside the result. For models whose hooks rename keys, which torch's
    ``get_model_state_dict`` cannot map to parameters."""
    keep = _dist.rank() == 0
    full = {}
    for key, value in model.state_dict().items():
        if isinstance(value, DTensor):
            value = value.full_tensor()  # a collective: every rank takes part
        if keep:
            full[key] = value.cpu() if isinstance(value, torch.Tensor) else value
    return full


def load_full_state_dict(model: nn.Module, state_dict: dict[str, torch.Tensor]) -> None:
    """Load a plain full state dict (any float dtype) into a quantized model.

    Int8 weights round the values to nearest (never stochastically). Under FSDP2, rank 0
    passes the state dict and the other ranks pass ``{}``: rank 0 broadcasts it. The
    weights of GPT-2 ``Conv1D`` layers are expected in GPT-2's ``[in, out]`` layout, as the
    unquantized model's state dict (and :func:`export_full_state_dict`) holds them.

    Args:
        model: A quantized model, sharded or not.
        state_dict: The unquantized model's keys and shapes, any floating dtype; ``{}``
            on ranks other than 0 under FSDP2.

    Raises:
        ValueError: (on every rank) a Conv1D weight in the int8 layout ``[out, in]``.
    """
    # a sharded model in a process group: only rank 0 holds the values
    distributed = _dist.is_distributed() and _dist.mesh_of(model) is not None
    problem = None
    try:
        state_dict = to_int8_layout(model, state_dict)
    except ValueError as error:
        problem = str(error)
    if distributed and conv1d_layers(model):  # the same on every rank: all check, or none
        # only rank 0 can tell, and the others would wait in its broadcast for ever
        problem = next((p for p in _dist.all_gather(problem) if p), None)
    if problem is not None:
        raise ValueError(problem)
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=distributed)
    set_model_state(model, state_dict, options)
