"""fsdp_int8 against bf16 / fp32 FSDP2 and torchao's int8 training, on one model, data and world size.

    python -m benchmarks.compare                       # the full comparison (about 30 min on 2 busy cores)
    python -m benchmarks.compare --quick               # fewer steps, a smoke run
    python -m benchmarks.compare --write-docs docs     # also writes docs/benchmarks.md and its plots

The baseline is **bf16 FSDP2** (bf16 parameters, fp32 gradient reduction: torchtitan's
default policy), the setting users would otherwise pick; every fsdp_int8 row computes in
bf16 too (``MixedPrecisionPolicy(param_dtype=bfloat16)``, as the launcher does) and runs
the compiled quantization kernels (``Int8TrainingConfig(compile="on")``). Rows are those of
``benchmarks.rows`` (recipes of ``launch.precisions``), built there.

Every row trains the launcher's Llama-style model (default: preset small) on the
embedded corpus (Python's standard library source) with torch AdamW (weight decay 0, so
torchao can run) for the same number of steps, each row in fresh processes (its own peak
memory), one after another. Its step time, though, comes from ONE more launch in which
every row's model takes its steps interleaved with the others' (step 1 of every row,
then step 2, ...): this machine is shared, and only rows timed side by side can be
compared (``benchmarks.timing``, the benchmarks' one loop: the order of the rows rotates
each step, and ratios are medians of the per-step ratios). Columns:

* all-gather / step: bytes of every all-gather buffer in one training step (all ranks'
  shares), counted at the torch.distributed calls;
* collectives / step: all collectives of the step (all-gathers, reduce-scatters, ...);
  in a ring each rank sends (N - 1) / N of these buffers (the sweeps print that);
* step ms: median step time on rank 0 in the interleaved launch; vs bf16, vs fp32: that
  time over the baseline's (lower is faster);
* peak RSS: the largest resident set of any rank (includes torch itself);
* bytes/param: each rank's parameters + gradients + optimizer states per parameter;
* val loss: validation loss (nats per byte) after the budget.

Then the step-time ratios at the issue's shape (dim 1024 and 512, 2 blocks, 4 x 256
tokens per rank: ``benchmarks.ratios``), and two sweeps, rows interleaved at every point:
bytes and time against the world size (1, 2, 4) and against the model width.
"""

from __future__ import annotations

import argparse
import os
import platform
import resource
import statistics
from pathlib import Path

import torch
import torch.distributed as dist

import fsdp_int8
from benchmarks import ratios
from benchmarks import rows as registry
from benchmarks.timing import interleave, paired_ratio, ratio_lines, train_step
from fsdp_int8 import hardware
from fsdp_int8.collectives import count_collectives
from fsdp_int8.hardware import device_type_for
from fsdp_int8.memory import persistent_bytes
from fsdp_int8.testing import run_distributed
from launch.data import load_corpus, sample_batch
from launch.model import PRESETS, ModelArgs, Transformer, next_token_loss

# (row of benchmarks.rows, AdamW weight decay): weight decay 0, so torchao can run,
# but in the last two rows, which show what weight decay does to each
ROWS = (("fp32", 0.0), ("bf16", 0.0), ("int8-mm", 0.0), ("int8", 0.0), ("all-bf16", 0.0), ("int8-grads", 0.0),
        ("torchao", 0.0), ("torchao", 0.1), ("int8", 0.1))
SWEEP_ROWS = ("bf16", "int8-mm", "int8")
OPTIMIZER = "torch AdamW"  # every row's (torchao's weights take no fused AdamW)


def label(row: str, weight_decay: float = 0.0) -> str:
    """What the tables call ``row`` trained with ``weight_decay``."""
    return registry.row(row).label + (f", weight decay {weight_decay:g}" if weight_decay else "")


def _batch_fn(settings: dict, rank: int, device: torch.device, corpus=None):
    corpus = corpus or load_corpus(None, settings["max_bytes"])

    def batch(step: int) -> tuple:
        data = torch.Generator().manual_seed(step * 1000 + rank)
        inputs, targets = sample_batch(corpus.train, settings["batch_size"], settings["seq_len"], data)
        return inputs.to(device), targets.to(device)

    return batch


