"""Step-time ratios against bf16 FSDP2, every row in ONE launch, steps interleaved.

    python -m benchmarks.ratios                         # dim 1024, 2 blocks, 4 x 256, 2 ranks
    python -m benchmarks.ratios --dim 512               # the issue's second width
    python -m benchmarks.ratios --quick                 # 4 timed steps: a smoke run
    python -m benchmarks.ratios --log                   # + a dated section in benchmarks/results/performance.md
    python -m benchmarks.ratios --profile 5             # + where the time goes, per op and step
    python -m benchmarks.ratios --experts 8             # mixture-of-experts blocks, 8 experts, top 2
    python -m benchmarks.ratios --experts qwen3-30b-a3b # one block's experts alone at that model's shape
    python -m benchmarks.ratios --model hf-llama --rows bf16:blocks int8-mm:blocks
                                                        # a Hugging Face Llama of the same shape

Each rank builds every row's model (same initial weights, same data) and times them with
the benchmarks' one loop (``benchmarks.timing``: each step runs every row once, the order
rotating; ratios are medians of the per-step ratios to the baseline's time in the same
step). A step is what the launcher runs: forward, cross-entropy, backward, gradient
clipping at 1.0 (inside backward for the lean call), the optimizer step (weight decay
0.1), zero_grad, then a barrier. Reported, from rank 0: each row's median step time, the
ratio of medians and the median of paired ratios to the baseline's (lower is faster).

Rows (``benchmarks.rows``, the registry; default ``bf16 default lean``):

* ``bf16``: bf16 FSDP2 (bf16 parameters, fp32 gradient reduction: torchtitan's policy)
  with fused torch AdamW, the baseline;
* ``default``: the library's default call, ``shard_model(model,
  config=Int8TrainingConfig(int8_matmul=Int8MatmulConfig()), mp_policy=<bf16 policy>)``
  with no compile flag (``compile="auto"``), fused torch AdamW;
* ``lean``: ``shard_model(model, config=Int8TrainingConfig.lean())`` with ``Int8AdamW.lean``;
* any recipe of ``launch.precisions`` (``NAME[:OPTION...]``), fused torch AdamW, fsdp_int8
  recipes computing in bf16 with compiled kernels unless their options say otherwise:
  ``int8-mm`` (all three GEMMs in int8), ``int8`` (weight-only), ``int8-mm:compile=off`` (no
  torch.compile; ``:fp32`` for fp32 compute), ``int8-mm-wgrad-bf16``, ``int8-grads``,
  ``fp32``, ``all-bf16``, ``torchao``, ``bf16:blocks`` (every block compiled whole).

``--profile N`` records N more steps of every row with torch.profiler (interleaved too)
and prints, per row, the self CPU time per step of each category of ops and the ops that
take the most (medians over the profiled steps), then the ops that differ most from the
baseline.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections import defaultdict
from pathlib import Path
from typing import Callable

import torch

from benchmarks import experts_gemm
from benchmarks import rows as registry
from benchmarks.report import log_run
from benchmarks.timing import interleave, paired_ratio, ratio_lines, train_step
from fsdp_int8 import hardware
from fsdp_int8.hardware import device_type_for
from fsdp_int8.testing import run_distributed
from launch.model import ModelArgs, Transformer, model_args
from launch.precisions import BLOCKS_OPTION

DEFAULT_ROWS = ("bf16", "default", "lean")


def shape(settings: dict) -> ModelArgs:
    """The model of a benchmark's ``settings`` (preset, seq_len, optional dim, n_layers,
    n_heads, n_experts)."""
    return model_args(settings["preset"], seq_len=settings["seq_len"], dim=settings.get("dim"),
                      n_layers=settings.get("n_layers"), n_heads=settings.get("n_heads"),
                      n_experts=settings.get("n_experts"))


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


def token_batch(step: int, rank: int, vocab_size: int, settings: dict, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Random ``(inputs, targets)`` of ``settings``' shape, seeded by step and rank: every row
    of a run trains on the same batch at a step."""
    tokens = torch.randint(0, vocab_size, (settings["batch_size"], settings["seq_len"] + 1),
                           generator=torch.Generator().manual_seed(step * 1000 + rank))
    return tokens[:, :-1].to(device), tokens[:, 1:].to(device)


def _category(name: str) -> str:
    for category, patterns in CATEGORIES:
        if any(p in name for p in patterns):
            return category
    return "other ops"


def _short(op: str) -> str:
    # compiled graphs are named by hash: one name for all of them
    return "## Call CompiledFxGraph ##" if "CompiledFxGraph" in op else op


