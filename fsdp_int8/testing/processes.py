"""Run a test body in N processes: CPU + gloo here, one GPU per rank + NCCL where there are enough.

Two front ends over one worker: :func:`run_distributed` for pytest-style tests, and
:class:`DistributedTestCase`, a ``MultiProcessTestCase`` that initialises the process
group on CPU too, for unittest-style suites (how to use them: docs/testing.md). The ranks
are forked from a server that imported torch and fsdp_int8 once, which saves seconds per
rank. Teardown follows what avoids gloo's exit-time abort: collect garbage, then destroy
the process group before the interpreter shuts down.
"""

from __future__ import annotations

import faulthandler
import gc
import multiprocessing
import os
import pickle
import queue
import signal
import sys
import tempfile
import time
import traceback
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.distributed as dist

from fsdp_int8._dist import device_type_for

__all__ = ["device_type_for", "run_distributed", "DistributedTestCase"]

DEFAULT_TIMEOUT_S = 300.0
_POLL_S = 0.5  # how often a silent wait checks for ranks that died without reporting
_CRASH_LOG_LINES = 80  # how much of a crashed rank's stderr its failure message quotes
_STACKS_SIGNAL = getattr(signal, "SIGUSR1", None)  # dumps a rank's Python stacks (not on Windows)
_STACKS_WAIT_S = 2.0  # time for the ranks to write them


def _init_process_group(rank: int, world_size: int, init_file: str, timeout: timedelta | None = None) -> str:
    device_type = device_type_for(world_size)
    if device_type != "cpu":
        torch.accelerator.set_device_index(rank)
    else:  # ranks share the CPU cores: give each its share instead of oversubscribing
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
    dist.init_process_group(
        backend=dist.get_default_backend_for_device(device_type),
        init_method=f"file://{init_file}",
        rank=rank,
        world_size=world_size,
        timeout=timeout,
    )
    return device_type


def _teardown() -> None:
    gc.collect()
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def _send_stderr_to(log_path: str) -> None:
    """Point this process's stderr (file descriptor 2, so C++ messages too) at ``log_path``
    and have Python dump every thread's stack there on a fatal signal: a rank that aborts
    in native code (``terminate called ...``, SIGABRT, SIGSEGV) then leaves its last words
    and where it stood, which the parent quotes in the failure."""
    sys.stderr.flush()
    log_fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(log_fd, 2)
    os.close(log_fd)
    faulthandler.enable(file=sys.stderr, all_threads=True)
    if _STACKS_SIGNAL is not None:  # the parent asks a rank that overstays where it is
        faulthandler.register(_STACKS_SIGNAL, file=sys.stderr, all_threads=True)


def _worker(rank, world_size, init_file, body, args, results, log_path, environ, pg_timeout) -> None:
    os.environ.clear()  # the caller's, not the forkserver's (multiprocessing carries cwd and sys.path)
    os.environ.update(environ)
    os.environ["RANK"], os.environ["WORLD_SIZE"] = str(rank), str(world_size)
    _send_stderr_to(log_path)
    try:
        _init_process_group(rank, world_size, init_file, pg_timeout)
        # Plain pickle bytes: a queue would pass tensors as shared-memory handles that die
        # with this process before the parent reads them.
        value = pickle.dumps(body(rank, world_size, *args))
        _teardown()
        results.put((rank, True, value))
    except BaseException:  # report everything, including assertion failures
        results.put((rank, False, traceback.format_exc()))
        raise SystemExit(1)


def _context() -> multiprocessing.context.BaseContext:
    """Fresh processes for the ranks: forked from a server that has imported torch and
    fsdp_int8 once (seconds saved per rank) where the platform has one, else spawned."""
    if "forkserver" not in multiprocessing.get_all_start_methods():
        return multiprocessing.get_context("spawn")
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(["torch", "torch.distributed", "fsdp_int8"])
    return context


