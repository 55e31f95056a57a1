"""The FSDP2 conformance suite for tensor-subclass weights: spec, report and the runner.

:func:`check_fsdp2_conformance` spawns one group of ranks per world size (through
:func:`fsdp_int8.testing.run_distributed`) and runs every scenario of that world size in
it, one after another (the scenarios themselves are in ``fsdp_int8.testing._scenarios``).

Results travel through files, not return values, so that a run that dies still reports:
each rank appends one JSON line per event to ``rank<r>.jsonl`` in a directory of its
spawn. A watchdog thread in every rank bounds each scenario:

* a scenario that runs longer than ``scenario_timeout`` ends the rank;
* a rank whose scenario failed drops a marker file; a rank still inside that scenario
  ``peer_failure_grace`` seconds later (blocked in a collective that the failed rank
  never reached) ends itself.

The parent then reads the journals: the scenario that was running is failed with each
rank's story, and the scenarios after it run in a fresh spawn. A rank-asymmetric failure
therefore costs seconds, never a hang, on gloo and NCCL alike (no collective timeout is
involved).
"""

from __future__ import annotations

import dataclasses
import json
import os
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Callable, Collection, Iterable, Sequence

import torch

__all__ = [
    "SubclassSpec",
    "ScenarioResult",
    "ConformanceReport",
    "SCENARIOS",
    "check_fsdp2_conformance",
    "assert_fsdp2_conformance",
]

PASSED, FAILED, NOT_APPLICABLE = "passed", "failed", "not applicable"

OP_SCENARIOS = {
    "op:view(-1)": "view(-1) keeps the subclass, has the flat shape and the same values",
    "op:as_strided": "as_strided(t, t.shape, contiguous strides, 0), as FSDP2 calls it on the "
                     "unsharded weight",
    "op:split/chunk": "torch.split and torch.chunk on dim 0: subclass pieces with the right rows",
    "op:new_zeros": "new_zeros([rows, cols]): a zero subclass tensor (FSDP2's padded shard)",
    "op:copy_": "copy_ from the subclass (exact) and from a float tensor (within one rounding step)",
    "op:pin_memory": "pin_memory keeps type and values (needs an accelerator)",
    "op:slice": "slices on dim 0, empty ones too, that alias the base (FSDP2 writes shards "
                "through them)",
    "op:cat": "torch.cat on dim 0 of two subclass tensors",
    "op:broadcast": "dist.broadcast of a subclass tensor (full state dicts broadcast from rank 0)",
}

SCENARIOS: dict[str, str] = {
    "parity_reshard": "training parity, reshard_after_forward=True: losses, sharded gradients "
                      "and weights before and after each optimizer step against an unsharded "
                      "reference with all-reduced gradients",
    "parity_no_reshard": "the same with reshard_after_forward=False",
    "world_size_1": "the same on one rank (FSDP2's single-rank path skips the collective)",
    "uneven_shards": "rows not divisible by the world size: the last rank holds fewer rows",
    "empty_shards": "fewer rows than ranks: some ranks hold empty shards",
    "hsdp": "HSDP on a 2 x (world/2) mesh: the hooks must work with the shard mesh only",
    "meta_init": "build on the meta device, fully_shard, to_empty, initialise with copy_, train",
    "bf16_mixed_precision": "MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32): the "
                            "unsharded weight is bf16, training tracks the fp32 reference",
    "wire_bytes": "bytes of FSDP2's all-gather, counted at the collective, against "
                  "wire_bytes_per_element",
    "dcp_reshard": "torch.distributed.checkpoint save at one world size, load at the next, bit-exact",
    **OP_SCENARIOS,
    "asymmetric_failure": "a failure injected on one rank only (its fsdp_pre_all_gather raises) "
                          "ends the run within a bounded time instead of hanging",
}
"""Every scenario the suite knows, by report key, with what it checks (in report order)."""


