"""``Int8AdamW`` / ``Int8SGD(grad_dtype=...)`` in one process: gradients are kept in that
dtype from backward to the step, and the update equals the update from fp32 gradients
rounded to it by hand, bit for bit; what is refused. FSDP2 on 2 ranks (the gradients
cast right after their reduce-scatter, clipping) is in
tests/distributed/test_optim_in_backward_distributed.py."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from fsdp_int8 import Int8AdamW, Int8SGD, Int8TrainingConfig, quantize_
from fsdp_int8.guard import NonFiniteGradientError

OPTIMIZERS = {
    "adamw": (Int8AdamW, dict(lr=1e-2, weight_decay=0.1)),
    "adamw-foreach": (Int8AdamW, dict(lr=1e-2, weight_decay=0.1, fused=False)),
    "adamw-8bit": (Int8AdamW, dict(lr=1e-2, state_bits=8, block_size=16)),
    "sgd-momentum": (Int8SGD, dict(lr=0.05, momentum=0.9, weight_decay=0.01)),
}


def _model() -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.LayerNorm(32), nn.ReLU(), nn.Linear(32, 4))
    return quantize_(model, Int8TrainingConfig(seed=0))


def _train(name: str, grad_dtype: torch.dtype | None, round_by_hand: torch.dtype | None) -> nn.Module:
    cls, kwargs = OPTIMIZERS[name]
    model = _model()
    opt = cls(model.parameters(), **kwargs, grad_dtype=grad_dtype)
    for step in range(3):
        x = torch.randn(64, 16, generator=torch.Generator().manual_seed(step))
        F.mse_loss(model(x), torch.tanh(x[:, :4])).backward()
        if grad_dtype is not None:
            assert {p.grad.dtype for p in model.parameters()} == {grad_dtype}
        if round_by_hand is not None:
            for p in model.parameters():
                p.grad = p.grad.to(round_by_hand).float()
        opt.step()
        opt.zero_grad()
    return model


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_kept_gradients_equal_rounding_by_hand(name, dtype):
    kept = _train(name, grad_dtype=dtype, round_by_hand=None)
    rounded = _train(name, grad_dtype=None, round_by_hand=dtype)
    for (key, a), (_, b) in zip(kept.named_parameters(), rounded.named_parameters()):
        if hasattr(a, "int_data"):
            assert torch.equal(a.int_data, b.int_data) and torch.equal(a.scale, b.scale), key
        else:
            assert torch.equal(a, b), key
    # and the rounding matters: fp32 gradients train to other weights
    plain = _train(name, grad_dtype=None, round_by_hand=None)
    assert not all(torch.equal(a.detach().float(), b.detach().float())
                   for a, b in zip(kept.parameters(), plain.parameters()))


def test_accumulated_gradients_stay_in_grad_dtype():
    model = _model()
    opt = Int8AdamW(model.parameters(), lr=1e-2, grad_dtype=torch.bfloat16)
    x = torch.randn(64, 16)
    for _ in range(2):
        F.mse_loss(model(x), torch.tanh(x[:, :4])).backward()
        assert {p.grad.dtype for p in model.parameters()} == {torch.bfloat16}
    opt.step()


def test_a_non_finite_kept_gradient_is_refused_before_anything_changes():
    model = _model()
    opt = Int8AdamW(model.parameters(), lr=1e-2, grad_dtype=torch.bfloat16)
    model[3].weight.register_hook(lambda grad: torch.full_like(grad, float("inf")))
    before = model[0].weight.int_data.clone()
    x = torch.randn(64, 16)
    F.mse_loss(model(x), torch.tanh(x[:, :4])).backward()
    assert model[3].weight.grad.dtype == torch.bfloat16
    with pytest.raises(NonFiniteGradientError):
        opt.step()
    assert torch.equal(model[0].weight.int_data, before)


@pytest.mark.parametrize("bad", [torch.int8, torch.float64, "bf16"], ids=str)
def test_grad_dtype_must_be_a_narrow_floating_dtype(bad):
    with pytest.raises(ValueError, match="grad_dtype must be None or one of"):
        Int8AdamW(_model().parameters(), grad_dtype=bad)


def test_grad_dtype_with_step_in_backward_is_refused():
    with pytest.raises(ValueError, match="step_in_backward=True each gradient is applied and freed"):
        Int8SGD(_model().parameters(), lr=0.1, grad_dtype=torch.bfloat16, step_in_backward=True)
