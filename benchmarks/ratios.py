"""Step-time ratios against bf16 FSDP2, every row in ONE launch, steps interleaved.

    python -m benchmarks.ratios                         # dim 1024, 2 blocks, 4 x 256, 2 ranks
    python -m benchmarks.ratios --dim 512               # the issue's second width
    python -m benchmarks.ratios --quick                 # 4 timed steps: a smoke run
    python -m benchmarks.ratios --profile 3             # + where the time goes, per op and step

Each rank builds every row's model (same initial weights, same data), then runs step 1
of every row, step 2 of every row, ...: a machine shared with other jobs slows all rows
alike, so the ratios hold even when the absolute times do not. A step is what the
launcher runs: forward, cross-entropy, backward, gradient clipping, torch AdamW (weight
decay 0.1), zero_grad, then a barrier. Reported: the median step time of rank 0 per row
and its ratio to the bf16 FSDP2 row (lower is faster).

Rows (all with FSDP2's bf16 parameters / fp32 gradient reduction, torchtitan's policy):

* ``bf16``: bf16 FSDP2, the baseline;
* ``int8-mm``: fsdp_int8, int8 weights, the output and grad_input matmuls as int8 GEMMs
  (``Int8MatmulConfig()``), compiled kernels on: what the launcher runs by default;
* ``int8``: fsdp_int8 weight-only (int8 weights, bf16 matmuls), compiled kernels on;
* ``int8-mm-eager``: ``int8-mm`` without torch.compile anywhere;
* ``int8-mm-all``: the weight gradient's matmul in int8 too;
* ``fp32``: fp32 FSDP2, for context.

``--profile N`` records N steps of every row with torch.profiler (after the timed steps)
and prints, per row, the self CPU time per step of the ops that take the most, grouped
into the categories of docs/performance.md.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections import defaultdict

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.fsdp import MixedPrecisionPolicy

import fsdp_int8
from benchmarks.speed_memory import bench_model_args, cpu_description
from fsdp_int8.quant import use_compiled_kernels
from fsdp_int8.testing import run_distributed
from launch.model import Transformer

BF16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
ROWS = ("bf16", "int8-mm", "int8", "int8-mm-eager", "int8-mm-all", "fp32")
DEFAULT_ROWS = ("bf16", "int8-mm", "int8")


# rows that run fsdp_int8's compiled kernels (fsdp_int8.quant.use_compiled_kernels, which
# the launcher turns on); the others run eagerly
COMPILED_ROWS = ("int8-mm", "int8", "int8-mm-all")


def build(row: str, args) -> torch.nn.Module:
    torch.manual_seed(0)
    model = Transformer(args)
    model.init_weights()
    if row in ("bf16", "fp32"):
        return fsdp_int8.shard_model(model, quantize=False, mp_policy=BF16 if row == "bf16" else None)
    matmuls = {
        "int8": None,
        "int8-mm": fsdp_int8.Int8MatmulConfig(),
        "int8-mm-eager": fsdp_int8.Int8MatmulConfig(),
        "int8-mm-all": fsdp_int8.Int8MatmulConfig(grad_weight=True),
    }[row]
    return fsdp_int8.shard_model(model, config=fsdp_int8.Int8TrainingConfig(int8_matmul=matmuls), mp_policy=BF16)


def _step(row: str, model, optimizer, tokens) -> float:
    use_compiled_kernels(row in COMPILED_ROWS)
    loss = F.cross_entropy(model(tokens[:, :-1]).flatten(0, 1).float(), tokens[:, 1:].flatten())
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    optimizer.zero_grad()
    dist.barrier()
    return loss.item()


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


def _profile(rows: dict, tokens_of, steps: int) -> dict:
    """Self CPU ms of every op in each profiled step (median over the steps), each row's
    steps interleaved with the others' like the timed ones."""
    from torch.profiler import ProfilerActivity, profile

    per_step = {name: [] for name in rows}
    walls = {name: [] for name in rows}
    for step in range(steps):
        for name, (model, optimizer) in rows.items():
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                began = time.perf_counter()
                _step(name, model, optimizer, tokens_of(10_000 + step))
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
    args = bench_model_args(settings)
    rows = {}
    for row in settings["rows"]:
        model = build(row, args)
        rows[row] = (model, torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1))
    data = torch.Generator().manual_seed(rank)
    batches = {}

    def tokens_of(step: int) -> torch.Tensor:
        if step not in batches:
            batches[step] = torch.randint(0, args.vocab_size, (settings["batch_size"], settings["seq_len"] + 1),
                                          generator=data)
        return batches[step]

    times = {row: [] for row in rows}
    losses = {row: [] for row in rows}
    for step in range(settings["warmup"] + settings["steps"]):
        for row, (model, optimizer) in rows.items():
            began = time.perf_counter()
            losses[row].append(_step(row, model, optimizer, tokens_of(step)))
            if step >= settings["warmup"]:
                times[row].append(time.perf_counter() - began)
    result = dict(times=times, losses=losses)
    if settings["profile"]:
        result["profile"] = _profile(rows, tokens_of, settings["profile"])
    return result


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="base")
    parser.add_argument("--dim", type=int, default=1024)
    parser.add_argument("--n-layers", type=int, default=2)
    parser.add_argument("--n-heads", type=int, default=0, help="0: dim / 64")
    parser.add_argument("--batch-size", type=int, default=4, help="sequences per rank")
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--steps", type=int, default=12, help="timed steps per row")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1, help="per rank")
    parser.add_argument("--rows", nargs="+", default=list(DEFAULT_ROWS), choices=ROWS)
    parser.add_argument("--profile", type=int, default=0, metavar="N", help="profile N more steps per row")
    parser.add_argument("--quick", action="store_true", help="4 timed steps after 2")
    args = parser.parse_args(argv)
    if args.quick:
        args.steps, args.warmup = 4, 2
    rows = list(dict.fromkeys(["bf16"] + args.rows))  # the baseline always runs
    settings = dict(preset=args.preset, dim=args.dim, n_layers=args.n_layers,
                    n_heads=args.n_heads or max(1, args.dim // 64), batch_size=args.batch_size,
                    seq_len=args.seq_len, steps=args.steps, warmup=args.warmup, threads=args.threads,
                    rows=rows, profile=args.profile)
    model_args = bench_model_args(settings)
    params = sum(p.numel() for p in Transformer(model_args).parameters())
    print(f"model: launcher Transformer, dim {model_args.dim}, {model_args.n_layers} blocks, "
          f"{model_args.n_heads} heads ({params / 1e6:.2f}M params); batch {args.batch_size} x {args.seq_len} "
          f"per rank; {args.world_size} gloo ranks, {args.threads} thread(s) each; {args.steps} timed steps "
          f"after {args.warmup}, rows interleaved step by step")
    print(f"CPU: {cpu_description()}; torch {torch.__version__}")
    result = run_distributed(_body, args.world_size, settings, timeout=3600)[0]
    base = statistics.median(result["times"]["bf16"])
    print(f"{'row':<15} {'median ms':>10} {'vs bf16':>8} {'min ms':>8} {'max ms':>8} {'last loss':>10}")
    for row, times in result["times"].items():
        median = statistics.median(times)
        print(f"{row:<15} {median * 1e3:10.1f} {median / base:7.2f}x {min(times) * 1e3:8.1f} "
              f"{max(times) * 1e3:8.1f} {result['losses'][row][-1]:10.4f}")
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
            print(f"  {ms:9.2f}  {_short(op)}")
    base = tables[names[0]]["ops"]
    for n in names[1:]:
        print()
        print(f"{n} minus {names[0]}: the ops that differ most (ms per step)")
        ops = tables[n]["ops"]
        diffs = {op: ops.get(op, 0.0) - base.get(op, 0.0) for op in set(ops) | set(base)}
        for op, ms in sorted(diffs.items(), key=lambda kv: -abs(kv[1]))[:top]:
            print(f"  {ms:+9.2f}  {_short(op)}")


def _short(op: str) -> str:
    # compiled graphs are named by hash: one name for all of them
    return "## Call CompiledFxGraph ##" if "CompiledFxGraph" in op else op


if __name__ == "__main__":
    main(sys.argv[1:])