# ---------------------------------------------------------------------------- spec
@dataclasses.dataclass(frozen=True)
class SubclassSpec:
    """How to build, read and measure a tensor-subclass weight.

    Every callable must be picklable (a module-level function, or a class method such
    as ``MyWeight.from_float``): the ranks run in spawned processes.

    Attributes:
        name: Shown in reports.
        from_float: ``from_float(t) -> weight``: the subclass holding the float tensor
            ``t`` (2-D, fp32, possibly on the meta device). The suite wraps the result in
            ``nn.Parameter``.
        to_float: ``to_float(weight) -> tensor``: the values a weight (or a shard, a
            slice, a flat view of one) stands for, as a plain floating tensor of its shape.
        wire_bytes_per_element: Bytes per weight element that FSDP2's all-gather moves
            (all ranks' shares together, no mixed precision, rows divisible by the world
            size): a number, or ``f(full_shape) -> float`` when it depends on the shape
            (an int8 weight with one fp32 scale per row of K elements: ``1 + 4 / K``).
        rounding_step: The largest change one rounding of an update can make, relative
            to the largest magnitude in its row: ``1 / 127`` for int8 rows scaled by
            their absmax, ``2 ** -7`` for bf16 storage, 0 for a format that stores fp32.
            Two runs that round the same update may land one step apart (stochastic
            rounding draws differ between a shard and the whole weight); the comparisons
            after optimizer steps allow this much and no more.
    """

    name: str
    from_float: Callable[[torch.Tensor], torch.Tensor]
    to_float: Callable[[torch.Tensor], torch.Tensor]
    wire_bytes_per_element: float | Callable[[torch.Size], float]
    rounding_step: float = 0.0

    def wire_bytes_for(self, shape: torch.Size) -> float:
        """Declared all-gather bytes per element for a weight of ``shape``."""
        per_element = self.wire_bytes_per_element
        return float(per_element(shape) if callable(per_element) else per_element)


@dataclasses.dataclass(frozen=True)
class ScenarioResult:
    """The outcome of one scenario: ``status`` is ``"passed"``, ``"failed"`` or ``"not applicable"``."""

    status: str
    detail: str = ""

    @property
    def failed(self) -> bool:
        return self.status == FAILED


@dataclasses.dataclass
class ConformanceReport:
    """What :func:`check_fsdp2_conformance` found, scenario by scenario.

    Attributes:
        spec_name: ``SubclassSpec.name``.
        world_sizes: The world sizes that ran.
        results: Report key (see :data:`SCENARIOS`) -> :class:`ScenarioResult`.
        seconds: Wall time of the whole check.
        spawns: Process groups spawned (one per world size, plus one more after each
            scenario that ended a spawn).
    """

    spec_name: str
    world_sizes: tuple[int, ...]
    results: dict[str, ScenarioResult]
    seconds: float = 0.0
    spawns: int = 0

    @property
    def failures(self) -> dict[str, ScenarioResult]:
        """The failed scenarios."""
        return {k: r for k, r in self.results.items() if r.failed}

    @property
    def ok(self) -> bool:
        """No scenario failed (``not applicable`` ones do not count)."""
        return not self.failures

    def status(self, key: str) -> str:
        """The status of scenario ``key``."""
        return self.results[key].status

    def table(self) -> str:
        """A markdown table: scenario | result | detail."""
        lines = [f"{self.spec_name}: {self._counts()} (world sizes {self.world_sizes}, "
                 f"{self.seconds:.0f} s)", "", "| scenario | result | detail |", "|---|---|---|"]
        for key, result in self.results.items():
            detail = result.detail.replace("|", "\\|").replace("\n", " ")
            lines.append(f"| {key} | {result.status} | {detail} |")
        return "\n".join(lines)

    def _counts(self) -> str:
        statuses = [r.status for r in self.results.values()]
        return ", ".join(f"{statuses.count(s)} {s}" for s in (PASSED, FAILED, NOT_APPLICABLE))

    def __str__(self) -> str:
        return self.table()


# ---------------------------------------------------------------------------- plan
@dataclasses.dataclass(frozen=True)
class _Step:
    """One scenario function run in every rank of a spawn; it reports ``keys``."""

    function: str
    keys: tuple[str, ...]
    kwargs: dict = dataclasses.field(default_factory=dict)


def _plan(
    world_size: int, *, first_multi: bool, selected: set[str], dcp_from: str | None,
    dcp_to: str, dcp_world_sizes: int,
) -> list[_Step]:
    """The steps of one world size's spawn, cheapest and safest first; the deliberate
    rank-asymmetric failure last (it ends the spawn)."""
    ops = tuple(k for k in OP_SCENARIOS if k in selected)
    candidates = [_Step("ops", ops, {"only": ops})] if ops else []
    if world_size == 1:
        candidates.append(_Step("parity", ("world_size_1",), {"kind": "world_size_1"}))
    else:
        candidates += [
            _Step("wire_bytes", ("wire_bytes",)),
            _Step("parity", ("parity_reshard",), {"kind": "reshard"}),
            _Step("parity", ("parity_no_reshard",), {"kind": "no_reshard"}),
        ]
        if first_multi:
            candidates += [
                _Step("bf16_mixed_precision", ("bf16_mixed_precision",)),
                _Step("meta_init", ("meta_init",)),
            ]
        if world_size >= 4 and world_size % 2 == 0:
            candidates.append(_Step("parity", ("hsdp",), {"kind": "hsdp"}))
        candidates += [
            _Step("parity", ("uneven_shards",), {"kind": "uneven"}),
            _Step("parity", ("empty_shards",), {"kind": "empty"}),
        ]
    if dcp_world_sizes >= 2:
        candidates.append(_Step("dcp", ("dcp_reshard",), {"load_from": dcp_from, "save_to": dcp_to}))
    if world_size >= 2 and first_multi:
        candidates.append(_Step("asymmetric_failure", ("asymmetric_failure",)))
    return [s for s in candidates if set(s.keys) & selected]


