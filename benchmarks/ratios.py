"""Step-time ratios against bf16 FSDP2, every row in ONE launch, steps interleaved.

    python -m benchmarks.ratios                         # dim 1024, 2 blocks, 4 x 256, 2 ranks
    python -m benchmarks.ratios --dim 512               # the issue's second width
    python -m benchmarks.ratios --quick                 # 4 timed steps: a smoke run
    python -m benchmarks.ratios --profile 5             # + where the time goes, per op and step
    python -m benchmarks.ratios --experts 8             # mixture-of-experts blocks, 8 experts, top 2

Each rank builds every row's model (same initial weights, same data), then runs step 1
of every row, step 2 of every row, ...: a machine shared with other jobs slows all rows
alike, so the ratios hold even when the absolute times do not. A step is what the
launcher runs: forward, cross-entropy, backward, gradient clipping, torch AdamW (weight
decay 0.1), zero_grad, then a barrier; the order of the rows rotates from one round to the
next. Reported, from rank 0: each row's median step time and its ratio to the bf16 FSDP2
row's, and the median over the rounds of the two rows' step-time ratio within a round
(lower is faster; the paired median cancels load that drifts between rounds).

Rows are recipes of ``launch.precisions`` (``NAME[:OPTION...]``); fsdp_int8 rows compute in
bf16 with the compiled kernels, as the launcher runs them, unless their options say otherwise:

* ``bf16``: bf16 FSDP2 (bf16 parameters, fp32 gradient reduction: torchtitan's policy),
  the baseline;
* ``int8-mm``: int8 weights, all three matmuls (output, grad_input, grad_weight) as int8
  GEMMs: what the launcher runs by default;
* ``int8``: weight-only int8 (bf16 matmuls);
* ``int8-mm:eager``: ``int8-mm`` without torch.compile anywhere (any fsdp_int8 row takes
  ``:eager``, and ``:fp32`` for fp32 compute: ``int8:fp32``, ``int8:fp32:eager``);
* ``int8-mm-wgrad-bf16``: output and grad_input in int8, the weight gradient in bf16;
* ``int8-grads``: weight-only int8 plus the int8 gradient reduce-scatter;
* ``fp32``: fp32 FSDP2, for context; ``all-bf16``: bf16 FSDP2 with a bf16 reduction;
  ``torchao``: torchao's int8 weight-only training.

``--profile N`` records N more steps of every row with torch.profiler (interleaved too)
and prints, per row, the self CPU time per step of each category of ops and the ops that
take the most (medians over the profiled steps), then the ops that differ most from bf16.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist

from fsdp_int8 import hardware
from fsdp_int8.hardware import device_type_for
from fsdp_int8.testing import run_distributed
from launch.model import ModelArgs, Transformer, model_args, next_token_loss
from launch.precisions import build_model, parse_row, row_argument

DEFAULT_ROWS = ("bf16", "int8-mm", "int8")


def shape(settings: dict) -> ModelArgs:
    """The model of a benchmark's ``settings`` (preset, seq_len, optional dim, n_layers,
    n_heads, n_experts)."""
    return model_args(settings["preset"], seq_len=settings["seq_len"], dim=settings.get("dim"),
                      n_layers=settings.get("n_layers"), n_heads=settings.get("n_heads"),
                      n_experts=settings.get("n_experts"))


def build(row: str, args: ModelArgs, *, compile: bool = True) -> torch.nn.Module:
    """The launcher's Transformer, initialised whole from seed 0 (the same weights in every
    row) and sharded as ``row`` (fsdp_int8 rows: compiled kernels unless ``:eager``, or
    ``compile=False``)."""
    return build_model(parse_row(row, compile=compile), args, device_type_for(dist.get_world_size()), full_init=True)


def train_step(model, optimizer, inputs: torch.Tensor, targets: torch.Tensor, clip: bool = True) -> float:
    """One training step, ended by a barrier; returns the loss."""
    loss = next_token_loss(model, inputs, targets)
    loss.backward()
    if clip:
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    optimizer.zero_grad()
    dist.barrier()
    return loss.item()


def time_interleaved(rows: dict, batch: Callable[[int], tuple], steps: int, warmup: int, clip: bool = True,
                     on_step: Callable | None = None) -> dict:
    """``{name: [seconds of each timed step]}`` of ``rows`` (``{name: (model, optimizer)}``),
    step ``i`` of every row before step ``i + 1`` of any."""
    times = {name: [] for name in rows}
    names = list(rows)
    for step in range(warmup + steps):
        inputs, targets = batch(step)
        turn = step % len(names)  # rotate the order: no row always runs first (or last)
        for name in names[turn:] + names[:turn]:
            model, optimizer = rows[name]
            began = time.perf_counter()
            train_step(model, optimizer, inputs, targets, clip)
            if step >= warmup:
                times[name].append(time.perf_counter() - began)
            if on_step is not None:
                on_step(name, step)
    return times


# Categories of the profile table: the first pattern found in an op's name decides.
CATEGORIES = (
    ("int8 GEMM", ("aten::_int_mm",)),
    ("float GEMM", ("aten::mm", "aten::addmm", "aten::bmm", "aten::matmul")),
    ("attention", ("scaled_dot_product", "flash_attention", "_efficient_attention")),
    ("FSDP + collectives", ("FSDP::", "gloo:", "c10d::", "all_gather", "reduce_scatter", "all_reduce",
                            "barrier")),
    ("random numbers", ("aten::rand", "aten::uniform_", "aten::random_", "aten::randint")),
    ("compiled kernels", ("CompiledFxGraph", "CompiledFunction", "Torch-Compiled", "cpp_fused")),
    ("casts and copies", ("aten::copy_", "aten::to", "aten::_to_copy", "aten::contiguous", "aten::clone")),
    ("reductions", ("aten::amax", "aten::aminmax", "aten::max", "aten::sum", "aten::linalg_vector_norm",
                    "aten::norm", "aten::mean")),
)


def _category(name: str) -> str:
    for category, patterns in CATEGORIES:
        if any(p in name for p in patterns):
            return category
    return "other ops"


def _short(op: str) -> str:
    # compiled graphs are named by hash: one name for all of them
    return "## Call CompiledFxGraph ##" if "CompiledFxGraph" in op else op


def profile_interleaved(rows: dict, batch: Callable[[int], tuple], steps: int) -> dict:
    """Self CPU ms of every op in each profiled step (median over the steps), each row's
    steps interleaved with the others' like the timed ones."""
    from torch.profiler import ProfilerActivity, profile

    per_step = {name: [] for name in rows}
    walls = {name: [] for name in rows}
    for step in range(steps):
        inputs, targets = batch(10_000 + step)
        for name, (model, optimizer) in rows.items():
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                began = time.perf_counter()
                train_step(model, optimizer, inputs, targets)
                walls[name].append(time.perf_counter() - began)
            ops = defaultdict(float)
            for event in prof.key_averages():
                ops[_short(event.key)] += event.self_cpu_time_total / 1e3
            per_step[name].append(dict(ops))
    tables = {}
    for name, dicts in per_step.items():
        keys = set().union(*dicts)
        ops = {k: statistics.median(d.get(k, 0.0) for d in dicts) for k in keys}
        tables[name] = dict(wall_ms=statistics.median(walls[name]) * 1e3, ops=ops)
    return tables


