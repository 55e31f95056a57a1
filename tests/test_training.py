"""Convergence of int8 + stochastic-rounding training against an fp32 reference run.

Each comparison trains the fp32 model and its quantized copy from the same initial
weights on the same full-batch data, so the only difference is the int8 storage (and
its rounding noise). Tolerances were set from observed runs (several inits and SR seeds)
and are stated next to each assertion.
"""

from __future__ import annotations

import copy

import torch
import torch.nn as nn
import torch.nn.functional as F

from _models import MLP, fibonacci_mod_task, lm_loss, regression_task
from fsdp_int8 import Int8TrainingConfig, Int8Weight, quantize_
from launch.model import ModelArgs, Transformer


def _train(model: nn.Module, loss_fn, opt: torch.optim.Optimizer, steps: int, every: int = 25):
    curve = []
    for step in range(1, steps + 1):
        loss = loss_fn()
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step % every == 0:
            curve.append(loss.item())
    with torch.no_grad():
        return curve, loss_fn().item()


def _int8_weights(model: nn.Module) -> list[Int8Weight]:
    return [p for p in model.parameters() if isinstance(p, Int8Weight)]


def test_mlp_int8_sr_matches_fp32():
    torch.manual_seed(0)
    base = MLP(32, 64, 8)
    x, y = regression_task(d_in=32, d_out=8)

    def run(config: Int8TrainingConfig | None) -> float:
        model = copy.deepcopy(base)
        if config is not None:
            quantize_(model, config)
            assert len(_int8_weights(model)) == 2  # fc1, fc2; fc3 has 8 outputs < 16
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
        _, final = _train(model, lambda: F.mse_loss(model(x), y), opt, steps=200)
        return final

    fp32 = run(None)
    sr = run(Int8TrainingConfig(stochastic_rounding=True, seed=0))
    rtn = run(Int8TrainingConfig(stochastic_rounding=False, seed=0))
    # The task is learnable: the target variance is 1.6 and fp32 reaches ~0.017.
    assert fp32 < 0.05
    # Observed int8+SR / fp32 final-loss ratios: 1.002-1.025 over 3 inits x 3 SR seeds.
    # Round-to-nearest int8 (same code, no SR) ends at 1.94x: updates below half a step
    # are lost. 1.15 is ~6x the observed SR excess and well below the RTN failure.
    assert sr / fp32 < 1.15, (sr, fp32)
    assert rtn / fp32 > 1.15, (rtn, fp32)  # the tolerance does discriminate


def test_llama_block_int8_sr_matches_fp32():
    """The launcher's Transformer with one block (the constructor's init: PyTorch's defaults)."""
    torch.manual_seed(0)
    base = Transformer(ModelArgs(vocab_size=17, dim=64, n_layers=1, n_heads=4, hidden_dim=128, max_seq_len=16))
    seqs = fibonacci_mod_task(batch=64, seq_len=16, vocab=17)

    def run(quantized: bool) -> tuple[list[float], float, nn.Module]:
        model = copy.deepcopy(base)
        if quantized:
            quantize_(model, Int8TrainingConfig(stochastic_rounding=True, seed=0))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
        curve, final = _train(model, lambda: lm_loss(model, seqs), opt, steps=200)
        return curve, final, model

    fp32_curve, fp32, _ = run(False)
    int8_curve, int8, model = run(True)
    names = {n for n, m in model.named_modules() if isinstance(getattr(m, "weight", None), Int8Weight)}
    assert names == {
        "layers.0.attention.wq", "layers.0.attention.wk", "layers.0.attention.wv", "layers.0.attention.wo",
        "layers.0.feed_forward.w1", "layers.0.feed_forward.w2", "layers.0.feed_forward.w3",
    }  # the output head stays fp32 by name
    # The model learns the recurrence: from ln(17) = 2.83 to ~0.10 (the first target of
    # each sequence depends on a random start token and stays unpredictable).
    assert fp32 < 0.3 and int8 < 0.3
    # Observed int8+SR vs fp32: final losses within 0.2% (3 SR seeds, 2 inits) and the
    # curves within 1.1% at every 25-step checkpoint from step 50; RTN int8 ends 1.18x
    # above fp32 (curves up to 23% apart). Final ratio < 1.08 and 5% per checkpoint from
    # step 50 on (before that the loss drops fast and small step shifts change it a lot)
    # leave a ~5x margin on the observed SR noise and still fail round to nearest.
    assert int8 / fp32 < 1.08, (int8, fp32)
    for step, (a, b) in enumerate(zip(int8_curve, fp32_curve), start=1):
        if step * 25 >= 50:
            assert abs(a - b) / b < 0.05, (step * 25, a, b)


