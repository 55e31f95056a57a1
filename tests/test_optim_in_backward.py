"""``Int8AdamW`` / ``Int8SGD`` with ``step_in_backward=True`` in one process: the same weights
and states as stepping after backward, bit for bit; gradients freed inside backward; what
it refuses (a second gradient before ``step()``, reading an applied gradient) and what a
non-finite gradient does.
The multi-process cases (FSDP2, HSDP, tensor parallelism, accumulation with gradient
sync off) are in tests/distributed/test_optim_in_backward_distributed.py."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import fsdp_int8
from fsdp_int8 import Int8AdamW, Int8SGD, Int8TrainingConfig, Int8Weight, quantize_
from fsdp_int8._weight import update_checks
from fsdp_int8.guard import NonFiniteGradientError
from fsdp_int8.optim._in_backward import is_applied

OPTIMIZERS = {
    "adamw": (Int8AdamW, dict(lr=1e-2, weight_decay=0.1)),
    "adamw-foreach": (Int8AdamW, dict(lr=1e-2, weight_decay=0.1, fused=False)),
    "adamw-8bit": (Int8AdamW, dict(lr=1e-2, weight_decay=0.1, state_bits=8, block_size=16)),
    "adamw-4bit": (Int8AdamW, dict(lr=1e-2, weight_decay=0.1, state_bits=4, block_size=16)),
    "sgd-nesterov": (Int8SGD, dict(lr=0.05, momentum=0.9, nesterov=True, weight_decay=0.01)),
}


@pytest.fixture(params=[False, True], ids=["cpu-policy", "accelerator-policy"])
def policy(request, monkeypatch):
    """Whether the step inside backward decides on the device as on an accelerator (no
    host read per parameter: the skip of a non-finite gradient is a masked write, and
    the verdicts wait for ``step()``), or reads each verdict on the host, as on the CPU."""
    if request.param:
        monkeypatch.setattr(update_checks, "defers", lambda device: True)
    return request.param


def _model(stochastic: bool = True) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.LayerNorm(32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4))
    return quantize_(model, Int8TrainingConfig(seed=0, stochastic_rounding=stochastic))


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(step)
    x = torch.randn(64, 16, generator=gen)
    return x, torch.tanh(x[:, :4] * 2)


def _train(name: str, in_backward: bool, steps: int = 4, scheduler: bool = False):
    cls, kwargs = OPTIMIZERS[name]
    model = _model()
    opt = cls(model.parameters(), **kwargs, step_in_backward=in_backward)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5) if scheduler else None
    losses = []
    for step in range(steps):
        x, y = _batch(step)
        loss = F.mse_loss(model(x), y)
        loss.backward()
        if in_backward:  # every gradient was applied and freed inside backward
            assert all(is_applied(p.grad) for p in model.parameters())
        opt.step()
        opt.zero_grad()
        if sched is not None:
            sched.step()
        losses.append(loss.item())
    return model, opt, losses


def _same_tensors(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for key in a:
        x, y = a[key], b[key]
        if isinstance(x, dict):
            _same_tensors(x, y)
        elif isinstance(x, Int8Weight):
            assert torch.equal(x.int_data, y.int_data) and torch.equal(x.scale, y.scale), key
        elif isinstance(x, torch.Tensor):
            assert torch.equal(x, y), key
        else:
            assert x == y, key


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_in_backward_equals_after_backward_bit_for_bit(name, policy):
    after, after_opt, after_losses = _train(name, in_backward=False, scheduler=True)
    inside, inside_opt, inside_losses = _train(name, in_backward=True, scheduler=True)
    assert inside_losses == after_losses
    assert inside_losses[-1] < inside_losses[0]
    _same_tensors(dict(inside.named_parameters()), dict(after.named_parameters()))
    _same_tensors(inside_opt.state_dict()["state"], after_opt.state_dict()["state"])
    assert [g["lr"] for g in inside_opt.param_groups] == [g["lr"] for g in after_opt.param_groups]


def test_rounding_does_not_depend_on_update_order():
    """Each weight is rounded from its own seed: updating the weights one at a time in
    reverse (the order inside backward) gives what one ``step()`` gives."""
    x, y = _batch(0)
    results = []
    for reverse in (False, True):
        model = _model()  # quantize_ reseeds the rounding streams: both runs start alike
        opt = Int8AdamW(model.parameters(), lr=1e-2)
        F.mse_loss(model(x), y).backward()
        if reverse:
            group = opt.param_groups[0]
            for param in reversed(group["params"]):
                opt.update_params([param], group)
        else:
            opt.step()
        results.append(dict(model.named_parameters()))
    _same_tensors(*results)


def test_second_gradient_before_step_is_refused():
    model = _model()
    opt = Int8AdamW(model.parameters(), lr=1e-2, step_in_backward=True)
    assert opt.step_in_backward
    x, y = _batch(0)
    F.mse_loss(model(x), y).backward()
    with pytest.raises(RuntimeError, match="already applied.*add to it.*set_requires_gradient_sync"):
        F.mse_loss(model(x), y).backward()


@pytest.mark.parametrize("foreach", [False, True])
def test_clipping_an_applied_gradient_raises(foreach):
    """torch's clip_grad_norm_ would find no gradients and clip nothing: it raises instead,
    naming the parameter and what to do; step() then clears the applied gradients."""
    model = _model()
    opt = Int8AdamW(model.parameters(), lr=1e-2, step_in_backward=True)
    x, y = _batch(0)
    F.mse_loss(model(x), y).backward()
    assert "AppliedGradient" in repr(model[0].weight.grad)
    with pytest.raises(RuntimeError, match=r"applied the gradient of parameter \d+ of group 0 .*clip_grad_norm_"):
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0, foreach=foreach)
    opt.step()
    assert all(p.grad is None for p in model.parameters())
    F.mse_loss(model(x), y).backward()  # the next step starts clean
    opt.zero_grad()
    assert all(p.grad is None for p in model.parameters())


def test_non_finite_gradient_never_reaches_a_weight(policy):
    model = _model()
    opt = Int8AdamW(model.parameters(), lr=1e-2, step_in_backward=True)
    poisoned = model[3].weight
    handle = poisoned.register_hook(lambda grad: torch.full_like(grad, float("nan")))
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    x, y = _batch(0)
    F.mse_loss(model(x), y).backward()
    with pytest.raises(NonFiniteGradientError, match="already updated"):
        opt.step()
    assert torch.equal(poisoned.int_data, before["3.weight"].int_data)
    assert torch.equal(poisoned.scale, before["3.weight"].scale)
    assert poisoned not in opt.state or float(opt.state[poisoned]["step"]) == 0.0
    assert not torch.equal(model[0].weight.int_data, before["0.weight"].int_data)  # the others moved
    assert all(torch.isfinite(p.detach().float()).all() for p in model.parameters())
    handle.remove()  # the next step trains normally
    opt.zero_grad()
    F.mse_loss(model(x), y).backward()
    opt.step()
    assert float(opt.state[poisoned]["step"]) == 1.0


def test_state_dict_resumes_exactly(policy):
    """Save after 2 in-backward steps, load into a fresh model and optimizer, train 2
    more: the same as 4 uninterrupted steps (the rounding streams are saved too)."""
    from fsdp_int8.checkpoint import capture_generators, restore_generators

    full, full_opt, _ = _train("adamw-8bit", in_backward=True, steps=4)
    model, opt, _ = _train("adamw-8bit", in_backward=True, steps=2)
    saved = ({k: v.clone() for k, v in model.state_dict().items()}, opt.state_dict(), capture_generators(model))
    cls, kwargs = OPTIMIZERS["adamw-8bit"]
    resumed = _model()
    resumed.load_state_dict(saved[0])
    resumed_opt = cls(resumed.parameters(), **kwargs, step_in_backward=True)
    resumed_opt.load_state_dict(saved[1])
    assert restore_generators(saved[2], resumed)
    for step in (2, 3):
        x, y = _batch(step)
        F.mse_loss(resumed(x), y).backward()
        resumed_opt.step()
        resumed_opt.zero_grad()
    _same_tensors(dict(resumed.named_parameters()), dict(full.named_parameters()))
    _same_tensors(resumed_opt.state_dict()["state"], full_opt.state_dict()["state"])


def test_step_in_backward_must_be_a_bool():
    with pytest.raises(TypeError, match="step_in_backward must be a bool"):
        Int8AdamW(_model().parameters(), step_in_backward="yes")


@pytest.mark.parametrize("name", ["adamw-8bit", "adamw-4bit", "sgd-nesterov"])
def test_large_parameters_update_in_pieces_of_rows(name, monkeypatch):
    """A parameter above the piece size is updated a range of rows at a time, so the
    step's fp32 copies stay bounded. Every operation is row-local (per-row scales, 8-bit
    blocks inside rows, element-wise moments): with round-to-nearest weights the pieces
    give the whole-parameter update bit for bit; with stochastic rounding, stepping
    inside backward still equals stepping after it."""
    from fsdp_int8.optim import _base

    def run(piece_elements: int, stochastic: bool, in_backward: bool):
        monkeypatch.setattr(_base, "_PIECE_ELEMENTS_CPU", piece_elements)
        cls, kwargs = OPTIMIZERS[name]
        model = _model(stochastic)
        opt = cls(model.parameters(), **kwargs, step_in_backward=in_backward)
        for step in range(3):
            x, y = _batch(step)
            F.mse_loss(model(x), y).backward()
            opt.step()
            opt.zero_grad()
        return dict(model.named_parameters()), opt.state_dict()["state"]

    whole = run(1 << 20, stochastic=False, in_backward=False)
    pieces = run(40, stochastic=False, in_backward=False)  # rows of 16 and 32: 2 and 1 per piece
    _same_tensors(pieces[0], whole[0])
    _same_tensors(pieces[1], whole[1])
    after = run(40, stochastic=True, in_backward=False)
    inside = run(40, stochastic=True, in_backward=True)
    _same_tensors(inside[0], after[0])
    _same_tensors(inside[1], after[1])


def _trained_with(step_elements, step_in_backward: bool):
    """Two int8 layers (rows of 512 values) and a bias, 8-bit AdamW, 3 steps."""
    torch.manual_seed(0)
    model = fsdp_int8.quantize_(nn.Sequential(nn.Linear(512, 256), nn.Linear(256, 512, bias=False)),
                                fsdp_int8.Int8TrainingConfig(seed=5))
    opt = fsdp_int8.Int8AdamW(model.parameters(), lr=1e-2, state_bits=8, block_size=64,
                              step_in_backward=step_in_backward, step_elements=step_elements)
    data = torch.Generator().manual_seed(1)
    for _ in range(3):
        model(torch.randn(8, 512, generator=data)).square().mean().backward()
        opt.step()
        opt.zero_grad()
    weights = [(p.int_data.clone(), p.scale.clone()) if isinstance(p, Int8Weight) else p.detach().clone()
               for p in model.parameters()]
    states = [v.clone() for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    return weights, states


@pytest.mark.parametrize("step_in_backward", [False, True])
def test_step_elements_in_pieces_of_whole_vectors_changes_no_bit(step_in_backward):
    # The rounding noise is drawn per row in row order, 4 values to a 64-bit draw, so
    # pieces of whole rows of 512 values draw the stream of one whole-parameter piece; and
    # pieces of 4,096 values fill every vector of torch's fused kernel as the whole does.
    # (One-row pieces, and one element of the bias at a time, put values in the kernel's
    # scalar tail, which may round the last bit differently.)
    want = _trained_with(None, step_in_backward)
    got = _trained_with(4096, step_in_backward)  # 8 rows a piece
    for a, b in zip(want[0] + want[1], got[0] + got[1]):
        assert all(map(torch.equal, a, b)) if isinstance(a, tuple) else torch.equal(a, b)


def test_step_elements_bounds_the_step_temporaries():
    from torch.distributed._tools.mem_tracker import MemTracker

    def step_peak(step_elements) -> int:
        torch.manual_seed(0)
        model = fsdp_int8.quantize_(nn.Sequential(nn.Linear(1024, 1024, bias=False)))
        opt = fsdp_int8.Int8AdamW(model.parameters(), lr=1e-3, state_bits=8, step_elements=step_elements)
        for _ in range(2):  # the second step's states exist before it starts
            model(torch.randn(4, 1024)).sum().backward()
            if opt.state:
                tracker = MemTracker()
                tracker.track_external(model, opt)
                with tracker:
                    opt.step()
                snapshot = tracker.get_tracker_snapshot("peak")
                peak = snapshot[next(iter(snapshot))]["Total"]
            else:
                opt.step()
            opt.zero_grad()
        return peak

    # default on CPU: the 1 M-element weight in one piece, ~21 bytes of fp32 temporaries
    # per element; 4,096 elements (4 rows) a piece: ~86 KB of them
    saved = step_peak(None) - step_peak(4096)
    assert saved > 15 * 2**20, saved
    with pytest.raises(ValueError, match="step_elements"):
        fsdp_int8.Int8AdamW(nn.Linear(4, 4).parameters(), step_elements=0)
    with pytest.raises(ValueError, match="step_elements"):
        fsdp_int8.Int8SGD(nn.Linear(4, 4).parameters(), lr=0.1, step_elements=True)


@pytest.mark.parametrize("options", [dict(step_in_backward=True), dict(grad_dtype=torch.bfloat16)], ids=str)
def test_a_dropped_optimizer_leaves_no_hook_behind(options):
    """The hooks hold their optimizer weakly: dropping it frees it (states included) at
    once and its hooks stop, so a fresh optimizer on the same model works alone."""
    import weakref

    model = _model()
    # torch imports torch._dynamo in the first optimizer a process makes, and that import
    # keeps the constructor's frames (and so that one optimizer) alive: not this test's subject
    Int8AdamW(model.parameters())
    opt = Int8AdamW(model.parameters(), lr=1e-2, **options)
    x, y = _batch(0)
    F.mse_loss(model(x), y).backward()
    opt.step()
    opt.zero_grad()
    dropped = weakref.ref(opt)
    del opt
    assert dropped() is None  # no gc.collect(): nothing but the user held it
    assert not any(getattr(p, "_post_accumulate_grad_hooks", None) for p in model.parameters())
    fresh = Int8AdamW(model.parameters(), lr=1e-2)
    F.mse_loss(model(x), y).backward()  # would raise "a second gradient" or cast to bf16 otherwise
    assert all(p.grad is not None and p.grad.dtype == torch.float32 for p in model.parameters())
    fresh.step()


def _clip_by_hand(params: list[torch.Tensor], max_norm: float, previous: dict[torch.Tensor, float],
                  every: list[torch.Tensor]) -> dict[torch.Tensor, float]:
    """What ``max_grad_norm`` does inside backward, after it: each gradient, in the order the
    hooks saw ``params``, scaled by max_norm / norm, ``norm² = S * max(1, P / P_seen)`` (``S``
    the squares so far, ``P`` the sum of ``previous`` over ``every`` parameter, in their
    order, ``P_seen`` that of the parameters seen so far). Returns this step's squares."""
    total = sum(previous.get(p, 0.0) for p in every)
    squares, seen, now = 0.0, 0.0, {}
    for param in params:
        now[param] = float(torch.linalg.vector_norm(param.grad, dtype=torch.float64).square())
        squares += now[param]
        seen += previous.get(param, 0.0)
        estimate = squares * max(1.0, total / seen) if total > 0 and seen > 0 else squares
        if estimate ** 0.5 > max_norm:
            param.grad.mul_(max_norm / (estimate ** 0.5 + 1e-6))
    return now