def _body(rank: int, world: int, settings: dict) -> dict:
    torch.set_num_threads(settings["threads"])
    args = shape(settings)
    rows = {}
    for row in settings["rows"]:
        model = build(row, args)
        rows[row] = (model, torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1))
    device = device_type_for(world)
    data = torch.Generator().manual_seed(rank)

    def batch(step: int) -> tuple:
        tokens = torch.randint(0, args.vocab_size, (settings["batch_size"], settings["seq_len"] + 1), generator=data)
        return tokens[:, :-1].to(device), tokens[:, 1:].to(device)

    result = dict(times=time_interleaved(rows, batch, settings["steps"], settings["warmup"]))
    if settings["profile"]:
        result["profile"] = profile_interleaved(rows, batch, settings["profile"])
    return result


def measure(settings: dict, world: int = 2) -> dict:
    """Run :func:`_body` on ``world`` ranks; rank 0's ``{"times": ..., "profile": ...}``."""
    return run_distributed(_body, world, settings, timeout=3600)[0]


def settings_for(dim: int, rows, *, steps: int, warmup: int, n_layers: int = 2, batch_size: int = 4,
                 seq_len: int = 256, threads: int = 1, profile: int = 0, baseline: str = "bf16",
                 n_experts: int = 0) -> dict:
    """The issue's benchmark shape (``base`` preset at ``dim``, heads of 64; ``n_experts``:
    top-2 mixture-of-experts blocks) as settings; the ``baseline`` row runs first."""
    return dict(preset="base", dim=dim, n_layers=n_layers, n_heads=max(1, dim // 64), batch_size=batch_size,
                seq_len=seq_len, steps=steps, warmup=warmup, threads=threads,
                rows=list(dict.fromkeys([baseline, *rows])), profile=profile, n_experts=n_experts)


def default_baseline(device: str = "cpu") -> str:
    """What users compare with: bf16 FSDP2 where bf16 matmuls are fast, else fp32 FSDP2."""
    return "bf16" if hardware.capability(device).bf16_matmul_fast else "fp32"


def paired_ratio(times: dict, row: str, baseline: str = "bf16") -> float:
    """The median over steps of ``row``'s step time over the baseline's in the same round
    (run back to back): load that drifts over seconds cancels in each pair."""
    return statistics.median(t / b for t, b in zip(times[row], times[baseline]))


def ratio_lines(times: dict, baseline: str = "bf16") -> list[str]:
    base = statistics.median(times[baseline])
    width = max(15, *map(len, times))
    lines = [f"{'row':<{width}} {'median ms':>10} {'ratio of medians':>17} {'median of ratios':>17} "
             f"{'min ms':>8} {'max ms':>8} {'steps':>6}"]
    for row, values in times.items():
        median = statistics.median(values)
        lines.append(f"{row:<{width}} {median * 1e3:10.1f} {median / base:16.2f}x "
                     f"{paired_ratio(times, row, baseline):16.2f}x {min(values) * 1e3:8.1f} "
                     f"{max(values) * 1e3:8.1f} {len(values):6d}")
    return lines


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dim", type=int, default=1024)
    parser.add_argument("--n-layers", type=int, default=2)
    parser.add_argument("--experts", type=int, default=0,
                        help="mixture-of-experts blocks of this many top-2 experts (the launcher's MoE: one "
                        "torch._grouped_mm per projection; int8-mm rows: one int8 GEMM per expert)")
    parser.add_argument("--batch-size", type=int, default=4, help="sequences per rank")
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--steps", type=int, default=20, help="timed steps per row")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1, help="per rank")
    parser.add_argument("--rows", nargs="+", default=list(DEFAULT_ROWS), type=row_argument, metavar="ROW",
                        help="recipes of launch.precisions, NAME[:OPTION...] (e.g. int8-mm:eager, int8:fp32)")
    parser.add_argument("--baseline", default="auto", choices=("auto", "bf16", "fp32"),
                        help="the row ratios are taken against; auto: bf16 FSDP2 where this hardware "
                        "has fast bf16 matmuls, else fp32 FSDP2")
    parser.add_argument("--json", type=Path, help="also write the times, ratios and hardware line here")
    parser.add_argument("--profile", type=int, default=0, metavar="N", help="profile N more steps per row")
    parser.add_argument("--quick", action="store_true", help="4 timed steps after 2")
    args = parser.parse_args(argv)
    if args.quick:
        args.steps, args.warmup = 4, 2
    device = device_type_for(args.world_size)
    baseline = default_baseline(device) if args.baseline == "auto" else args.baseline
    settings = settings_for(args.dim, args.rows, steps=args.steps, warmup=args.warmup, n_layers=args.n_layers,
                            batch_size=args.batch_size, seq_len=args.seq_len, threads=args.threads,
                            profile=args.profile, baseline=baseline, n_experts=args.experts)

    model = shape(settings)
    params = sum(p.numel() for p in Transformer(model).parameters())
    experts = f", {model.n_experts} experts (top {model.top_k}) per block" if model.n_experts else ""
    print(f"model: launcher Transformer, dim {model.dim}, {model.n_layers} blocks, {model.n_heads} heads{experts} "
          f"({params / 1e6:.2f}M params); batch {args.batch_size} x {args.seq_len} per rank; "
          f"{args.world_size} ranks ({device_type_for(args.world_size)}), {args.threads} thread(s) each; "
          f"{args.steps} timed steps after {args.warmup}, rows interleaved step by step")
    machine = hardware.hardware_line(device)
    print(machine)
    result = measure(settings, args.world_size)
    print("\n".join(ratio_lines(result["times"], baseline)))
    if args.json:
        ratios = {row: paired_ratio(result["times"], row, baseline) for row in result["times"]}
        args.json.write_text(json.dumps(dict(hardware=machine, settings=settings, baseline=baseline,
                                             median_of_ratios=ratios, times=result["times"]), indent=1) + "\n")
    if args.profile:
        print_profile(result["profile"])
    return result


def print_profile(tables: dict, top: int = 25) -> None:
    print()
    print("Self CPU time per step (ms, median over the profiled steps), rank 0, by category:")
    names = list(tables)
    categories = [c for c, _ in CATEGORIES] + ["other ops"]
    print(f"{'category':<18}" + "".join(f"{n:>15}" for n in names))
    sums = {n: defaultdict(float) for n in names}
    for n in names:
        for op, ms in tables[n]["ops"].items():
            sums[n][_category(op)] += ms
    for c in categories:
        print(f"{c:<18}" + "".join(f"{sums[n][c]:15.1f}" for n in names))
    print(f"{'sum of ops':<18}" + "".join(f"{sum(sums[n].values()):15.1f}" for n in names))
    print(f"{'wall (median)':<18}" + "".join(f"{tables[n]['wall_ms']:15.1f}" for n in names))
    for n in names:
        print()
        print(f"{n}: top ops by self CPU ms per step")
        for op, ms in sorted(tables[n]["ops"].items(), key=lambda kv: -kv[1])[:top]:
            print(f"  {ms:9.2f}  {op}")
    base = tables[names[0]]["ops"]
    for n in names[1:]:
        print()
        print(f"{n} minus {names[0]}: the ops that differ most (ms per step)")
        ops = tables[n]["ops"]
        diffs = {op: ops.get(op, 0.0) - base.get(op, 0.0) for op in set(ops) | set(base)}
        for op, ms in sorted(diffs.items(), key=lambda kv: -abs(kv[1]))[:top]:
            print(f"  {ms:+9.2f}  {op}")


if __name__ == "__main__":
    main(sys.argv[1:])
