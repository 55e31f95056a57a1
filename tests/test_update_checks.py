"""The finiteness check of int8 weight updates: at once on the CPU, once per optimizer
step on accelerators (``fsdp_int8._weight.update_checks``).

The accelerator behaviour is a policy of the device type; these tests turn it on for the
CPU (``defers`` patched) so the deferred path runs here exactly as it would on a GPU,
minus the device."""

from __future__ import annotations

import pytest
import torch

import fsdp_int8
from fsdp_int8 import Int8Weight
from fsdp_int8._weight import update_checks as _update_checks


@pytest.fixture(params=[False, True], ids=["eager", "compiled"])
def kernels(request):
    """Whether the weights under test run compiled kernels (``Int8Weight.compiled``)."""
    return request.param


@pytest.fixture
def deferred(monkeypatch):
    """Updates defer their verdicts as on an accelerator; records each read's batch."""
    monkeypatch.setattr(_update_checks, "defers", lambda device: True)
    batches = []
    read = _update_checks.VERDICTS.flush

    def recording_read(pending):
        batches.append(len(pending))
        read(pending)

    monkeypatch.setattr(_update_checks.VERDICTS, "flush", recording_read)
    _update_checks.VERDICTS.items.clear()
    yield batches
    _update_checks.VERDICTS.items.clear()


def _weights(count: int, *, nan_in: int | None = None, compiled: bool = False) -> list[torch.nn.Parameter]:
    generator = torch.Generator().manual_seed(0)
    params = []
    for index in range(count):
        param = torch.nn.Parameter(Int8Weight.from_float(torch.randn(6, 32, generator=generator), compiled=compiled))
        param.grad = torch.randn(6, 32, generator=generator)
        if index == nan_in:
            param.grad[2, 5] = float("nan")
        params.append(param)
    return params


@pytest.mark.parametrize("make", [
    lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.1),  # per-weight addcdiv_ (fused when compiled)
    lambda p: torch.optim.AdamW(p, lr=1e-2, fused=True),  # one fused kernel, then assign_
    lambda p: torch.optim.SGD(p, lr=1e-2, momentum=0.9, foreach=True),  # _foreach_ ops, element by element
    lambda p: fsdp_int8.Int8AdamW(p, lr=1e-2),  # fp32 work copies, then one assign_ each
], ids=["adamw", "adamw-fused", "sgd-foreach", "int8-adamw"])
def test_a_step_reads_all_its_verdicts_once_at_its_end(deferred, kernels, make):
    params = _weights(3, compiled=kernels)
    before = [p.detach().int_data.clone() for p in params]
    optimizer = make(params)
    optimizer.step()
    assert deferred == [3]  # one read of the three verdicts, after the step
    assert not _update_checks.VERDICTS.items
    assert any(not torch.equal(p.detach().int_data, b) for p, b in zip(params, before))


def test_a_non_finite_update_raises_at_the_end_of_the_step(deferred, kernels):
    params = _weights(3, nan_in=1, compiled=kernels)
    optimizer = torch.optim.AdamW(params, lr=1e-2)
    with pytest.raises(ValueError, match=r"1 of 3 int8 weight updates .* non-finite .*\[6, 32\]"):
        optimizer.step()
    assert deferred == [3]
    # as a plain tensor would: the bad weight holds its non-finite row, the others updated
    assert not torch.isfinite(params[1].detach().scale).all()
    assert torch.isfinite(params[0].detach().scale).all() and torch.isfinite(params[2].detach().scale).all()
    assert not _update_checks.VERDICTS.items  # read once: the next step starts clean


def test_updates_outside_an_optimizer_are_read_when_enough_have_piled_up(deferred, monkeypatch):
    monkeypatch.setattr(_update_checks.VERDICTS, "cap", 3)
    weight = Int8Weight.from_float(torch.randn(4, 16))
    weight.add_(torch.ones(4, 16))
    weight.add_(torch.full((4, 16), float("inf")))
    assert deferred == [] and len(_update_checks.VERDICTS.items) == 2
    other = Int8Weight.from_float(torch.randn(4, 16))
    with pytest.raises(ValueError, match="1 of 3 int8 weight updates"):
        other.mul_(torch.full((4, 16), 2.0))
    assert deferred == [3] and not _update_checks.VERDICTS.items


def test_on_the_cpu_a_non_finite_update_raises_at_once_and_changes_nothing(kernels):
    weight = Int8Weight.from_float(torch.randn(4, 16), compiled=kernels)
    before = (weight.int_data.clone(), weight.scale.clone())
    with pytest.raises(ValueError, match="non-finite"):
        weight.addcdiv_(torch.ones(4, 16), torch.zeros(4, 16))  # 1 / 0: Inf
    with pytest.raises(ValueError, match="non-finite"):
        weight.add_(torch.full((4, 16), float("nan")))
    assert torch.equal(weight.int_data, before[0]) and torch.equal(weight.scale, before[1])
    assert not _update_checks.VERDICTS.items


def test_loading_values_is_checked_at_once_even_where_updates_defer(deferred):
    """Only optimizer-style updates defer; copying values in (a load) raises right away."""
    weight = Int8Weight.from_float(torch.randn(4, 16))
    with pytest.raises(ValueError, match="non-finite"):
        weight.copy_(torch.full((4, 16), float("nan")))
    assert not _update_checks.VERDICTS.items
