"""Train a small Llama-style byte-level language model with FSDP2 and int8 weights.

Run it under torchrun, one process per GPU (or per share of the CPU without GPUs):

    torchrun --nproc_per_node 2 -m launch.train --preset tiny --precision int8

--tp 2 splits each block's attention heads and MLP over pairs of neighbouring ranks
(tensor parallelism; the pairs train on one batch, FSDP2 shards over the rest):

    torchrun --nproc_per_node 4 -m launch.train --preset tiny --tp 2

--pp 2 splits the blocks into two pipeline stages on two groups of ranks (stage 0 holds the
embedding, the last the norm and head; a 1F1B schedule runs --microbatches pieces of each
batch through them; FSDP2 shards each stage over its group):

    torchrun --nproc_per_node 4 -m launch.train --preset tiny --pp 2

CUDA + NCCL are used when every local rank has a GPU, CPU + gloo otherwise. The text is
the Python standard library's own source unless --data names a directory or file. A run
writes to --out: metrics.jsonl (every step), loss.png, run.json (which torchrun job owns
the folder), and checkpoints/ every --checkpoint-every steps; --resume (or a torchrun
restart of the same job) continues from the latest one. A new run refuses an --out that
holds another run's checkpoints unless given --resume or --overwrite.
"""

from __future__ import annotations

import argparse
import gc
import math
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

import fsdp_int8
from fsdp_int8.collectives import count_collectives
from fsdp_int8.config import ON
from fsdp_int8.hardware import device_type_for
from launch import arguments, parallel, pipeline, run_dir
from launch.build import build_model
from launch.compile_policy import check_blocks
from launch.data import Corpus, load_corpus, sample_batch
from launch.hardware_choice import resolve_auto
from launch.metrics import RunLog, bits_per_byte, plot_losses, read_metrics
from launch.model import Transformer, routing_stats
from launch.precisions import Recipe, resolve_compile

# Everything random derives from --seed: the initial weights (Transformer.init_weights), the
# stochastic rounding of int8 updates (Int8TrainingConfig.seed) and the batches:
BATCH_SEED_STRIDE = 1_000_003  # a prime above any rank or step count: (seed, rank, step) give distinct seeds
VALIDATION_SEED = 10_000  # data-parallel index r's validation batches: from VALIDATION_SEED + r at every evaluation


# ---------------------------------------------------------------- arguments
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The launcher's arguments, checked and resolved (:func:`launch.arguments.parse`)."""
    return arguments.parse(argv, description=__doc__)


