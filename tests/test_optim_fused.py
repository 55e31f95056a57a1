"""The fused optimizers (fsdp_int8.optim) in one process: parity with torch.optim, one
requantization per step, 8-bit states, state dicts, errors.

Multi-process cases (DTensor parameters, no collectives, resharded checkpoints):
tests/distributed/test_optim_distributed.py.
"""

from __future__ import annotations

import contextlib
import copy
from typing import Iterator

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from _models import MLP, regression_task
from _quant import quantize_rowwise

from fsdp_int8 import Int8AdamW, Int8SGD, Int8TrainingConfig, Int8Weight, quantize_
from fsdp_int8._quant.generators import WEIGHT_ROUNDING
from fsdp_int8.optim._state_codec import dequantize_state_blocks, quantize_state_blocks


# ---------------------------------------------------------------- helpers
@contextlib.contextmanager
def spy_assign() -> Iterator[list[tuple[Int8Weight, torch.Tensor]]]:
    """Record every ``Int8Weight.assign_`` call: (weight, a copy of the values)."""
    calls: list[tuple[Int8Weight, torch.Tensor]] = []
    original = Int8Weight.assign_

    def assign_(self, values, **options):
        calls.append((self, values.detach().clone()))
        return original(self, values, **options)

    Int8Weight.assign_ = assign_
    try:
        yield calls
    finally:
        Int8Weight.assign_ = original


def _net(stochastic_rounding: bool = False, seed: int = 0) -> nn.Module:
    """Int8 layers with rows of 64 and 40 (ragged 16-blocks), fp32 biases, a plain 2-D head."""
    torch.manual_seed(seed)
    model = nn.Sequential(
        nn.Linear(40, 64), nn.ReLU(), nn.Linear(64, 48), nn.ReLU(), nn.Linear(48, 4),
    )
    quantize_(model, Int8TrainingConfig(stochastic_rounding=stochastic_rounding, seed=seed))
    assert isinstance(model[0].weight, Int8Weight) and isinstance(model[2].weight, Int8Weight)
    assert not isinstance(model[4].weight, Int8Weight)  # out_features 4 < min_features
    return model


def _values(param: torch.Tensor) -> torch.Tensor:
    return param.dequantize(torch.float32) if isinstance(param, Int8Weight) else param.detach().clone()


def _backward(model: nn.Module, step: int) -> None:
    gen = torch.Generator().manual_seed(step)
    x, y = torch.randn(16, 40, generator=gen), torch.randn(16, 4, generator=gen)
    model.zero_grad()
    F.mse_loss(model(x), y).backward()


def _step_against_reference(model, step, opt, params, ref_opt, ref_params, sync=None) -> dict:
    """One step of ``opt`` and of the torch reference from the same values and gradients;
    the values written before requantization must equal the reference's. Returns them,
    keyed by the int8 weight's id."""
    _backward(model, step)
    with torch.no_grad():
        for ref, param in zip(ref_params, params):
            ref.copy_(_values(param))
            ref.grad = param.grad.clone()
    if sync is not None:
        sync(ref_opt, ref_params, opt, params)
    with spy_assign() as calls:
        opt.step()
    ref_opt.step()
    written = {id(weight): values for weight, values in calls}
    for ref, param in zip(ref_params, params):
        got = written[id(param)] if isinstance(param, Int8Weight) else param.detach()
        torch.testing.assert_close(got, ref.detach(), **EXACT)
    return written


def _sync_reference_state(ref_opt, ref_params, opt, params) -> None:
    """Give the reference torch optimizer this optimizer's (dequantized) moments."""
    for ref, param in zip(ref_params, params):
        state, ref_state = opt.state[param], ref_opt.state[ref]
        if "exp_avg_int8" in state:
            m = dequantize_state_blocks(state["exp_avg_int8"], state["exp_avg_scale"], opt.defaults["block_size"])
            r = dequantize_state_blocks(
                state["exp_avg_sq_sqrt_uint8"], state["exp_avg_sq_sqrt_scale"], opt.defaults["block_size"]
            )
            ref_state["exp_avg"].copy_(m.view_as(ref))
            ref_state["exp_avg_sq"].copy_((r * r).view_as(ref))
        elif "momentum_buffer" not in state and "exp_avg" not in state:
            continue
        else:
            for key in ("exp_avg", "exp_avg_sq", "momentum_buffer"):
                if key in state:
                    ref_state[key].copy_(state[key])