def run_distributed(
    body: Callable[..., Any],
    world_size: int = 2,
    *args: Any,
    timeout: float = DEFAULT_TIMEOUT_S,
    pg_timeout: timedelta | None = None,
) -> list[Any]:
    """Run ``body(rank, world_size, *args)`` in ``world_size`` fresh processes.

    The ranks are forked from a server that imported torch and fsdp_int8 once
    (``multiprocessing``'s forkserver; spawned where the platform has none); each takes the
    caller's environment, working directory and ``sys.path`` as they are at the call, with
    ``RANK`` and ``WORLD_SIZE`` set. Before ``body`` runs each initialises the default
    process group (file rendezvous in a temporary directory; device and backend from
    :func:`device_type_for`; on an accelerator ``torch.accelerator.set_device_index(rank)``,
    on the CPU ``os.cpu_count() // world_size`` threads per rank); after it returns each
    collects garbage, runs a barrier and destroys the group. ``body`` and ``args`` must be
    picklable (module-level functions). Starting the ranks costs a second or more: put
    many cases in one body.

    Each rank's stderr is copied to this process's stderr when the ranks end. A rank that
    dies without reporting (a native crash: SIGABRT, SIGSEGV) has the end of it, with
    Python's stacks at the crash (``faulthandler``), quoted in the error; ranks that
    overstay ``timeout`` are asked for their stacks (SIGUSR1) before they are ended, which
    the ``TimeoutError`` quotes.

    Args:
        body: The test body.
        world_size: Number of processes.
        *args: More positional arguments for ``body``.
        timeout: Seconds the ranks have to finish, together.
        pg_timeout: ``init_process_group``'s ``timeout`` in each rank (``None``: torch's default).

    Returns:
        Each rank's return value, indexed by rank (pickled in the rank: it must be picklable).

    Raises:
        AssertionError: a rank raised (a failed ``assert`` or an unpicklable return value
            included) or died: ``"k of N ranks failed:"`` and each failed rank's traceback
            under ``--- rank r ---``. It stops waiting at the first failure (the others may
            be blocked in a collective) and ends the rest, so usually one rank is listed.
        TimeoutError: the ranks did not all finish within ``timeout`` seconds (a hang); the
            message names the missing ranks.

    Example::

        def _body(rank: int, world_size: int) -> float:   # module-level: it is pickled
            model = fsdp_int8.shard_model(MyModel().to(device_type_for(world_size)))
            ...
            return loss

        def test_my_model():
            losses = run_distributed(_body, world_size=2)   # one result per rank
    """
    ctx = _context()
    results = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "rendezvous")
        logs = [os.path.join(tmp, f"rank{r}.stderr") for r in range(world_size)]
        procs = [
            ctx.Process(target=_worker, args=(r, world_size, init_file, body, args, results, logs[r], dict(os.environ), pg_timeout))
            for r in range(world_size)
        ]
        for p in procs:
            p.start()
        outcomes: dict[int, tuple[bool, Any]] = {}
        deadline = time.monotonic() + timeout
        try:
            while len(outcomes) < world_size:
                try:
                    rank, ok, value = results.get(timeout=_POLL_S)
                except queue.Empty:
                    dead = [
                        r for r, p in enumerate(procs)
                        if r not in outcomes and p.exitcode is not None
                    ]
                    if dead and results.empty():  # died without a word (crash, OOM kill, ...)
                        for r in dead:
                            outcomes[r] = (False, _crash_report(procs[r].exitcode, logs[r]))
                        break
                    if time.monotonic() > deadline:
                        missing = sorted(set(range(world_size)) - set(outcomes))
                        raise TimeoutError(
                            f"ranks {missing} of {world_size} did not finish in {timeout:.0f} s "
                            "(a hang: a collective that not every rank reached?)"
                            + _where_they_are(procs, logs, missing)
                        ) from None
                    continue
                outcomes[rank] = (ok, value)
                if not ok:  # a failed rank may leave the others blocked in a collective
                    break
        finally:
            for rank, p in enumerate(procs):
                p.join(timeout=5 if len(outcomes) == world_size else 1)
                if p.is_alive():  # blocked behind a failed rank: ended here, no report of its own
                    p.kill()
                    p.join()
                elif rank not in outcomes and p.exitcode != 0:  # it crashed while another reported
                    outcomes[rank] = (False, _crash_report(p.exitcode, logs[rank]))
            _echo_stderr(logs)
    failures = {r: v for r, (ok, v) in outcomes.items() if not ok}
    if failures:
        details = "\n".join(f"--- rank {r} ---\n{tb}" for r, tb in sorted(failures.items()))
        raise AssertionError(f"{len(failures)} of {world_size} ranks failed:\n{details}")
    return [pickle.loads(outcomes[r][1]) for r in range(world_size)]


