"""The finiteness check of int8 updates: at once on the CPU, once per optimizer step on
accelerators (``fsdp_int8._weight.update_checks``).

The accelerator behaviour is a policy of the device type; these tests turn it on for the
CPU (``defers`` patched) so the deferred path runs here exactly as it would on a GPU,
minus the device."""

from __future__ import annotations

import pytest
import torch

import fsdp_int8
from fsdp_int8 import Int8Weight
from fsdp_int8._weight import end_of_step
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
    read = end_of_step._FLUSHES[_update_checks.VERDICTS]

    def recording_read(pending):
        batches.append(len(pending))
        read(pending)

    monkeypatch.setitem(end_of_step._FLUSHES, _update_checks.VERDICTS, recording_read)
    monkeypatch.setattr(_update_checks, "_read", recording_read)  # reads made at once, too
    return batches


def _weights(count: int, *, compiled: bool = False) -> list[torch.nn.Parameter]:
    generator = torch.Generator().manual_seed(0)
    params = []
    for index in range(count):
        param = torch.nn.Parameter(Int8Weight.from_float(torch.randn(6, 32, generator=generator), compiled=compiled))
        param.grad = torch.randn(6, 32, generator=generator)
        params.append(param)
    return params


def _batched(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    fsdp_int8.optim.batch_int8_updates(optimizer)
    return optimizer


@pytest.mark.parametrize("make", [
    lambda p: _batched(torch.optim.AdamW(p, lr=1e-2, weight_decay=0.1)),  # per-weight addcdiv_ (fused when compiled)
    lambda p: _batched(torch.optim.AdamW(p, lr=1e-2, fused=True)),  # one fused kernel, then assign_
    lambda p: _batched(torch.optim.SGD(p, lr=1e-2, momentum=0.9, foreach=True)),  # _foreach_ ops, element by element
    lambda p: fsdp_int8.Int8AdamW(p, lr=1e-2),  # fp32 work copies, then one assign_ each
    lambda p: fsdp_int8.Int8AdamW(p, lr=1e-2, state_bits=8, block_size=16),  # and the 8-bit states' verdicts
], ids=["adamw", "adamw-fused", "sgd-foreach", "int8-adamw", "int8-adamw-8bit"])
def test_a_step_reads_all_its_verdicts_once_at_its_end(deferred, kernels, make):
    params = _weights(3, compiled=kernels)
    before = [p.detach().int_data.clone() for p in params]
    optimizer = make(params)
    optimizer.step()
    assert len(deferred) == 1 and deferred[0] >= 3  # one read of every verdict, after the step
    assert any(not torch.equal(p.detach().int_data, b) for p, b in zip(params, before))


def test_a_torch_optimizer_without_batching_reads_each_verdict_at_once_and_says_how_to_batch(deferred):
    params = _weights(3)
    optimizer = torch.optim.AdamW(params, lr=1e-2)
    with pytest.warns(RuntimeWarning, match="batch_int8_updates"):
        optimizer.step()
    assert deferred == [1, 1, 1]


def test_batching_is_undone_by_its_handle_and_refused_for_the_fused_optimizers():
    params = _weights(1)
    optimizer = torch.optim.SGD(params, lr=0.1)
    handle = fsdp_int8.optim.batch_int8_updates(optimizer)
    assert fsdp_int8.optim.batch_int8_updates(optimizer) is handle
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 1)  # wraps the batched step in turn
    optimizer.step()
    scheduler.step()
    assert scheduler.last_epoch == 1
    handle.remove()
    assert vars(optimizer).get("step") is not None  # the scheduler's wrapper stays, ours passes through
    optimizer.step()
    assert fsdp_int8.optim.batch_int8_updates(optimizer) is not handle
    plain = torch.optim.SGD(_weights(1), lr=0.1)
    fsdp_int8.optim.batch_int8_updates(plain).remove()
    assert "step" not in vars(plain)  # the class's own step again
    with pytest.raises(TypeError, match="holds its int8 updates' end-of-step work itself"):
        fsdp_int8.optim.batch_int8_updates(fsdp_int8.Int8SGD(_weights(1), lr=0.1))


def test_a_non_finite_update_raises_at_the_end_of_the_step(deferred, kernels):
    # Finite gradients (a NaN gradient is refused before the step by the default guard, where
    # quantize_ or shard_model registered it); an infinite learning rate for the second
    # weight makes its update alone non-finite.
    params = _weights(3, compiled=kernels)
    optimizer = _batched(torch.optim.AdamW(
        [{"params": [params[0], params[2]]}, {"params": [params[1]], "lr": float("inf"), "weight_decay": 0.0}], lr=1e-2))
    with pytest.raises(ValueError, match=r"1 of 3 int8 updates .* non-finite .*weight \[6, 32\]"):
        optimizer.step()
    assert deferred == [3]
    # as a plain tensor would: the bad weight holds its non-finite row, the others updated
    assert not torch.isfinite(params[1].detach().scale).all()
    assert torch.isfinite(params[0].detach().scale).all() and torch.isfinite(params[2].detach().scale).all()


def test_a_non_finite_8bit_state_joins_the_step_verdict(deferred):
    """An Inf moment (finite gradients whose square overflows) is one verdict of the step."""
    params = _weights(2)
    params[0].grad[0, 0] = 3e38  # finite; its square is not
    optimizer = fsdp_int8.Int8AdamW(params, lr=1e-2, state_bits=8, block_size=16)
    with pytest.raises(ValueError, match=r"int8 updates .* non-finite .*optimizer state \[6, 32\]"):
        optimizer.step()
    assert deferred == [4]  # two weights and two states, read together


def test_on_the_cpu_a_non_finite_update_raises_at_once_and_changes_nothing(kernels):
    weight = Int8Weight.from_float(torch.randn(4, 16), compiled=kernels)
    before = (weight.int_data.clone(), weight.scale.clone())
    with pytest.raises(ValueError, match="non-finite"):
        weight.addcdiv_(torch.ones(4, 16), torch.zeros(4, 16))  # 1 / 0: Inf
    with pytest.raises(ValueError, match="non-finite"):
        weight.add_(torch.full((4, 16), float("nan")))
    assert torch.equal(weight.int_data, before[0]) and torch.equal(weight.scale, before[1])


def test_loading_values_is_checked_at_once_even_where_updates_defer(deferred):
    """Only optimizer-style updates defer; copying values in (a load) raises right away."""
    weight = Int8Weight.from_float(torch.randn(4, 16))
    with pytest.raises(ValueError, match="non-finite"):
        weight.copy_(torch.full((4, 16), float("nan")))
    assert deferred == []