def _not_planned_reason(key: str, world_sizes: Sequence[int]) -> str:
    sizes = tuple(world_sizes)
    if key == "world_size_1":
        return f"world size 1 is not in world_sizes={sizes}"
    if key == "hsdp":
        return f"needs an even world size >= 4 for a 2-D mesh; world_sizes={sizes}"
    if key == "dcp_reshard":
        return f"needs two world sizes (save at one, load at the other); world_sizes={sizes}"
    return f"needs a world size >= 2; world_sizes={sizes}"


# ---------------------------------------------------------------------------- journals
class _Journal:
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


def _read_journal(path: Path) -> list[dict]:
    if not path.exists():
        return []
    records = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:  # a line cut short when the rank ended
            break
    return records


def _abort_marker(directory: Path, step: int) -> Path:
    return directory / f"abort-{step}"


class _Watchdog:
    """Ends this rank when its current step overstays (see the module docstring)."""

    POLL_S = 0.1

    def __init__(self, journal: _Journal, directory: Path, timeout: float, grace: float) -> None:
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
        marker = _abort_marker(self._directory, step)
        if marker.exists():
            since = time.time() - marker.stat().st_mtime
            if since > self._grace:
                return (f"still inside the scenario {since:.1f} s after another rank failed it "
                        "(blocked in a collective that rank never reached?)")
        return None


# ---------------------------------------------------------------------------- rank side
def _rank_main(
    rank: int, world_size: int, spec: SubclassSpec, steps: list[_Step], directory: str,
    scenario_timeout: float, grace: float,
) -> None:
    """Runs in every spawned rank: each step, then a barrier, journaling as it goes."""
    import torch.distributed as dist

    from fsdp_int8.testing import _scenarios as scenarios

    directory_path = Path(directory)
    journal = _Journal(directory_path, rank)
    # Gloo groups of our own (they work next to NCCL too) keep the barriers between
    # scenarios and the agreements inside them apart from every collective a scenario
    # issues, and from each other: a rank that failed early waits at the barrier while
    # the others may still be in an agreement.
    control = dist.new_group(backend="gloo")
    agreement = dist.new_group(backend="gloo")
    watchdog = _Watchdog(journal, directory_path, scenario_timeout, grace)
    for index, step in enumerate(steps):
        journal.write(ev="start", step=index, function=step.function)
        watchdog.enter(index)
        outcomes = scenarios.run_step(spec, step.function, step.keys, step.kwargs, agreement)
        if any(status == FAILED for status, _ in outcomes.values()):
            _abort_marker(directory_path, index).touch()
        journal.write(ev="end", step=index, outcomes=outcomes)
        dist.barrier(group=control)
        watchdog.leave()
    journal.write(ev="done")


# ---------------------------------------------------------------------------- parent side
def _combine_ranks(per_rank: dict[int, tuple[str, str]]) -> ScenarioResult:
    """One result from every rank's: the same status everywhere, or a failure."""
    statuses = {status for status, _ in per_rank.values()}
    if len(statuses) == 1 and FAILED not in statuses:
        return ScenarioResult(statuses.pop(), per_rank[min(per_rank)][1])
    lines: dict[str, list[int]] = {}
    for r, (status, detail) in sorted(per_rank.items()):
        text = detail if status == FAILED else f"{status}: {detail}" if detail else status
        lines.setdefault(text, []).append(r)
    prefix = "" if len(statuses) == 1 else "ranks disagree: "
    body = "; ".join(f"rank{'s' if len(rs) > 1 else ''} {','.join(map(str, rs))}: {text}"
                     for text, rs in lines.items())
    return ScenarioResult(FAILED, prefix + body)


def _merge_world_sizes(per_ws: dict[int, ScenarioResult]) -> ScenarioResult:
    """One result per key: failed if any world size failed, passed if any passed."""
    for status in (FAILED, PASSED, NOT_APPLICABLE):
        chosen = {ws: r for ws, r in per_ws.items() if r.status == status}
        if chosen:
            if len(per_ws) == 1:
                return next(iter(chosen.values()))
            detail = "; ".join(f"world size {ws}: {r.detail}" if r.detail else f"world size {ws}"
                               for ws, r in chosen.items())
            return ScenarioResult(status, detail)
    raise AssertionError("no results")