def profile_interleaved(steps_of: dict[str, Callable[[int], object]], steps: int) -> dict:
    """Self CPU ms of every op in each profiled step (median over the steps) and the wall
    time, each row's step run under torch.profiler, interleaved like the timed ones."""
    from torch.profiler import ProfilerActivity, profile

    per_step = {name: [] for name in steps_of}

    def profiled(name: str) -> Callable[[int], None]:
        def step(i: int) -> None:
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                steps_of[name](10_000 + i)
            ops = defaultdict(float)
            for event in prof.key_averages():
                ops[_short(event.key)] += event.self_cpu_time_total / 1e3
            per_step[name].append(dict(ops))
        return step

    walls = interleave({name: profiled(name) for name in steps_of}, steps=steps)
    tables = {}
    for name, dicts in per_step.items():
        keys = set().union(*dicts)
        ops = {k: statistics.median(d.get(k, 0.0) for d in dicts) for k in keys}
        tables[name] = dict(wall_ms=statistics.median(walls[name]) * 1e3, ops=ops)
    return tables


def _body(rank: int, world: int, settings: dict) -> dict:
    torch.set_num_threads(settings["threads"])
    args = shape(settings)
    device = device_type_for(world)

    def batch(step: int) -> tuple:
        return token_batch(step, rank, args.vocab_size, settings, device)

    steps_of = {}
    for name in settings["rows"]:
        row = registry.row(name)
        model, optimizer = registry.build(row, args, model=settings.get("model", registry.LAUNCHER))

        def step(i: int, model=model, optimizer=optimizer, clip=row.clip) -> float:
            return train_step(model, optimizer, *batch(i), clip=clip)

        steps_of[name] = step
    result = dict(times=interleave(steps_of, steps=settings["steps"], warmup=settings["warmup"]))
    if settings["profile"]:
        result["profile"] = profile_interleaved(steps_of, settings["profile"])
    return result


def measure(settings: dict, world: int = 2) -> dict:
    """Run :func:`_body` on ``world`` ranks; rank 0's ``{"times": ..., "profile": ...}``."""
    return run_distributed(_body, world, settings, timeout=3600)[0]


