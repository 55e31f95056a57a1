"""Post-accumulate-grad hooks that last as long as the optimizer that set them.

A parameter keeps its hooks for its own lifetime, and a hook that held its optimizer
would keep that optimizer (and its states) alive and updating after the user dropped it,
e.g. for a fresh one after a restart. The hooks here hold their owner weakly: once the
owner is collected they do nothing, and they are removed.
"""

from __future__ import annotations

import weakref
from typing import Any, Callable, Iterable

import torch


def _remove(handles: list[Any]) -> None:
    for handle in handles:
        handle.remove()


def register_while_alive(
    owner: object, params: Iterable[torch.Tensor], on_gradient: Callable[[Any, torch.Tensor], None]
) -> None:
    """Call ``on_gradient(owner, param)`` from each of ``params``' post-accumulate-grad
    hooks while ``owner`` lives; remove the hooks when it is collected."""
    owner_ref = weakref.ref(owner)

    def hook(param: torch.Tensor) -> None:
        alive = owner_ref()
        if alive is not None:
            on_gradient(alive, param)

    handles = [param.register_post_accumulate_grad_hook(hook) for param in params]
    weakref.finalize(owner, _remove, handles)


def watch_new(
    owner: object, names: dict[int, str], params: Iterable[torch.Tensor], group_index: int,
    on_gradient: Callable[[Any, torch.Tensor], None],
) -> list[torch.Tensor]:
    """Hook each of ``params`` (parameter group ``group_index``) that ``names`` does not
    hold yet, as :func:`register_while_alive` does, and record its name for error messages
    (``names[id(param)]``: "parameter i of group g", ``i`` counting every watched
    parameter); return those parameters."""
    start = len(names)
    new = []
    for index, param in enumerate(params):
        if id(param) not in names:
            names[id(param)] = f"parameter {start + index} of group {group_index}"
            new.append(param)
    register_while_alive(owner, new, on_gradient)
    return new