def _clipped_run(in_backward: bool, max_norm: float | None, steps: int = 4, resume_at: int | None = None):
    """Train with ``max_grad_norm`` inside backward, or with the same clipping by hand after
    backward (``max_norm=None``: none); with ``resume_at``, through a state dict. From step 2
    the learning rate is halved, as a scheduler would."""
    model = _model()
    order: list[torch.Tensor] = []  # the parameters in the order their hooks run
    if not in_backward:
        for p in model.parameters():
            p.register_post_accumulate_grad_hook(order.append)

    def optimizer() -> Int8AdamW:
        return Int8AdamW(model.parameters(), lr=1e-2, step_in_backward=in_backward,
                         max_grad_norm=max_norm if in_backward else None)

    opt, seen, previous = optimizer(), [], {}
    for step in range(steps):
        if step == resume_at:
            saved = opt.state_dict()
            opt = optimizer()
            opt.load_state_dict(saved)
        if step >= 2:
            for group in opt.param_groups:
                group["lr"] = 5e-3
        x, y = _batch(step)
        order.clear()
        F.mse_loss(model(x), y).backward()
        if not in_backward:
            seen.append(float(torch.nn.utils.get_total_norm([p.grad for p in model.parameters()])))
            if max_norm is not None:
                previous = _clip_by_hand(list(order), max_norm, previous, list(model.parameters()))
        opt.step()
        opt.zero_grad()
        if in_backward:
            seen.append(opt.grad_norm)
    return seen, {name: p.detach().clone() for name, p in model.named_parameters()}


