"""Step time and persistent memory: fp32 / bf16 FSDP2 against int8 weights, with three optimizers.

    python -m benchmarks.speed_memory                  # dim 1024, 2 blocks, 2 ranks
    python -m benchmarks.speed_memory --preset small   # the launcher's small preset as is

Every row trains the same model on the same data for the same steps, each in fresh
processes (so each peak RSS is its own), one after another in this one run: read the
ratios, not the absolute times (these machines are noisy). Columns:

* step: median wall time of a training step (forward, backward, clip, optimizer), rank 0;
* vs bf16, vs fp32: the bf16 FSDP2 (bf16 parameters, fp32 reduction: the baseline users
  run) and fp32 FSDP2 rows with torch AdamW of this run, over that median (higher is faster);
  every int8 row computes in bf16 like the launcher, with its compiled kernels from width 512;
* bytes/param: storage of each rank's own parameters + gradients + optimizer states,
  divided by its parameter count (fp32 + Adam: 16); 8-bit AdamW keeps its moments in
  blocks of 128 values per scale;
* peak RSS: the largest resident set of any rank, for context (includes torch itself).
"""

from __future__ import annotations

import argparse
import os
import sys
import resource
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

import fsdp_int8
from fsdp_int8 import _hardware
from fsdp_int8.testing import device_type_for, run_distributed
from launch.model import PRESETS, ModelArgs, Transformer
from launch.train import compiled_kernels_wanted, int8_matmuls

# Every int8 row computes in bf16 (bf16 parameters, fp32 reduction), as the launcher does, with
# the compiled quantization kernels on from width 512 (the launcher's --compile auto).
# int8: weight-only; int8-mm: all three GEMMs in int8 (the default Int8MatmulConfig);
# int8-mm-wgrad-bf16: the weight gradient's GEMM in bf16; int8-bf16: int8 weights of a bf16
# model (bf16 gradients and reduction too).
PRECISIONS = ("fp32", "bf16", "int8", "int8-mm", "int8-mm-wgrad-bf16", "int8-bf16")
LABELS = {"bf16": "bf16 FSDP2", "fp32": "fp32 FSDP2", "int8": "int8 weight-only"}
EIGHT_BIT_BLOCK = 128  # values per scale of 8-bit Adam states
OPTIMIZERS = ("torch AdamW", "fused AdamW", "8-bit AdamW")


def bench_model_args(settings: dict) -> ModelArgs:
    """The preset with the benchmark's overrides and room for its sequence length."""
    fields = dict(PRESETS[settings["preset"]].__dict__)
    overrides = {k: settings[k] for k in ("dim", "n_layers", "n_heads") if settings.get(k)}
    if overrides:
        fields.update(overrides, hidden_dim=0)
    fields["max_seq_len"] = max(fields["max_seq_len"], settings["seq_len"])
    return ModelArgs(**fields)


def build(precision: str, preset: ModelArgs) -> Transformer:
    torch.manual_seed(0)
    model = Transformer(preset)
    model.init_weights()
    if precision == "int8-bf16":
        model.to(torch.bfloat16)
    bf16 = torch.distributed.fsdp.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    if precision.startswith("int8"):
        fsdp_int8.quant.use_compiled_kernels(compiled_kernels_wanted("auto", preset.dim))
        fsdp_int8.shard_model(model, config=fsdp_int8.Int8TrainingConfig(int8_matmul=int8_matmuls(precision)),
                              mp_policy=None if precision == "int8-bf16" else bf16)
    else:
        fsdp_int8.shard_model(model, quantize=False, mp_policy=bf16 if precision == "bf16" else None)
    return model


def make_optimizer(name: str, precision: str, model: torch.nn.Module) -> torch.optim.Optimizer:
    params = model.parameters()
    if name == "torch AdamW":
        return torch.optim.AdamW(params, lr=1e-3, weight_decay=0.1)
    if name == "fused AdamW" and not precision.startswith("int8"):
        return torch.optim.AdamW(params, lr=1e-3, weight_decay=0.1, fused=True)
    from fsdp_int8.optim import Int8AdamW  # fused: one requantization per step

    if name.startswith("8-bit"):
        return Int8AdamW(params, lr=1e-3, weight_decay=0.1, state_bits=8, block_size=EIGHT_BIT_BLOCK)
    return Int8AdamW(params, lr=1e-3, weight_decay=0.1)