def _train_row(rank: int, world: int, row: str, weight_decay: float, settings: dict) -> dict:
    """One row trained for the budget, alone in its processes: bytes, memory, val loss."""
    torch.set_num_threads(settings["threads"])
    device = torch.device(device_type_for(world))
    args = ratios.shape(settings)
    corpus = load_corpus(None, settings["max_bytes"])
    model, optimizer = registry.build(registry.row(row, optimizer=OPTIMIZER), args, lr=settings["lr"],
                                      weight_decay=weight_decay)
    batch = _batch_fn(settings, rank, device, corpus)
    gathered, collective, sent, bytes_per_param = 0, 0, 0.0, 0.0
    for step in range(settings["steps"]):
        inputs, targets = batch(step)
        with count_collectives() as counter:
            loss = next_token_loss(model, inputs, targets)
            loss.backward()
        optimizer.step()
        if step == 1:
            bytes_per_param = persistent_bytes(model, optimizer).per_param
            gathered, collective = counter.total_bytes("all_gather_single"), counter.total_bytes()
            sent = counter.wire_bytes()
        optimizer.zero_grad()
    val = torch.zeros((), device=device)
    if settings["eval_batches"]:
        generator = torch.Generator().manual_seed(99 + rank)
        with torch.no_grad():
            for _ in range(settings["eval_batches"]):
                inputs, targets = sample_batch(corpus.val, settings["batch_size"], settings["seq_len"], generator)
                val += next_token_loss(model, inputs.to(device), targets.to(device))
        dist.all_reduce(val)
        val /= settings["eval_batches"] * world
    peak = torch.tensor(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0, device=device)
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    return dict(all_gather=gathered, collectives=collective, sent_per_rank=sent, peak_mb=peak.item(),
                bytes_per_param=bytes_per_param, val_loss=val.item() if settings["eval_batches"] else float("nan"))


def timed_rows(rank: int, world: int, rows: list[str], settings: dict) -> dict:
    """Every row's model in this one launch, steps interleaved: ``{row: dict(step_s,
    all_gather, sent_per_rank)}`` (bytes counted on the first step)."""
    torch.set_num_threads(settings["threads"])
    device = torch.device(device_type_for(world))
    args = ratios.shape(settings)
    batch = _batch_fn(settings, rank, device)
    steps_of, counted = {}, {}
    for row in rows:
        model, optimizer = registry.build(registry.row(row, optimizer=OPTIMIZER), args, lr=settings["lr"],
                                          weight_decay=0.0)

        def step(i: int, model=model, optimizer=optimizer) -> float:
            return train_step(model, optimizer, *batch(i + 1), clip=False)

        steps_of[row] = step
    for row, step in steps_of.items():  # the first warm-up step, counted
        with count_collectives() as counter:
            step(-1)
        counted[row] = dict(all_gather=counter.total_bytes("all_gather_single"), sent_per_rank=counter.wire_bytes())
    times = interleave(steps_of, steps=settings["timed_steps"], warmup=settings["warmup"] - 1)
    return {row: dict(counted[row], step_s=statistics.median(times[row]), times=times[row]) for row in rows}


def _run(body, world: int, *args) -> dict | str:
    try:
        return run_distributed(body, world, *args, timeout=3600)[0]
    except Exception as error:  # the peer's failures are results too: show them
        lines = [l for l in str(error).strip().splitlines() if l.strip() and not l.startswith(" ")]
        return (lines[-1] if lines else repr(error))[:110]


def _paired(row: dict, base: dict) -> float:
    return paired_ratio({"row": row["times"], "base": base["times"]}, "row", "base")