def _event(journal: list[dict], ev: str, index: int) -> dict | None:
    """The first ``ev`` record ("start", "end", "stopped") of step ``index``, if any."""
    return next((e for e in journal if e.get("ev") == ev and e.get("step") == index), None)


def _died_during(step: _Step, index: int, journals: dict[int, list[dict]], ended_at: float,
                 grace: float, spawn_error: str) -> dict[str, ScenarioResult]:
    """Results of the step a spawn died in, from whatever each rank wrote."""
    stories, failed_at, injected = [], None, False
    for r, journal in sorted(journals.items()):
        end, stopped = _event(journal, "end", index), _event(journal, "stopped", index)
        if end is not None:
            failures = [d for s, d in end["outcomes"].values() if s == FAILED]
            if failures:
                failed_at = end["t"] if failed_at is None else min(failed_at, end["t"])
                injected |= any(_INJECTED in d for d in failures)
                stories.append(f"rank {r} failed: {failures[0]}")
            else:
                stories.append(f"rank {r} finished it")
        elif stopped is not None:
            stories.append(f"rank {r} was stopped: {stopped['why']}")
        else:
            stories.append(f"rank {r} ended without a word")
    story = "; ".join(stories)
    if step.function == "asymmetric_failure":
        return {step.keys[0]: _judge_asymmetric(injected, failed_at, ended_at, grace, story)}
    if failed_at is None and spawn_error:  # nobody says why: show what the spawn said
        story = f"{story}; the spawn reported: {spawn_error[-600:]}"
    return {key: ScenarioResult(FAILED, f"rank-asymmetric failure or hang: {story}")
            for key in step.keys}


_INJECTED = "injected rank-asymmetric failure"


def _judge_asymmetric(injected: bool, failed_at: float | None, ended_at: float, grace: float,
                      story: str) -> ScenarioResult:
    if not injected or failed_at is None:
        return ScenarioResult(FAILED, f"the injected failure did not happen as planned: {story}")
    took = ended_at - failed_at
    # Bound: the grace period, the watchdog's poll, and the parent noticing dead ranks
    # (run_distributed polls every 0.5 s, then joins for 1 s) with slack for a busy CPU.
    bound = grace + 15.0
    if took > bound:
        return ScenarioResult(
            FAILED, f"the run ended {took:.1f} s after the failure (> {bound:.0f} s): {story}")
    return ScenarioResult(PASSED, f"the run ended {took:.1f} s after the failure: {story}")


def _read_spawn(steps: list[_Step], journals: dict[int, list[dict]], ended_at: float,
                grace: float, spawn_error: str) -> tuple[dict[str, ScenarioResult], int]:
    """The results a spawn's journals hold, and how many steps they settle."""
    results: dict[str, ScenarioResult] = {}
    for index, step in enumerate(steps):
        ends = {r: _event(journal, "end", index) for r, journal in journals.items()}
        if all(ends.values()) and step.function != "asymmetric_failure":
            for key in step.keys:
                results[key] = _combine_ranks({r: tuple(e["outcomes"][key]) for r, e in ends.items()})
            continue
        if any(_event(journal, "start", index) for journal in journals.values()):
            results.update(_died_during(step, index, journals, ended_at, grace, spawn_error))
            return results, index + 1
        return results, index
    return results, len(steps)


def _run_world_size(
    spec: SubclassSpec, world_size: int, steps: list[_Step], root: Path, *,
    scenario_timeout: float, grace: float,
) -> tuple[dict[str, ScenarioResult], int]:
    """All steps of one world size; a fresh spawn resumes after a step that ended one."""
    from fsdp_int8.testing.processes import run_distributed

    results: dict[str, ScenarioResult] = {}
    spawns = 0
    while steps:
        directory = root / f"ws{world_size}-spawn{spawns}"
        directory.mkdir(parents=True)
        spawn_error = ""
        try:
            run_distributed(
                _rank_main, world_size, spec, steps, str(directory), scenario_timeout, grace,
                timeout=120.0 + scenario_timeout * len(steps),  # a backstop: watchdogs act first
            )
        except (AssertionError, TimeoutError) as error:
            spawn_error = str(error)
        spawns += 1
        journals = {r: _read_journal(directory / f"rank{r}.jsonl") for r in range(world_size)}
        settled, finished = _read_spawn(steps, journals, time.time(), grace, spawn_error)
        results.update(settled)
        if finished == 0:  # the spawn died before any scenario: nothing to resume
            why = f"the ranks failed before any scenario: {spawn_error[-1500:]}"
            results.update({key: ScenarioResult(FAILED, why) for step in steps for key in step.keys})
            break
        steps = steps[finished:]
    return results, spawns


