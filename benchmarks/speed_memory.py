"""Step time and persistent memory: fp32 / bf16 FSDP2 against int8 weights, with three optimizers.

    python -m benchmarks.speed_memory                  # dim 1024, 2 blocks, 2 ranks
    python -m benchmarks.speed_memory --preset small   # the launcher's small preset as is
    python -m benchmarks.speed_memory --log            # + a dated section in benchmarks/results/performance.md

Every row trains the same model on the same data. Memory: each row runs alone in fresh
processes (so each peak RSS is its own) for two steps. Time: one launch per precision
times its rows with the bf16 and fp32 FSDP2 baselines (torch AdamW) beside them, steps
interleaved in the benchmarks' one loop (``benchmarks.timing``). Rows are built by the
registry (``benchmarks.rows``). Columns:

* step: median wall time of a training step (forward, backward, clip, optimizer), rank 0;
* vs bf16, vs fp32: the median over steps of the row's step time over the bf16 FSDP2 (bf16
  parameters, fp32 reduction: the baseline users run) or fp32 FSDP2 row's (torch AdamW)
  in the same step (lower is faster); every int8 row computes in bf16 like the launcher,
  with compiled kernels from width 512 (``compile=auto`` for the whole model, as the
  launcher's --compile auto), unless its options say otherwise;
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
from pathlib import Path

import torch
import torch.distributed as dist

from benchmarks import rows as registry
from benchmarks.ratios import shape
from benchmarks.report import log_run
from benchmarks.timing import interleave, paired_ratio, train_step
from fsdp_int8 import hardware
from fsdp_int8.config import AUTO
from fsdp_int8.hardware import device_type_for
from fsdp_int8.memory import persistent_bytes
from fsdp_int8.testing import run_distributed
from launch.model import PRESETS, Transformer, next_token_loss
from launch.precisions import parse_row, resolve_compile, row_argument

# Rows are recipes of launch.precisions (NAME[:OPTION...]). int8: weight-only; int8-mm: all
# three GEMMs in int8; int8-mm-wgrad-bf16: the weight gradient's GEMM in bf16;
# int8:bf16-model: int8 weights of a bf16 model (bf16 gradients and reduction too).
PRECISIONS = ("fp32", "bf16", "int8", "int8-mm", "int8-mm-wgrad-bf16", "int8:bf16-model")
OPTIMIZERS = ("torch AdamW", "fused AdamW", "8-bit AdamW")
BASELINES = (("bf16", "torch AdamW"), ("fp32", "torch AdamW"))


def optimizer_of(name: str, int8: bool) -> str:
    """The registry's optimizer for column ``name``: the fused form is fsdp_int8's
    ``Int8AdamW`` (one requantization per step) for a model with int8 weights, torch's
    fused AdamW for the others."""
    return "Int8AdamW" if name == "fused AdamW" and int8 else name


def _row(precision: str, optimizer: str, settings: dict) -> registry.Row:
    """The registry's row: compiled kernels from width 512 (the launcher's ``--compile
    auto``) unless the recipe's own ``compile=`` option says."""
    int8 = parse_row(precision).precision.int8
    compile = resolve_compile(AUTO, shape(settings).dim)
    return registry.row(precision, compile=compile, optimizer=optimizer_of(optimizer, int8))


def _batch(settings: dict, rank: int, step: int) -> tuple:
    """The same batch of ``step`` for every row."""
    args, device = shape(settings), device_type_for(dist.get_world_size())
    tokens = torch.randint(0, args.vocab_size, (settings["batch_size"], settings["seq_len"] + 1),
                           generator=torch.Generator().manual_seed(step * 1000 + rank))
    return tokens[:, :-1].to(device), tokens[:, 1:].to(device)


def _memory(rank: int, world: int, precision: str, optimizer_name: str, settings: dict) -> dict:
    """One row alone: bytes per parameter after its first step, and the peak RSS of two."""
    torch.set_num_threads(settings["threads"])
    model, optimizer = registry.build(_row(precision, optimizer_name, settings), shape(settings))
    bytes_per_param = 0.0
    for step in range(2):
        inputs, targets = _batch(settings, rank, step)
        next_token_loss(model, inputs, targets).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        if step == 0:  # grads and states exist now, before zero_grad frees the grads
            bytes_per_param = persistent_bytes(model, optimizer).per_param
        optimizer.zero_grad()
    peak = torch.tensor(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0, device=device_type_for(world))
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    return dict(bytes_per_param=bytes_per_param, peak_rss_mb=peak.item())


