"""Step time and persistent memory: fp32 / bf16 FSDP2 against int8 weights, with three optimizers.

    python -m benchmarks.speed_memory                  # dim 1024, 2 blocks, 2 ranks
    python -m benchmarks.speed_memory --preset small   # the launcher's small preset as is

Every row trains the same model on the same data for the same steps, each in fresh
processes (so each peak RSS is its own), one after another in this one run: read the
ratios, not the absolute times (these machines are noisy). Columns:

* step: median wall time of a training step (forward, backward, clip, optimizer), rank 0;
* vs bf16, vs fp32: the bf16 FSDP2 (bf16 parameters, fp32 reduction: the baseline users
  run) and fp32 FSDP2 rows with torch AdamW of this run, over that median (higher is faster);
  every int8 row computes in bf16 like the launcher, with its compiled kernels from width 512
  (the launcher's --compile auto), unless its options say otherwise;
* bytes/param: storage of each rank's own parameters + gradients + optimizer states,
  divided by its parameter count (fp32 + Adam: 16); 8-bit AdamW keeps its moments in
  blocks of 128 values per scale;
* peak RSS: the largest resident set of any rank, for context (includes torch itself).
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from benchmarks.ratios import shape
from fsdp_int8 import Int8AdamW, hardware
from fsdp_int8.hardware import device_type_for
from fsdp_int8.memory import persistent_bytes
from fsdp_int8.testing import run_distributed
from launch.model import PRESETS, Transformer, next_token_loss
from launch.precisions import Recipe, build_model, compile_wanted, parse_row, row_argument

# Rows are recipes of launch.precisions (NAME[:OPTION...]). int8: weight-only; int8-mm: all
# three GEMMs in int8; int8-mm-wgrad-bf16: the weight gradient's GEMM in bf16;
# int8:bf16-model: int8 weights of a bf16 model (bf16 gradients and reduction too).
PRECISIONS = ("fp32", "bf16", "int8", "int8-mm", "int8-mm-wgrad-bf16", "int8:bf16-model")
EIGHT_BIT_BLOCK = 128  # values per scale of 8-bit Adam states
OPTIMIZERS = ("torch AdamW", "fused AdamW", "8-bit AdamW")


def make_optimizer(name: str, int8: bool, model: torch.nn.Module) -> torch.optim.Optimizer:
    """Optimizer ``name``: its fused form is fsdp_int8's ``Int8AdamW`` (one requantization
    per step) for a model with int8 weights (``int8``), torch's fused AdamW for the others."""
    params = model.parameters()
    if name == "torch AdamW":
        return torch.optim.AdamW(params, lr=1e-3, weight_decay=0.1)
    if name == "fused AdamW" and not int8:
        return torch.optim.AdamW(params, lr=1e-3, weight_decay=0.1, fused=True)
    if name.startswith("8-bit"):
        return Int8AdamW(params, lr=1e-3, weight_decay=0.1, state_bits=8, block_size=EIGHT_BIT_BLOCK)
    return Int8AdamW(params, lr=1e-3, weight_decay=0.1)


def recipe_of(row: str, dim: int) -> Recipe:
    """Row ``row``'s recipe: compiled kernels from width 512 (the launcher's ``--compile
    auto``) unless the row says ``:eager`` or ``:compiled``."""
    return parse_row(row, compile=compile_wanted("auto", dim))