# ---------------------------------------------------------------- parity with torch.optim
# Why exact equality (rtol=atol=0): Int8AdamW / Int8SGD run torch.optim's own fp32
# operations (lerp_, mul_, addcmul_, sqrt, div_, add_, addcdiv_ with the same Python-double
# scalars) in the same order on the same fp32 inputs, so every rounding is the same.
# torch's for-loop and foreach paths agree bit for bit on CPU, and both are checked.
EXACT = dict(rtol=0.0, atol=0.0)


_TORCH_ADAMW_FORMS = {  # torch.optim.AdamW's kernel -> Int8AdamW's `fused` that matches it
    "for-loop": (dict(foreach=False), False),
    "foreach": (dict(foreach=True), False),
    "fused": (dict(fused=True), True),
}


@pytest.mark.parametrize("form", list(_TORCH_ADAMW_FORMS))
@pytest.mark.parametrize("state_bits", [32, 8])
def test_adamw_matches_torch_adamw_before_requantization(state_bits, form):
    """From the same weights and moments, each step's fp32 values before requantization
    equal torch.optim.AdamW's on fp32 copies (and 8-bit moments, dequantized, are the
    same state: the reference is given them before each step): the fused kernel's
    with ``fused=True``, the for-loop and foreach forms' with ``fused=False``."""
    model = _net()
    params = list(model.parameters())
    ref_kwargs, fused = _TORCH_ADAMW_FORMS[form]
    opt = Int8AdamW(params, lr=1e-2, weight_decay=0.1, state_bits=state_bits, block_size=16, fused=fused)
    ref_params = [_values(p).requires_grad_() for p in params]
    ref_opt = torch.optim.AdamW(ref_params, lr=1e-2, weight_decay=0.1, **ref_kwargs)
    for step in range(4):
        sync = _sync_reference_state if step else None
        written = _step_against_reference(model, step, opt, params, ref_opt, ref_params, sync)
        # Round to nearest: the int8 bytes are those of the reference's values, rounded.
        for weight in (model[0].weight, model[2].weight):
            expected, scale = quantize_rowwise(written[id(weight)], stochastic=False)
            assert torch.equal(weight.int_data, expected) and torch.equal(weight.scale, scale)
    if state_bits == 8:
        assert opt.state[model[0].weight]["exp_avg_int8"].dtype == torch.int8
        assert opt.state[model[4].weight]["exp_avg_sq_sqrt_uint8"].shape == (4, 48)  # plain 2-D
        assert opt.state[model[0].bias]["exp_avg"].dtype == torch.float32  # 1-D: fp32


def test_adamw_one_step_against_torch_adamw_on_the_int8_weight():
    """torch.optim.AdamW on the Int8Weight itself: its weight decay's mul_ by a scalar
    rescales the scales exactly (no requantization), its addcdiv_ requantizes once: one
    requantization per step, like Int8AdamW.

    Tolerance: the exact rescale and Int8AdamW's fp32 update round the decayed values in
    a different order, so only values within an fp32 rounding of a .5 boundary after the
    update can land on the other side: at most one step apart, on a tiny fraction.
    """
    model = _net()
    ours, theirs = copy.deepcopy(model), copy.deepcopy(model)
    for m in (ours, theirs):
        _backward(m, 0)
    opt = Int8AdamW(ours.parameters(), lr=1e-2, weight_decay=0.1)
    ref = torch.optim.AdamW(theirs.parameters(), lr=1e-2, weight_decay=0.1, foreach=False)
    with spy_assign() as calls:
        opt.step()
    assert len(calls) == 2  # one per int8 weight
    with spy_assign() as calls:
        ref.step()
    assert len(calls) == 2  # one per int8 weight: the weight decay is an exact rescale
    for index in (0, 2):
        diff = (ours[index].weight.int_data.int() - theirs[index].weight.int_data.int()).abs()
        assert int(diff.max()) <= 1
        assert float((diff > 0).float().mean()) <= 0.01, float((diff > 0).float().mean())


