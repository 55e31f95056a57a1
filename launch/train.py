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
from fsdp_int8.config import AUTO, COMPILE_CHOICES, ON
from fsdp_int8.hardware import device_type_for
from launch import parallel, pipeline, run_dir
from launch.build import build_model
from launch.compile_policy import BLOCKS_FLAG, check_blocks, compile_choice
from launch.data import Corpus, load_corpus, sample_batch
from launch.hardware_choice import resolve_auto
from launch.metrics import RunLog, bits_per_byte, plot_losses, read_metrics
from launch.model import PRESETS, Transformer, check_pp, check_tp, model_args, routing_stats
from launch.precisions import LAUNCHER_PRECISIONS, PRECISIONS, Recipe, resolve_compile

# Everything random derives from --seed: the initial weights (Transformer.init_weights), the
# stochastic rounding of int8 updates (Int8TrainingConfig.seed) and the batches:
BATCH_SEED_STRIDE = 1_000_003  # a prime above any rank or step count: (seed, rank, step) give distinct seeds
VALIDATION_SEED = 10_000  # data-parallel index r's validation batches: from VALIDATION_SEED + r at every evaluation


# ---------------------------------------------------------------- arguments
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="torchrun --nproc_per_node N -m launch.train",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    model = parser.add_argument_group("model")
    model.add_argument("--preset", default="tiny", choices=list(PRESETS),
                       help="model size (default: tiny, for CPUs; 1b is about a billion parameters)")
    model.add_argument("--dim", type=int, help="override the preset's width")
    model.add_argument("--n-layers", type=int, help="override the preset's number of blocks")
    model.add_argument("--n-heads", type=int, help="override the preset's attention heads")
    train = parser.add_argument_group("training")
    train.add_argument("--precision", default=AUTO, choices=(AUTO, *LAUNCHER_PRECISIONS),
                       help="auto (default): int8-mm where this hardware has a fast int8 GEMM, else int8; "
                       + "; ".join(f"{name}: {PRECISIONS[name].help}" for name in LAUNCHER_PRECISIONS))
    train.add_argument("--compute-dtype", default=AUTO, choices=(AUTO, "fp32", "bf16"),
                       help="compute dtype of int8 runs; auto (default): bf16 where this hardware has "
                       "fast bf16 matmuls, else fp32 (the all-gather is int8 either way)")
    train.add_argument("--compile", default=AUTO, choices=COMPILE_CHOICES, type=compile_choice,
                       help="the int8 quantization kernels, as Int8TrainingConfig(compile=...): on: fused "
                       "with torch.compile; off: eager; auto (default): on from width 512, where it repays "
                       "its ~15 s of start-up per process, on a machine with a compiler")
    train.add_argument(BLOCKS_FLAG, action="store_true", help="compile every transformer block whole "
                       "(torchtitan's per-block compile, before sharding; --compile still decides the kernels "
                       "of the weight updates outside the blocks); off by default, not with --tp or --pp")
    train.add_argument("--steps", type=int, default=300, help="optimizer steps in the whole run")
    train.add_argument("--batch-size", type=int, default=16, help="sequences per rank and step")
    train.add_argument("--seq-len", type=int, default=128, help="bytes per sequence")
    train.add_argument("--optimizer", choices=("adamw", "int8-adamw", "int8-adamw-8bit"),
                       help="torch AdamW (the default), fsdp_int8's fused AdamW (one requantization per step), "
                       "or the same with 8-bit Adam states (the default with --lean)")
    train.add_argument("--lr", type=float, default=3e-3, help="AdamW peak learning rate")
    train.add_argument("--weight-decay", type=float, default=0.1, help="AdamW weight decay")
    train.add_argument("--warmup", type=int, default=20, help="linear warm-up steps, then cosine")
    train.add_argument("--grad-clip", type=float, default=1.0,
                       help="max gradient norm (0: off; default 1.0); with --step-in-backward, by the step's norm as estimated "
                       "when each gradient arrives (Int8AdamW's max_grad_norm: the step's own norm does not exist inside backward)")
    train.add_argument("--step-in-backward", action="store_true",
                       help="with --optimizer int8-adamw or int8-adamw-8bit: update each parameter inside "
                       "backward as soon as its gradient is reduced, and free the gradient (gradients never "
                       "all live at once; --grad-clip by the step's norm as estimated so far; not with --pp)")
    train.add_argument("--bf16-grads", action="store_true",
                       help="with --optimizer int8-adamw or int8-adamw-8bit: keep gradients in bf16 from their "
                       "reduce-scatter to the step (half their memory; not with --step-in-backward)")
    train.add_argument("--quantize-embeddings", action="store_true",
                       help="int8 precisions: int8 token embedding too (one scale per token row)")
    train.add_argument("--int8-gathered-weights", action="store_true",
                       help="int8 precisions: keep FSDP2's gathered weights int8 and dequantize a transient "
                       "copy per matmul (the values of weight-only int8, half the gathered bytes)")
    train.add_argument("--activation-checkpointing", action="store_true",
                       help="recompute each block's activations in backward instead of keeping them")
    train.add_argument("--lean", action="store_true",
                       help="the lean-memory recipe in one word: --optimizer int8-adamw-8bit --step-in-backward "
                       "--quantize-embeddings --int8-gathered-weights --activation-checkpointing (clipping by the "
                       "step's gradient norm as estimated when each gradient arrives; docs/memory.md)")
    train.add_argument("--cpu-offload", action="store_true", help="FSDP2's CPU offload: sharded weights, gradients, "
                       "optimizer states and the step in host memory (the GPU holds gathered groups only; docs/memory.md)")
    train.add_argument("--replicas", type=int, default=1,
                       help="HSDP: replicate the sharded model over this many groups of ranks")
    train.add_argument("--tp", type=int, default=1,
                       help="tensor-parallel degree: split each block's attention and MLP over this many "
                       "neighbouring ranks, which train on one batch (FSDP over the world / tp others)")
    train.add_argument("--pp", type=int, default=1,
                       help="pipeline-parallel degree: split the blocks into this many stages, each on "
                       "world / pp ranks (which FSDP shards it over); the stages of one data-parallel "
                       "index train on one batch")
    train.add_argument("--microbatches", type=int,
                       help="with --pp: pieces each batch runs through the stages in (default: --pp; "
                       "--batch-size must divide by it)")
    train.add_argument("--pp-schedule", default="1f1b", choices=tuple(pipeline.SCHEDULES),
                       help="with --pp: the pipeline schedule (default 1f1b: at most --pp microbatches' "
                       "activations held; gpipe: all forwards, then all backwards)")
    train.add_argument("--seed", type=int, default=0, help="seeds init, data order and rounding")
    data = parser.add_argument_group("data")
    data.add_argument("--data", help="directory or file of text (default: Python's stdlib source)")
    data.add_argument("--max-bytes", type=int, help="read at most this much text")
    out = parser.add_argument_group("output and checkpoints")
    out.add_argument("--out", default="runs/demo", help="directory for metrics, plot, checkpoints")
    out.add_argument("--eval-every", type=int, default=100, help="validation every N steps")
    out.add_argument("--eval-batches", type=int, default=8, help="validation batches per rank")
    out.add_argument("--checkpoint-every", type=int, default=100, help="save every N steps (0: never)")
    out.add_argument("--keep", type=int, default=2, help="checkpoints to keep")
    out.add_argument("--checkpoint-async", action="store_true",
                     help="write checkpoints in the background while training goes on (save_checkpoint's async_)")
    out.add_argument("--resume", action="store_true",
                     help="continue from the latest checkpoint in --out (implied after a torchrun restart)")
    out.add_argument("--overwrite", action="store_true",
                     help="start over in an --out that holds another run's checkpoints, deleting them")
    args = parser.parse_args(argv)

    for name in ("steps", "batch_size", "seq_len", "eval_every", "eval_batches", "replicas", "tp", "pp", "keep"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.checkpoint_every < 0:
        parser.error("--checkpoint-every must be >= 0")
    if args.resume and args.overwrite:
        parser.error("--resume continues the run in --out, --overwrite deletes it: pass one")
    error = lean_error(args) or step_in_backward_error(args)
    if error:
        parser.error(error)
    try:
        args.model = model_args(args.preset, seq_len=args.seq_len, dim=args.dim, n_layers=args.n_layers,
                                n_heads=args.n_heads)
        check_tp(args.model, args.tp)
        check_pp(args.model, args.pp)
        # --compile-blocks' refusals; with --precision / --compute-dtype auto, again once resolved
        check_blocks(args, fp32=args.precision == "fp32" or args.compute_dtype == "fp32")
    except ValueError as error:
        parser.error(str(error))
    error = microbatch_error(args) or parallel.layout_error(
        int(os.environ.get("WORLD_SIZE", 1)), tp=args.tp, pp=args.pp, replicas=args.replicas)
    if error:
        parser.error(error)
    return args


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
    state_bits = 8 if args.optimizer.endswith("8bit") else 32
    if args.lean:  # the library's lean call, with this run's --optimizer and --grad-clip
        return fsdp_int8.Int8AdamW.lean(model.parameters(), lr=args.lr, weight_decay=args.weight_decay,
                                        state_bits=state_bits, max_grad_norm=args.grad_clip or None)
    return fsdp_int8.Int8AdamW(model.parameters(), lr=args.lr, weight_decay=args.weight_decay,
                               state_bits=state_bits, step_in_backward=args.step_in_backward,
                               grad_dtype=torch.bfloat16 if args.bf16_grads else None,
                               max_grad_norm=(args.grad_clip or None) if args.step_in_backward else None)


def lean_error(args: argparse.Namespace) -> str | None:
    """Resolve --lean and --optimizer's default into ``args``; why they do not fit, if so."""
    if args.lean:
        if args.optimizer == "adamw":
            return "--lean trains with fsdp_int8's optimizer: drop --optimizer adamw (or --lean)"
        args.optimizer = args.optimizer or "int8-adamw-8bit"
        args.step_in_backward = args.quantize_embeddings = args.activation_checkpointing = True
        args.int8_gathered_weights = True
    args.optimizer = args.optimizer or "adamw"
    if args.bf16_grads and args.optimizer == "adamw":
        return "--bf16-grads needs fsdp_int8's optimizer: --optimizer int8-adamw or int8-adamw-8bit"
    if args.bf16_grads and args.step_in_backward:
        return "--bf16-grads keeps gradients until the step, --step-in-backward keeps none: drop one"
    for flag, wanted in (("--quantize-embeddings", args.quantize_embeddings),
                         ("--int8-gathered-weights", args.int8_gathered_weights)):
        if wanted and args.precision in LAUNCHER_PRECISIONS and not PRECISIONS[args.precision].int8:
            return f"{flag} needs an int8 precision, not --precision {args.precision}"
    return None


def step_in_backward_error(args: argparse.Namespace) -> str | None:
    """Why --step-in-backward does not fit the other arguments."""
    if not args.step_in_backward:
        return None
    if args.optimizer == "adamw":
        return "--step-in-backward needs fsdp_int8's optimizer: --optimizer int8-adamw or int8-adamw-8bit"
    if args.pp > 1:
        return ("--step-in-backward applies each gradient once per step, and a pipeline schedule hands "
                "each parameter one gradient per microbatch: drop one of --step-in-backward and --pp")
    return None


def microbatch_error(args: argparse.Namespace) -> str | None:
    """Why --microbatches does not fit the other arguments (``args`` takes its default, --pp)."""
    if args.pp == 1:
        return "--microbatches is for pipeline parallelism (--pp > 1)" if args.microbatches is not None else None
    args.microbatches = args.pp if args.microbatches is None else args.microbatches
    if args.microbatches < 1 or args.batch_size % args.microbatches:
        return f"--batch-size {args.batch_size} does not divide into --microbatches {args.microbatches}"
    if args.pp_schedule == "1f1b" and args.microbatches < args.pp:
        return f"--pp-schedule 1f1b needs at least --pp {args.pp} microbatches, got {args.microbatches}"
    return None


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
