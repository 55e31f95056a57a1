"""Count the bytes of every collective, where it crosses: at the ``torch.distributed`` calls.

FSDP2 looks its collectives up on the ``torch.distributed`` module at each call
(``all_gather_single``, ``reduce_scatter_single``, ``all_reduce``), so wrapping those names
sees exactly what FSDP2 sends: dtype, element count and bytes of each buffer, never a
number computed from parameter shapes.
"""

from __future__ import annotations

import contextlib
import threading
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist

__all__ = ["CollectiveRecord", "CollectiveCounter", "count_collectives"]

# name -> (index of the tensor whose size defines the collective, keyword of that tensor)
# The full-size buffer: the gathered output, the scattered input, the reduced tensor.
_WATCHED: dict[str, tuple[int, str]] = {
    "all_gather_single": (0, "output_tensor"),
    "all_gather_into_tensor": (0, "output_tensor"),
    "reduce_scatter_single": (1, "input"),
    "reduce_scatter_tensor": (1, "input"),
    "all_reduce": (0, "tensor"),
    "all_to_all_single": (1, "input"),
    "broadcast": (0, "tensor"),
}


@dataclass(frozen=True)
class CollectiveRecord:
    """One collective call as seen by this rank.

    Attributes:
        name: The ``torch.distributed`` function, e.g. ``"all_gather_single"``.
        dtype: The dtype of the full buffer.
        numel: Its element count (all ranks' shares).
        bytes: Its size in bytes.
        world_size: The size of the group the call ran on.
    """

    name: str
    dtype: torch.dtype
    numel: int
    bytes: int
    world_size: int

    @property
    def wire_bytes(self) -> float:
        """Bytes this rank sends (and receives) for this call in a ring algorithm:
        ``bytes * (world_size - 1) / world_size``."""
        return self.bytes * (self.world_size - 1) / self.world_size


@dataclass(eq=False)  # identity, not equal records: nested counters leave the active list one by one
class CollectiveCounter:
    """The records of one :func:`count_collectives` block; read :attr:`records` or the summaries.

    Counters compare by identity, not by their records: nested blocks each count what ran
    inside them, and leave in order, even when an inner and an outer counter hold equal
    records.

    Attributes:
        records: Every call recorded while the block was active, in order.
    """

    records: list[CollectiveRecord] = field(default_factory=list)

    def clear(self) -> None:
        """Forget what was recorded (e.g. at the start of each step)."""
        self.records.clear()

    def of(self, name: str) -> list[CollectiveRecord]:
        """Records of one collective, e.g. ``"all_gather_single"``."""
        return [r for r in self.records if r.name == name]

    def total_bytes(self, name: str | None = None) -> int:
        """Full-buffer bytes of all calls (of ``name`` only, if given)."""
        return sum(r.bytes for r in self.records if name is None or r.name == name)

    def wire_bytes(self, name: str | None = None) -> float:
        """Bytes this rank sent in a ring for all calls (of ``name`` only, if given); see
        :attr:`CollectiveRecord.wire_bytes`."""
        return sum(r.wire_bytes for r in self.records if name is None or r.name == name)

    def summary(self) -> dict[str, dict[str, int]]:
        """``{name: {"calls": n, "bytes": b}}``."""
        out: dict[str, dict[str, int]] = defaultdict(lambda: {"calls": 0, "bytes": 0})
        for r in self.records:
            out[r.name]["calls"] += 1
            out[r.name]["bytes"] += r.bytes
        return dict(out)


_lock = threading.Lock()
_active: list[CollectiveCounter] = []
_originals: dict[str, Callable[..., Any]] = {}


def _wrap(name: str, original: Callable[..., Any]) -> Callable[..., Any]:
    index, keyword = _WATCHED[name]

    def counted(*args: Any, **kwargs: Any) -> Any:
        tensor = kwargs.get(keyword, args[index] if len(args) > index else None)
        if _active and isinstance(tensor, torch.Tensor):
            group = kwargs.get("group")
            record = CollectiveRecord(
                name=name, dtype=tensor.dtype, numel=tensor.numel(),
                bytes=tensor.numel() * tensor.element_size(),
                world_size=dist.get_world_size(group),
            )
            for counter in _active:
                counter.records.append(record)
        return original(*args, **kwargs)

    counted.__wrapped__ = original  # type: ignore[attr-defined]
    return counted


@contextlib.contextmanager
def count_collectives() -> Iterator[CollectiveCounter]:
    """Record every ``torch.distributed`` collective issued inside the block.

    While active it wraps the ``torch.distributed`` module attributes
    ``all_gather_single``, ``all_gather_into_tensor``, ``reduce_scatter_single``,
    ``reduce_scatter_tensor``, ``all_reduce``, ``all_to_all_single`` and ``broadcast`` and
    records the full-size buffer of each call (the gathered output, the scattered input,
    the reduced tensor). Code that looks the function up on ``torch.distributed`` at call
    time (FSDP2 does) is seen; a reference bound before the block is not. The patch is
    process-wide (all threads); counters can nest, and each active counter records every
    call. The originals are restored when the last active counter exits.

    Returns:
        A fresh :class:`CollectiveCounter` (yielded by the context manager).

    Example::

        with fsdp_int8.collectives.count_collectives() as counter:
            loss = model(x).sum(); loss.backward()
        counter.summary()  # {"all_gather_single": {"calls": 4, "bytes": ...}, ...}
    """
    counter = CollectiveCounter()
    with _lock:
        if not _active:
            for name in _WATCHED:
                if hasattr(dist, name):
                    _originals[name] = getattr(dist, name)
                    setattr(dist, name, _wrap(name, _originals[name]))
        _active.append(counter)
    try:
        yield counter
    finally:
        with _lock:
            _active.remove(counter)
            if not _active:
                for name, original in _originals.items():
                    setattr(dist, name, original)
                _originals.clear()
