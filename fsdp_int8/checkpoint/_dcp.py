"""What goes through ``torch.distributed.checkpoint`` (dcp): the training state dict, which
of its entries are int8, what a checkpoint's index holds, and dcp's save and load with or
without a process group."""

from __future__ import annotations

import contextlib
import warnings
from pathlib import Path
from typing import Any, Iterator

import torch
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

from fsdp_int8 import _dist
from fsdp_int8.weight import Int8Weight, local_shard


def training_state(model: nn.Module, optimizer: torch.optim.Optimizer | None) -> dict[str, Any]:
    """``{"model": ..., "optimizer": ...}`` as dcp saves and loads it (no optimizer: no entry)."""
    state: dict[str, Any] = {"model": get_model_state_dict(model)}
    if optimizer is not None:
        state["optimizer"] = get_optimizer_state_dict(model, optimizer)
    return state


def int8_keys(model_state: dict[str, Any]) -> list[str]:
    """The sorted keys of a model state dict's int8 weights (sharded or not)."""
    return sorted(k for k, v in model_state.items() if isinstance(local_shard(v), Int8Weight))


def stored_entries(path: Path) -> dict[str, Any]:
    """The metadata of every entry in checkpoint ``path``'s index, by key."""
    return dcp.FileSystemReader(path).read_metadata().state_dict_metadata


@contextlib.contextmanager
def _single_process_is_intended() -> Iterator[None]:
    """dcp warns that it assumes one process without a process group: so do we."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def save(state: dict[str, Any], path: Path) -> None:
    """Write this rank's part of ``state`` into ``path``."""
    with _single_process_is_intended():
        dcp.save(state, checkpoint_id=path, no_dist=not _dist.is_distributed())


def load(state: dict[str, Any], path: Path) -> None:
    """Fill ``state``'s tensors in place from ``path``, resharding as they are placed."""
    with _single_process_is_intended():
        dcp.load(state, checkpoint_id=path, no_dist=not _dist.is_distributed())