def test_clipping_inside_backward_by_the_norm_estimated_so_far(policy):
    """``max_grad_norm`` scales each gradient by max_norm / (the step's norm estimated from
    the squares so far and the previous step's proportions): the same weights, bit for
    bit, as the same rule applied by hand after backward; the norms are torch's (fp64 sums
    against torch's fp32: 1e-6 apart)."""
    max_norm = 0.05  # below every step's norm here (~0.4-0.5): every step is clipped
    inside_norms, inside = _clipped_run(True, max_norm)
    by_hand_norms, by_hand = _clipped_run(False, max_norm)
    torch.testing.assert_close(torch.tensor(inside_norms), torch.tensor(by_hand_norms), rtol=1e-6, atol=0)
    assert min(inside_norms) > max_norm
    _same_tensors(inside, by_hand)
    unclipped = _clipped_run(False, None)[1]
    assert not all(torch.equal(a.int_data, unclipped[k].int_data) for k, a in inside.items() if hasattr(a, "int_data"))
    # the previous step's squared norms live in the parameters' states: a state dict
    # resumes them exactly, and the updates read the groups load_state_dict makes (their
    # learning rate, too)
    _, resumed = _clipped_run(True, max_norm, resume_at=2)
    _same_tensors(resumed, inside)


def test_a_gradient_spike_is_clipped_in_the_step_that_carries_it(policy):
    """A gradient 1000x the previous step's norm is scaled to max_grad_norm within its own
    step (the previous step's norm alone would let it through nearly whole)."""
    param = nn.Parameter(torch.zeros(8, 8))
    optimizer = Int8SGD([param], lr=1.0, step_in_backward=True, max_grad_norm=1.0)
    for norm in (1.0, 1000.0):  # a step of norm 1 sets the previous norm; then the spike
        before = param.detach().clone()
        (param * torch.full((8, 8), norm / 8)).sum().backward()  # the gradient's norm: `norm`
        optimizer.step()
        applied = before - param.detach()  # lr 1, no momentum: the clipped gradient itself
        torch.testing.assert_close(applied.norm(), torch.tensor(1.0), rtol=1e-5, atol=0)
    assert optimizer.grad_norm == pytest.approx(1000.0)