def _read_log(path: str, start: int = 0) -> str:
    """A rank's stderr from byte ``start`` on ("" if the rank died before it opened it)."""
    try:
        with open(path, errors="replace") as log:
            log.seek(start)
            return log.read()
    except FileNotFoundError:
        return ""


def _crash_report(exitcode: int | None, log_path: str) -> str:
    """What a rank that died without reporting left: its exit code (negative: the signal)
    and the end of its stderr, where a native abort's message and faulthandler's stacks are."""
    tail = "".join(_read_log(log_path).splitlines(keepends=True)[-_CRASH_LOG_LINES:])
    return f"exited with code {exitcode} before reporting; the end of its stderr:\n{tail or '(empty)'}\n"


def _where_they_are(procs: list, logs: list[str], ranks: list[int]) -> str:
    """Ask ``ranks`` (still running) for their Python stacks; what they wrote."""
    if _STACKS_SIGNAL is None:
        return ""
    sizes = {rank: os.path.getsize(logs[rank]) if os.path.exists(logs[rank]) else 0 for rank in ranks}
    for rank in ranks:
        if procs[rank].is_alive():
            os.kill(procs[rank].pid, _STACKS_SIGNAL)
    time.sleep(_STACKS_WAIT_S)
    return "".join(
        f"\n--- rank {rank}, where it waits ---\n{_read_log(logs[rank], sizes[rank]) or '(no answer)'}"
        for rank in ranks
    )


def _echo_stderr(logs: list[str]) -> None:
    """Copy each rank's stderr to this process's, so pytest shows it beside the failure."""
    for rank, path in enumerate(logs):
        text = _read_log(path)
        if text:
            sys.stderr.write(f"--- stderr of rank {rank} ---\n{text}")
    sys.stderr.flush()


def __getattr__(name: str) -> Any:
    # DistributedTestCase is built on first use: importing torch's internal test utilities
    # costs every spawned rank about a second, and run_distributed does not need them.
    if name != "DistributedTestCase":
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()[name] = _make_distributed_test_case()
    return globals()[name]


def _make_distributed_test_case() -> type:
    try:
        from torch.testing._internal.common_distributed import MultiProcessTestCase
    except ImportError as error:  # expecttest missing
        raise ImportError(
            "fsdp_int8.testing.DistributedTestCase needs torch's test utilities, which need "
            "the expecttest package: pip install expecttest"
        ) from error

    class DistributedTestCase(MultiProcessTestCase):
        """A ``MultiProcessTestCase`` whose ranks run on CPU + gloo when GPUs are missing.

        Unlike torch's ``FSDPTest`` it does not skip on CPU. ``setUp`` spawns
        ``world_size`` processes (2 unless a subclass overrides the property) for each test
        method, which runs in every rank with ``self.rank`` and ``self.device_type`` set
        and the default process group initialised (as for :func:`run_distributed`);
        torch's ``run_test`` destroys the group afterwards, then the rank collects garbage.
        A failing rank fails the test in the parent with torch's ``RuntimeError("Process r
        exited with error code 10 and exception: ...")``.

        Built on first use, and only where torch's test utilities import (they need
        ``expecttest``): otherwise importing the name raises ``ImportError``.
        """

        @property
        def world_size(self) -> int:
            return 2

        def setUp(self) -> None:
            super().setUp()
            self._spawn_processes()

        @classmethod
        def _run(cls, rank: int, test_name: str, file_name: str, parent_pipe, **kwargs) -> None:
            self = cls(test_name)
            self.rank = rank
            self.file_name = file_name
            self.device_type = _init_process_group(rank, self.world_size, file_name)
            self.run_test(test_name, parent_pipe)  # destroys the process group afterwards
            gc.collect()

    DistributedTestCase.__module__ = __name__
    DistributedTestCase.__qualname__ = "DistributedTestCase"
    return DistributedTestCase
