"""GPU evidence in one command: correctness on CUDA, int8 GEMMs against bf16, training steps.

    python -m benchmarks.gpu                      # everything (~25 min on an H100), into docs/gpu.md
    python -m benchmarks.gpu --part checks        # correctness on CUDA only (one part per command)
    python -m benchmarks.gpu --part gemm | experts | train
    python -m benchmarks.gpu --dry-run            # the same code on the CPU at tiny shapes (CI runs it)

Parts:

* ``checks``: what only a GPU can show, each case pass / fail: int8 GEMMs through
  ``F.linear`` against a float reference at cuBLASLt's shape rules (token counts of 16 or
  fewer, padded; features divisible by 8, and the error for others), the compiled kernels
  (Triton) against eager bit for bit, the deferred finiteness check of optimizer updates
  (one sync per step), a checkpoint round trip, the experts' grouped int8 GEMMs (Triton's
  kernels against each expert's ``F.linear``, no host read), the lean call's chunked loss
  and sliced grad_input against transformers' loss and the whole weight (bit for bit), and
  FSDP2 on one rank with NCCL; then the
  test suite's distributed tests: its world-size-1 case with one GPU, all of them with two
  or more (each test runs on GPUs when there is one per rank, else on the CPU).
* ``gemm``: ``torch._int_mm`` against a bf16 matmul at Llama shapes (8192 and 16384 tokens
  x 4096x4096, 4096x14336, 14336x4096), raw and as ``F.linear`` runs it with an
  ``Int8Weight`` (activation quantization and the scale epilogue included), forward and
  forward + backward: TFLOP/s and the ratio to bf16.
* ``experts``: one MoE block's experts at Qwen3-30B-A3B's shape (4096 tokens, top 8 of
  128), ``int8_grouped_mm``'s Triton kernels against bf16 ``torch._grouped_mm``, forward
  and backward, with kernels and host reads per call (``benchmarks.experts_gemm``).
* ``train``: bf16 FSDP2 against int8 matmuls and weight-only int8 (bf16 compute), once
  with compiled kernels (the rows ``bf16``, ``int8-mm``, ``int8`` of ``launch.precisions``)
  and once with every transformer block compiled whole (``bf16:blocks``,
  ``int8-mm:blocks``, ``int8:blocks``: what FSDP2 users run on GPUs, each compared with
  ``bf16:blocks``), FSDP2 world size 1, the launcher's ``1b`` preset, rows interleaved step
  by step: tokens/s, peak memory, loss after the same steps. Then bf16 FSDP2, int8 with
  ``Int8AdamW(state_bits=8, grad_dtype=torch.bfloat16)`` and the lean recipe
  (``--lean``: int8 embeddings, int8 gathered weights, ``Int8AdamW(state_bits=8,
  step_in_backward=True)``), each built alone with activation checkpointing:
  ``torch.cuda.max_memory_allocated`` per parameter of the second step, and the ratio.

Writes a dated section into docs/gpu.md (``--out``) and its JSON next to it (with the
hardware line); ``--dry-run`` writes nothing unless ``--out`` is given.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F

import fsdp_int8
from benchmarks import experts_gemm, ratios
from benchmarks._gpu_checks import run_checks
from benchmarks import rows as registry
from benchmarks.timing import interleave, paired_ratio, train_step
from fsdp_int8 import Int8MatmulConfig, Int8Weight, hardware
from fsdp_int8.hardware import device_type_for
from fsdp_int8.testing import run_distributed
from launch.model import next_token_loss
from launch.build import build_model
from launch.precisions import Recipe

ROOT = Path(__file__).resolve().parent.parent
PARTS = ("checks", "gemm", "experts", "train")
GEMM_SHAPES = [(tokens, k, n) for tokens in (8192, 16384) for k, n in ((4096, 4096), (4096, 14336), (14336, 4096))]
DRY_GEMM_SHAPES = [(64, 64, 64), (64, 64, 128)]
GOALS = {
    "int8 GEMM >= 1.6x bf16 TFLOP/s (H100/H200)": ("gemm", "raw", 1.6),
    "int8 F.linear forward >= 1.4x bf16 (epilogue included)": ("gemm", "linear forward", 1.4),
    "int8 matmul training >= 1.3x bf16 FSDP2 tokens/s (1b)": ("train", "int8-mm", 1.3),
    "compiled int8 matmul training >= 1.3x compiled bf16 FSDP2 tokens/s (1b)": ("train", "int8-mm:blocks", 1.3),
}


# ---------------------------------------------------------------- gemm
def _tflops(flops: float, seconds: float) -> float:
    return flops / seconds / 1e12


def run_gemm(device: str, shapes: list[tuple[int, int, int]]) -> list[dict]:
    """Per shape: TFLOP/s of bf16 and int8, raw and through ``F.linear``, and the ratios."""
    dev = torch.device(device)
    rows = []
    for tokens, k, n in shapes:
        x = torch.randn(tokens, k, device=dev, dtype=torch.bfloat16)
        w = torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02
        x8 = torch.randint(-127, 128, (tokens, k), device=dev, dtype=torch.int8)
        w8 = torch.randint(-127, 128, (n, k), device=dev, dtype=torch.int8)
        weight = torch.nn.Parameter(Int8Weight.from_float(w.float(), int8_matmul=Int8MatmulConfig(),
                                                          dtype=torch.bfloat16))
        plain = torch.nn.Parameter(w.clone())
        xg = x.clone().requires_grad_()
        grad = torch.randn(tokens, n, device=dev, dtype=torch.bfloat16)
        flops = 2.0 * tokens * k * n
        times = {
            "bf16 raw": hardware.best_seconds(lambda: x @ w.t(), dev, 5),
            "int8 raw": hardware.best_seconds(lambda: torch._int_mm(x8, w8.t()), dev, 5),
            "bf16 linear forward": hardware.best_seconds(lambda: F.linear(x, plain), dev, 5),
            "int8 linear forward": hardware.best_seconds(lambda: F.linear(x, weight), dev, 5),
            "bf16 linear fwd+bwd": hardware.best_seconds(lambda: F.linear(xg, plain).backward(grad), dev, 3),
            "int8 linear fwd+bwd": hardware.best_seconds(lambda: F.linear(xg, weight).backward(grad), dev, 3),
        }
        row = dict(tokens=tokens, k=k, n=n)
        for name, seconds in times.items():
            row[f"{name} TFLOP/s"] = _tflops(flops * (3 if "bwd" in name else 1), seconds)
        for what in ("raw", "linear forward", "linear fwd+bwd"):
            row[f"{what} ratio"] = row[f"int8 {what} TFLOP/s"] / row[f"bf16 {what} TFLOP/s"]
        rows.append(row)
    return rows


# ---------------------------------------------------------------- train
# rows of benchmarks.ratios: compiled kernels, and every block compiled whole (what GPU
# users of FSDP2 run; each compared with bf16 FSDP2 compiled the same way)
TRAIN_ROWS = ("bf16", "int8-mm", "int8", "bf16:blocks", "int8-mm:blocks", "int8:blocks")


def _baseline_of(row: str) -> str:
    """The bf16 FSDP2 row ``row`` is compared with: compiled alike."""
    return "bf16:blocks" if row.endswith(":blocks") else "bf16"


def _train_body(rank: int, world: int, settings: dict) -> dict:
    args = ratios.shape(settings)
    device = torch.device(device_type_for(world))
    cuda = device.type == "cuda"
    models, memory = {}, {}

    def batch(step: int) -> tuple:
        return ratios.token_batch(step, rank, args.vocab_size, settings, device)

    steps_of = {}
    for name in settings["rows"]:
        row = registry.row(name, compile=settings["compile_kernels"], optimizer="torch AdamW")
        model, optimizer = registry.build(row, args, lr=3e-4)
        models[name] = model

        def step(i: int, model=model, optimizer=optimizer, clip=row.clip) -> float:
            return train_step(model, optimizer, *batch(i), clip=clip)

        steps_of[name] = step

    def record_peak(name: str, step: int) -> None:  # called after each row's step
        if cuda:
            memory[name] = max(memory.get(name, 0), torch.cuda.max_memory_allocated())
            torch.cuda.reset_peak_memory_stats()

    if cuda:
        torch.cuda.reset_peak_memory_stats()
    times = interleave(steps_of, steps=settings["steps"], warmup=settings["warmup"], on_step=record_peak)
    inputs, targets = batch(10_000)
    with torch.no_grad():
        losses = {name: float(next_token_loss(model, inputs, targets)) for name, model in models.items()}
    tokens = settings["batch_size"] * settings["seq_len"] * world
    result = {}
    for name, values in times.items():
        seconds = sorted(values)[len(values) // 2]
        result[name] = dict(step_s=seconds, tokens_per_s=tokens / seconds, loss=losses[name],
                            peak_bytes=memory.get(name), ratio=paired_ratio(times, name, _baseline_of(name)))
    return result


# the peak-memory comparison (docs/memory.md): each row built alone, activation
# checkpointing on, torch.cuda.max_memory_allocated of its second step
MEMORY_ROWS = ("bf16", "int8-8bit-bf16-grads", "lean", "lean-4bit")


def _build_for_memory(row: str, args, device: torch.device):
    """bf16 FSDP2 + torch AdamW; int8 + 8-bit AdamW keeping bf16 gradients until the step;
    or the library's lean call (``Int8TrainingConfig.lean()`` + ``Int8AdamW.lean``), with
    8-bit or 4-bit states."""
    if row == "bf16":
        model = build_model(Recipe.of("bf16"), args, device, full_init=True, activation_checkpointing=True)
        return model, torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1)
    if row in ("lean", "lean-4bit"):
        model = build_model(Recipe.of("int8"), args, device, full_init=True, lean=True, activation_checkpointing=True)
        bits = 4 if row == "lean-4bit" else 8
        return model, fsdp_int8.Int8AdamW.lean(model.parameters(), lr=3e-4, weight_decay=0.1, state_bits=bits)
    model = build_model(Recipe.of("int8"), args, device, full_init=True, activation_checkpointing=True)
    return model, fsdp_int8.Int8AdamW(model.parameters(), lr=3e-4, weight_decay=0.1, state_bits=8,
                                      grad_dtype=torch.bfloat16)


def _memory_body(rank: int, world: int, settings: dict) -> dict:
    """Bytes per parameter at each row's peak (``None`` off CUDA), one row at a time."""
    import gc

    args = ratios.shape(settings)
    device = torch.device(device_type_for(world))
    cuda = device.type == "cuda"
    data = torch.Generator().manual_seed(rank)
    peaks = {}
    for row in MEMORY_ROWS:
        model, optimizer = _build_for_memory(row, args, device)
        parameters = sum(p.numel() for p in model.parameters())
        for _ in range(2):  # the second step is the steady state (optimizer states exist)
            if cuda:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
            tokens = torch.randint(0, args.vocab_size, (settings["batch_size"], settings["seq_len"] + 1),
                                   generator=data).to(device)
            next_token_loss(model, tokens[:, :-1], tokens[:, 1:]).backward()
            optimizer.step()
            optimizer.zero_grad()
        peaks[row] = torch.cuda.max_memory_allocated() / parameters if cuda else None
        del model, optimizer
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
    return peaks


