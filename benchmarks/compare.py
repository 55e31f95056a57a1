"""fsdp_int8 against fp32 / bf16 FSDP2 and torchao's int8 training, on one model, data and world size.

    python -m benchmarks.compare                       # the full comparison (about 10 min on 2 cores)
    python -m benchmarks.compare --quick               # fewer steps, a smoke run
    python -m benchmarks.compare --write-docs docs     # also writes docs/benchmarks.md and its plots

Every row trains the launcher's Llama-style model (default: preset small) on the
embedded corpus (Python's standard library source) with torch AdamW (weight decay 0, so
torchao can run) for the same number of steps, each row in fresh processes, one after
another in this one run. Columns:

* all-gather / step: bytes of every all-gather buffer in one training step (all ranks'
  shares), counted at the torch.distributed calls;
* collectives / step: all collectives of the step (all-gathers, reduce-scatters, ...);
  in a ring each rank sends (N - 1) / N of these buffers (the sweeps print that);
* step ms: median step time on rank 0, and its speed-up over fp32 FSDP2;
* peak RSS: the largest resident set of any rank (includes torch itself);
* bytes/param: each rank's parameters + gradients + optimizer states per parameter;
* val loss: validation loss (nats per byte) after the budget.

Then two sweeps, a few steps each: bytes and time against the world size (1, 2, 4) and
against the model width, for bf16 FSDP2 and fsdp_int8.
"""

from __future__ import annotations

import argparse
import os
import platform
import resource
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

import fsdp_int8
from benchmarks.speed_memory import cpu_description
from fsdp_int8.testing import device_type_for, run_distributed
from launch.data import load_corpus, sample_batch
from launch.model import PRESETS, ModelArgs, Transformer

BF16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
ALL_BF16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)

# name -> (how the model is prepared, AdamW weight decay)
ROWS = {
    "fp32 FSDP2": ("fp32", 0.0),
    "bf16 FSDP2": ("bf16", 0.0),
    "fsdp_int8 weight-only": ("int8", 0.0),
    "fsdp_int8 int8 matmuls": ("int8-mm", 0.0),
    "all-bf16 FSDP2 (bf16 reduce)": ("all-bf16", 0.0),
    "fsdp_int8 + int8 gradients": ("int8-grads", 0.0),
    "torchao int8 weight-only": ("torchao", 0.0),
    "torchao, weight decay 0.1": ("torchao", 0.1),
    "fsdp_int8, weight decay 0.1": ("int8", 0.1),
}


