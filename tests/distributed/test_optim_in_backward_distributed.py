"""``Int8AdamW(step_in_backward=True)`` under FSDP2 on 2 gloo ranks, one spawn: FSDP, HSDP,
tensor parallelism, the int8 gradient reduce-scatter and gradient accumulation (gradient
sync off on all micro-batches but the last) each give the weights and optimizer states of
stepping after backward, bit for bit, with stochastic rounding and 8-bit states; a plain
parameter in a multi-process run (DDP's case) is refused, ``clip_grad_norm_`` of
gradients applied inside backward raises, ``max_grad_norm``'s global norm is torch's and a
checkpoint resumes its clipping exactly; a NaN in one rank's gradient, whichever rank's
shard it reaches, leaves the parameter unchanged on every rank (with and without
``max_grad_norm``). ``Int8AdamW(grad_dtype=bf16)``
(gradients kept in bf16 until the step) equals rounding the fp32 gradients by hand, and
torch's ``clip_grad_norm_`` works on its gradients."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

import fsdp_int8
from fsdp_int8 import Int8AdamW, Int8TrainingConfig
from fsdp_int8.gradients import enable_quantized_reduce_scatter
from fsdp_int8.guard import NonFiniteGradientError
from fsdp_int8.optim._in_backward import is_applied
from fsdp_int8.testing import device_type_for, run_distributed

from _cases import assert_identical, case, local_of, snapshot
from _nets import MLPNet

PLAN = {"up": ColwiseParallel(), "down": RowwiseParallel()}
STEPS, MICRO_BATCHES = 3, 2


def _build(mesh_kind: str, world: int, stochastic_rounding: bool = True):
    torch.manual_seed(0)
    model = MLPNet(dim=32, hidden=64)
    config = Int8TrainingConfig(min_features=1, seed=5, stochastic_rounding=stochastic_rounding)
    device = device_type_for(world)
    if mesh_kind == "hsdp":
        mesh = init_device_mesh(device, (world, 1), mesh_dim_names=("dp_replicate", "dp_shard"))
        return fsdp_int8.shard_model(model, mesh=mesh, config=config)
    if mesh_kind == "tp":
        mesh = init_device_mesh(device, (1, world), mesh_dim_names=("dp", "tp"))
        return fsdp_int8.shard_model(model, mesh=mesh, config=config, tp_plan=PLAN)
    return fsdp_int8.shard_model(model, config=config)


def _train(rank: int, world: int, mesh_kind: str, in_backward: bool, *, int8_gradients: bool = False,
           accumulate: bool = False, grad_dtype: torch.dtype | None = None,
           round_grads_to: torch.dtype | None = None) -> tuple[dict, dict]:
    """Weights and states after ``STEPS`` steps; ``round_grads_to`` rounds each final fp32
    gradient to that dtype by hand before the step (the reference of ``grad_dtype``)."""
    model = _build(mesh_kind, world)
    if int8_gradients:
        enable_quantized_reduce_scatter(model)
    opt = Int8AdamW(model.parameters(), lr=1e-2, state_bits=8, block_size=16, step_in_backward=in_backward,
                    grad_dtype=grad_dtype)
    data = torch.Generator().manual_seed(rank if mesh_kind != "tp" else 0)  # tp ranks share a batch
    for _ in range(STEPS):
        micro = MICRO_BATCHES if accumulate else 1
        for index in range(micro):
            if accumulate:
                model.set_requires_gradient_sync(index == micro - 1)
            x = torch.randn(4, 3, 32, generator=data)
            F.mse_loss(model(x), torch.tanh(x[..., :4])).backward()
            if in_backward and index < micro - 1:  # no sync: FSDP2 keeps the gradient, no update yet
                assert all(p.grad is None for p in model.parameters())
        if in_backward:
            assert all(is_applied(p.grad) for p in model.parameters())
        if grad_dtype is not None:
            assert {local_of(p.grad).dtype for p in model.parameters()} == {grad_dtype}
        if round_grads_to is not None:
            for p in model.parameters():
                local_of(p.grad).copy_(local_of(p.grad).to(round_grads_to))
        opt.step()
        opt.zero_grad()
    weights = {n: local_of(p).detach().clone() for n, p in model.named_parameters()}
    states = {i: {k: local_of(v).clone() if isinstance(v, torch.Tensor) else v for k, v in s.items()}
              for i, s in opt.state_dict()["state"].items()}
    return weights, states


def _assert_same(a: dict, b: dict, what: str) -> None:
    assert a.keys() == b.keys(), what
    for key in a:
        x, y = a[key], b[key]
        if isinstance(x, dict):
            _assert_same(x, y, f"{what}[{key}]")
        elif hasattr(x, "int_data"):
            assert torch.equal(x.int_data, y.int_data) and torch.equal(x.scale, y.scale), f"{what}: {key}"
        else:
            assert torch.equal(x, y), f"{what}: {key}"


class _TwoBranches(nn.Module):
    """A norm-like weight (1-D, plain) and an int8 linear, each reading the input directly,
    so that a NaN put into one branch's output gradient reaches that branch's weight only."""

    def __init__(self, dim: int = 8, rows: int = 8) -> None:
        super().__init__()
        self.norm = nn.Parameter(torch.linspace(0.5, 1.5, dim))
        self.lin = nn.Linear(dim, rows, bias=False)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x * self.norm, self.lin(x)


class _Poisonable(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([_TwoBranches()])

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.layers[0](x)


def _nan_on_one_rank_skips_everywhere(rank: int, world: int, target: str, column: int,
                                      max_grad_norm: float | None) -> None:
    """A clean step, then a step whose gradient of ``target`` holds NaN at output column
    ``column`` on rank 1's batch only: after FSDP2's reduce-scatter the NaN is in one
    rank's shard (rows ``column``), and every rank must still skip the whole parameter."""
    torch.manual_seed(0)
    model = fsdp_int8.shard_model(_Poisonable(), config=Int8TrainingConfig(min_features=1, seed=5))
    block = model.layers[0]
    param = block.norm if target == "norm" else block.lin.weight
    other = block.lin.weight if target == "norm" else block.norm
    opt = Int8AdamW(model.parameters(), lr=1e-2, step_in_backward=True, max_grad_norm=max_grad_norm)
    data = torch.Generator().manual_seed(rank)

    def backward(poison: bool) -> None:
        outputs = model(torch.randn(4, 8, generator=data))
        if poison and rank == 1:
            hit = outputs[0 if target == "norm" else 1]
            hit.register_hook(lambda g: g.index_fill(-1, torch.tensor([column]), float("nan")))
        sum(out.square().mean() for out in outputs).backward()

    def snapshot(p: torch.Tensor) -> dict:
        state = {k: local_of(v).clone() for k, v in opt.state[p].items() if isinstance(v, torch.Tensor)}
        return {"weight": local_of(p).detach().clone(), **state}

    backward(poison=False)
    opt.step()
    opt.zero_grad()
    before, other_step = snapshot(param), float(opt.state[other]["step"])
    backward(poison=True)
    with pytest.raises(NonFiniteGradientError, match="NaN or Inf"):
        opt.step()
    opt.zero_grad()
    _assert_same(snapshot(param), before, f"rank {rank}: {target} after a NaN in rows {column}")
    assert float(opt.state[other]["step"]) == other_step + 1  # the clean parameter was stepped


