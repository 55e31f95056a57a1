"""Parent side: turning the ranks' journals into one :class:`ScenarioResult` per key.

A step that every rank finished is judged from the ranks' outcomes. A step that a spawn
died in (a rank-asymmetric failure, a hang ended by the watchdogs) is failed with each
rank's story, except the deliberate ``asymmetric_failure``, which passes when the run
ended soon enough after the injected error.
"""

from __future__ import annotations

from fsdp_int8.testing._plan import Step
from fsdp_int8.testing._spec import FAILED, INJECTED, NOT_APPLICABLE, PASSED, ScenarioResult


def combine_ranks(per_rank: dict[int, tuple[str, str]]) -> ScenarioResult:
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


def merge_world_sizes(per_ws: dict[int, ScenarioResult]) -> ScenarioResult:
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


def _died_during(step: Step, index: int, journals: dict[int, list[dict]], ended_at: float,
                 grace: float, spawn_error: str) -> dict[str, ScenarioResult]:
    """Results of the step a spawn died in, from whatever each rank wrote."""
    stories, failed_at, injected = [], None, False
    for r, journal in sorted(journals.items()):
        end, stopped = _event(journal, "end", index), _event(journal, "stopped", index)
        if end is not None:
            failures = [d for s, d in end["outcomes"].values() if s == FAILED]
            if failures:
                failed_at = end["t"] if failed_at is None else min(failed_at, end["t"])
                injected |= any(INJECTED in d for d in failures)
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


def read_spawn(steps: list[Step], journals: dict[int, list[dict]], ended_at: float,
               grace: float, spawn_error: str) -> tuple[dict[str, ScenarioResult], int]:
    """The results a spawn's journals hold, and how many steps they settle."""
    results: dict[str, ScenarioResult] = {}
    for index, step in enumerate(steps):
        ends = {r: _event(journal, "end", index) for r, journal in journals.items()}
        if all(ends.values()) and step.function != "asymmetric_failure":
            for key in step.keys:
                results[key] = combine_ranks({r: tuple(e["outcomes"][key]) for r, e in ends.items()})
            continue
        if any(_event(journal, "start", index) for journal in journals.values()):
            results.update(_died_during(step, index, journals, ended_at, grace, spawn_error))
            return results, index + 1
        return results, index
    return results, len(steps)