def _row(rank: int, world: int, row: str, optimizer_name: str, args_dict: dict) -> dict:
    torch.set_num_threads(args_dict["threads"])
    preset = shape(args_dict)
    recipe = recipe_of(row, preset.dim)
    device = device_type_for(world)
    model = build_model(recipe, preset, device, full_init=True)
    optimizer = make_optimizer(optimizer_name, recipe.precision.int8, model)
    data = torch.Generator().manual_seed(rank)
    times, bytes_per_param = [], 0.0
    for step in range(args_dict["warmup"] + args_dict["steps"]):
        tokens = torch.randint(0, preset.vocab_size, (args_dict["batch_size"], args_dict["seq_len"] + 1), generator=data)
        tokens = tokens.to(device)
        began = time.perf_counter()
        loss = next_token_loss(model, tokens[:, :-1], tokens[:, 1:])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        if step == 0:  # grads and states exist now, before zero_grad frees the grads
            bytes_per_param = persistent_bytes(model, optimizer).per_param
        optimizer.zero_grad()
        dist.barrier()
        if step >= args_dict["warmup"]:
            times.append(time.perf_counter() - began)
    peak = torch.tensor(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0, device=device)
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    return dict(step_s=statistics.median(times), bytes_per_param=bytes_per_param, peak_rss_mb=peak.item(),
                loss=loss.item())


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="base", choices=list(PRESETS))
    parser.add_argument("--dim", type=int, default=1024, help="override the preset's width (0: keep)")
    parser.add_argument("--n-layers", type=int, default=2, help="override the preset's depth (0: keep)")
    parser.add_argument("--n-heads", type=int, default=16, help="override the preset's heads (0: keep)")
    parser.add_argument("--batch-size", type=int, default=4, help="sequences per rank")
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--steps", type=int, default=8, help="timed steps per row")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--threads", type=int, default=max(1, (os.cpu_count() or 1) // 2), help="per rank")
    parser.add_argument("--precisions", nargs="+", default=list(PRECISIONS), type=row_argument, metavar="ROW",
                        help="recipes of launch.precisions, NAME[:OPTION...] (e.g. int8-mm:eager, int8:fp32)")
    parser.add_argument("--optimizers", nargs="+", default=list(OPTIMIZERS), choices=OPTIMIZERS)
    parser.add_argument("--write-docs", type=Path, help="also write the output to this docs folder")
    args = parser.parse_args(argv)
    lines: list[str] = []

    def say(text: str = "") -> None:
        print(text, flush=True)
        lines.append(text)

    settings = {k: getattr(args, k) for k in
                ("preset", "dim", "n_layers", "n_heads", "batch_size", "seq_len", "steps", "warmup", "threads")}
    preset = shape(settings)
    params = sum(p.numel() for p in Transformer(preset).parameters())
    say(f"model: launcher Transformer, preset {args.preset!r} with dim {preset.dim}, {preset.n_layers} "
          f"blocks, {preset.n_heads} heads ({params / 1e6:.2f}M params), batch {args.batch_size} x {args.seq_len} per rank, world size "
          f"{args.world_size}, {args.threads} thread(s) per rank, {args.steps} timed steps after {args.warmup}")
    say(hardware.hardware_line(device_type_for(args.world_size)))
    labels = {row: recipe_of(row, preset.dim).label for row in args.precisions}
    width = max(19, *map(len, labels.values()))
    header = (f"{'precision':<{width}} {'optimizer':<12} {'step ms':>8} {'vs bf16':>8} {'vs fp32':>8} {'bytes/param':>12} "
              f"{'peak RSS MB':>12}")
    say(header)
    say("-" * len(header))
    baselines: dict[str, float] = {}  # fp32 / bf16 FSDP2 with torch AdamW: step seconds
    for name in args.precisions:
        for optimizer in args.optimizers:
            label = labels[name]
            try:
                row = run_distributed(_row, args.world_size, name, optimizer, settings)[0]
            except Exception as error:  # print the failure in its row, keep the table going
                say(f"{label:<{width}} {optimizer:<12} failed: {str(error).strip().splitlines()[-1][:90]}")
                continue
            if name in ("fp32", "bf16") and optimizer == "torch AdamW":
                baselines[name] = row["step_s"]
            ratios = [f"{baselines[b] / row['step_s']:.2f}x" if b in baselines else "-" for b in ("bf16", "fp32")]
            say(f"{label:<{width}} {optimizer:<12} {row['step_s'] * 1e3:8.1f} {ratios[0]:>8} {ratios[1]:>8} "
                f"{row['bytes_per_param']:12.2f} {row['peak_rss_mb']:12.0f}")
    say("vs bf16 / vs fp32: speed-up over bf16 FSDP2 (bf16 params, fp32 reduce; the baseline users run) and over "
        "fp32 FSDP2, each with torch AdamW (higher is faster); int8 rows compute in bf16, (bf16-model) ones hold a bf16 model")
    if args.write_docs:
        from benchmarks.report import write_verbatim

        command = "python -m benchmarks.speed_memory " + " ".join(argv if argv is not None else sys.argv[1:])
        write_verbatim(args.write_docs / "speed_memory.md", "Speed and memory", command, lines)


if __name__ == "__main__":
    main()