def _row(rank: int, world: int, precision: str, optimizer_name: str, args_dict: dict) -> dict:
    torch.set_num_threads(args_dict["threads"])
    preset = bench_model_args(args_dict)
    model = build(precision, preset)
    optimizer = make_optimizer(optimizer_name, precision, model)
    data = torch.Generator().manual_seed(rank)
    times, bytes_per_param = [], 0.0
    for step in range(args_dict["warmup"] + args_dict["steps"]):
        tokens = torch.randint(0, preset.vocab_size, (args_dict["batch_size"], args_dict["seq_len"] + 1), generator=data)
        began = time.perf_counter()
        loss = F.cross_entropy(model(tokens[:, :-1]).flatten(0, 1).float(), tokens[:, 1:].flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        if step == 0:  # grads and states exist now, before zero_grad frees the grads
            bytes_per_param = fsdp_int8.persistent_bytes(model, optimizer).per_param
        optimizer.zero_grad()
        dist.barrier()
        if step >= args_dict["warmup"]:
            times.append(time.perf_counter() - began)
    peak = torch.tensor(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0)
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
    parser.add_argument("--precisions", nargs="+", default=list(PRECISIONS), choices=PRECISIONS)
    parser.add_argument("--optimizers", nargs="+", default=list(OPTIMIZERS), choices=OPTIMIZERS)
    parser.add_argument("--write-docs", type=Path, help="also write the output to this docs folder")
    args = parser.parse_args(argv)
    lines: list[str] = []

    def say(text: str = "") -> None:
        print(text, flush=True)
        lines.append(text)

    settings = {k: getattr(args, k) for k in
                ("preset", "dim", "n_layers", "n_heads", "batch_size", "seq_len", "steps", "warmup", "threads")}
    preset = bench_model_args(settings)
    params = sum(p.numel() for p in Transformer(preset).parameters())
    say(f"model: launcher Transformer, preset {args.preset!r} with dim {preset.dim}, {preset.n_layers} "
          f"blocks, {preset.n_heads} heads ({params / 1e6:.2f}M params), batch {args.batch_size} x {args.seq_len} per rank, world size "
          f"{args.world_size}, {args.threads} thread(s) per rank, {args.steps} timed steps after {args.warmup}")
    say(_hardware.hardware_line(device_type_for(args.world_size)))
    header = (f"{'precision':<19} {'optimizer':<12} {'step ms':>8} {'vs bf16':>8} {'vs fp32':>8} {'bytes/param':>12} "
              f"{'peak RSS MB':>12}")
    say(header)
    say("-" * len(header))
    baselines: dict[str, float] = {}  # fp32 / bf16 FSDP2 with torch AdamW: step seconds
    for precision in args.precisions:
        for optimizer in args.optimizers:
            label = LABELS.get(precision, precision)
            try:
                row = run_distributed(_row, args.world_size, precision, optimizer, settings)[0]
            except Exception as error:  # print the failure in its row, keep the table going
                say(f"{label:<19} {optimizer:<12} failed: {str(error).strip().splitlines()[-1][:90]}")
                continue
            if precision in ("fp32", "bf16") and optimizer == "torch AdamW":
                baselines[precision] = row["step_s"]
            ratios = [f"{baselines[b] / row['step_s']:.2f}x" if b in baselines else "-" for b in ("bf16", "fp32")]
            say(f"{label:<19} {optimizer:<12} {row['step_s'] * 1e3:8.1f} {ratios[0]:>8} {ratios[1]:>8} "
                f"{row['bytes_per_param']:12.2f} {row['peak_rss_mb']:12.0f}")
    say("vs bf16 / vs fp32: speed-up over bf16 FSDP2 (bf16 params, fp32 reduce; the baseline users run) and over "
        "fp32 FSDP2, each with torch AdamW (higher is faster); int8 rows compute in bf16, int8-bf16 holds a bf16 model")
    if args.write_docs:
        from benchmarks.report import write_verbatim

        command = "python -m benchmarks.speed_memory " + " ".join(argv if argv is not None else sys.argv[1:])
        write_verbatim(args.write_docs / "speed_memory.md", "Speed and memory", command, lines)


if __name__ == "__main__":
    main()
