"""``Int8AdamW(state_bits=4)``: the 4-bit state codec against a float64 reference, the byte
layout, and one update against AdamW's formulas in float64 from the same 4-bit state.
Resharding (2 -> 1 and 2 -> 4 ranks) and the precision on 1, 2 and 4 ranks:
tests/distributed/test_optim_distributed.py; the step inside backward:
tests/test_optim_in_backward.py (its ``adamw-4bit`` rows)."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from fsdp_int8 import Int8AdamW
from fsdp_int8.optim._state_codec import (
    SIGNED_4BIT_LEVELS,
    UNSIGNED_4BIT_LEVELS,
    dequantize_state_4bit,
    packed_columns,
    quantize_state_4bit,
)


def _reference_codes(values: torch.Tensor, block: int, signed: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """In float64, each value's nearest level (as a fraction of its block's absmax) and
    its distance to the nearest boundary between two levels (in the same units)."""
    levels = torch.tensor(SIGNED_4BIT_LEVELS if signed else UNSIGNED_4BIT_LEVELS, dtype=torch.float64)
    rows, length = values.shape
    x = values.double()
    amax = torch.stack([x[:, i:i + block].abs().amax(dim=1) for i in range(0, length, block)], dim=1)
    per_value = amax.repeat_interleave(block, dim=1)[:, :length]
    fraction = torch.where(per_value > 0, x / per_value.clamp_min(1e-300), torch.zeros_like(x))
    codes = (fraction.unsqueeze(-1) - levels).abs().argmin(dim=-1)
    if not signed:
        codes = torch.maximum(codes, (x > 0).long())  # a positive value never rounds to 0
    boundaries = (levels[1:] + levels[:-1]) / 2
    margin = (fraction.unsqueeze(-1) - boundaries).abs().amin(dim=-1)
    return codes, margin


def _unpack(packed: torch.Tensor, length: int) -> torch.Tensor:
    return torch.stack((packed & 15, packed >> 4), dim=2).reshape(packed.shape[0], -1)[:, :length].long()


@pytest.mark.parametrize("signed", [True, False], ids=["signed", "unsigned"])
@pytest.mark.parametrize("length, block", [(64, 16), (33, 16), (7, 4), (130, 128)])
def test_codes_are_the_nearest_levels_of_each_blocks_absmax(signed, length, block):
    gen = torch.Generator().manual_seed(length + block)
    values = torch.randn(6, length, generator=gen) * torch.logspace(-6, 2, 6).unsqueeze(1)
    if not signed:
        values = values.abs()
        values[1, :3] = 0.0  # exact zeros stay level 0
    values[4, :block] = 0.0  # an all-zero block: scale 0, every value 0
    packed = torch.empty(6, packed_columns(length), dtype=torch.uint8)
    scale = quantize_state_4bit(values, block, signed=signed, out=packed)
    expected, margin = _reference_codes(values, block, signed)
    codes = _unpack(packed, length)
    # fp32 division may land on the other side of a boundary only within its rounding
    differ = codes != expected
    assert (margin[differ] < 1e-6).all(), (codes[differ], expected[differ])
    assert differ.float().mean() < 1e-3
    # the scale is each block's absmax, exactly (the level 1.0 holds it)
    assert torch.equal(scale[:, 0], values[:, :block].abs().amax(dim=1))
    levels = torch.tensor(SIGNED_4BIT_LEVELS if signed else UNSIGNED_4BIT_LEVELS)
    decoded = dequantize_state_4bit(packed, scale, block, length, signed=signed)
    per_value = scale.repeat_interleave(block, dim=1)[:, :length]
    assert torch.equal(decoded, levels[codes] * per_value)  # level x scale, one fp32 product
    assert torch.equal(decoded[4, :block], torch.zeros(block))
    if not signed:
        assert torch.equal(decoded > 0, values > 0)


def test_byte_layout_low_nibble_first_and_an_odd_row_padded_with_level_zero():
    values = torch.tensor([[1.0, -1.0, 0.0]])
    packed = torch.empty(1, 2, dtype=torch.uint8)
    quantize_state_4bit(values, 4, signed=True, out=packed)
    top, bottom, zero = (SIGNED_4BIT_LEVELS.index(v) for v in (1.0, -1.0, 0.0))
    assert packed.tolist() == [[top | bottom << 4, zero | zero << 4]]


def test_non_finite_values_raise_or_give_a_non_finite_scale():
    values = torch.ones(2, 8)
    values[1, 3] = float("nan")
    packed = torch.empty(2, 4, dtype=torch.uint8)
    with pytest.raises(ValueError, match="non-finite"):
        quantize_state_4bit(values, 4, signed=True, out=packed)
    scale = quantize_state_4bit(values, 4, signed=True, out=packed, nonfinite="propagate")
    assert torch.isfinite(scale).tolist() == [[True, True], [False, True]]
    with pytest.raises(ValueError, match="uint8 of shape"):
        quantize_state_4bit(values, 4, signed=True, out=torch.empty(2, 8, dtype=torch.uint8))


def test_state_layout_and_default_block():
    weight, bias, short = nn.Parameter(torch.randn(3, 300)), nn.Parameter(torch.randn(3)), nn.Parameter(torch.randn(4, 64))
    opt = Int8AdamW([weight, bias, short], state_bits=4)
    for p in (weight, bias, short):
        p.grad = torch.randn_like(p)
    opt.step()
    state = opt.state[weight]
    assert state["exp_avg_4bit"].shape == (3, 150) and state["exp_avg_4bit"].dtype == torch.uint8
    assert state["exp_avg_scale"].shape == (3, 3)  # 128 per block by default: 128 + 128 + 44
    assert state["exp_avg_sq_sqrt_4bit"].shape == (3, 150)
    assert set(opt.state[bias]) == set(opt.state[short]) == {"step", "exp_avg", "exp_avg_sq"}  # 1-D; rows < 128
    assert Int8AdamW.uses_quantized_state(short, 4, 64) and not Int8AdamW.uses_quantized_state(short, 4)
    lean = Int8AdamW.lean([nn.Parameter(torch.randn(2, 256))], state_bits=4)
    assert lean.param_groups[0]["state_bits"] == 4 and lean.step_in_backward


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "foreach"])
def test_one_update_matches_adamw_in_float64_from_the_same_4bit_state(fused):
    """Two steps: the first makes a 4-bit state; the second's update is recomputed in
    float64 from that state (decoded) and the same gradient."""
    lr, betas, eps, wd, block = 1e-2, (0.9, 0.99), 1e-8, 0.1, 16
    gen = torch.Generator().manual_seed(0)
    param = nn.Parameter(torch.randn(8, 40, generator=gen))
    opt = Int8AdamW([param], lr=lr, betas=betas, eps=eps, weight_decay=wd, state_bits=4, block_size=block,
                    fused=fused)
    param.grad = torch.randn(8, 40, generator=gen)
    opt.step()
    state = opt.state[param]
    m0 = dequantize_state_4bit(state["exp_avg_4bit"], state["exp_avg_scale"], block, 40, signed=True).double()
    r0 = dequantize_state_4bit(state["exp_avg_sq_sqrt_4bit"], state["exp_avg_sq_sqrt_scale"], block, 40,
                               signed=False).double()
    w0, grad = param.detach().double().clone(), torch.randn(8, 40, generator=gen)
    param.grad = grad.clone()
    opt.step()
    g = grad.double()
    m = betas[0] * m0 + (1 - betas[0]) * g
    v = betas[1] * r0 * r0 + (1 - betas[1]) * g * g
    step = 2
    denom = (v / (1 - betas[1] ** step)).sqrt() + eps
    expected = w0 * (1 - lr * wd) - lr / (1 - betas[0] ** step) * m / denom
    # fp32 arithmetic against float64: a few ulps of the weights (|w| < 5, ulp <= 5e-7)
    torch.testing.assert_close(param.detach().double(), expected, rtol=0, atol=5e-6)
    for key, reference, signed in (("exp_avg", m, True), ("exp_avg_sq_sqrt", v.sqrt(), False)):
        codes, margin = _reference_codes(reference.float(), block, signed)
        stored = _unpack(state[f"{key}_4bit"], 40)
        differ = stored != codes
        assert (margin[differ] < 1e-5).all(), key  # only where fp32 and float64 straddle a boundary