def model_args(settings: dict, dim: int | None = None) -> ModelArgs:
    fields = dict(PRESETS[settings["preset"]].__dict__)
    if dim:
        fields.update(dim=dim, hidden_dim=0, n_heads=max(1, dim // 64))
    fields["max_seq_len"] = max(fields["max_seq_len"], settings["seq_len"])
    return ModelArgs(**fields)


def _shard_torchao(model: torch.nn.Module) -> None:
    from torchao.prototype.quantized_training import int8_weight_only_quantized_training
    from torchao.quantization import quantize_

    quantize_(model, int8_weight_only_quantized_training())
    for block in model.layers:
        fully_shard(block)
    fully_shard(model, reshard_after_forward=False)


def prepare(kind: str, args: ModelArgs) -> torch.nn.Module:
    torch.manual_seed(0)
    model = Transformer(args)
    model.init_weights()
    model.to(device_type_for(dist.get_world_size()))
    if kind == "torchao":
        _shard_torchao(model)
    elif kind.startswith("int8"):
        matmuls = fsdp_int8.Int8MatmulConfig() if kind == "int8-mm" else None
        config = fsdp_int8.Int8TrainingConfig(int8_matmul=matmuls, quantize_gradients=kind == "int8-grads")
        fsdp_int8.shard_model(model, config=config)
    else:
        policy = {"fp32": None, "bf16": BF16, "all-bf16": ALL_BF16}[kind]
        fsdp_int8.shard_model(model, quantize=False, mp_policy=policy)
    return model


def _train_row(rank: int, world: int, kind: str, weight_decay: float, settings: dict) -> dict:
    torch.set_num_threads(settings["threads"])
    device = torch.device(device_type_for(world))
    args = model_args(settings, settings.get("dim"))
    corpus = load_corpus(None, settings["max_bytes"])
    model = prepare(kind, args)
    optimizer = torch.optim.AdamW(model.parameters(), lr=settings["lr"], weight_decay=weight_decay)
    times, gathered, collective, sent, bytes_per_param = [], 0, 0, 0.0, 0.0
    for step in range(settings["steps"]):
        data = torch.Generator().manual_seed(step * 1000 + rank)
        inputs, targets = sample_batch(corpus.train, settings["batch_size"], settings["seq_len"], data)
        began = time.perf_counter()
        with fsdp_int8.count_collectives() as counter:
            loss = F.cross_entropy(model(inputs.to(device)).flatten(0, 1).float(), targets.to(device).flatten())
            loss.backward()
        optimizer.step()
        if step == 1:
            bytes_per_param = fsdp_int8.persistent_bytes(model, optimizer).per_param
            gathered, collective = counter.total_bytes("all_gather_single"), counter.total_bytes()
            sent = counter.wire_bytes()
        optimizer.zero_grad()
        dist.barrier()
        if step >= 2:
            times.append(time.perf_counter() - began)
    val = torch.zeros((), device=device)
    if settings["eval_batches"]:
        generator = torch.Generator().manual_seed(99 + rank)
        with torch.no_grad():
            for _ in range(settings["eval_batches"]):
                inputs, targets = sample_batch(corpus.val, settings["batch_size"], settings["seq_len"], generator)
                val += F.cross_entropy(model(inputs.to(device)).flatten(0, 1).float(), targets.to(device).flatten())
        dist.all_reduce(val)
        val /= settings["eval_batches"] * world
    peak = torch.tensor(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0, device=device)
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    return dict(step_s=statistics.median(times) if times else float("nan"), all_gather=gathered,
                collectives=collective, sent_per_rank=sent, peak_mb=peak.item(), bytes_per_param=bytes_per_param,
                val_loss=val.item() if settings["eval_batches"] else float("nan"))


def _run(kind: str, weight_decay: float, settings: dict, world: int) -> dict | str:
    try:
        return run_distributed(_train_row, world, kind, weight_decay, settings, timeout=1800)[0]
    except Exception as error:  # the peer's failures are results too: show them
        lines = [l for l in str(error).strip().splitlines() if l.strip() and not l.startswith(" ")]
        return (lines[-1] if lines else repr(error))[:110]


def _mb(n: float) -> str:
    return f"{n / 1e6:.3f} MB"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="small", choices=list(PRESETS))
    parser.add_argument("--steps", type=int, default=150, help="training budget of every row")
    parser.add_argument("--batch-size", type=int, default=8, help="sequences per rank")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--threads", type=int, default=max(1, (os.cpu_count() or 1) // 2), help="per rank")
    parser.add_argument("--quick", action="store_true", help="20 steps, short sweeps: a smoke run")
    parser.add_argument("--write-docs", type=Path, help="write benchmarks.md and plots into this docs folder")
    args = parser.parse_args(argv)
    if args.quick:
        args.steps = 20
    settings = dict(preset=args.preset, steps=args.steps, batch_size=args.batch_size, seq_len=args.seq_len,
                    lr=args.lr, threads=args.threads, eval_batches=8, max_bytes=8_000_000)
    model = model_args(settings)
    params = sum(p.numel() for p in Transformer(model).parameters())
    lines: list[str] = []

    def say(text: str = "") -> None:
        print(text, flush=True)
        lines.append(text)

    say(f"model: launcher Transformer, preset {args.preset!r} (dim {model.dim}, {model.n_layers} blocks, "
        f"{params / 1e6:.2f}M params); batch {args.batch_size} x {args.seq_len} bytes per rank; "
        f"{args.world_size} ranks on {device_type_for(args.world_size)}, {args.threads} thread(s) each; "
        f"{args.steps} steps of torch AdamW (lr {args.lr})")
    say(f"CPU: {cpu_description()}; torch {torch.__version__}; Python {platform.python_version()}")
    try:
        import torchao

        say(f"torchao {torchao.__version__}")
    except ImportError:
        say("torchao: not installed (pip install -e '.[bench]'): its rows are skipped")
    say()
    header = (f"| {'row':<27} | {'all-gather / step':>17} | {'collectives / step':>18} | {'step ms':>8} | "
              f"{'vs fp32':>7} | {'peak RSS MB':>11} | {'bytes/param':>11} | {'val loss':>8} |")
    say(header)
    say("|" + "|".join("-" * (len(c)) for c in header.split("|")[1:-1]) + "|")
    results: dict[str, dict | str] = {}
    for name, (kind, weight_decay) in ROWS.items():
        if kind == "torchao" and not _has_torchao():
            say(f"| {name:<27} | skipped: torchao is not installed |")
            continue
        results[name] = row = _run(kind, weight_decay, settings, args.world_size)
        if isinstance(row, str):
            say(f"| {name:<27} | failed: {row} |")
            continue
        base = results.get("fp32 FSDP2")
        ratio = f"{base['step_s'] / row['step_s']:.2f}x" if isinstance(base, dict) else "-"
        say(f"| {name:<27} | {_mb(row['all_gather']):>17} | {_mb(row['collectives']):>18} | "
            f"{row['step_s'] * 1e3:8.1f} | {ratio:>7} | {row['peak_mb']:11.0f} | "
            f"{row['bytes_per_param']:11.2f} | {row['val_loss']:8.4f} |")

    ours, titan, all_bf16 = (results.get(k) for k in
                             ("fsdp_int8 + int8 gradients", "bf16 FSDP2", "all-bf16 FSDP2 (bf16 reduce)"))
    if all(isinstance(r, dict) for r in (ours, titan, all_bf16)):
        say()
        say(f"Whole-step collective bytes of fsdp_int8 + int8 gradients: "
            f"{ours['collectives'] / titan['collectives']:.3f} of bf16 params + fp32 reduce (torchtitan's "
            f"default; target <= 0.40), {ours['collectives'] / all_bf16['collectives']:.3f} of all-bf16 "
            f"(target <= 0.55). Embeddings, norms and the output head stay in full precision here "
            f"({_full_precision_share(model):.1%} of the parameters).")

    sweep = dict(settings, steps=6 if args.quick else 12, eval_batches=0)
    say()
    say("How bytes and time grow with the world size (same model, batch per rank fixed):")
    world_rows = []
    for world in (1, 2, 4):
        for kind, label in (("bf16", "bf16 FSDP2"), ("int8", "fsdp_int8")):
            row = _run(kind, 0.0, sweep, world)
            if isinstance(row, dict):
                world_rows.append((world, label, row))
                say(f"  world {world}, {label:<11}: all-gather {_mb(row['all_gather']):>12}/step, each rank "
                    f"sends {_mb(row['sent_per_rank']):>12}/step (all collectives), step {row['step_s'] * 1e3:7.1f} ms")
            else:
                say(f"  world {world}, {label:<11}: failed: {row}")
    say()
    say(f"How bytes and time grow with the model width ({args.world_size} ranks):")
    width_rows = []
    for dim in (128, 256, 512) if args.quick else (128, 256, 512, 1024):
        for kind, label in (("bf16", "bf16 FSDP2"), ("int8", "fsdp_int8")):
            row = _run(kind, 0.0, dict(sweep, dim=dim), args.world_size)
            if isinstance(row, dict):
                width_rows.append((dim, label, row))
                say(f"  dim {dim:5d}, {label:<11}: all-gather {_mb(row['all_gather']):>12}/step, "
                    f"step {row['step_s'] * 1e3:7.1f} ms")
            else:
                say(f"  dim {dim:5d}, {label:<11}: failed: {row}")
    if args.write_docs:
        from benchmarks.report import write_report

        command = "python -m benchmarks.compare " + " ".join(argv if argv is not None else os.sys.argv[1:])
        write_report(args.write_docs, command, lines, results, world_rows, width_rows)


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
