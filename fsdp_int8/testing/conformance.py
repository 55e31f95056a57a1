"""The FSDP2 conformance suite for tensor-subclass weights: the public entry points.

:func:`check_fsdp2_conformance` spawns one group of ranks per world size (through
:func:`fsdp_int8.testing.run_distributed`) and runs every scenario of that world size in
it, one after another. The parts:

* ``_spec``: :class:`SubclassSpec`, the results and :data:`SCENARIOS`, shared by both sides;
* ``_plan``: which scenarios each world size's spawn runs, in which order;
* ``_rank`` over ``_scenarios_*``: what every rank runs (training parity, ops,
  collectives, checkpoint), journaling as it goes (``_journal``);
* ``_verdicts``: the parent reading the journals back into results.

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

import tempfile
import time
from pathlib import Path
from typing import Any, Collection, Iterable

from fsdp_int8.testing._journal import read_journal
from fsdp_int8.testing._plan import Step, not_planned_reason, plan
from fsdp_int8.testing._rank import rank_main
from fsdp_int8.testing._spec import (
    FAILED, NOT_APPLICABLE, SCENARIOS, ConformanceReport, ScenarioResult, SubclassSpec,
)
from fsdp_int8.testing._verdicts import merge_world_sizes, read_spawn
from fsdp_int8.testing.processes import run_distributed

__all__ = [
    "SubclassSpec",
    "ScenarioResult",
    "ConformanceReport",
    "SCENARIOS",
    "check_fsdp2_conformance",
    "assert_fsdp2_conformance",
]


def _run_world_size(
    spec: SubclassSpec, world_size: int, steps: list[Step], root: Path, *,
    scenario_timeout: float, grace: float,
) -> tuple[dict[str, ScenarioResult], int]:
    """All steps of one world size; a fresh spawn resumes after a step that ended one."""
    results: dict[str, ScenarioResult] = {}
    spawns = 0
    while steps:
        directory = root / f"ws{world_size}-spawn{spawns}"
        directory.mkdir(parents=True)
        spawn_error = ""
        try:
            run_distributed(
                rank_main, world_size, spec, steps, str(directory), scenario_timeout, grace,
                timeout=120.0 + scenario_timeout * len(steps),  # a backstop: watchdogs act first
            )
        except (AssertionError, TimeoutError) as error:
            spawn_error = str(error)
        spawns += 1
        journals = {r: read_journal(directory / f"rank{r}.jsonl") for r in range(world_size)}
        settled, finished = read_spawn(steps, journals, time.time(), grace, spawn_error)
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
        scenario_timeout: Seconds one scenario may take on a rank before the rank is ended
            and the scenario failed.
        peer_failure_grace: Seconds a rank may stay in a scenario that another rank has
            already failed (then it is presumed blocked in a collective and ended).

    Returns:
        A :class:`ConformanceReport`: every selected key, ``passed``, ``failed`` (with the
        reason) or ``not applicable`` (with why). A failing subclass never raises.

    Raises:
        ValueError: an unknown scenario key, or a world size below 1.
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
            steps = plan(ws, first_multi=ws == first_multi, selected=selected,
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
            ordered[key] = merge_world_sizes(per_key[key])
        else:
            ordered[key] = ScenarioResult(NOT_APPLICABLE, not_planned_reason(key, sizes))
    return ConformanceReport(spec.name, sizes, ordered, time.monotonic() - started, spawns)


def assert_fsdp2_conformance(
    spec: SubclassSpec,
    world_sizes: Iterable[int] = (1, 2, 4),
    *,
    allowed_failures: Collection[str] = (),
    **options: Any,
) -> ConformanceReport:
    """:func:`check_fsdp2_conformance` for pytest: raises ``AssertionError`` listing every failure.

    ``**options`` are :func:`check_fsdp2_conformance`'s keyword arguments.

    Args:
        spec: The weight under test.
        world_sizes: World sizes to run, as for :func:`check_fsdp2_conformance`.
        allowed_failures: Report keys whose failure is known and accepted (they are
            still run and reported).

    Returns:
        The report, when nothing but ``allowed_failures`` failed.

    Raises:
        AssertionError: ``"<name>: k FSDP2 conformance scenario(s) failed:"``, a line
            ``- key: reason`` for each failure not in ``allowed_failures``, then
            :meth:`ConformanceReport.table`.
    """
    report = check_fsdp2_conformance(spec, world_sizes, **options)
    failures = {k: r for k, r in report.failures.items() if k not in set(allowed_failures)}
    if failures:
        listed = "\n".join(f"- {key}: {result.detail}" for key, result in failures.items())
        raise AssertionError(f"{spec.name}: {len(failures)} FSDP2 conformance scenario(s) "
                             f"failed:\n{listed}\n\n{report.table()}")
    return report
