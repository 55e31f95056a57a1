"""Work an optimizer step leaves for its end, owned by that step.

Some writes of int8 weights are cheaper once per optimizer step than once per weight: the
finiteness verdicts of updates on an accelerator (one device sync per step instead of one
per weight, :mod:`~fsdp_int8._weight.update_checks`) and the updates of weights whose
tensor-parallel peers share row scales (one ``all_reduce`` per step instead of one per
weight, :mod:`~fsdp_int8._weight.tensor_parallel`).

An :class:`EndOfStep` holds that work for one optimizer: ``Int8AdamW`` and ``Int8SGD`` own
one, and :func:`fsdp_int8.optim.batch_int8_updates` gives a ``torch.optim`` optimizer one.
While its :meth:`EndOfStep.collecting` block runs (the optimizer's ``step()``), the writes
the step makes hand their work to it; when the block ends the work is flushed, each kind
in the order of :data:`ORDER`. Nothing is process-wide: two optimizers keep apart, and a
write made outside any step (a load, an update loop by hand) does its work at once.

Within a step, an op that reads a weight whose update is held flushes the step's work
first (:func:`flush_if_holding`): every rank runs the same step, so the collectives of
that flush line up. Outside a step nothing is held, so a read never starts a collective.
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import Any, Callable, Iterable, Iterator

import torch

__all__ = ["ORDER", "EndOfStep", "register_kind", "hold", "flush_active", "flush_if_holding"]

# The flush order: updates land before their verdicts are read.
ORDER = ("tensor-parallel updates", "update verdicts")

# How each kind of held work is flushed, registered once by the module that makes it.
_FLUSHES: dict[str, Callable[[list], None]] = {}

# The step collecting work in this thread, if any (set by EndOfStep.collecting).
_ACTIVE: contextvars.ContextVar["EndOfStep | None"] = contextvars.ContextVar("fsdp_int8_end_of_step", default=None)


def register_kind(name: str, flush: Callable[[list], None]) -> str:
    """Declare the kind of work ``name`` (one of :data:`ORDER`), flushed by ``flush`` (which
    runs the items in the order they were held, and may raise). Returns ``name``."""
    if name not in ORDER:
        raise ValueError(f"unknown end-of-step work {name!r}; the order is {ORDER}")
    if name in _FLUSHES:
        raise ValueError(f"end-of-step work {name!r} is registered already")
    _FLUSHES[name] = flush
    return name


def _storage_of(tensor: Any) -> int | None:
    int_data = getattr(tensor, "int_data", None)
    return None if int_data is None else int_data.untyped_storage().data_ptr()


class EndOfStep:
    """The work one optimizer's step holds until it ends.

    Args:
        kinds: The kinds of work this step holds (default: every kind of :data:`ORDER`);
            a write of another kind does its work at once. The step inside backward holds
            only verdicts: its tensor-parallel writes round at once, so no weight waits
            between backward and ``step()``.
    """

    def __init__(self, kinds: Iterable[str] = ORDER) -> None:
        self.kinds = tuple(kinds)
        unknown = set(self.kinds) - set(ORDER)
        if unknown:
            raise ValueError(f"unknown end-of-step work {sorted(unknown)}; the order is {ORDER}")
        self._items: dict[str, list] = {name: [] for name in self.kinds}
        self._storages: set[int] = set()  # int8 storages whose new values wait here

    def __len__(self) -> int:
        return sum(len(items) for items in self._items.values())

    def held(self, name: str) -> list:
        """The items of kind ``name`` held now (a copy)."""
        return list(self._items.get(name, ()))

    def hold(self, name: str, item: Any, weight: torch.Tensor | None = None) -> None:
        """Hold ``item`` of kind ``name`` until the step ends; ``weight``: the int8 weight
        whose new values it holds (an op reading that weight flushes first)."""
        if weight is not None:
            self._storages.add(_storage_of(weight))
        self._items[name].append(item)

    def holds(self, weight: Any) -> bool:
        """Whether new values of ``weight`` wait here."""
        return bool(self._storages) and _storage_of(weight) in self._storages

    def discard(self) -> None:
        """Forget everything held (the step that made it raised)."""
        for items in self._items.values():
            items.clear()
        self._storages.clear()

    def flush(self, through: str | None = None) -> None:
        """Flush the held work, kind by kind in :data:`ORDER`, up to the kind ``through`` (all by default). A
        flush that raises does not stop the later ones (every item runs once); the first
        error is raised at the end."""
        failed: Exception | None = None
        self._storages.clear()
        for name in ORDER if through is None else ORDER[: ORDER.index(through) + 1]:
            items = self._items.get(name)
            if not items:
                continue
            taken = list(items)
            items.clear()  # before flushing: ops the flush runs do not flush again
            try:
                _FLUSHES[name](taken)
            except Exception as error:  # noqa: BLE001 -- re-raised below, after the other kinds
                failed = failed or error
        if failed is not None:
            raise failed

    @contextlib.contextmanager
    def collecting(self, *, flush: bool = True) -> Iterator["EndOfStep"]:
        """Writes made inside the block hand their end-of-step work to this step. With
        ``flush``, the work is flushed when the block ends; if the block raises, the held
        work is dropped (a weight whose update waited keeps its values from before the step)."""
        token = _ACTIVE.set(self)
        try:
            yield self
            if flush:  # still collecting: verdicts of the held updates join this flush
                self.flush()
        except BaseException:
            if flush:
                self.discard()
            raise
        finally:
            _ACTIVE.reset(token)


def hold(name: str, item: Any, weight: torch.Tensor | None = None) -> bool:
    """Hand ``item`` of kind ``name`` to the step collecting now. ``False`` when no step
    collects that kind: the caller then does the work at once."""
    step = _ACTIVE.get()
    if step is None or name not in step.kinds:
        return False
    step.hold(name, item, weight)
    return True


def flush_active(through: str | None = None) -> None:
    """Flush the work of the step collecting now, if any, up to the kind ``through`` (before
    a write whose collective must come after the held ones)."""
    step = _ACTIVE.get()
    if step is not None:
        step.flush(through)


def flush_if_holding(tensors: Iterable[Any]) -> None:
    """Settle the collecting step if any of ``tensors`` (an op's arguments) has new values
    waiting in it. Outside a step nothing waits: no work, no collective."""
    step = _ACTIVE.get()
    if step is None or not step._storages:
        return
    for tensor in tensors:
        if step.holds(tensor):
            step.flush()
            return