def run_train(dry_run: bool) -> dict:
    settings = (dict(preset="tiny", batch_size=2, seq_len=32, steps=2, warmup=1) if dry_run
                else dict(preset="1b", batch_size=4, seq_len=2048, steps=10, warmup=3))
    # A dry run's tiny widths leave the kernels eager, as the launcher's --compile auto does
    # there (compiling them costs more than it saves); its :blocks rows still compile.
    settings.update(threads=1, rows=list(TRAIN_ROWS), compile_kernels="off" if dry_run else "on")
    return dict(settings=settings, rows=run_distributed(_train_body, 1, settings, timeout=3600)[0],
                memory=run_distributed(_memory_body, 1, settings, timeout=3600)[0])


# ---------------------------------------------------------------- report
def _lines(machine: str, results: dict) -> list[str]:
    lines = [machine, ""]
    if "checks" in results:
        checks = results["checks"]
        passed = sum(v.startswith("pass") for v in checks.values())
        lines += [f"Checks: {passed} passed, {len(checks) - passed} other", "", "| check | result |", "|---|---|"]
        lines += [f"| {name} | {outcome} |" for name, outcome in checks.items()] + [""]
    if "gemm" in results:
        lines += ["| tokens x K x N | bf16 TFLOP/s | int8 TFLOP/s | int8/bf16 raw | F.linear fwd | F.linear fwd+bwd |",
                  "|---|---:|---:|---:|---:|---:|"]
        for r in results["gemm"]:
            lines.append(f"| {r['tokens']} x {r['k']} x {r['n']} | {r['bf16 raw TFLOP/s']:.1f} | "
                         f"{r['int8 raw TFLOP/s']:.1f} | {r['raw ratio']:.2f}x | {r['linear forward ratio']:.2f}x | "
                         f"{r['linear fwd+bwd ratio']:.2f}x |")
        lines.append("")
    if "experts" in results:
        lines += ["Experts (`benchmarks.experts_gemm`):", "", "```", *results["experts"], "```", ""]
    if "train" in results:
        s = results["train"]["settings"]
        lines += [f"Training, preset {s['preset']}, batch {s['batch_size']} x {s['seq_len']}, FSDP2 world size 1, "
                  f"{s['steps']} timed steps after {s['warmup']}, rows interleaved:", "",
                  "| row | tokens/s | step time vs bf16 compiled alike (median of ratios) | peak memory | "
                  "loss after the steps |",
                  "|---|---:|---:|---:|---:|"]
        for name, r in results["train"]["rows"].items():
            peak = "n/a (CPU)" if r["peak_bytes"] is None else f"{r['peak_bytes'] / 2**30:.2f} GiB"
            lines.append(f"| {name} | {r['tokens_per_s']:,.0f} | {r['ratio']:.2f}x | {peak} | {r['loss']:.4f} |")
        lines.append("")
        memory = results["train"].get("memory", {})
        if memory:
            lines += ["Peak memory, each row alone, activation checkpointing on, second step "
                      "(torch.cuda.max_memory_allocated per parameter; docs/memory.md):", "",
                      "| row | bytes/param | vs bf16 |", "|---|---:|---:|"]
            for name, per_param in memory.items():
                if per_param is None:
                    lines.append(f"| {name} | n/a (CPU) | - |")
                else:
                    lines.append(f"| {name} | {per_param:.2f} | {per_param / memory['bf16']:.2f}x |")
            lines.append("")
    return lines


