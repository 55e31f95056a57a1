"""Per-rank journals and the watchdog that bounds each scenario in time.

Results travel through files, not return values, so that a run that dies still reports:
each rank appends one JSON line per event to ``rank<r>.jsonl`` in a directory of its
spawn. A watchdog thread in every rank ends the rank when its current step overstays:

* a step that runs longer than ``scenario_timeout``;
* a step that another rank has already failed (it dropped :func:`abort_marker`), still
  running ``peer_failure_grace`` seconds later: this rank is presumed blocked in a
  collective that the failed rank never reached.
"""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path
from typing import Any


class Journal:
    """Append-only JSON lines of one rank; every line is flushed at once (a rank may be
    ended by its watchdog at any moment)."""

    def __init__(self, directory: Path, rank: int) -> None:
        self._file = open(directory / f"rank{rank}.jsonl", "a", encoding="utf-8")
        self._lock = threading.Lock()

    def write(self, **record: Any) -> None:
        record["t"] = time.time()
        with self._lock:
            self._file.write(json.dumps(record) + "\n")
            self._file.flush()


def read_journal(path: Path) -> list[dict]:
    """The records of one rank's journal (none if it never wrote one)."""
    if not path.exists():
        return []
    records = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:  # a line cut short when the rank ended
            break
    return records


def abort_marker(directory: Path, step: int) -> Path:
    """The file a rank drops when it failed step ``step``: the others' watchdogs watch it."""
    return directory / f"abort-{step}"


class Watchdog:
    """Ends this rank when its current step overstays (see the module docstring)."""

    POLL_S = 0.1

    def __init__(self, journal: Journal, directory: Path, timeout: float, grace: float) -> None:
        self._journal, self._directory = journal, directory
        self._timeout, self._grace = timeout, grace
        self._lock = threading.Lock()
        self._step: int | None = None
        self._started = 0.0
        threading.Thread(target=self._watch, daemon=True, name="conformance-watchdog").start()

    def enter(self, step: int) -> None:
        with self._lock:
            self._step, self._started = step, time.monotonic()

    def leave(self) -> None:
        with self._lock:
            self._step = None

    def _watch(self) -> None:
        while True:
            time.sleep(self.POLL_S)
            with self._lock:
                if self._step is None:
                    continue
                why = self._overstay(self._step)
                if why:
                    self._journal.write(ev="stopped", step=self._step, why=why)
                    os._exit(3)  # the main thread may be blocked in a collective forever

    def _overstay(self, step: int) -> str | None:
        elapsed = time.monotonic() - self._started
        if elapsed > self._timeout:
            return f"did not finish within scenario_timeout={self._timeout:.0f} s"
        marker = abort_marker(self._directory, step)
        if marker.exists():
            since = time.time() - marker.stat().st_mtime
            if since > self._grace:
                return (f"still inside the scenario {since:.1f} s after another rank failed it "
                        "(blocked in a collective that rank never reached?)")
        return None
