"""The ``checks`` part of ``python -m benchmarks.gpu``: what only a GPU can show, each case
pass / fail (int8 GEMMs at cuBLASLt's shape rules, compiled kernels against eager, the
deferred finiteness check, a checkpoint round trip, the experts' grouped int8 GEMMs, the
lean call's value-neutral cuts, FSDP2 on one rank), then the test
suite's distributed tests on the GPUs there are."""

from __future__ import annotations

import subprocess
import sys
import traceback
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

import fsdp_int8
from benchmarks.timing import train_step
from fsdp_int8 import Int8MatmulConfig, Int8Weight
from fsdp_int8.hardware import device_type_for
from fsdp_int8.testing import run_distributed
from launch.build import build_model
from launch.model import PRESETS
from launch.precisions import Recipe

__all__ = ["run_checks"]

ROOT = Path(__file__).resolve().parent.parent


def _check_linear_shapes(device: str) -> None:
    config = fsdp_int8.Int8TrainingConfig(int8_matmul=Int8MatmulConfig(), min_features=1)
    for tokens in (1, 16, 17, 64):  # <= 16 rows are padded to 17 for cuBLASLt
        layer = fsdp_int8.quantize_(torch.nn.Sequential(torch.nn.Linear(64, 32)), config).to(device)
        x = torch.randn(tokens, 64, device=device, requires_grad=True)
        reference = F.linear(x, layer[0].weight.dequantize(), layer[0].bias)
        out = layer(x)
        out.sum().backward()
        # int8 activations: one rounding of x per row (<= 1/254 of its absmax), so the
        # output moves by well under 5% of its scale; exactness is tested on the CPU
        error = (out - reference).abs().max() / reference.abs().max()
        assert error < 0.05 and x.grad is not None and torch.isfinite(x.grad).all(), (tokens, float(error))
    if device == "cuda":
        odd = fsdp_int8.quantize_(torch.nn.Sequential(torch.nn.Linear(60, 32)), config).to(device)
        try:
            odd(torch.randn(4, 60, device=device))
        except ValueError as error:
            assert "divisible by 8" in str(error)
        else:
            raise AssertionError("in_features=60 ran an int8 GEMM on CUDA")


def _compiled_or_eager_step(device: str, compile: str) -> tuple[torch.Tensor, ...]:
    """Forward, backward and an SGD step of a bf16 int8-matmul layer; what each wrote."""
    torch.manual_seed(0)
    config = fsdp_int8.Int8TrainingConfig(int8_matmul=Int8MatmulConfig(), compile=compile)
    layer = fsdp_int8.quantize_(torch.nn.Sequential(torch.nn.Linear(512, 256)).to(torch.bfloat16), config).to(device)
    x = torch.randn(64, 512, device=device).bfloat16().requires_grad_()
    out = layer(x)
    out.float().square().sum().backward()
    torch.optim.SGD(layer.parameters(), lr=1e-2).step()
    weight = layer[0].weight
    return out.detach(), x.grad, weight.int_data.clone(), weight.scale.clone()


def _check_compiled_matches_eager(device: str) -> None:
    # compile="on" runs activation quantization, dequantization and the weight update as
    # compiled passes with the eager passes' fp32 operations: the same bits. A compile that
    # fails falls back to eager (with a warning, once per process), which would compare
    # eager with eager: the profiler must see the compiled regions run.
    from torch.profiler import ProfilerActivity, profile

    eager = _compiled_or_eager_step(device, compile="off")
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        compiled = _compiled_or_eager_step(device, compile="on")
    regions = sum(e.count for e in prof.key_averages() if e.key.startswith("Torch-Compiled Region"))
    assert regions >= 3, f"{regions} compiled regions ran (forward, backward, update): torch.compile fell back to eager"
    for name, e, c in zip(("output", "grad_input", "int8 weight", "scales"), eager, compiled):
        assert torch.equal(e, c), f"{name}: compiled != eager"


