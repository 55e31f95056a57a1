"""Plain full-precision state dicts in and out of a quantized (possibly sharded) model: for
the unquantized model, a Hugging Face ``save_pretrained``, or a fresh quantized run."""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import StateDictOptions

from fsdp_int8 import _dist
from fsdp_int8.checkpoint._dcp import model_state_dict, set_model_state
from fsdp_int8.weight import Int8Weight

__all__ = ["export_full_state_dict", "load_full_state_dict"]


def export_full_state_dict(
    model: nn.Module, dtype: torch.dtype = torch.bfloat16
) -> dict[str, torch.Tensor]:
    """A plain, full, dequantized state dict on rank 0 (``{}`` on other ranks), on CPU.

    Its keys and shapes are those of the unquantized model, so it loads into it with
    ``load_state_dict`` (or a Hugging Face model's ``save_pretrained``). Call on every rank.

    Args:
        model: A quantized model, sharded or not.
        dtype: Floating dtype of every floating entry.
    """
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    full = model_state_dict(model, options)
    plain = {}
    for key, value in full.items():
        if isinstance(value, Int8Weight):
            value = value.dequantize(dtype)
        elif isinstance(value, torch.Tensor) and value.is_floating_point():
            value = value.to(dtype)
        plain[key] = value
    return plain if _dist.rank() == 0 else {}


def load_full_state_dict(model: nn.Module, state_dict: dict[str, torch.Tensor]) -> None:
    """Load a plain full state dict (any float dtype) into a quantized model.

    Int8 weights round the values to nearest (never stochastically). Under FSDP2, rank 0
    passes the state dict and the other ranks pass ``{}``: rank 0 broadcasts it.
    """
    # a sharded model in a process group: only rank 0 holds the values
    distributed = _dist.is_distributed() and _dist.mesh_of(model) is not None
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=distributed)
    set_model_state(model, state_dict, options)