@pytest.mark.parametrize(
    "kwargs",
    [dict(momentum=0.0), dict(momentum=0.9, weight_decay=0.01), dict(momentum=0.9, nesterov=True, weight_decay=0.1)],
    ids=["plain", "momentum+wd", "nesterov+wd"],
)
def test_sgd_matches_torch_sgd_before_requantization(kwargs):
    model = _net()
    params = list(model.parameters())
    opt = Int8SGD(params, lr=0.05, **kwargs)
    ref_params = [_values(p).requires_grad_() for p in params]
    ref_opt = torch.optim.SGD(ref_params, lr=0.05, **kwargs)
    for step in range(3):
        _step_against_reference(model, step, opt, params, ref_opt, ref_params)
    if kwargs["momentum"]:
        assert all(opt.state[p]["momentum_buffer"].dtype == torch.float32 for p in params)
    else:
        assert not opt.state  # stateless, as torch.optim.SGD


# ---------------------------------------------------------------- one requantization per step
@pytest.mark.parametrize(
    "make",
    [
        lambda p: Int8AdamW(p, state_bits=32),
        lambda p: Int8AdamW(p, state_bits=8, block_size=16),
        lambda p: Int8SGD(p, lr=0.1, momentum=0.9),
    ],
    ids=["adamw-32", "adamw-8", "sgd"],
)
def test_one_requantization_per_int8_weight_per_step(make):
    model = _net(stochastic_rounding=True)
    opt = make(model.parameters())
    weights = [model[0].weight, model[2].weight]
    for step in range(3):
        _backward(model, step)
        with spy_assign() as calls:
            opt.step()
        assert sorted(id(w) for w, _ in calls) == sorted(id(w) for w in weights)


def test_zero_learning_rate_leaves_int8_weights_and_rounding_stream_untouched():
    """lr == 0 (warm-up from 0; get_optimizer_state_dict's initialising step): no
    requantization, so no int8 value moves and no rounding noise is drawn."""
    model = _net(stochastic_rounding=True)
    before = [(w.int_data.clone(), w.scale.clone()) for w in (model[0].weight, model[2].weight)]
    opt = Int8AdamW(model.parameters(), lr=0.0, state_bits=8, block_size=16)
    rng = WEIGHT_ROUNDING.get_state()
    _backward(model, 0)
    with spy_assign() as calls:
        opt.step()
    assert calls == []
    for (data, scale), w in zip(before, (model[0].weight, model[2].weight)):
        assert torch.equal(data, w.int_data) and torch.equal(scale, w.scale)
    assert all(torch.equal(v, WEIGHT_ROUNDING.get_state()[k]) for k, v in rng.items())
    assert float(opt.state[model[0].weight]["step"]) == 1.0  # the moments did update