def _check_deferred_finiteness(device: str) -> None:
    weight = torch.nn.Parameter(Int8Weight.from_float(torch.randn(32, 32, device=device)))
    # an infinite learning rate on finite gradients: the update alone is non-finite (a
    # non-finite gradient is refused before the step by the default guard)
    optimizer = torch.optim.SGD([weight], lr=float("inf"))
    fsdp_int8.optim.batch_int8_updates(optimizer)  # on a GPU: the flag is read once, when step() ends
    weight.grad = torch.ones((32, 32), device=device)
    try:
        optimizer.step()
    except ValueError as error:
        assert "non-finite" in str(error), error
    else:
        raise AssertionError("a step writing Inf into an int8 weight did not raise")


def _check_lean_cuts_keep_the_bits(device: str) -> None:
    """The lean call's value-neutral cuts on this device's kernels: the chunked loss (its
    log-softmax backward written in place) against transformers' loss, and grad_input's
    weight dequantized in slices against the whole weight's."""
    from transformers.loss.loss_utils import ForCausalLMLoss

    from fsdp_int8.integrations.hf_loss import chunked_causal_lm_loss

    logits = (torch.randn(2, 129, 4000, device=device) * 3).bfloat16()
    labels = torch.randint(0, 4000, (2, 129), device=device)
    grads = []
    for loss_fn in (ForCausalLMLoss, lambda *a: chunked_causal_lm_loss(*a, chunk_tokens=64)):
        leaf = logits.clone().requires_grad_()
        loss_fn(leaf, labels, 4000).backward()
        grads.append(leaf.grad)
    assert torch.equal(*grads), f"chunked loss gradient differs by up to {(grads[0] - grads[1]).abs().max()}"
    # an output head's shape: its 6 M elements are over the bound, grad_input takes two
    # slices; eager kernels (a slice's dequantization always is); 16 tokens on a CPU, whose
    # bf16 matmuls may be reference loops
    tokens = 256 if device == "cuda" else 16
    head = fsdp_int8.quantize_(torch.nn.Linear(512, 12000, bias=False, device=device),
                               fsdp_int8.Int8TrainingConfig(skip_names=(), compile="off")).to(torch.bfloat16)
    x = torch.randn(tokens, 512, device=device, dtype=torch.bfloat16, requires_grad=True)
    grad_y = torch.randn(tokens, 12000, device=device).bfloat16()
    head(x).backward(grad_y)
    whole = torch.matmul(grad_y, head.weight.dequantize(torch.bfloat16))
    assert torch.equal(whole, x.grad), f"sliced grad_input differs by up to {(whole - x.grad).abs().max()}"


def _check_grouped_int8_gemms(device: str) -> str:
    """The experts' grouped int8 GEMMs (Triton kernels on CUDA; on the CPU, Triton's
    interpreter) against each expert's rows through F.linear's int8 GEMMs: the same values
    within bf16 rounding (bit for bit on the CPU's tests), and no host read."""
    from benchmarks.experts_gemm import triton_interpreted
    from fsdp_int8.testing import count_host_syncs
    from fsdp_int8.weight import int8_grouped_mm

    experts, out_features, in_features = 8, 64, 96
    generator = torch.Generator().manual_seed(0)
    values = torch.randn(experts, out_features, in_features, generator=generator).to(device)
    weight = Int8Weight.from_float(values, int8_matmul=Int8MatmulConfig(), dtype=torch.bfloat16)
    counts = torch.tensor([40, 0, 17, 3, 64, 1, 30, 5])
    offs = counts.cumsum(0).to(device=device, dtype=torch.int32)
    x = torch.randn(int(counts.sum()), in_features, generator=generator).bfloat16().to(device)
    with triton_interpreted(device == "cpu"), count_host_syncs() as reads:
        got = int8_grouped_mm(x, weight, offs)
    want = torch.cat([F.linear(x[a:b], weight[e]) for e, (a, b) in
                      enumerate(zip([0, *offs.tolist()[:-1]], offs.tolist())) if b > a])
    error = float((got.float() - want.float()).abs().max() / want.float().abs().max())
    assert reads.count == 0, reads.summary()
    assert error <= 2 ** -7, error  # one bf16 rounding of the output at most
    return "bit-exact" if error == 0 else f"max difference {error:.1e} of the largest value"