def _goal_lines(results: dict) -> list[str]:
    lines = ["Goals (docs/gpu.md states them met or not):"]
    for goal, (part, key, target) in GOALS.items():
        if part == "gemm" and "gemm" in results:
            worst = min(r[f"{key} ratio"] for r in results["gemm"])
            lines.append(f"- {goal}: worst shape {worst:.2f}x: {'met' if worst >= target else 'NOT met'}")
        elif part == "train" and "train" in results:
            speedup = 1 / results["train"]["rows"][key]["ratio"]
            lines.append(f"- {goal}: {speedup:.2f}x: {'met' if speedup >= target else 'NOT met'}")
    return lines


def write_docs(out: Path, machine: str, results: dict, argv: list[str]) -> Path:
    """Append a dated section to ``out`` (docs/gpu.md) and write its JSON beside it."""
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    section = [f"## {stamp}: `python -m benchmarks.gpu {' '.join(argv)}`", "", *_lines(machine, results),
               *_goal_lines(results), ""]
    if not out.exists():
        out.write_text("# fsdp_int8 on GPUs\n\nEach section below is one run of `python -m benchmarks.gpu`, "
                       "written by it (never by hand).\n\n")
    with out.open("a") as file:
        file.write("\n".join(section) + "\n")
    json_path = out.with_suffix(".json")
    runs = json.loads(json_path.read_text()) if json_path.exists() else []
    runs.append(dict(date=stamp, argv=argv, hardware=machine, results=results))
    json_path.write_text(json.dumps(runs, indent=1) + "\n")
    return out


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--part", default="all", choices=(*PARTS, "all"))
    parser.add_argument("--dry-run", action="store_true", help="the CPU at tiny shapes: the code path, no evidence")
    parser.add_argument("--out", type=Path, help="markdown file to append to (default: docs/gpu.md; none for --dry-run)")
    argv = sys.argv[1:] if argv is None else argv
    args = parser.parse_args(argv)
    if not args.dry_run and not torch.cuda.is_available():
        parser.error("no CUDA GPU here: run with --dry-run to check the code path on the CPU")
    device = "cpu" if args.dry_run else "cuda"
    machine = hardware.hardware_line(device)
    print(machine, flush=True)
    parts = PARTS if args.part == "all" else (args.part,)
    results: dict = {}
    if "checks" in parts:
        with tempfile.TemporaryDirectory() as scratch:
            results["checks"] = run_checks(device, args.dry_run, Path(scratch))
    if "gemm" in parts:
        results["gemm"] = run_gemm(device, DRY_GEMM_SHAPES if args.dry_run else GEMM_SHAPES)
    if "experts" in parts:  # one MoE block's experts, int8 against bf16 torch._grouped_mm
        shape, tokens, steps = ("tiny", 16, 1) if args.dry_run else ("qwen3-30b-a3b", 4096, 10)
        results["experts"] = experts_gemm.run(shape, tokens=tokens, steps=steps, warmup=1, threads=1, device=device)
    if "train" in parts:
        results["train"] = run_train(args.dry_run)
    print("\n".join(_lines(machine, results)[2:] + _goal_lines(results)), flush=True)
    out = args.out or (None if args.dry_run else ROOT / "docs" / "gpu.md")
    if out is not None:
        print(f"written: {write_docs(out, machine, results, argv)}")
    return results


if __name__ == "__main__":
    main()