# ---------------------------------------------------------------- 8-bit states
def test_8bit_states_train_as_well_as_fp32_states():
    """100 full-batch steps on the regression task, stochastic rounding as in training.

    Observed final losses: 0.01168 (fp32 states) and 0.01159 (8-bit), from 1.62 at the
    start; between seeds the fp32-state run itself varies by ~7% (0.0110 to 0.0118).
    The bound, 10% of the fp32-state loss, is above that seed-to-seed spread; 8-bit
    moments that are not carried from step to step (never written back) end at ~0.10.
    """
    x, y = regression_task()
    finals = {}
    for bits in (32, 8):
        torch.manual_seed(0)
        model = quantize_(MLP(), Int8TrainingConfig(seed=0))
        opt = Int8AdamW(model.parameters(), lr=1e-2, state_bits=bits, block_size=32)
        for _ in range(100):
            loss = F.mse_loss(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
        with torch.no_grad():
            finals[bits] = F.mse_loss(model(x), y).item()
        if bits == 8:  # fc1 (rows of 32), fc2 (64) and the plain fc3 (64) all have 8-bit states
            assert all("exp_avg_int8" in opt.state[m.weight] for m in (model.fc1, model.fc2, model.fc3))
    assert abs(finals[8] - finals[32]) <= 0.1 * finals[32], finals
    assert finals[32] < 0.02, finals


def test_blocks_never_cross_rows():
    """Each row is quantized alone: any set of rows (a shard on any rank) gets the same
    bytes and scales as in the whole tensor, so checkpoints reshard bit-exactly."""
    gen = torch.Generator().manual_seed(0)
    rows, row_len, block = 9, 37, 16  # 3 blocks per row: 16, 16, 5
    magnitudes = 10.0 ** torch.arange(-4, 5, dtype=torch.float32)  # rows 1e-4 ... 1e4
    values = torch.randn(rows, row_len, generator=gen) * magnitudes[:, None]
    for signed in (True, False):
        data = values if signed else values.abs()
        q, scale = quantize_state_blocks(data, block, signed=signed)
        assert q.shape == (rows, row_len) and scale.shape == (rows, 3)
        assert q.dtype == (torch.int8 if signed else torch.uint8)
        for start, stop in ((0, 1), (0, 5), (5, 9), (3, 4), (8, 9)):  # uneven "shards"
            q_part, scale_part = quantize_state_blocks(data[start:stop], block, signed=signed)
            assert torch.equal(q_part, q[start:stop]) and torch.equal(scale_part, scale[start:stop])
        # The error of each element is at most half a level of its own block (unsigned:
        # a positive value below half a level rounds up to level 1, an error < 1 level).
        error = (dequantize_state_blocks(q, scale, block) - data).abs()
        level = scale.repeat_interleave(block, dim=1)[:, :row_len]
        bound = 0.5 * level if signed else torch.where(data >= 0.5 * level, 0.5 * level, level)
        assert bool((error <= bound * (1 + 1e-5)).all())
        # Each row's last, short block has its own scale: its absmax over 5 elements.
        levels = 127 if signed else 255
        torch.testing.assert_close(scale[:, 2], data[:, 32:].abs().amax(dim=1) / levels, rtol=0, atol=0)


def test_second_moment_never_rounds_to_zero_so_steps_stay_bounded():
    """A positive sqrt(v) far below its block's largest rounds up to level 1, not to 0.

    The scenario: element 0 gets one large gradient, then none; element 1 a small steady
    one, then none. m forgets at 0.9 per step, v at 0.999: after 50 steps element 0 still
    dominates the block's sqrt(v) (so element 1's sqrt(v), ~1/1400 of it, is below half a
    level) but no longer its m (element 1's m survives, ~20 levels). Rounded to 0, element
    1's v would be 0 at the first step without gradient and its step m / eps, 7.7e3 * lr
    here; rounded up to level 1 its steps stay below Adam's own bound (~3 * lr).
    """
    r = torch.tensor([[1000.0, 1e-3, 0.0, 5.0]])
    q, scale = quantize_state_blocks(r, 4, signed=False)
    assert q.tolist() == [[255, 1, 0, 1]]  # 1e-3 and 5 (< half a level of 3.9) -> level 1
    lr = 1e-3
    param = nn.Parameter(torch.zeros(1, 4))
    opt = Int8AdamW([param], lr=lr, weight_decay=0.0, state_bits=8, block_size=4)
    grads = [[1.0, 1e-4, 0.0, 0.0]] + [[0.0, 1e-4, 0.0, 0.0]] * 49 + [[0.0, 0.0, 0.0, 0.0]] * 3
    largest = 0.0
    for grad in grads:
        before = param.detach().clone()
        param.grad = torch.tensor([grad])
        opt.step()
        largest = max(largest, float((param.detach() - before).abs().max()))
    assert opt.state[param]["exp_avg_sq_sqrt_uint8"][0, 1] == 1
    assert largest <= 4 * lr, largest / lr  # observed: 1.0 lr (the first step)


# ---------------------------------------------------------------- state dicts, dtypes
def test_state_dict_round_trip_keeps_state_dtypes_on_a_bf16_model():
    """torch's load_state_dict would cast every state to the parameter's dtype (bf16
    scales, float moments); ours keep int8 / uint8 / fp32 and continue identically."""
    def make():
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 32)).to(torch.bfloat16)
        quantize_(model, Int8TrainingConfig(stochastic_rounding=False))
        return model, Int8AdamW(model.parameters(), lr=1e-2, state_bits=8, block_size=8)

    def train(model, opt, steps):
        for step in range(steps):
            gen = torch.Generator().manual_seed(step)
            x = torch.randn(8, 32, generator=gen).to(torch.bfloat16)
            opt.zero_grad()
            model(x).float().pow(2).mean().backward()
            opt.step()

    model, opt = make()
    train(model, opt, 2)
    saved_model = copy.deepcopy(model.state_dict())
    saved = copy.deepcopy(opt.state_dict())
    train(model, opt, 2)

    model2, opt2 = make()
    model2.load_state_dict(saved_model)
    opt2.load_state_dict(saved)
    for param in model2.parameters():
        for key, value in opt2.state[param].items():
            original = opt.state[dict(zip(map(id, model2.parameters()), model.parameters()))[id(param)]][key]
            assert value.dtype == original.dtype, key
    assert opt2.state[model2[0].weight]["exp_avg_scale"].dtype == torch.float32
    assert opt2.state[model2[0].bias]["exp_avg"].dtype == torch.float32  # fp32 moments of bf16
    train(model2, opt2, 2)
    for a, b in zip(model.parameters(), model2.parameters()):
        assert torch.equal(_values(a), _values(b))