def test_stochastic_rounding_lets_sub_step_updates_accumulate():
    """Why SR exists: updates far below one int8 step are lost by round-to-nearest."""
    torch.manual_seed(0)
    base = MLP(32, 64, 8)
    x, y = regression_task(d_in=32, d_out=8)
    lr, steps = 3e-3, 200

    def run(config: Int8TrainingConfig | None):
        model = copy.deepcopy(base)
        if config is not None:  # every Linear, so nothing but int8 weights trains
            quantize_(model, Int8TrainingConfig(
                stochastic_rounding=config.stochastic_rounding, seed=config.seed,
                module_filter=lambda module, name: True,
            ))
        weights = [model.fc1.weight, model.fc2.weight, model.fc3.weight]
        start = [w.detach().clone() for w in weights]
        opt = torch.optim.SGD(weights, lr=lr)
        loss_fn = lambda: F.mse_loss(model(x), y)  # noqa: E731
        with torch.no_grad():
            initial = loss_fn().item()
        largest_update = 0.0
        for _ in range(steps):
            loss = loss_fn()
            opt.zero_grad()
            loss.backward()
            if config is not None:
                largest_update = max(
                    largest_update,
                    max(float((lr * w.grad).abs().div(w.scale[:, None]).max()) for w in weights),
                )
            opt.step()
        with torch.no_grad():
            final = loss_fn().item()
        return initial - final, weights, start, largest_update

    fp32_drop, *_ = run(None)
    rtn_drop, rtn_w, rtn_start, rtn_largest = run(Int8TrainingConfig(stochastic_rounding=False, seed=0))
    sr_drop, sr_w, sr_start, sr_largest = run(Int8TrainingConfig(stochastic_rounding=True, seed=0))

    # Premise: every per-step update is far below one int8 step (observed max 0.06 step),
    # so round to nearest (which needs half a step) can never move a value.
    assert rtn_largest < 0.25 and sr_largest < 0.25, (rtn_largest, sr_largest)
    assert fp32_drop > 0.01  # fp32 makes clear progress (observed 1.624 -> 1.603)

    # Round to nearest: the int8 values are frozen bit for bit ...
    for w, w0 in zip(rtn_w, rtn_start):
        assert torch.equal(w.int_data, w0.int_data)
    # ... so the loss barely moves (observed 2% of the fp32 drop: only the per-row scales
    # drift, following each row's absmax element).
    assert rtn_drop < 0.1 * fp32_drop, (rtn_drop, fp32_drop)

    # Stochastic rounding: the same tiny updates move thousands of int8 values (observed
    # ~3400 of 6656) and the loss follows fp32 (observed drop 99% of fp32's).
    changed = sum(int((w.int_data != w0.int_data).sum()) for w, w0 in zip(sr_w, sr_start))
    assert changed > 1000, changed
    assert sr_drop > 0.8 * fp32_drop, (sr_drop, fp32_drop)


def test_launcher_rope_backward_is_autograds_bit_for_bit():
    """The launcher's RoPE writes its backward as the inverse rotation (a form inductor
    vectorizes); its values must be what autograd derives from the forward formula."""
    from launch.rope import apply_rope, rope_frequencies

    def autograd_rope(x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
        pairs = x.float().unflatten(-1, (-1, 2))
        cos, sin = freqs[: x.shape[1], None, :, 0], freqs[: x.shape[1], None, :, 1]
        even, odd = pairs[..., 0], pairs[..., 1]
        return torch.stack([even * cos - odd * sin, even * sin + odd * cos], dim=-1).flatten(-2).type_as(x)

    freqs = rope_frequencies(16, 32, 10000.0)
    generator = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(2, 24, 3, 16, generator=generator).to(dtype)
        grad = torch.randn(2, 24, 3, 16, generator=generator).to(dtype)
        ours, theirs = x.clone().requires_grad_(), x.clone().requires_grad_()
        out_ours, out_theirs = apply_rope(ours, freqs), autograd_rope(theirs, freqs)
        out_ours.backward(grad)
        out_theirs.backward(grad)
        assert torch.equal(out_ours, out_theirs), dtype
        assert torch.equal(ours.grad, theirs.grad), dtype
        assert not torch.equal(ours.grad, grad)  # a rotation, not the identity