def test_gradients_in_the_previous_steps_proportions_are_clipped_by_the_exact_norm():
    """When every parameter's gradient keeps its share of the squared norm (here each step's
    gradients are one pattern times a factor), the estimate is the step's exact norm from
    the first parameter on: each gradient is scaled by max_norm / norm, as clip_grad_norm_
    would after backward. The first step has no proportions: its first parameter is
    clipped by its own norm alone."""
    params = [nn.Parameter(torch.zeros(4, 4)), nn.Parameter(torch.zeros(3))]
    patterns = [torch.randn(4, 4, generator=torch.Generator().manual_seed(1)), torch.full((3,), 5.0)]
    optimizer = Int8SGD(params, lr=1.0, step_in_backward=True, max_grad_norm=1.0)
    for factor in (1.0, 3.0, 0.5):
        before = [p.detach().clone() for p in params]
        (factor * sum((p * g).sum() for p, g in zip(params, patterns))).backward()
        optimizer.step()
        applied = [b - p.detach() for b, p in zip(before, params)]  # lr 1, no momentum: the clipped gradients
        norm = factor * float(torch.linalg.vector_norm(torch.cat([g.reshape(-1) for g in patterns])))
        assert optimizer.grad_norm == pytest.approx(norm)
        if factor == 1.0:
            continue
        for update, pattern in zip(applied, patterns):
            # float32 gradients and updates: a few ulps of the values (~1e-7 relative)
            torch.testing.assert_close(update, factor * pattern / norm, rtol=1e-5, atol=1e-7)


