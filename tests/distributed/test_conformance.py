"""The FSDP2 conformance suite (``fsdp_int8.testing.check_fsdp2_conformance``) on our own
``Int8Weight``, on an independent reference subclass (bf16 on the wire), and on copies of
the reference broken on purpose: each must fail exactly the scenario that catches it.

One spawn per world size and subclass (a spawn costs seconds); the mutation checks run
only the scenarios they are about, at the smallest world size that shows them.
"""

from __future__ import annotations

import pytest

from fsdp_int8.testing import conformance as _conformance
from fsdp_int8.testing import (
    SCENARIOS, ConformanceReport, ScenarioResult, SubclassSpec, assert_fsdp2_conformance,
    check_fsdp2_conformance,
)

from _cases import FULL_MATRIX
from _conformance_specs import BF16_REFERENCE, BROKEN_OUT, BROKEN_VIEW, BROKEN_WIRE, INT8_WEIGHT

# pin_memory needs an accelerator: on a CPU-only machine it is the one scenario that
# cannot run. Everything else must have run, at some world size, and passed.
_MAY_BE_NOT_APPLICABLE = {"op:pin_memory"}


def _assert_everything_ran(report: ConformanceReport) -> None:
    assert list(report.results) == list(SCENARIOS), report.table()
    skipped = {k for k, r in report.results.items() if r.status == "not applicable"}
    assert skipped <= _MAY_BE_NOT_APPLICABLE, report.table()
    assert report.spawns == len(report.world_sizes), report.table()  # nothing ended a spawn early


@pytest.mark.parametrize(
    "spec, world_sizes",
    # World sizes 1 and 4 alone cover every scenario (the 2-rank ones run at 4): one spawn
    # fewer than (1, 2, 4), which the exhaustive matrix runs. The reference subclass checks
    # the suite itself, as the broken ones below do: exhaustive only.
    [(INT8_WEIGHT, (1, 2, 4) if FULL_MATRIX else (1, 4)),
     pytest.param(BF16_REFERENCE, (1, 4), marks=pytest.mark.exhaustive)],
    ids=["Int8Weight", "reference"],
)
def test_subclass_conforms(spec: SubclassSpec, world_sizes: tuple[int, ...]) -> None:
    # A 1 s grace (default 3 s) shortens the deliberate rank-asymmetric failure.
    report = assert_fsdp2_conformance(spec, world_sizes=world_sizes, peer_failure_grace=1.0)
    _assert_everything_ran(report)
    # The scenarios checked what they claim, not vacuously.
    assert "bytes per element as declared" in report.results["wire_bytes"].detail
    assert "loaded bit-exactly" in report.results["dcp_reshard"].detail
    # The failure is injected on the last rank of the first multi-rank spawn.
    injected = f"rank {min(w for w in world_sizes if w >= 2) - 1} failed: RuntimeError: injected"
    assert injected in report.results["asymmetric_failure"].detail, report.table()


# ---------------------------------------------------------------- mutations
@pytest.mark.parametrize(
    "spec, world_size, scenarios, broken",
    [
        # post_all_gather ignores out=: stale memory from the second unshard on (the
        # backward's re-gather with reshard_after_forward, the next step's forward).
        # One rank is enough (FSDP2's single-rank path calls the hook the same way) and
        # the cheapest spawn; the 2-rank parity scenarios catch it alike.
        pytest.param(BROKEN_OUT, 1, ("world_size_1", "op:view(-1)"), {"world_size_1"}, marks=pytest.mark.exhaustive),
        # view(-1) keeps the 2-D shape; the other ops are fine.
        pytest.param(BROKEN_VIEW, 1, ("op:view(-1)", "op:slice", "op:split/chunk"), {"op:view(-1)"},
                     marks=pytest.mark.exhaustive),
        # pre_all_gather sends fp32, twice the declared bf16 bytes; training stays exact.
        (BROKEN_WIRE, 2, ("wire_bytes", "parity_reshard"), {"wire_bytes"}),
    ],
    ids=["post_all_gather-ignores-out", "view-keeps-shape", "pre_all_gather-sends-fp32"],
)
def test_a_broken_subclass_fails_the_right_scenario(spec, world_size, scenarios, broken) -> None:
    report = check_fsdp2_conformance(spec, world_sizes=(world_size,), scenarios=scenarios)
    assert set(report.results) == set(scenarios), report.table()
    assert set(report.failures) == broken, report.table()
    details = {key: report.results[key].detail for key in broken}
    if spec is BROKEN_OUT:  # caught by the comparisons, not by a crash
        assert all("step 0" in d or "step 1" in d for d in details.values()), details
    if spec is BROKEN_VIEW:
        assert "wrong result: view(-1) has shape (6, 8), expected (48,)" in details["op:view(-1)"]
    if spec is BROKEN_WIRE:
        assert "4.0000 per element" in details["wire_bytes"], details
        assert "declared 2.0000 per element" in details["wire_bytes"], details


# ---------------------------------------------------------------- the wrapper (no spawn)
def test_assert_wrapper_lists_every_failure(monkeypatch) -> None:
    results = {
        "wire_bytes": ScenarioResult("failed", "moved 4 bytes per element"),
        "hsdp": ScenarioResult("failed", "loss off"),
        "op:cat": ScenarioResult("passed", "correct"),
        "op:pin_memory": ScenarioResult("not applicable", "no accelerator"),
    }
    fake = ConformanceReport("Fake", (2,), results, 1.0, 1)
    monkeypatch.setattr(_conformance, "check_fsdp2_conformance", lambda *a, **k: fake)
    with pytest.raises(AssertionError) as info:
        assert_fsdp2_conformance(BF16_REFERENCE, world_sizes=(2,))
    message = str(info.value)
    assert "2 FSDP2 conformance scenario(s) failed" in message
    assert "- wire_bytes: moved 4 bytes per element" in message and "- hsdp: loss off" in message
    assert "op:cat" in message  # the whole table follows
    report = assert_fsdp2_conformance(BF16_REFERENCE, allowed_failures={"wire_bytes", "hsdp"})
    assert report is fake and not report.ok and set(report.failures) == {"wire_bytes", "hsdp"}


def test_unknown_scenario_and_bad_world_size_are_rejected() -> None:
    with pytest.raises(ValueError, match="unknown scenarios"):
        check_fsdp2_conformance(BF16_REFERENCE, scenarios=("parity",))
    with pytest.raises(ValueError, match="positive"):
        check_fsdp2_conformance(BF16_REFERENCE, world_sizes=(0,))
