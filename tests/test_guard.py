"""A step on NaN or Inf gradients is refused before it changes anything."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

import fsdp_int8
import fsdp_int8.guard
from fsdp_int8 import Int8AdamW, Int8SGD, Int8TrainingConfig, quantize_
from fsdp_int8._quant.generators import WEIGHT_ROUNDING
from fsdp_int8.guard import NonFiniteGradientError


def _model() -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.LayerNorm(32), nn.Linear(32, 8))
    return quantize_(model, Int8TrainingConfig(min_features=8))


def _snapshot(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    return {
        "params": {k: v.detach().clone() for k, v in model.state_dict().items()},
        "state": copy.deepcopy(optimizer.state_dict()["state"]),
        "rounding": WEIGHT_ROUNDING.get_state(),
    }


def _assert_same(a, b) -> None:
    flat_a, _ = torch.utils._pytree.tree_flatten(a)
    flat_b, _ = torch.utils._pytree.tree_flatten(b)
    assert len(flat_a) == len(flat_b)
    for x, y in zip(flat_a, flat_b):
        if isinstance(x, fsdp_int8.Int8Weight):
            assert torch.equal(x.int_data, y.int_data) and torch.equal(x.scale, y.scale)
        elif isinstance(x, torch.Tensor):
            assert torch.equal(x, y)
        else:
            assert x == y


@pytest.mark.parametrize("make", [
    lambda p: Int8AdamW(p, lr=1e-2),
    lambda p: Int8AdamW(p, lr=1e-2, state_bits=8, block_size=8),
    lambda p: Int8SGD(p, lr=1e-2, momentum=0.9),
    lambda p: fsdp_int8.guard.guard_finite_steps(torch.optim.AdamW(p, lr=1e-2)) and p,
], ids=["int8_adamw", "int8_adamw_8bit", "int8_sgd", "torch_adamw_guarded"])
def test_a_nan_gradient_in_any_parameter_changes_nothing(make):
    model = _model()
    params = list(model.parameters())
    optimizer = make(params)
    if isinstance(optimizer, list):  # the guarded torch optimizer: rebuild to keep a handle
        optimizer = torch.optim.AdamW(params, lr=1e-2)
        fsdp_int8.guard.guard_finite_steps(optimizer)
    x = torch.randn(4, 16)
    model(x).square().mean().backward()
    optimizer.step()  # a good step first: states exist
    optimizer.zero_grad()
    model(x).square().mean().backward()
    model[1].weight.grad[3] = float("nan")  # a norm's weight, not an int8 one
    before = _snapshot(model, optimizer)
    with pytest.raises(NonFiniteGradientError, match="unchanged"):
        optimizer.step()
    _assert_same(_snapshot(model, optimizer), before)
    model[1].weight.grad.zero_()  # the caller skips the bad part: the next step works
    optimizer.step()


def test_the_guard_can_be_removed():
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    handle = fsdp_int8.guard.guard_finite_steps(optimizer)
    model(torch.randn(2, 16)).sum().backward()
    model[1].bias.grad[0] = float("inf")
    with pytest.raises(NonFiniteGradientError):
        optimizer.step()
    handle.remove()
    optimizer.step()  # torch applies it: the guard is off
    assert not torch.isfinite(model[1].bias).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_the_check_tells_huge_finite_gradients_from_non_finite_ones(dtype):
    # The fast check is a 2-norm: values whose squares overflow (1e30 in fp32; 300 in fp16,
    # whose norm 424 is fine, but 3e4 overflows it) must still count as finite, and NaN,
    # +Inf and -Inf next to finite values as non-finite.
    from fsdp_int8.guard import _all_finite

    huge = 1e30 if dtype != torch.float16 else 3e4
    finite = [torch.full((5, 7), huge, dtype=dtype), torch.randn(3, dtype=dtype)]
    assert _all_finite(finite) == (True, [])
    for bad in (float("nan"), float("inf"), float("-inf")):
        tensor = torch.randn(5, 7, dtype=dtype)
        tensor[2, 3] = bad
        assert not _all_finite([finite[1], tensor])[0], bad
        assert not _all_finite([torch.full((4,), huge, dtype=dtype), tensor])[0], bad


@pytest.mark.parametrize("make", [
    lambda params: torch.optim.AdamW(params, lr=1e-2),
    lambda params: fsdp_int8.Int8AdamW(params, lr=1e-2),
], ids=["torch AdamW", "Int8AdamW"])
def test_an_optimizer_built_before_quantize_is_refused_at_its_first_step(make):
    # quantize_ gives the model new weight objects: an optimizer built before holds the
    # old ones, and without the refusal its steps move the model's int8 weights by 0.0
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 4))
    early = make(model.parameters())
    fsdp_int8.quantize_(model, fsdp_int8.Int8TrainingConfig(min_features=1))
    model(torch.randn(2, 8)).square().mean().backward()
    with pytest.raises(RuntimeError, match=r"quantize_ replaced.*Build the optimizer after quantize_"):
        early.step()
    late = make(model.parameters())
    before = model[0].weight.int_data.clone()
    late.step()
    assert not torch.equal(before, model[0].weight.int_data)
    late.step()  # checked once, at the first step


def test_values_read_with_the_verdict_come_back_in_the_same_sync():
    """An optimizer's seeds ride along with the verdict: one host read for both."""
    from fsdp_int8.guard import _all_finite
    from fsdp_int8.testing import count_host_syncs

    values = torch.tensor([5, -3, 2**62], dtype=torch.int64)
    with count_host_syncs() as reads:
        assert _all_finite([torch.ones(3)], read_with=values) == (True, [5, -3, 2**62])
    assert reads.count == 1, reads.summary()
