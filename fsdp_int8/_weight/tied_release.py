"""Free an int8 table tied to the output head once the head's backward has read it.

FSDP2 keeps the root group's parameters gathered from the forward to the root's
post-backward, at the very end of backward. The head's backward reads a tied table first;
the only later reader, the lookup's backward, reads its ids and gradient rows, never the
weight (:mod:`.tied_gradient`). In between, the blocks' backward would hold the gathered
table for nothing. Under ``Int8TrainingConfig(reshard_early=True)`` the head's last
backward reshards that one parameter through FSDP2's own per-parameter transition (the
modules get the sharded parameter back, the gathered storage is freed); the group's
post-backward then finds it sharded and reduces its gradient as usual. Only when FSDP2
reshards the group after this backward anyway (not under
``set_reshard_after_backward(False)``, whose next forward skips the all-gather).

Each linear forward that will run a backward on a watched table counts one read and each
of those backwards ends one: the table is freed when none is left (a head applied twice,
or pipelined microbatches, free it after the last). A forward whose backward never runs
leaves its read counted, and the table then stays gathered: no saving, nothing wrong.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch
import torch.nn as nn

from fsdp_int8._fsdp_compat import (
    fsdp_modules,
    gathered_param,
    param_groups,
    reshard_param_if_group_will,
    tied_embedding_params,
)
from fsdp_int8._weight.tensor import Int8Weight


@dataclass
class _Watch:
    """One watched table: its group and FSDP parameter, by weak reference (a model that is
    dropped leaves nothing behind), and the backward reads still to come."""

    group: weakref.ref
    fsdp_param: weakref.ref
    pending: int = 0


_watched: list[_Watch] = []


def release_tied_tables_after_head(model: nn.Module) -> int:
    """Watch every int8 table of ``model``'s root group that an embedding shares with an
    output head; return how many."""
    fsdp = fsdp_modules(model)
    if not fsdp:
        return 0
    _watched[:] = [w for w in _watched if w.group() is not None and w.fsdp_param() is not None]  # dropped models
    count = 0
    for group in param_groups(fsdp[0][1]):
        for fsdp_param in tied_embedding_params(group):
            if isinstance(getattr(fsdp_param.sharded_param, "_local_tensor", None), Int8Weight):
                _watched.append(_Watch(weakref.ref(group), weakref.ref(fsdp_param)))
                count += 1
    return count


def _watch_of(weight: torch.Tensor) -> _Watch | None:
    """The watch of the table that FSDP2 gathered as ``weight``, if any (a dropped model's
    watch gathers nothing)."""
    for watch in _watched:
        fsdp_param = watch.fsdp_param()
        if fsdp_param is not None and watch.group() is not None and gathered_param(fsdp_param) is weight:
            return watch
    return None


def note_read(weight: torch.Tensor) -> None:
    """Called by a forward whose backward will read ``weight``."""
    if _watched and not torch.compiler.is_compiling():
        watch = _watch_of(weight)
        if watch is not None:
            watch.pending += 1


def read_done(weight: torch.Tensor) -> None:
    """Called by that backward once it no longer needs ``weight``: the last frees it."""
    if not _watched or torch.compiler.is_compiling():
        return
    watch = _watch_of(weight)
    if watch is None or watch.pending < 1:
        return
    watch.pending -= 1
    if watch.pending == 0:
        reshard_param_if_group_will(watch.group(), watch.fsdp_param())