# ---------------------------------------------------------------- the run
def train(args: argparse.Namespace, corpus: Corpus, mode: str) -> None:
    """Set up, then train from step 0 (or the latest checkpoint) to --steps."""
    rank, world, device = setup_distributed()
    recipe = choose_recipe(args, device)
    out = Path(args.out)
    if mode == "resume":  # on every rank, before --out is claimed: a refused resume leaves it as it was
        run_dir.check_recipe(out, run_dir.recipe_of(args), parse_args)
    run_dir.prepare(out, mode)  # --out is this job's (and emptied for --overwrite) before any rank reads it
    mesh = parallel.device_mesh(device.type, tp=args.tp, replicas=args.replicas, pp=args.pp)
    data_index, data_ranks = parallel.data_rank(mesh)  # tensor-parallel peers and pipeline stages train on one batch
    model = build_model(recipe, args.model, device, seed=args.seed, mesh=parallel.stage_mesh(mesh),
                        stage=parallel.pipeline_stage(mesh),  # with --pp: this rank's stage of the model
                        quantize_embeddings=args.quantize_embeddings,
                        activation_checkpointing=args.activation_checkpointing,
                        int8_gathered_weights=args.int8_gathered_weights, cpu_offload=args.cpu_offload,
                        lean=args.lean)
    run = pipeline.runner(model, mesh, device, microbatches=args.microbatches, schedule=args.pp_schedule)
    optimizer = make_optimizer(args, model)
    # a stage holds its part of the checkpoint's keys: the other stages' are no error
    start = run_dir.resume(out, model, optimizer, strict=args.pp == 1) if mode == "resume" else 0
    if start >= args.steps:  # e.g. a restart after the last checkpoint: nothing left to do
        if rank == 0:
            print(f"the run in {out} is complete: its checkpoint is at step {start} and --steps is "
                  f"{args.steps} (raise --steps to train further)", flush=True)
        return
    log = RunLog(out / "metrics.jsonl", total=args.steps, start=start, resumed=mode == "resume", enabled=rank == 0)
    log.start(describe(args, model, corpus, world, device, start, mesh),
              step=start, world_size=world, tp=args.tp, pp=args.pp, precision=args.precision, preset=args.preset)

    tokens_per_step = args.batch_size * args.seq_len * data_ranks
    val, pending = None, None  # pending: a checkpoint still being written (--checkpoint-async)
    compiling = eval_compiles = recipe.blocks or recipe.compile == ON  # the first step and evaluation compile
    if compiling:
        log.note("compiling " + ("each transformer block" if recipe.blocks else "the quantization kernels")
                 + ": the first step and the first evaluation take longer (minutes on a few CPU cores)")
    try:
        for step in range(start, args.steps):
            began = time.perf_counter()
            lr = learning_rate(step, args)
            for group in optimizer.param_groups:
                group["lr"] = lr
            generator = batch_generator(args, data_index, step)
            inputs, targets = sample_batch(corpus.train, args.batch_size, args.seq_len, generator)
            with count_collectives() as counter:  # the bytes each step moves, for the log
                loss = run.train_step(inputs.to(device), targets.to(device))
            grad_norm = None
            if args.grad_clip > 0 and not args.step_in_backward:  # inside backward the optimizer clips
                grad_norm = parallel.clip_grad_norm_(model.parameters(), args.grad_clip, pp_group=parallel.pp_group(mesh))
            optimizer.step()
            optimizer.zero_grad()
            if args.step_in_backward:  # the norm the hooks measured during this step's backward
                grad_norm = optimizer.grad_norm
            log.step(step, loss, lr, time.perf_counter() - began, tokens_per_step, counter, grad_norm,
                     routing_stats(model) if log.enabled else None)
            if compiling and step == start:
                log.compiled(f"step {step}", time.perf_counter() - began)

            done = step + 1
            if done % args.eval_every == 0 or done == args.steps:
                began = time.perf_counter()
                val = evaluate(run, corpus, args, device, data_index)
                log.validation(done, val)
                if eval_compiles:  # the first evaluation compiles too (no autograd: other graphs)
                    log.compiled("the first evaluation", time.perf_counter() - began)
                    eval_compiles = False
            if args.checkpoint_every and (done % args.checkpoint_every == 0 or done == args.steps):
                pending = run_dir.save(out, model, optimizer, done, args, pending)
    except BaseException:  # the save in flight is finished (or reported) before the error ends the run
        run_dir.finish_in_flight(pending)
        raise
    if pending is not None:  # the last checkpoint is published before the run ends
        pending.result()
    log.close(args.steps, val)
    if rank == 0:
        report(args, world, loss.item(), val)


# ---------------------------------------------------------------- what train() calls, in order
def setup_distributed() -> tuple[int, int, torch.device]:
    """Rank, world size and device (a GPU per local rank, else the CPU), from torchrun's environment."""
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    device_type = device_type_for(local_world)
    if device_type != "cpu":
        device = torch.device(device_type, local_rank)
        torch.accelerator.set_device_index(local_rank)
    else:
        device = torch.device("cpu")
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_world))  # the node's cores, shared
    rank, world = run_dir.init_process_group(device)
    return rank, world, device


def choose_recipe(args: argparse.Namespace, device: torch.device) -> Recipe:
    """--precision, --compute-dtype, --compile and --compile-blocks as a recipe, ``auto``
    resolved for this hardware (``args`` takes the choices; rank 0 says what it chose and why)."""
    args.precision, args.compute_dtype, why = resolve_auto(args.precision, args.compute_dtype, device)
    if why and dist.get_rank() == 0:
        print(why, flush=True)
    check_blocks(args, fp32=Recipe.of(args.precision, args.compute_dtype).computes_in_fp32)
    return Recipe.of(args.precision, args.compute_dtype, resolve_compile(args.compile, args.model.dim),
                     args.compile_blocks)


def make_optimizer(args: argparse.Namespace, model: Transformer) -> torch.optim.Optimizer:
    if args.optimizer == "adamw":
        optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.weight_decay)
        fsdp_int8.optim.batch_int8_updates(optimizer)  # int8 updates' checks: one device sync per step
        return optimizer
    state_bits = {"int8-adamw-8bit": 8, "int8-adamw-4bit": 4}.get(args.optimizer, 32)
    if args.lean:  # the library's lean call, with this run's --optimizer and --grad-clip
        return fsdp_int8.Int8AdamW.lean(model.parameters(), lr=args.lr, weight_decay=args.weight_decay,
                                        state_bits=state_bits, max_grad_norm=args.grad_clip or None)
    return fsdp_int8.Int8AdamW(model.parameters(), lr=args.lr, weight_decay=args.weight_decay,
                               state_bits=state_bits, step_in_backward=args.step_in_backward,
                               grad_dtype=torch.bfloat16 if args.bf16_grads else None,
                               max_grad_norm=(args.grad_clip or None) if args.step_in_backward else None)