def _in_backward_equals_after(rank: int, world: int, directory: str) -> None:
    cases = {
        "FSDP": dict(mesh_kind="fsdp"),
        "HSDP (2 replicas x 1 shard)": dict(mesh_kind="hsdp"),
        "tensor parallel, int8 colwise/rowwise": dict(mesh_kind="tp"),
        "FSDP + int8 gradient reduce-scatter": dict(mesh_kind="fsdp", int8_gradients=True),
        "FSDP, 2 micro-batches, gradient sync off on the first": dict(mesh_kind="fsdp", accumulate=True),
    }
    for name, options in cases.items():
        with case(name):
            after = _train(rank, world, in_backward=False, **options)
            inside = _train(rank, world, in_backward=True, **options)
            _assert_same(inside[0], after[0], "weights")
            _assert_same(inside[1], after[1], "optimizer state")
    for name, options in {
        "FSDP": dict(mesh_kind="fsdp"),
        "HSDP (2 replicas x 1 shard)": dict(mesh_kind="hsdp"),
        "tensor parallel": dict(mesh_kind="tp"),
        "FSDP + int8 gradient reduce-scatter": dict(mesh_kind="fsdp", int8_gradients=True),
        "FSDP, 2 micro-batches, gradient sync off on the first": dict(mesh_kind="fsdp", accumulate=True),
    }.items():
        with case(f"{name}: grad_dtype=bf16 equals fp32 gradients rounded to bf16 before the step"):
            kept = _train(rank, world, in_backward=False, grad_dtype=torch.bfloat16, **options)
            rounded = _train(rank, world, in_backward=False, round_grads_to=torch.bfloat16, **options)
            _assert_same(kept[0], rounded[0], "weights")
            _assert_same(kept[1], rounded[1], "optimizer state")
    with case("grad_dtype=bf16: torch's clip_grad_norm_ sees every gradient, and scales them"):
        model = _build("fsdp", world)
        opt = Int8AdamW(model.parameters(), lr=1e-2, grad_dtype=torch.bfloat16)
        x = torch.randn(4, 3, 32, generator=torch.Generator().manual_seed(rank))
        F.mse_loss(model(x), torch.tanh(x[..., :4])).backward()
        grads = [local_of(p.grad).float() for p in model.parameters()]
        local_sq = torch.stack([g.square().sum() for g in grads]).sum()
        torch.distributed.all_reduce(local_sq)
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1e-3).full_tensor()
        # the norm of bf16 values, summed in fp32 by two routes: equal to a few fp32 ulps
        torch.testing.assert_close(norm.float(), local_sq.sqrt(), rtol=1e-2, atol=0)
        clipped = [local_of(p.grad).float() for p in model.parameters()]
        ratio = float(clipped[0].norm() / grads[0].norm())
        assert abs(ratio - 1e-3 / float(norm)) < 1e-2 * ratio, (ratio, float(norm))
        opt.step()
    for mesh_kind in ("fsdp", "hsdp", "tp"):
        with case(f"{mesh_kind}: max_grad_norm's global norm is the gradients' norm, replicas counted once"):
            x = torch.randn(4, 3, 32, generator=torch.Generator().manual_seed(rank if mesh_kind != "tp" else 0))
            after = _build(mesh_kind, world)
            F.mse_loss(after(x), torch.tanh(x[..., :4])).backward()
            # each gradient's own norm (DTensor reduces its shards): TP's mix of meshes is
            # more than torch's clip_grad_norm_ takes in one call
            expected = sum(float(torch.linalg.vector_norm(p.grad).full_tensor()) ** 2 for p in after.parameters()) ** 0.5
            inside = _build(mesh_kind, world)
            opt = Int8AdamW(inside.parameters(), lr=1e-2, step_in_backward=True, max_grad_norm=1.0)
            F.mse_loss(inside(x), torch.tanh(x[..., :4])).backward()
            opt.step()
            # fp64 sums of fp32 squares against torch's fp32 norm of norms: 1e-5 apart at most
            assert abs(opt.grad_norm - expected) <= 1e-5 * expected, (opt.grad_norm, expected)
    with case("max_grad_norm: a sharded checkpoint resumes the clipping rule (each parameter's previous "
              "squared norm) exactly"):
        def step(model, opt, index: int) -> None:
            x = torch.randn(4, 3, 32, generator=torch.Generator().manual_seed(10 * index + rank))
            F.mse_loss(model(x), torch.tanh(x[..., :4])).backward()
            opt.step()
            opt.zero_grad()

        def clipping(model) -> Int8AdamW:
            return Int8AdamW(model.parameters(), lr=1e-2, step_in_backward=True, max_grad_norm=0.05)

        # round to nearest: stochastic rounding draws from one bank per process, which two
        # models in one process share (and the load rewinds); a resumed run has one model
        model = _build("fsdp", world, stochastic_rounding=False)
        opt = clipping(model)
        for index in range(2):
            step(model, opt, index)
        fsdp_int8.save_checkpoint(directory, model, opt, step=1)
        resumed = _build("fsdp", world, stochastic_rounding=False)
        resumed_opt = clipping(resumed)
        fsdp_int8.load_checkpoint(directory, resumed, resumed_opt)
        squares = [float(opt.state[p]["previous_grad_norm_sq"]) for p in model.parameters()]
        loaded = [float(resumed_opt.state[p]["previous_grad_norm_sq"]) for p in resumed.parameters()]
        assert squares == loaded, (squares, loaded)
        assert opt.grad_norm == resumed_opt.grad_norm and opt.grad_norm > 0.05  # clipped
        step(model, opt, 2)
        step(resumed, resumed_opt, 2)
        assert_identical(snapshot(model, opt), snapshot(resumed, resumed_opt), "resumed")
    # rows 0-3 of each weight are rank 0's shard, rows 4-7 rank 1's
    for target, column in (("norm", 1), ("norm", 6), ("lin", 1), ("lin", 6)):
        for max_grad_norm in (None, 1.0):
            with case(f"a NaN in rank 1's gradient of {target}, rows {column}, max_grad_norm={max_grad_norm}: "
                      "every rank skips the parameter"):
                _nan_on_one_rank_skips_everywhere(rank, world, target, column, max_grad_norm)
    with case("step_in_backward: clip_grad_norm_ of the FSDP2 model raises instead of clipping nothing"):
        model = _build("fsdp", world)
        opt = Int8AdamW(model.parameters(), lr=1e-2, step_in_backward=True)
        x = torch.randn(4, 3, 32, generator=torch.Generator().manual_seed(rank))
        F.mse_loss(model(x), torch.tanh(x[..., :4])).backward()
        with pytest.raises(RuntimeError, match="applied the gradient of .*clip_grad_norm_.*step_in_backward=False"):
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)
        opt.step()
        assert all(p.grad is None for p in model.parameters())
    with case("a plain parameter in a 2-process run (DDP's case) is refused"):
        torch.manual_seed(0)
        model = fsdp_int8.quantize_(MLPNet(dim=32, hidden=64), Int8TrainingConfig(min_features=1))
        opt = Int8AdamW(model.parameters(), lr=1e-2, step_in_backward=True)
        with pytest.raises(RuntimeError, match="plain \\(non-DTensor\\).*DDP"):
            model(torch.randn(2, 3, 32)).square().mean().backward()
        del opt
        model = fsdp_int8.quantize_(MLPNet(dim=32, hidden=64), Int8TrainingConfig(min_features=1))
        opt = Int8AdamW(model.parameters(), lr=1e-2, grad_dtype=torch.bfloat16)
        with pytest.raises(RuntimeError, match="grad_dtype=torch.bfloat16.*plain \\(non-DTensor\\).*DDP"):
            model(torch.randn(2, 3, 32)).square().mean().backward()
        del opt


def test_step_in_backward_equals_step_after_backward_under_fsdp2(tmp_path):
    run_distributed(_in_backward_equals_after, 2, str(tmp_path / "checkpoints"), timeout=600)
