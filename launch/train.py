"""Train a small Llama-style byte-level LM with FSDP2 and int8 weights.

Run under torchrun (one process per GPU, or per CPU share without GPUs)::

    torchrun --nproc_per_node 2 -m launch.train --preset tiny --precision int8

The device and backend come from the environment: CUDA + NCCL when every local rank has
a GPU, CPU + gloo otherwise. The default corpus is the Python standard library's source.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.fsdp import MixedPrecisionPolicy

import fsdp_int8
from launch.data import load_corpus, sample_batch
from launch.model import PRESETS, ModelArgs, Transformer

PRECISIONS = ("fp32", "bf16", "int8")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="launch.train",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    model = parser.add_argument_group("model")
    model.add_argument("--preset", default="tiny", help=f"model size: {', '.join(PRESETS)}")
    model.add_argument("--dim", type=int, help="override the preset's width")
    model.add_argument("--n-layers", type=int, help="override the preset's depth")
    model.add_argument("--n-heads", type=int, help="override the preset's head count")
    train = parser.add_argument_group("training")
    train.add_argument("--precision", default="int8", choices=PRECISIONS,
                       help="fp32 / bf16-mixed FSDP2 baselines, or int8 weights (default)")
    train.add_argument("--compute-dtype", default="fp32", choices=("fp32", "bf16"),
                       help="matmul dtype of int8 runs (the int8 all-gather is the same)")
    train.add_argument("--steps", type=int, default=300, help="optimizer steps")
    train.add_argument("--batch-size", type=int, default=16, help="sequences per rank and step")
    train.add_argument("--seq-len", type=int, default=128, help="bytes per sequence")
    train.add_argument("--lr", type=float, default=3e-3, help="AdamW peak learning rate")
    train.add_argument("--weight-decay", type=float, default=0.1)
    train.add_argument("--warmup", type=int, default=20, help="linear warm-up steps")
    train.add_argument("--seed", type=int, default=0)
    data = parser.add_argument_group("data")
    data.add_argument("--data", help="directory or file of text (default: Python's stdlib source)")
    data.add_argument("--max-bytes", type=int, default=None, help="read at most this much text")
    out = parser.add_argument_group("output")
    out.add_argument("--log-every", type=int, default=25, help="print every N steps")
    out.add_argument("--eval-batches", type=int, default=8, help="validation batches per rank")
    args = parser.parse_args(argv)
    if args.preset not in PRESETS:
        parser.error(f"unknown preset {args.preset!r}; choose one of {', '.join(PRESETS)}")
    for name in ("steps", "batch_size", "seq_len", "log_every", "eval_batches"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    return args


def model_args(args: argparse.Namespace) -> ModelArgs:
    preset = PRESETS[args.preset]
    overrides = {k: getattr(args, k) for k in ("dim", "n_layers", "n_heads") if getattr(args, k)}
    fields = {**preset.__dict__, **overrides, "hidden_dim": 0 if overrides else preset.hidden_dim}
    fields["max_seq_len"] = max(fields["max_seq_len"], args.seq_len)
    return ModelArgs(**fields)


def setup_distributed() -> tuple[int, int, torch.device]:
    """Rank, world size and device from torchrun's environment."""
    if "RANK" not in os.environ:
        raise SystemExit("run this under torchrun, e.g. torchrun --nproc_per_node 2 -m launch.train")
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    if torch.cuda.is_available() and torch.cuda.device_count() >= local_world:
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_world))
    dist.init_process_group(backend=dist.get_default_backend_for_device(device))
    return dist.get_rank(), dist.get_world_size(), device


def build_model(args: argparse.Namespace, device: torch.device) -> Transformer:
    """Build on meta, shard (quantizing for int8), allocate on the device, initialise."""
    with torch.device("meta"):
        model = Transformer(model_args(args))
    bf16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    if args.precision == "int8":
        fsdp_int8.shard_model(
            model, config=fsdp_int8.Int8TrainingConfig(seed=args.seed),
            mp_policy=bf16 if args.compute_dtype == "bf16" else None,
        )
    else:
        fsdp_int8.shard_model(model, quantize=False, mp_policy=bf16 if args.precision == "bf16" else None)
    model.to_empty(device=device)
    torch.manual_seed(args.seed)
    model.init_weights()
    return model


def learning_rate(step: int, args: argparse.Namespace) -> float:
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    progress = (step - args.warmup) / max(1, args.steps - args.warmup)
    return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def loss_on(model: Transformer, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    logits = model(inputs)
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


@torch.no_grad()
def evaluate(model, data, args, rank, device) -> float:
    generator = torch.Generator().manual_seed(10_000 + rank)
    total = torch.zeros((), device=device)
    for _ in range(args.eval_batches):
        inputs, targets = sample_batch(data, args.batch_size, args.seq_len, generator)
        total += loss_on(model, inputs.to(device), targets.to(device))
    dist.all_reduce(total)
    return total.item() / (args.eval_batches * dist.get_world_size())


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    corpus = load_corpus(args.data, args.max_bytes)  # before the process group: fail fast
    rank, world, device = setup_distributed()
    try:
        model = build_model(args, device)
        optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.weight_decay)
        generator = torch.Generator().manual_seed(args.seed * 1000 + rank)
        if rank == 0:
            params = sum(p.numel() for p in model.parameters())
            print(
                f"training {params / 1e6:.2f}M params ({args.preset}, {args.precision}) on {world} "
                f"x {device.type}, {corpus.train.numel() / 1e6:.1f} MB of text from {corpus.source}",
                flush=True,
            )
        started = time.perf_counter()
        for step in range(args.steps):
            for group in optimizer.param_groups:
                group["lr"] = learning_rate(step, args)
            inputs, targets = sample_batch(corpus.train, args.batch_size, args.seq_len, generator)
            with fsdp_int8.count_collectives() as counter:
                loss = loss_on(model, inputs.to(device), targets.to(device))
                loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad()
            if rank == 0 and (step % args.log_every == 0 or step == args.steps - 1):
                gathered = counter.total_bytes("all_gather_single")
                tokens = (step + 1) * args.batch_size * args.seq_len * world
                print(
                    f"step {step:5d}  loss {loss.item():.4f}  "
                    f"{tokens / (time.perf_counter() - started):8.0f} tok/s  "
                    f"all-gather {gathered / 1e6:.3f} MB/step",
                    flush=True,
                )
        val = evaluate(model, corpus.val, args, rank, device)
        if rank == 0:
            print(f"done: {args.steps} steps, validation loss {val:.4f} ({val / math.log(2):.3f} bits/byte)")
    finally:
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