def test_loads_a_torch_adamw_state_dict():
    """state_bits=32 has torch.optim.AdamW's layout: its state dict loads (as fp32)."""
    model = _net()
    ref = torch.optim.AdamW(model.parameters(), lr=1e-2)
    _backward(model, 0)
    ref.step()
    opt = Int8AdamW(model.parameters(), lr=1e-2)
    opt.load_state_dict(ref.state_dict())
    for param in model.parameters():
        assert set(opt.state[param]) == {"step", "exp_avg", "exp_avg_sq"}
        assert torch.equal(opt.state[param]["exp_avg"], ref.state[param]["exp_avg"])
    _backward(model, 1)
    opt.step()
    assert float(opt.state[model[0].weight]["step"]) == 2.0


def test_bf16_parameters_update_in_fp32_with_fp32_states():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 32)).to(torch.bfloat16)
    quantize_(model, Int8TrainingConfig())
    opt = Int8AdamW(model.parameters(), lr=1e-2)
    x = torch.randn(8, 32).to(torch.bfloat16)
    losses = []
    for _ in range(20):
        loss = model(x).float().pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0], losses
    assert model[0].bias.dtype == torch.bfloat16 and model[0].weight.dtype == torch.bfloat16
    assert all(opt.state[p]["exp_avg"].dtype == torch.float32 for p in model.parameters())


def test_parameter_groups_and_parameters_without_gradients():
    model = _net()
    opt = Int8AdamW(
        [
            {"params": [model[0].weight, model[0].bias], "state_bits": 8, "block_size": 8},
            {"params": [model[2].weight, model[2].bias, model[4].weight, model[4].bias], "lr": 0.0},
        ],
        lr=1e-2,
    )
    _backward(model, 0)
    model[2].bias.grad = None
    opt.step()
    assert "exp_avg_int8" in opt.state[model[0].weight]
    assert "exp_avg" in opt.state[model[2].weight]  # the default state_bits=32
    assert model[2].bias not in opt.state


