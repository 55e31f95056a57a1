"""End-of-step work owned by one optimizer step (``fsdp_int8._weight.end_of_step``): a fixed
flush order, no process-wide state, reads of held weights, two optimizers kept apart."""

from __future__ import annotations

import pytest
import torch

import fsdp_int8
from fsdp_int8 import Int8Weight
from fsdp_int8._weight import end_of_step, tensor_parallel, update_checks


@pytest.fixture
def kinds(monkeypatch):
    """Two kinds of work in a private order, recording what each flush gets."""
    monkeypatch.setattr(end_of_step, "ORDER", ("first", "second"))
    flushed: list[tuple[str, list]] = []
    failing: set[str] = set()

    def flush_of(name: str):
        def flush(items: list) -> None:
            flushed.append((name, items))
            if name in failing:
                raise ValueError(f"{name} failed")
        return flush

    monkeypatch.setattr(end_of_step, "_FLUSHES", {name: flush_of(name) for name in ("first", "second")})
    return flushed, failing


def test_the_library_flushes_updates_before_their_verdicts():
    assert end_of_step.ORDER.index(tensor_parallel.UPDATES) < end_of_step.ORDER.index(update_checks.VERDICTS)


def test_no_module_holds_deferred_work():
    """The state lives in EndOfStep objects; the module keeps flush functions and a
    context variable naming the step collecting now, nothing else mutable."""
    mutable = {
        name: value for name, value in vars(end_of_step).items()
        if isinstance(value, (list, set, dict)) and not name.startswith("__")
    }
    assert set(mutable) == {"_FLUSHES"}
    assert all(callable(flush) for flush in end_of_step._FLUSHES.values())


def test_work_is_flushed_in_the_fixed_order_when_the_step_ends(kinds):
    flushed, _ = kinds
    step = end_of_step.EndOfStep(("first", "second"))
    with step.collecting():
        assert end_of_step.hold("second", "b1")
        assert end_of_step.hold("first", "a1")
        assert end_of_step.hold("second", "b2")
        assert flushed == []
    assert flushed == [("first", ["a1"]), ("second", ["b1", "b2"])]
    assert len(step) == 0


def test_outside_a_step_nothing_is_held(kinds):
    flushed, _ = kinds
    assert not end_of_step.hold("first", "at once")  # the caller does the work itself
    step = end_of_step.EndOfStep(("second",))  # a step that holds one kind only
    with step.collecting():
        assert not end_of_step.hold("first", "at once")
        assert end_of_step.hold("second", "held")
    assert flushed == [("second", ["held"])]


def test_a_step_that_raises_drops_its_work(kinds):
    flushed, _ = kinds
    step = end_of_step.EndOfStep(("first", "second"))
    with pytest.raises(RuntimeError, match="in the step"):
        with step.collecting():
            end_of_step.hold("first", "a")
            raise RuntimeError("in the step")
    assert flushed == [] and len(step) == 0


def test_a_failing_flush_does_not_stop_the_others_and_its_error_is_raised(kinds):
    flushed, failing = kinds
    failing.add("first")
    step = end_of_step.EndOfStep(("first", "second"))
    with pytest.raises(ValueError, match="first failed"):
        with step.collecting():
            end_of_step.hold("first", 1)
            end_of_step.hold("second", 2)
    assert flushed == [("first", [1]), ("second", [2])]
    assert len(step) == 0  # each item ran once


def test_unknown_and_duplicate_kinds_are_refused(kinds):
    with pytest.raises(ValueError, match="unknown end-of-step work 'third'"):
        end_of_step.register_kind("third", print)
    with pytest.raises(ValueError, match="registered already"):
        end_of_step.register_kind("first", print)
    with pytest.raises(ValueError, match="unknown end-of-step work"):
        end_of_step.EndOfStep(("first", "third"))


def test_reading_a_weight_held_by_the_step_flushes_it_first(kinds):
    flushed, _ = kinds
    held, other = Int8Weight.from_float(torch.randn(4, 8)), Int8Weight.from_float(torch.randn(4, 8))
    step = end_of_step.EndOfStep(("first", "second"))
    with step.collecting(flush=False):
        step.hold("first", "update", held)
        assert step.holds(held) and not step.holds(other)
        end_of_step.flush_if_holding((other, torch.ones(2)))
        assert flushed == []
        held.read_rows()  # any read of the weight goes through flush_if_holding
        assert flushed == [("first", ["update"])] and not step.holds(held)


def test_a_weight_read_outside_its_step_flushes_nothing(kinds):
    """Work held by a step that is not collecting now (the step inside backward, between
    hooks) is not touched by a read: no flush, so no collective on one rank alone."""
    flushed, _ = kinds
    weight = Int8Weight.from_float(torch.randn(4, 8))
    step = end_of_step.EndOfStep(("first", "second"))
    with step.collecting(flush=False):
        step.hold("second", "verdict", weight)
    weight.read_rows()
    weight.add_(torch.ones(4, 8))
    assert flushed == [] and len(step) == 1


def _int8_params(count: int, seed: int) -> list[torch.nn.Parameter]:
    generator = torch.Generator().manual_seed(seed)
    params = []
    for _ in range(count):
        param = torch.nn.Parameter(Int8Weight.from_float(torch.randn(6, 32, generator=generator)))
        param.grad = torch.randn(6, 32, generator=generator)
        params.append(param)
    return params


def test_two_optimizers_in_one_process_keep_their_work_apart(monkeypatch):
    """Each step reads its own verdicts once; a NaN in one model's update raises in that
    model's step only, and the other optimizer's next step is clean."""
    monkeypatch.setattr(update_checks, "defers", lambda device: True)
    reads: list[int] = []
    read = end_of_step._FLUSHES[update_checks.VERDICTS]
    monkeypatch.setitem(end_of_step._FLUSHES, update_checks.VERDICTS, lambda items: (reads.append(len(items)), read(items)))
    first, second = _int8_params(3, seed=0), _int8_params(2, seed=1)
    first_optimizer = fsdp_int8.Int8AdamW(first, lr=1e-2)
    # an infinite learning rate for one weight makes its update alone non-finite (a
    # non-finite gradient is refused before the step by the default guard)
    second_optimizer = torch.optim.AdamW(
        [{"params": [second[0]]}, {"params": [second[1]], "lr": float("inf"), "weight_decay": 0.0}], lr=1e-2)
    fsdp_int8.optim.batch_int8_updates(second_optimizer)
    first_optimizer.step()
    assert reads == [3]
    with pytest.raises(ValueError, match=r"1 of 2 int8 updates .*weight \[6, 32\]"):
        second_optimizer.step()
    assert reads == [3, 2]
    for param in first:
        param.grad = torch.ones(6, 32)
    first_optimizer.step()  # nothing of the other optimizer's step is left to raise here
    assert reads == [3, 2, 3]