def _check_checkpoint_round_trip(device: str, folder: Path) -> None:
    model = fsdp_int8.quantize_(torch.nn.Sequential(torch.nn.Linear(64, 64)),
                                fsdp_int8.Int8TrainingConfig(min_features=1)).to(device)
    optimizer = fsdp_int8.Int8AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(8, 64, device=device)).sum().backward()
    optimizer.step()
    fsdp_int8.save_checkpoint(folder, model, optimizer, step=1)
    saved = model[0].weight.int_data.clone(), model[0].weight.scale.clone()
    with torch.no_grad():
        model[0].weight.zero_()
    fsdp_int8.load_checkpoint(folder, model, optimizer)
    assert torch.equal(model[0].weight.int_data, saved[0]) and torch.equal(model[0].weight.scale, saved[1])


def _fsdp_one_rank(rank: int, world: int) -> str:
    device = torch.device(device_type_for(world))
    model = build_model(Recipe.of("int8-mm"), PRESETS["tiny"], device)  # on meta, sharded, then initialised
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    tokens = torch.randint(0, 256, (4, 33), device=device)
    losses = [train_step(model, optimizer, tokens[:, :-1], tokens[:, 1:], clip=False) for _ in range(3)]
    assert losses[-1] < losses[0], losses
    return f"{device.type}: losses {losses[0]:.3f} -> {losses[-1]:.3f}"


def run_checks(device: str, dry_run: bool, folder: Path) -> dict:
    """Each check's ``"pass"`` or its error, then the distributed tests' summary line."""
    cases: dict[str, Callable[[], object]] = {
        "F.linear int8 GEMMs at cuBLASLt's shape rules": lambda: _check_linear_shapes(device),
        "compiled kernels equal eager, bit for bit": lambda: _check_compiled_matches_eager(device),
        "deferred finiteness check raises at step()": lambda: _check_deferred_finiteness(device),
        "checkpoint round trip, bit-exact": lambda: _check_checkpoint_round_trip(device, folder / "checkpoint"),
        "experts' grouped int8 GEMMs: Triton kernels, no host read": lambda: _check_grouped_int8_gemms(device),
        "the lean call's loss and sliced grad_input keep the bits": lambda: _check_lean_cuts_keep_the_bits(device),
        "FSDP2 world size 1 trains (int8 matmuls)": lambda: run_distributed(_fsdp_one_rank, 1)[0],
    }
    results = {}
    for name, case in cases.items():
        try:
            outcome = case()
            results[name] = "pass" + (f" ({outcome})" if isinstance(outcome, str) else "")
        except Exception as error:  # noqa: BLE001 -- every failure is reported, none stops the run
            results[name] = f"FAIL: {type(error).__name__}: {str(error)[:300]}"
            traceback.print_exc()
    if not dry_run:  # the suite's multi-process tests run on GPUs wherever there is one per rank
        if torch.cuda.device_count() >= 2:
            name, selection = "tests/distributed (ranks on GPUs where there are enough)", ["tests/distributed"]
        else:
            name = "tests/distributed at world size 1"
            selection = ["-k", "world_size_one", "tests/distributed/test_fsdp.py"]
        suite = subprocess.run([sys.executable, "-m", "pytest", "-q", *selection], cwd=ROOT,
                               capture_output=True, text=True)
        results[name] = (suite.stdout.strip().splitlines() or ["no output"])[-1]
    return results