def _timed(rank: int, world: int, pairs: list[tuple[str, str]], settings: dict) -> dict:
    """``{(precision, optimizer): [seconds per timed step]}``, every pair in this launch."""
    torch.set_num_threads(settings["threads"])
    steps_of = {}
    for pair in pairs:
        model, optimizer = registry.build(_row(*pair, settings), shape(settings))

        def step(i: int, model=model, optimizer=optimizer) -> float:
            return train_step(model, optimizer, *_batch(settings, rank, i))

        steps_of["|".join(pair)] = step
    return interleave(steps_of, steps=settings["steps"], warmup=settings["warmup"])


def _failure(error: Exception) -> str:
    return str(error).strip().splitlines()[-1][:90]


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
                        help="recipes of launch.precisions, NAME[:OPTION...] (e.g. int8-mm:compile=off, int8:fp32)")
    parser.add_argument("--optimizers", nargs="+", default=list(OPTIMIZERS), choices=OPTIMIZERS)
    parser.add_argument("--write-docs", type=Path, help="also write the output to this docs folder")
    parser.add_argument("--log", action="store_true",
                        help="also append a dated section (command, hardware line, table) to "
                        "benchmarks/results/performance.md")
    args = parser.parse_args(argv)
    lines: list[str] = []

    def say(text: str = "") -> None:
        print(text, flush=True)
        lines.append(text)

    settings = {k: getattr(args, k) for k in
                ("preset", "dim", "n_layers", "n_heads", "batch_size", "seq_len", "steps", "warmup", "threads")}
    preset = shape(settings)
    params = sum(p.numel() for p in Transformer(preset).parameters())
    say(f"model: launcher Transformer, preset {args.preset!r} with dim {preset.dim}, {preset.n_layers} blocks, "
        f"{preset.n_heads} heads ({params / 1e6:.2f}M params), batch {args.batch_size} x {args.seq_len} per rank, "
        f"world size {args.world_size}, {args.threads} thread(s) per rank, {args.steps} timed steps after "
        f"{args.warmup}, each precision's rows interleaved with the baselines' in one launch")
    say(hardware.hardware_line(device_type_for(args.world_size)))
    labels = {name: _row(name, "torch AdamW", settings).label for name in args.precisions}
    width = max(19, *map(len, labels.values()))
    header = (f"{'precision':<{width}} {'optimizer':<12} {'step ms':>8} {'vs bf16':>8} {'vs fp32':>8} "
              f"{'bytes/param':>12} {'peak RSS MB':>12}")
    say(header)
    say("-" * len(header))
    for name in args.precisions:
        pairs = [(name, optimizer) for optimizer in args.optimizers]
        try:
            times = run_distributed(_timed, args.world_size, list(dict.fromkeys([*BASELINES, *pairs])), settings,
                                    timeout=3600)[0]
        except Exception as error:  # print the failure in its rows, keep the table going
            times = _failure(error)
        for pair in pairs:
            label = f"{labels[name]:<{width}} {pair[1]:<12}"
            try:
                row = run_distributed(_memory, args.world_size, *pair, settings)[0]
            except Exception as error:
                say(f"{label} failed: {_failure(error)}")
                continue
            if isinstance(times, str):
                say(f"{label} timing failed: {times}; {row['bytes_per_param']:.2f} bytes/param")
                continue
            key = "|".join(pair)
            ratios = [f"{paired_ratio(times, key, '|'.join(b)):.2f}x" for b in BASELINES]
            say(f"{label} {statistics.median(times[key]) * 1e3:8.1f} {ratios[0]:>8} {ratios[1]:>8} "
                f"{row['bytes_per_param']:12.2f} {row['peak_rss_mb']:12.0f}")
    say("vs bf16 / vs fp32: the median over steps of the row's step time over bf16 FSDP2's (bf16 params, fp32 "
        "reduce; the baseline users run) or fp32 FSDP2's, each with torch AdamW, in the same step (lower is "
        "faster); int8 rows compute in bf16, (bf16-model) ones hold a bf16 model")
    command = "python -m benchmarks.speed_memory " + " ".join(argv if argv is not None else sys.argv[1:])
    if args.write_docs:
        from benchmarks.report import write_verbatim

        write_verbatim(args.write_docs / "speed_memory.md", "Speed and memory", command, lines)
    if args.log:
        print(f"logged: {log_run('performance.md', 'Speed and memory', command, lines)}")


if __name__ == "__main__":
    main()
