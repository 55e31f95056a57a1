"""Memory accounting (fsdp_int8.memory): persistent bytes per rank, counted by hand.

The sum over ranks of sharded counts: tests/distributed/test_optim_distributed.py.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from fsdp_int8 import Int8AdamW, Int8TrainingConfig, Int8Weight, quantize_
from fsdp_int8.memory import persistent_bytes


def _net() -> nn.Module:
    """Int8 weights [64, 40] and [48, 64], fp32 biases, a plain fp32 head [4, 48]."""
    model = nn.Sequential(nn.Linear(40, 64), nn.ReLU(), nn.Linear(64, 48), nn.ReLU(), nn.Linear(48, 4))
    quantize_(model, Int8TrainingConfig())
    assert isinstance(model[0].weight, Int8Weight) and isinstance(model[2].weight, Int8Weight)
    assert not isinstance(model[4].weight, Int8Weight)  # out_features 4 < min_features
    return model


def test_persistent_bytes_against_a_hand_count():
    model = _net()  # int8 [64, 40] and [48, 64]; fp32 biases 64, 48, 4; fp32 head [4, 48]
    opt = Int8AdamW(model.parameters(), state_bits=8, block_size=16)
    model(torch.randn(16, 40)).square().mean().backward()
    opt.step()
    n_params = 64 * 40 + 64 + 48 * 64 + 48 + 4 * 48 + 4
    weights = (64 * 40 + 4 * 64) + (48 * 64 + 4 * 48) + 4 * (64 + 48 + 4 * 48 + 4)
    grads = 4 * n_params
    blocks = 64 * 3 + 48 * 4 + 4 * 3  # rows x ceil(K / 16): K = 40, 64, 48
    states = (
        2 * (64 * 40 + 48 * 64 + 4 * 48)  # int8 exp_avg + uint8 sqrt(exp_avg_sq), 1 byte each
        + 2 * 4 * blocks  # two fp32 scales per block
        + 2 * 4 * (64 + 48 + 4)  # fp32 moments of the biases
        + 4 * 6  # one fp32 step per parameter
    )
    counted = persistent_bytes(model, opt)
    assert (counted.params, counted.weights, counted.grads, counted.states) == (n_params, weights, grads, states)
    assert persistent_bytes(model, opt).per_param == (weights + grads + states) / n_params
    bf16 = persistent_bytes(model, opt, grad_dtype=torch.bfloat16)
    assert bf16.grads == 2 * n_params and bf16.states == states
    opt.zero_grad()  # no .grad: counted at the parameters' dtype (fp32)
    assert persistent_bytes(model, opt).grads == grads
    assert persistent_bytes(model).states == 0


def test_bytes_per_param_of_a_wide_layer():
    """The numbers of docs/optim.md for K = 1024: 1 + 4/K (weight), 2 + 8/64 (8-bit
    moments), 4 or 2 (fp32 or bf16 gradient); the one step counter is negligible."""
    lin = quantize_(nn.Linear(1024, 128, bias=False), Int8TrainingConfig())
    opt = Int8AdamW(lin.parameters(), state_bits=8)
    lin.weight.grad = torch.randn(128, 1024)
    opt.step()
    n = 128 * 1024
    step = 4 / n
    assert persistent_bytes(lin, opt).per_param == pytest.approx(
        1 + 4 / 1024 + 2 + 8 / 64 + 4 + step, rel=1e-12
    )
    assert persistent_bytes(lin, opt, grad_dtype=torch.bfloat16).per_param == pytest.approx(
        1 + 4 / 1024 + 2 + 8 / 64 + 2 + step, rel=1e-12
    )
