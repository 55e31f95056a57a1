"""Work an optimizer step leaves for its end, flushed in one fixed order.

Some writes of int8 weights are cheaper or only correct once per optimizer step, not once
per weight: the finiteness verdicts of updates on an accelerator (one device sync per
step, :mod:`~fsdp_int8._weight.update_checks`) and the updates of weights whose
tensor-parallel peers share row scales (one ``all_reduce`` per step,
:mod:`~fsdp_int8._weight.tensor_parallel`). Each kind is a :class:`HeldWork` queue made
here. :func:`settle` flushes every queue in the order of :data:`ORDER`, whatever order
their modules were imported in: after each ``torch.optim`` optimizer's ``step()`` (one
global step post-hook, registered with the first held item), when a queue reaches its
cap (updates made outside an optimizer), and before any op reads a weight whose update
is held (:func:`settle_if_waiting`, which the op table calls for every op).
"""

from __future__ import annotations

from typing import Any, Callable, Iterable

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook

__all__ = ["ORDER", "HeldWork", "held_work", "settle", "settle_if_waiting"]

# The flush order: updates land before their verdicts are read.
ORDER = ("tensor-parallel updates", "update verdicts")

_queues: dict[str, "HeldWork"] = {}
_waiting_storages: set[int] = set()  # int8 storages whose values wait in a queue
_hook: list = []  # the optimizer step post-hook's handle, once registered


def _storage_of(tensor: Any) -> int | None:
    int_data = getattr(tensor, "int_data", None)
    return None if int_data is None else int_data.untyped_storage().data_ptr()


class HeldWork:
    """One kind of work held until the step ends.

    Args:
        name: Its place in :data:`ORDER`.
        flush: Runs the held items (in the order they were held); may raise.
        cap: Items held before a forced :func:`settle` (bounds the memory of update loops
            outside an optimizer).
    """

    def __init__(self, name: str, flush: Callable[[list], None], cap: int) -> None:
        self.name = name
        self.flush = flush
        self.cap = cap
        self.items: list = []
        self._storages: set[int] = set()

    def hold(self, item: Any, weight: torch.Tensor | None = None) -> None:
        """Hold ``item`` until the step ends; ``weight``: the int8 weight whose values it
        holds (an op reading that weight settles first)."""
        if not _hook:
            _hook.append(register_optimizer_step_post_hook(lambda optimizer, args, kwargs: settle()))
        if weight is not None:
            storage = _storage_of(weight)
            self._storages.add(storage)
            _waiting_storages.add(storage)
        self.items.append(item)
        if len(self.items) >= self.cap:
            settle()

    def holds(self, weight: torch.Tensor) -> bool:
        """Whether an update of ``weight`` waits in this queue."""
        return _storage_of(weight) in self._storages

    def _take(self) -> list:
        items, self.items, self._storages = self.items, [], set()
        # what the other queues still hold keeps waiting (a weight may be in several)
        _waiting_storages.clear()
        _waiting_storages.update(*(queue._storages for queue in _queues.values()))
        return items


def held_work(name: str, flush: Callable[[list], None], *, cap: int) -> HeldWork:
    """The queue named ``name`` (one of :data:`ORDER`), made once."""
    if name not in ORDER:
        raise ValueError(f"unknown end-of-step work {name!r}; the order is {ORDER}")
    if name in _queues:
        raise ValueError(f"end-of-step work {name!r} exists already")
    _queues[name] = HeldWork(name, flush, cap)
    return _queues[name]


def settle() -> None:
    """Flush every queue in :data:`ORDER`. A flush that raises does not stop the later
    ones (every item is run once); the first error is raised at the end."""
    failed: Exception | None = None
    for name in ORDER:
        queue = _queues.get(name)
        if queue is None or not queue.items:
            continue
        items = queue._take()  # before flushing: ops the flush runs do not settle again
        try:
            queue.flush(items)
        except Exception as error:  # noqa: BLE001 -- re-raised below, after the other queues
            failed = failed or error
    if failed is not None:
        raise failed


def settle_if_waiting(tensors: Iterable[Any]) -> None:
    """:func:`settle` if any of ``tensors`` (an op's arguments) has an update held."""
    if not _waiting_storages:
        return
    for tensor in tensors:
        if _storage_of(tensor) in _waiting_storages:
            settle()
            return
