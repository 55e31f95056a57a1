"""The one end-of-step queue (``fsdp_int8._weight.end_of_step``): a fixed flush order, caps,
reads of held weights, and the optimizer step's end."""

from __future__ import annotations

import pytest
import torch

from fsdp_int8 import Int8Weight
from fsdp_int8._weight import end_of_step, tensor_parallel, update_checks


@pytest.fixture
def queues(monkeypatch):
    """Two fresh queues in a private order; the library's own are set aside meanwhile."""
    monkeypatch.setattr(end_of_step, "ORDER", ("first", "second"))
    monkeypatch.setattr(end_of_step, "_queues", {})
    monkeypatch.setattr(end_of_step, "_waiting_storages", set())
    flushed: list[tuple[str, list]] = []

    def make(name: str, *, cap: int = 100, fail: bool = False) -> end_of_step.HeldWork:
        def flush(items: list) -> None:
            flushed.append((name, items))
            if fail:
                raise ValueError(f"{name} failed")

        return end_of_step.held_work(name, flush, cap=cap)

    return make, flushed


def test_the_library_flushes_updates_before_their_verdicts():
    assert end_of_step.ORDER.index(tensor_parallel.UPDATES.name) < end_of_step.ORDER.index(update_checks.VERDICTS.name)


def test_queues_flush_in_the_fixed_order_whatever_order_they_were_made_in(queues):
    make, flushed = queues
    second = make("second")  # made first, as an earlier import would
    first = make("first")
    second.hold("b1")
    first.hold("a1")
    second.hold("b2")
    end_of_step.settle()
    assert flushed == [("first", ["a1"]), ("second", ["b1", "b2"])]
    end_of_step.settle()  # nothing held: nothing flushed
    assert len(flushed) == 2


def test_a_failing_flush_does_not_stop_the_others_and_its_error_is_raised(queues):
    make, flushed = queues
    first, second = make("first", fail=True), make("second")
    first.hold(1)
    second.hold(2)
    with pytest.raises(ValueError, match="first failed"):
        end_of_step.settle()
    assert flushed == [("first", [1]), ("second", [2])]
    assert not first.items and not second.items  # each item ran once


def test_unknown_and_duplicate_queues_are_refused(queues):
    make, _ = queues
    with pytest.raises(ValueError, match="unknown end-of-step work 'third'"):
        make("third")
    make("first")
    with pytest.raises(ValueError, match="exists already"):
        make("first")


def test_a_full_queue_settles_everything(queues):
    make, flushed = queues
    first, second = make("first"), make("second", cap=2)
    first.hold("a")
    second.hold("b1")
    assert flushed == []
    second.hold("b2")
    assert flushed == [("first", ["a"]), ("second", ["b1", "b2"])]


def test_reading_a_weight_whose_update_is_held_settles_first(queues):
    make, flushed = queues
    first = make("first")
    held, other = Int8Weight.from_float(torch.randn(4, 8)), Int8Weight.from_float(torch.randn(4, 8))
    first.hold("update", held)
    assert first.holds(held) and not first.holds(other)
    end_of_step.settle_if_waiting((other, torch.ones(2)))
    assert flushed == []
    held.read_rows()  # any read of the weight goes through settle_if_waiting
    assert flushed == [("first", ["update"])] and not first.holds(held)


def test_an_optimizer_step_settles_at_its_end(queues):
    make, flushed = queues
    first = make("first")
    param = torch.nn.Parameter(torch.ones(3))
    param.grad = torch.ones(3)
    optimizer = torch.optim.SGD([param], lr=0.1)
    first.hold("during the step")
    optimizer.step()
    assert flushed == [("first", ["during the step"])]


def test_a_weight_held_by_two_queues_waits_until_both_are_flushed(queues):
    make, flushed = queues
    first, second = make("first"), make("second")
    weight = Int8Weight.from_float(torch.randn(4, 8))
    first.hold("a", weight)
    second.hold("b", weight)
    first._take()  # as settle does, one queue at a time
    assert second.holds(weight)
    weight.read_rows()
    assert flushed == [("second", ["b"])]