def check_fsdp2_conformance(
    spec: SubclassSpec,
    world_sizes: Iterable[int] = (1, 2, 4),
    *,
    scenarios: Collection[str] | None = None,
    scenario_timeout: float = 120.0,
    peer_failure_grace: float = 3.0,
) -> ConformanceReport:
    """Run the FSDP2 conformance scenarios for ``spec`` and report each one.

    One spawn per world size (CPU + gloo, or one GPU per rank + NCCL, as
    :func:`fsdp_int8.testing.run_distributed` picks), in the order given: the
    checkpoint saved at one world size is loaded at the next. A scenario that ends a
    spawn (a rank-asymmetric failure, a hang) is reported failed and the remaining
    scenarios of that world size continue in a fresh spawn.

    Args:
        spec: The weight under test.
        world_sizes: World sizes to run; 1 (the single-rank path), 2 and 4 (HSDP) cover
            every scenario.
        scenarios: Report keys to run (see :data:`SCENARIOS`); ``None``: all.
        scenario_timeout: Seconds one scenario may take on a rank before the rank is ended.
        peer_failure_grace: Seconds a rank may stay in a scenario that another rank has
            already failed (then it is presumed blocked and ended).

    Returns:
        A :class:`ConformanceReport`: every selected key, ``passed``, ``failed`` (with the
        reason) or ``not applicable`` (with why).
    """
    selected = set(SCENARIOS) if scenarios is None else set(scenarios)
    unknown = selected - set(SCENARIOS)
    if unknown:
        raise ValueError(f"unknown scenarios {sorted(unknown)}; known: {list(SCENARIOS)}")
    sizes = tuple(dict.fromkeys(int(ws) for ws in world_sizes))
    if not sizes or min(sizes) < 1:
        raise ValueError(f"world_sizes must be positive, got {sizes}")
    started = time.monotonic()
    per_key: dict[str, dict[int, ScenarioResult]] = {}
    spawns = 0
    first_multi = next((ws for ws in sizes if ws >= 2), None)
    with tempfile.TemporaryDirectory(prefix="fsdp2-conformance-") as tmp:
        root = Path(tmp)
        previous_checkpoint: str | None = None
        for ws in sizes:
            checkpoint = str(root / f"dcp-ws{ws}")
            steps = _plan(ws, first_multi=ws == first_multi, selected=selected,
                          dcp_from=previous_checkpoint, dcp_to=checkpoint, dcp_world_sizes=len(sizes))
            if not steps:
                continue
            results, n = _run_world_size(spec, ws, steps, root, scenario_timeout=scenario_timeout,
                                         grace=peer_failure_grace)
            spawns += n
            for key, result in results.items():
                per_key.setdefault(key, {})[ws] = result
            if (Path(checkpoint) / "expected.pt").exists():
                previous_checkpoint = checkpoint
    ordered: dict[str, ScenarioResult] = {}
    for key in SCENARIOS:
        if key not in selected:
            continue
        if key in per_key:
            ordered[key] = _merge_world_sizes(per_key[key])
        else:
            ordered[key] = ScenarioResult(NOT_APPLICABLE, _not_planned_reason(key, sizes))
    return ConformanceReport(spec.name, sizes, ordered, time.monotonic() - started, spawns)


def assert_fsdp2_conformance(
    spec: SubclassSpec,
    world_sizes: Iterable[int] = (1, 2, 4),
    *,
    allowed_failures: Collection[str] = (),
    **options: Any,
) -> ConformanceReport:
    """:func:`check_fsdp2_conformance`, raising ``AssertionError`` that lists every failure.

    Args:
        spec, world_sizes, options: As for :func:`check_fsdp2_conformance`.
        allowed_failures: Report keys whose failure is known and accepted (they are
            still run and reported).

    Returns:
        The report, when nothing but ``allowed_failures`` failed.
    """
    report = check_fsdp2_conformance(spec, world_sizes, **options)
    failures = {k: r for k, r in report.failures.items() if k not in set(allowed_failures)}
    if failures:
        listed = "\n".join(f"- {key}: {result.detail}" for key, result in failures.items())
        raise AssertionError(f"{spec.name}: {len(failures)} FSDP2 conformance scenario(s) "
                             f"failed:\n{listed}\n\n{report.table()}")
    return report