def describe(args: argparse.Namespace, model: Transformer, corpus: Corpus, world: int, device: torch.device,
             start: int, mesh: DeviceMesh) -> str:
    """The run's opening line (a collective under --pp: the stages' parameters are counted together)."""
    params = torch.tensor(float(sum(p.numel() for p in model.parameters())), device=device)
    if args.pp > 1:
        dist.all_reduce(params, group=parallel.pp_group(mesh))
    params = params.item()
    dims = [f"pp {args.pp}"] * (args.pp > 1) + [f"tp {args.tp}"] * (args.tp > 1) + [f"dp {world // (args.tp * args.pp)}"]
    schedule = [f"{args.pp_schedule} over {args.microbatches} microbatches"] * (args.pp > 1)
    layout = f" ({', '.join([' x '.join(dims), *schedule])})" if len(dims) > 1 else ""
    return (f"{args.precision} {args.preset}: {params / 1e6:.2f}M parameters on {world} x {device.type}{layout}; "
            f"{corpus.train.numel() / 1e6:.1f} MB of text from {corpus.source}"
            + (f"; resumed at step {start}" if start else ""))


def learning_rate(step: int, args: argparse.Namespace) -> float:
    """Linear warm-up, then cosine decay to a tenth of the peak."""
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    progress = (step - args.warmup) / max(1, args.steps - args.warmup)
    return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def batch_generator(args: argparse.Namespace, data_index: int, step: int) -> torch.Generator:
    """The batch depends only on (seed, data-parallel index, step): a resumed run sees the
    same data, and tensor-parallel peers (one data index) the same batch."""
    return torch.Generator().manual_seed((args.seed * BATCH_SEED_STRIDE + data_index) * BATCH_SEED_STRIDE + step)


@torch.no_grad()
def evaluate(run: pipeline.WholeModel | pipeline.Pipeline, corpus: Corpus, args: argparse.Namespace,
             device: torch.device, data_index: int) -> float:
    """Mean validation loss over --eval-batches per data-parallel index, the same batches every
    time (tensor-parallel peers and pipeline stages have the same losses: the mean over all
    ranks is theirs)."""
    generator = torch.Generator().manual_seed(VALIDATION_SEED + data_index)
    total = torch.zeros((), device=device)
    for _ in range(args.eval_batches):
        inputs, targets = sample_batch(corpus.val, args.batch_size, args.seq_len, generator)
        total += run.eval_loss(inputs.to(device), targets.to(device))
    dist.all_reduce(total)
    return total.item() / (args.eval_batches * dist.get_world_size())


def report(args: argparse.Namespace, world: int, last_loss: float, val: float | None) -> None:
    """Rank 0's closing line and loss plot."""
    out = Path(args.out)
    records = read_metrics(out / "metrics.jsonl")
    plot = plot_losses(records, out / "loss.png", f"{args.preset}, {args.precision}, {world} ranks")
    first = next((r["loss"] for r in records if "loss" in r), float("nan"))
    rates = [r["tokens_per_s"] for r in records if "tokens_per_s" in r]
    print(
        f"done: {args.steps} steps | train loss {first:.3f} -> {last_loss:.3f} | "
        f"validation {val:.4f} ({bits_per_byte(val):.3f} bits/byte) | "
        f"median {sorted(rates)[len(rates) // 2] if rates else 0:,.0f} tok/s | "
        f"{out / 'metrics.jsonl'}" + (f", {plot}" if plot else ""),
        flush=True,
    )


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)  # what checkpoints record
    if "RANK" not in os.environ:
        print("launch.train runs under torchrun, e.g.: torchrun --nproc_per_node 2 -m launch.train", file=sys.stderr)
        return 2
    try:  # before the process group exists: bad input fails here on every rank, no hang
        mode = run_dir.start_mode(Path(args.out), resume=args.resume, overwrite=args.overwrite)
        corpus = load_corpus(args.data, args.max_bytes)
        if corpus.val.numel() <= args.seq_len + 1:
            raise ValueError(
                f"the validation split of {corpus.source} has {corpus.val.numel()} bytes, fewer "
                f"than one sequence of {args.seq_len + 1}: use more text or a smaller --seq-len"
            )
    except (OSError, ValueError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    try:
        train(args, corpus, mode)
        gc.collect()  # free the model's FSDP state before the process group goes (gloo aborts at exit otherwise)
        dist.barrier()
    except run_dir.RecipeMismatch as error:  # every rank refuses; one says why
        if dist.get_rank() == 0:
            print(f"error: {error}", file=sys.stderr, flush=True)
        dist.barrier()  # torchrun ends the other ranks when one exits: not before rank 0 has said it
        return 2
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