def _mb(n: float) -> str:
    return f"{n / 1e6:.3f} MB"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="small", choices=list(PRESETS))
    parser.add_argument("--steps", type=int, default=150, help="training budget of every row")
    parser.add_argument("--timed-steps", type=int, default=12, help="interleaved timed steps per row")
    parser.add_argument("--batch-size", type=int, default=8, help="sequences per rank")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--threads", type=int, default=max(1, (os.cpu_count() or 1) // 2), help="per rank")
    parser.add_argument("--issue-steps", type=int, default=16,
                        help="interleaved timed steps per row at the issue's shape (0: skip)")
    parser.add_argument("--quick", action="store_true", help="20 steps, short timings and sweeps: a smoke run")
    parser.add_argument("--write-docs", type=Path, help="write benchmarks.md and plots into this docs folder")
    args = parser.parse_args(argv)
    if args.quick:
        args.steps, args.timed_steps, args.issue_steps = 20, 4, 4
    settings = dict(preset=args.preset, steps=args.steps, batch_size=args.batch_size, seq_len=args.seq_len,
                    lr=args.lr, threads=args.threads, eval_batches=8, max_bytes=8_000_000,
                    timed_steps=args.timed_steps, warmup=3)
    model = ratios.shape(settings)
    params = sum(p.numel() for p in Transformer(model).parameters())
    lines: list[str] = []

    def say(text: str = "") -> None:
        print(text, flush=True)
        lines.append(text)

    say(f"model: launcher Transformer, preset {args.preset!r} (dim {model.dim}, {model.n_layers} blocks, "
        f"{params / 1e6:.2f}M params); batch {args.batch_size} x {args.seq_len} bytes per rank; "
        f"{args.world_size} ranks on {device_type_for(args.world_size)}, {args.threads} thread(s) each; "
        f"{args.steps} steps of torch AdamW (lr {args.lr}); step times: {args.timed_steps} steps per row "
        f"interleaved in one launch; fsdp_int8 rows compute in bf16 with compiled kernels")
    say(f"{hardware.hardware_line(device_type_for(args.world_size))}; Python {platform.python_version()}")
    try:
        import torchao

        say(f"torchao {torchao.__version__}")
    except ImportError:
        say("torchao: not installed (pip install -e '.[bench]'): its rows are skipped")
    say()
    results: dict[str, dict | str] = {}  # by label
    row_of = {label(row, weight_decay): row for row, weight_decay in ROWS}
    for row, weight_decay in ROWS:
        name = label(row, weight_decay)
        if row == "torchao" and not _has_torchao():
            results[name] = "skipped: torchao is not installed"
            continue
        results[name] = _run(_train_row, args.world_size, row, weight_decay, settings)
        print(f"  trained {name}: {results[name]}", flush=True)
    to_time = list(dict.fromkeys(row_of[n] for n, r in results.items() if isinstance(r, dict)))
    timed = _run(timed_rows, args.world_size, to_time, settings)
    for name, row in results.items():
        if isinstance(row, dict):
            row["step_s"] = timed[row_of[name]]["step_s"] if isinstance(timed, dict) else float("nan")
            row["times"] = timed[row_of[name]]["times"] if isinstance(timed, dict) else []

    width = max(28, *map(len, results))
    header = (f"| {'row':<{width}} | {'all-gather / step':>17} | {'collectives / step':>18} | {'step ms':>8} | "
              f"{'vs bf16':>7} | {'vs fp32':>7} | {'peak RSS MB':>11} | {'bytes/param':>11} | {'val loss':>8} |")
    say(header)
    say("|" + "|".join("-" * (len(c)) for c in header.split("|")[1:-1]) + "|")
    bf16, fp32 = results.get(label("bf16")), results.get(label("fp32"))
    for name, row in results.items():
        if isinstance(row, str):
            say(f"| {name:<{width}} | {row if row.startswith('skipped') else 'failed: ' + row} |")
            continue
        vs = [f"{_paired(row, base):.2f}x" if isinstance(base, dict) and row["times"] else "-" for base in (bf16, fp32)]
        say(f"| {name:<{width}} | {_mb(row['all_gather']):>17} | {_mb(row['collectives']):>18} | "
            f"{row['step_s'] * 1e3:8.1f} | {vs[0]:>7} | {vs[1]:>7} | {row['peak_mb']:11.0f} | "
            f"{row['bytes_per_param']:11.2f} | {row['val_loss']:8.4f} |")
    if not isinstance(timed, dict):
        say(f"(the interleaved timing launch failed: {timed})")
    say("(vs bf16, vs fp32: median over the interleaved rounds of the step time over that baseline's in the "
        "same round: lower is faster)")

    ours, titan, all_bf16 = (results.get(label(k)) for k in ("int8-grads", "bf16", "all-bf16"))
    if all(isinstance(r, dict) for r in (ours, titan, all_bf16)):
        say()
        say(f"Whole-step collective bytes of {label('int8-grads')}: "
            f"{ours['collectives'] / titan['collectives']:.3f} of bf16 params + fp32 reduce (torchtitan's "
            f"default; target <= 0.40), {ours['collectives'] / all_bf16['collectives']:.3f} of all-bf16 "
            f"(target <= 0.55). Embeddings, norms and the output head stay in full precision here "
            f"({_full_precision_share(model):.1%} of the parameters).")

    issue = {}
    if args.issue_steps:
        say()
        say(f"Step time at the issue's shape (launcher Transformer at dim 1024 and 512, 2 blocks, heads of 64, "
            f"batch 4 x 256 per rank, {args.world_size} ranks, {args.threads} thread(s) each, fused torch AdamW, "
            f"gradient clipping; {args.issue_steps} steps per row interleaved in one launch per width, "
            f"median; lower is faster):")
        for dim in (1024, 512):
            shape = ratios.settings_for(dim, ["int8-mm", "int8"], steps=args.issue_steps, warmup=3,
                                        threads=args.threads)
            try:
                times = ratios.measure(shape, args.world_size)["times"]
            except Exception as error:  # noqa: BLE001
                say(f"  dim {dim}: failed: {str(error).strip().splitlines()[-1][:100]}")
                continue
            issue[dim] = {row: paired_ratio(times, row, "bf16") for row in times}
            say(f"  dim {dim}:")
            for line in ratio_lines(times, "bf16", ratios.labels_of(times)):
                say(f"    {line}")

    say()
    summary = []
    for shape, where in (("preset " + args.preset, None), ("dim 1024", 1024), ("dim 512", 512)):
        if where is None and isinstance(timed, dict) and "bf16" in timed:
            r = {k: paired_ratio({k: v["times"], "bf16": timed["bf16"]["times"]}, k, "bf16") for k, v in timed.items()}
        elif where in issue:
            r = issue[where]
        else:
            continue
        summary.append(f"{shape}: int8 matmuls {r.get('int8-mm', float('nan')):.2f}x, "
                       f"weight-only {r.get('int8', float('nan')):.2f}x")
    say("Summary, step time over bf16 FSDP2's (bf16 compute; goals: int8 matmuls <= 0.80x at dim 1024 and "
        "< 1.00x at dim 512, weight-only <= 1.00x): " + "; ".join(summary) + ".")

    sweep = dict(settings, timed_steps=4 if args.quick else 8, warmup=2)
    rows = list(SWEEP_ROWS)
    labels = {row: label(row) for row in rows}
    say()
    say("How bytes and time grow with the world size (same model, batch per rank fixed; rows interleaved "
        "at every point):")
    world_rows = _sweep("world", [(world, world, sweep) for world in (1, 2, 4)], rows, labels, say,
                        sends=True)
    say()
    say(f"How bytes and time grow with the model width ({args.world_size} ranks; rows interleaved at every point):")
    dims = (128, 256, 512) if args.quick else (128, 256, 512, 1024)
    width_rows = _sweep("dim", [(dim, args.world_size, dict(sweep, dim=dim, n_heads=max(1, dim // 64)))
                                for dim in dims], rows, labels, say)
    if args.write_docs:
        from benchmarks.report import write_report

        command = "python -m benchmarks.compare " + " ".join(argv if argv is not None else os.sys.argv[1:])
        write_report(args.write_docs, command, lines, results, world_rows, width_rows)


def _sweep(name: str, points: list[tuple[int, int, dict]], rows: list[str], labels: dict[str, str],
           say, *, sends: bool = False) -> list[tuple]:
    """Time every row at each ``(key, world size, settings)`` point, interleaved, and say a
    line per row (with the bytes each rank sends if ``sends``); the ``(key, label, result)``s."""
    found = []
    width = max(map(len, labels.values()))
    for key, world, settings in points:
        point = _run(timed_rows, world, rows, settings)
        if isinstance(point, str):
            say(f"  {name} {key}: failed: {point}")
            continue
        for row_name in rows:
            row = point[row_name]
            found.append((key, labels[row_name], row))
            sent = f"each rank sends {_mb(row['sent_per_rank']):>12}/step (all collectives), " if sends else ""
            say(f"  {name} {key:5d}, {labels[row_name]:<{width}}: all-gather {_mb(row['all_gather']):>12}/step, {sent}"
                f"step {row['step_s'] * 1e3:7.1f} ms ({_paired(row, point['bf16']):.2f}x bf16)")
    return found


def _full_precision_share(args: ModelArgs) -> float:
    """The fraction of parameters that the default Int8TrainingConfig leaves unquantized."""
    model = Transformer(args)
    config = fsdp_int8.Int8TrainingConfig()
    quantized = sum(m.weight.numel() for n, m in model.named_modules() if config.should_quantize(m, n))
    return 1 - quantized / sum(p.numel() for p in model.parameters())


def _has_torchao() -> bool:
    try:
        import torchao  # noqa: F401

        return True
    except ImportError:
        return False


if __name__ == "__main__":
    main()