# ---------------------------------------------------------------- errors
@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(state_bits=16), ValueError, "state_bits must be 4, 8 or 32"),
        (dict(state_bits=True), ValueError, "state_bits must be 4, 8 or 32"),
        (dict(state_bits=4, block_size=33), ValueError, "block_size must be even"),
        (dict(block_size=0), ValueError, "block_size must be >= 1"),
        (dict(block_size=2.5), TypeError, "block_size must be an int"),
        (dict(lr=-1.0), ValueError, "lr must be in"),
        (dict(betas=(0.9, 1.0)), ValueError, "beta2 must be in"),
        (dict(betas=0.9), ValueError, "betas must be a pair"),
        (dict(eps=-1e-8), ValueError, "eps must be in"),
        (dict(weight_decay="0.1"), TypeError, "weight_decay must be a number"),
    ],
)
def test_adamw_rejects_bad_arguments(kwargs, error, match):
    with pytest.raises(error, match=match):
        Int8AdamW([nn.Parameter(torch.zeros(2, 2))], **kwargs)


def test_bad_parameters_and_gradients_raise_clearly():
    with pytest.raises(ValueError, match="complex parameters"):
        Int8AdamW([nn.Parameter(torch.zeros(2, dtype=torch.complex64))])
    with pytest.raises(ValueError, match="Nesterov momentum needs momentum > 0"):
        Int8SGD([nn.Parameter(torch.zeros(2))], lr=0.1, nesterov=True)
    with pytest.raises(ValueError, match="state_bits must be 4, 8 or 32"):
        Int8AdamW([nn.Parameter(torch.zeros(2))]).add_param_group(
            {"params": [nn.Parameter(torch.zeros(2))], "state_bits": 2}
        )
    param = nn.Parameter(torch.zeros(3, 2))
    param.grad = torch.zeros(3, 2).to_sparse()
    with pytest.raises(RuntimeError, match="sparse gradients"):
        Int8SGD([param], lr=0.1).step()
    model = _net()
    opt = Int8AdamW(model.parameters(), state_bits=8, block_size=16)
    _backward(model, 0)
    model[0].weight.grad[0, 0] = float("nan")
    with pytest.raises(ValueError, match="NaN or Inf"):
        opt.step()


@pytest.mark.parametrize("make", [
    lambda p: Int8AdamW(p, lr=1e-2, weight_decay=0.1),
    lambda p: Int8AdamW(p, lr=1e-2, state_bits=8, block_size=16),
    lambda p: Int8SGD(p, lr=1e-2, momentum=0.9),
], ids=["adamw", "adamw_8bit", "sgd"])
def test_chunks_of_many_parameters_give_the_bits_of_one_at_a_time(make, monkeypatch):
    # CPU steps update one parameter at a time; accelerators update chunks of many with
    # _foreach_ ops. Both must give the same bits (stochastic rounding included): run the
    # many-parameter path on CPU by raising the CPU limit, against the default.
    from fsdp_int8.optim import _base

    results = []
    for limit in (_base._CHUNK_ELEMENTS_CPU, _base._CHUNK_ELEMENTS):
        monkeypatch.setattr(_base, "_CHUNK_ELEMENTS_CPU", limit)
        model = _net(stochastic_rounding=True)
        opt = make(model.parameters())
        for step in range(3):
            _backward(model, step)
            opt.step()
        results.append(([_values(p) for p in model.parameters()], copy.deepcopy(opt.state_dict()["state"])))
    (params_a, state_a), (params_b, state_b) = results
    assert all(torch.equal(a, b) for a, b in zip(params_a, params_b))
    flat_a, flat_b = (torch.utils._pytree.tree_leaves(s) for s in (state_a, state_b))
    assert all(torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b for a, b in zip(flat_a, flat_b))
