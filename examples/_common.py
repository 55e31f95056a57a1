"""What the examples share: their tiny models and how they read back a rank's int8 state.

Not an example itself; the scripts import it from their own folder.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from typing import Iterator

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor

import fsdp_int8


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor.detach()


class TinyLM(nn.Module):
    """Stands for your model: embedding, residual MLP blocks in a ``ModuleList``, head."""

    def __init__(self, vocab: int = 64, dim: int = 64, n_layers: int = 2) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(
            nn.Sequential(nn.LayerNorm(dim), nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))
            for _ in range(n_layers)
        )
        self.head = nn.Linear(dim, vocab)  # "head" stays full precision (Int8TrainingConfig.skip_names)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for layer in self.layers:
            x = x + layer(x)
        return self.head(x)


def tiny_llama(seed: int, vocab: int = 128, seq: int = 16) -> nn.Module:
    """A 2-block Hugging Face Llama built from a config (nothing downloaded)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=seq,
    )
    torch.manual_seed(seed)
    return LlamaForCausalLM(config)


def int8_names(model: nn.Module) -> list[str]:
    """The names of this rank's parameters that are ``Int8Weight`` shards."""
    return [name for name, p in model.named_parameters() if isinstance(_local(p), fsdp_int8.Int8Weight)]


def int8_count(model: nn.Module) -> int:
    """How many of this rank's parameters are ``Int8Weight`` shards."""
    return len(int8_names(model))


def int8_shards(model: nn.Module) -> dict[str, torch.Tensor]:
    """Copies of this rank's int8 rows and scales of every int8 weight (``name.int_data``,
    ``name.scale``)."""
    out = {}
    for name, param in model.named_parameters():
        local = _local(param)
        if isinstance(local, fsdp_int8.Int8Weight):
            out[name + ".int_data"], out[name + ".scale"] = local.int_data.clone(), local.scale.clone()
    return out


def local_state(model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> dict[str, torch.Tensor]:
    """Copies of this rank's shards: parameters (an int8 weight as its int8 rows and scales,
    as :func:`int8_shards`) and, given the optimizer, its state."""
    out = int8_shards(model)
    for name, param in model.named_parameters():
        local = _local(param)
        if not isinstance(local, fsdp_int8.Int8Weight):
            out[name] = local.clone()
        if optimizer is not None:
            for key, value in optimizer.state[param].items():
                out[f"{name}:{key}"] = _local(value).clone()
    return out


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    """Whether two ``local_state`` (or ``int8_shards``) results hold the same keys and bytes."""
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@contextlib.contextmanager
def job_folder(prefix: str, device: torch.device, *, one_process_ok: bool = False) -> Iterator[tuple[int, str]]:
    """``(rank, folder)``: the example's process group and a scratch folder of rank 0's that
    every rank writes into; both cleaned up afterwards.

    The process group is created from torchrun's environment unless the caller already has
    one (it is then used as it is, and kept). ``one_process_ok``: a plain ``python`` run
    (``WORLD_SIZE`` unset or 1) makes none and runs unsharded, rank 0.
    """
    created = not dist.is_initialized() and (not one_process_ok or int(os.environ.get("WORLD_SIZE", "1")) > 1)
    if created:
        dist.init_process_group(dist.get_default_backend_for_device(device))
    rank = dist.get_rank() if dist.is_initialized() else 0
    folder = [tempfile.mkdtemp(prefix=prefix) if rank == 0 else None]
    if dist.is_initialized():
        dist.broadcast_object_list(folder)  # every rank writes into rank 0's folder
    try:
        yield rank, folder[0]
    finally:  # no collective here: a rank that failed must exit, not wait for the others
        if rank == 0:
            shutil.rmtree(folder[0], ignore_errors=True)
        if created:
            dist.destroy_process_group()