def test_a_finite_gradient_whose_squares_overflow_float32_is_clipped_not_skipped():
    """A gradient of 1e30s is finite, though its squared norm is not in float32: the norm is
    summed in float64, so the gradient is clipped to max_grad_norm and applied, not
    reported as NaN or Inf."""
    param = nn.Parameter(torch.zeros(4, 4))
    optimizer = Int8SGD([param], lr=1.0, step_in_backward=True, max_grad_norm=1.0)
    (param * torch.full((4, 4), 1e30)).sum().backward()
    optimizer.step()  # would raise NonFiniteGradientError with a float32 norm
    torch.testing.assert_close(param.detach().norm(), torch.tensor(1.0), rtol=1e-5, atol=0)
    assert optimizer.grad_norm == pytest.approx(4e30)


def test_max_grad_norm_is_checked():
    model = _model()
    with pytest.raises(ValueError, match="clip_grad_norm_ before optimizer.step"):
        Int8AdamW(model.parameters(), max_grad_norm=1.0)
    for bad in (0.0, -1.0, True, "1"):
        with pytest.raises(ValueError, match="max_grad_norm must be a positive number"):
            Int8AdamW(model.parameters(), step_in_backward=True, max_grad_norm=bad)
    assert Int8AdamW(model.parameters(), step_in_backward=True).grad_norm is None