def settings_for(dim: int, rows, *, steps: int, warmup: int, n_layers: int = 2, batch_size: int = 4,
                 seq_len: int = 256, threads: int = 1, profile: int = 0, baseline: str = "bf16",
                 n_experts: int = 0, model: str = registry.LAUNCHER) -> dict:
    """The issue's benchmark shape (``base`` preset at ``dim``, heads of 64; ``n_experts``:
    top-2 mixture-of-experts blocks; ``model``: the launcher's Transformer or ``"hf-llama"``)
    as settings; the ``baseline`` row runs first."""
    return dict(preset="base", dim=dim, n_layers=n_layers, n_heads=max(1, dim // 64), batch_size=batch_size,
                seq_len=seq_len, steps=steps, warmup=warmup, threads=threads,
                rows=list(dict.fromkeys([baseline, *rows])), profile=profile, n_experts=n_experts, model=model)


def _experts_argument(value: str) -> int | str:
    """``--experts``: a count of experts per block, or a model's name from
    :data:`benchmarks.experts_gemm.SHAPES`."""
    if value in experts_gemm.SHAPES:
        return value
    try:
        return int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{value!r} is neither a number of experts nor one of {', '.join(experts_gemm.SHAPES)}") from None


def default_baseline(device: str = "cpu") -> str:
    """What users compare with: bf16 FSDP2 where bf16 matmuls are fast, else fp32 FSDP2."""
    return "bf16" if hardware.capability(device).bf16_matmul_fast else "fp32"


COMPILED_BASELINE = "bf16:blocks"  # bf16 FSDP2 with every block compiled whole


def compiled_block_rows(times: dict) -> dict:
    """The rows with compiled blocks and their compiled baseline (``bf16:blocks``), when it
    ran and another compiled-block row did: ``{}`` otherwise."""
    rows = {name: t for name, t in times.items() if name.split(":")[-1] == BLOCKS_OPTION}
    return rows if COMPILED_BASELINE in rows and len(rows) > 1 else {}


def labels_of(names) -> dict[str, str]:
    """What the tables call each row: its name, its label and its optimizer."""
    out = {}
    for name in names:
        row = registry.row(name)
        out[name] = f"{name}: {row.label}, {row.optimizer}" if name != row.label else f"{name}, {row.optimizer}"
    return out


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dim", type=int, default=1024)
    parser.add_argument("--n-layers", type=int, default=2)
    parser.add_argument("--experts", type=_experts_argument, default=0,
                        help="mixture-of-experts blocks of this many top-2 experts (the launcher's MoE: one "
                        "torch._grouped_mm per projection; int8-mm rows: fsdp_int8's grouped int8 GEMM); or a "
                        f"model's name ({', '.join(experts_gemm.SHAPES)}): that model's experts alone, "
                        "int8 against bf16 torch._grouped_mm (benchmarks.experts_gemm; --batch-size x --seq-len "
                        "tokens, --steps, --warmup and --threads apply)")
    parser.add_argument("--model", default=registry.LAUNCHER, choices=registry.MODELS,
                        help="every row's model: the launcher's Transformer, or a Hugging Face LlamaForCausalLM "
                        "of the same shape (transformers' rotate_half RoPE; library calls, bf16 / fp32 FSDP2 and "
                        "int8 / int8-mm recipes)")
    parser.add_argument("--batch-size", type=int, default=4, help="sequences per rank")
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--steps", type=int, default=20, help="timed steps per row")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1, help="per rank")
    parser.add_argument("--rows", nargs="+", default=list(DEFAULT_ROWS), type=registry.row_argument, metavar="ROW",
                        help="library calls (default, lean) or recipes of launch.precisions, NAME[:OPTION...] "
                        "(e.g. int8-mm:compile=off, int8:fp32)")
    parser.add_argument("--baseline", default="auto", choices=("auto", "bf16", "fp32"),
                        help="the row ratios are taken against; auto: bf16 FSDP2 where this hardware "
                        "has fast bf16 matmuls, else fp32 FSDP2")
    parser.add_argument("--json", type=Path, help="also write the times, ratios and hardware line here")
    parser.add_argument("--log", action="store_true",
                        help="also append a dated section (command, hardware line, table) to "
                        "benchmarks/results/performance.md")
    parser.add_argument("--profile", type=int, default=0, metavar="N", help="profile N more steps per row")
    parser.add_argument("--quick", action="store_true", help="4 timed steps after 2")
    args = parser.parse_args(argv)
    if args.quick:
        args.steps, args.warmup = 4, 2
    if isinstance(args.experts, str):
        lines = experts_gemm.run(args.experts, tokens=args.batch_size * args.seq_len, steps=args.steps,
                                 warmup=args.warmup, threads=args.threads)
        for line in lines:
            print(line, flush=True)
        if args.log:
            log_run("performance.md", f"ratios --experts {args.experts}", " ".join(["python -m benchmarks.ratios",
                    *(argv if argv is not None else sys.argv[1:])]), lines)
        return {"experts": lines}
    device = device_type_for(args.world_size)
    baseline = default_baseline(device) if args.baseline == "auto" else args.baseline
    settings = settings_for(args.dim, args.rows, steps=args.steps, warmup=args.warmup, n_layers=args.n_layers,
                            batch_size=args.batch_size, seq_len=args.seq_len, threads=args.threads,
                            profile=args.profile, baseline=baseline, n_experts=args.experts, model=args.model)
    lines: list[str] = []

    def say(text: str = "") -> None:
        print(text, flush=True)
        lines.append(text)

    model = shape(settings)
    if args.model == registry.HF_LLAMA:
        if model.n_experts:
            parser.error("--model hf-llama builds dense blocks: drop --experts")
        with torch.device("meta"):
            params = sum(p.numel() for p in registry.hf_llama(model).parameters())
        name = "Hugging Face LlamaForCausalLM"
    else:
        params = sum(p.numel() for p in Transformer(model).parameters())
        name = "launcher Transformer"
    experts = f", {model.n_experts} experts (top {model.top_k}) per block" if model.n_experts else ""
    say(f"model: {name}, dim {model.dim}, {model.n_layers} blocks, {model.n_heads} heads{experts} "
        f"({params / 1e6:.2f}M params); batch {args.batch_size} x {args.seq_len} per rank; "
        f"{args.world_size} ranks ({device}), {args.threads} thread(s) each; "
        f"{args.steps} timed steps after {args.warmup}, rows interleaved step by step")
    machine = hardware.hardware_line(device)
    say(machine)
    result = measure(settings, args.world_size)
    for line in ratio_lines(result["times"], baseline, labels_of(result["times"])):
        say(line)
    say(f"(ratios: step time over {baseline}'s; median of ratios: the median over steps of the ratio within "
        "a step; lower is faster)")
    compiled = compiled_block_rows(result["times"])
    if compiled:  # like with like: compiled blocks against compiled bf16 FSDP2, in the same steps
        say()
        say(f"compiled blocks against {COMPILED_BASELINE}:")
        for line in ratio_lines(compiled, COMPILED_BASELINE, labels_of(compiled)):
            say(line)
    if args.json:
        ratios = {row: paired_ratio(result["times"], row, baseline) for row in result["times"]}
        args.json.write_text(json.dumps(dict(hardware=machine, settings=settings, baseline=baseline,
                                             median_of_ratios=ratios, times=result["times"]), indent=1) + "\n")
    if args.log:
        command = "python -m benchmarks.ratios " + " ".join(sys.argv[1:] if argv is None else argv)
        print(f"logged: {log_run('performance.md', 'Step-time ratios', command, lines)}")
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
