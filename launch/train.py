"""Train a small Llama-style byte-level language model with FSDP2 and int8 weights.

Run it under torchrun, one process per GPU (or per share of the CPU without GPUs):

    torchrun --nproc_per_node 2 -m launch.train --preset tiny --precision int8

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
import json
import math
import os
import shutil
import sys
import time
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy

import fsdp_int8
from fsdp_int8 import _dist, _hardware
from launch.data import Corpus, load_corpus, sample_batch
from launch.metrics import MetricsLog, Progress, bits_per_byte, plot_losses, read_metrics
from launch.model import PRESETS, ModelArgs, Transformer

PRECISIONS = ("auto", "fp32", "bf16", "int8", "int8-mm", "int8-mm-all", "int8-mm-wgrad-bf16")


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
    train.add_argument("--precision", default="auto", choices=PRECISIONS,
                       help="auto (default): int8 matmuls where this hardware has a fast int8 GEMM, "
                       "else int8 weights only; int8-mm: int8 weights + int8 GEMMs for all three "
                       "matmuls (int8-mm-all is the same; int8-mm-wgrad-bf16 keeps the weight gradient's "
                       "GEMM in the compute dtype); int8: int8 weights only; fp32 / bf16: the FSDP2 baselines")
    train.add_argument("--compute-dtype", default="auto", choices=("auto", "fp32", "bf16"),
                       help="compute dtype of int8 runs; auto (default): bf16 where this hardware has "
                       "fast bf16 matmuls, else fp32 (the all-gather is int8 either way)")
    train.add_argument("--compile", default="auto", choices=("auto", "on", "off"),
                       help="fuse int8 quantization steps with torch.compile; auto (default): on "
                       "from width 512, where it repays its ~15 s of start-up per process")
    train.add_argument("--steps", type=int, default=300, help="optimizer steps in the whole run")
    train.add_argument("--batch-size", type=int, default=16, help="sequences per rank and step")
    train.add_argument("--seq-len", type=int, default=128, help="bytes per sequence")
    train.add_argument("--optimizer", default="adamw", choices=("adamw", "int8-adamw", "int8-adamw-8bit"),
                       help="torch AdamW, fsdp_int8's fused AdamW (one requantization per step), "
                       "or the same with 8-bit Adam states")
    train.add_argument("--lr", type=float, default=3e-3, help="AdamW peak learning rate")
    train.add_argument("--weight-decay", type=float, default=0.1, help="AdamW weight decay")
    train.add_argument("--warmup", type=int, default=20, help="linear warm-up steps, then cosine")
    train.add_argument("--grad-clip", type=float, default=1.0, help="max gradient norm (0: off)")
    train.add_argument("--replicas", type=int, default=1,
                       help="HSDP: replicate the sharded model over this many groups of ranks")
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
    out.add_argument("--resume", action="store_true",
                     help="continue from the latest checkpoint in --out (implied after a torchrun restart)")
    out.add_argument("--overwrite", action="store_true",
                     help="start over in an --out that holds another run's checkpoints, deleting them")
    args = parser.parse_args(argv)

    for name in ("steps", "batch_size", "seq_len", "eval_every", "eval_batches", "replicas", "keep"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.checkpoint_every < 0:
        parser.error("--checkpoint-every must be >= 0")
    if args.resume and args.overwrite:
        parser.error("--resume continues the run in --out, --overwrite deletes it: pass one")
    try:
        args.model = model_args(args)
    except ValueError as error:
        parser.error(str(error))
    world = int(os.environ.get("WORLD_SIZE", 1))
    if world % args.replicas:
        parser.error(f"--replicas {args.replicas} does not divide the world size {world}")
    return args


def model_args(args: argparse.Namespace) -> ModelArgs:
    preset = PRESETS[args.preset]
    overrides = {k: getattr(args, k) for k in ("dim", "n_layers", "n_heads") if getattr(args, k)}
    fields = {**preset.__dict__, **overrides}
    if overrides:
        fields["hidden_dim"] = 0  # recomputed from the new width
    fields["max_seq_len"] = max(fields["max_seq_len"], args.seq_len)
    return ModelArgs(**fields)


# ---------------------------------------------------------------- set-up
def setup_distributed() -> tuple[int, int, torch.device]:
    """Rank, world size and device, from torchrun's environment."""
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    if torch.cuda.is_available() and torch.cuda.device_count() >= local_world:
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_world))
    # After a torchrun restart the agent's store still holds the previous attempt's keys,
    # and gloo would read the dead ranks' addresses from them: give each attempt its own.
    store, rank, world = next(dist.rendezvous("env://"))
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    dist.init_process_group(
        backend=dist.get_default_backend_for_device(device),
        store=dist.PrefixStore(f"launch.train/attempt_{attempt}", store),
        rank=rank, world_size=world,
    )
    return rank, world, device


def choose_for_hardware(args: argparse.Namespace, device: torch.device) -> str | None:
    """Resolve ``auto`` in --precision and --compute-dtype from what ``device`` runs fast.

    Rank 0 decides (its capability check may time a kernel) and every rank takes its
    choice, so all ranks build the same model. Returns the line that says what was chosen
    and why (``None`` if nothing was ``auto``).
    """
    if args.precision != "auto" and not (args.compute_dtype == "auto" and args.precision.startswith("int8")):
        return None
    found = _hardware.capability(device) if _dist.rank() == 0 else None
    found = _dist.broadcast_from_rank0(found)
    reasons = []
    if args.precision == "auto":
        args.precision = "int8-mm" if found.int8_gemm_fast else "int8"
        kind = "a fast" if found.int8_gemm_fast else "no fast"
        reasons.append(f"--precision {args.precision} ({kind} int8 GEMM: {found.int8_evidence})")
    if args.compute_dtype == "auto" and args.precision.startswith("int8"):
        args.compute_dtype = "bf16" if found.bf16_matmul_fast else "fp32"
        kind = "a fast" if found.bf16_matmul_fast else "no fast"
        reasons.append(f"--compute-dtype {args.compute_dtype} ({kind} bf16 matmul: {found.bf16_evidence})")
    return f"auto on {found.name}: " + "; ".join(reasons)


def int8_matmuls(precision: str) -> fsdp_int8.Int8MatmulConfig | None:
    """Which matmuls an int8 ``--precision`` runs in int8 (``None``: weight-only)."""
    if not precision.startswith("int8-mm"):
        return None
    return fsdp_int8.Int8MatmulConfig(grad_weight=precision != "int8-mm-wgrad-bf16")


def compiled_kernels_wanted(compile: str, dim: int) -> bool:
    """``--compile``: on, off, or auto (on from width 512, where its start-up cost pays)."""
    return compile == "on" or (compile == "auto" and dim >= 512)


def build_model(args: argparse.Namespace, device: torch.device) -> Transformer:
    """Build on meta, shard (quantizing for int8), allocate on the device, initialise."""
    with torch.device("meta"):
        model = Transformer(args.model)
    world = dist.get_world_size()
    mesh = (
        init_device_mesh(device.type, (args.replicas, world // args.replicas), mesh_dim_names=("replicate", "shard"))
        if args.replicas > 1 else init_device_mesh(device.type, (world,))
    )
    bf16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    if args.precision.startswith("int8"):
        fsdp_int8.quant.use_compiled_kernels(compiled_kernels_wanted(args.compile, args.model.dim))
        fsdp_int8.shard_model(
            model, mesh=mesh,
            config=fsdp_int8.Int8TrainingConfig(seed=args.seed, int8_matmul=int8_matmuls(args.precision)),
            mp_policy=bf16 if args.compute_dtype == "bf16" else None,
        )
    else:
        fsdp_int8.shard_model(model, mesh=mesh, quantize=False,
                              mp_policy=bf16 if args.precision == "bf16" else None)
    model.to_empty(device=device)
    torch.manual_seed(args.seed)
    with warnings.catch_warnings():  # DTensor's CPU random-op notice; see docs/limits.md
        warnings.filterwarnings("ignore", message="DTensor random operators")
        model.init_weights()
    return model


def make_optimizer(args: argparse.Namespace, model: Transformer) -> torch.optim.Optimizer:
    if args.optimizer == "adamw":
        return torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.weight_decay)
    state_bits = 8 if args.optimizer.endswith("8bit") else 32
    return fsdp_int8.Int8AdamW(model.parameters(), lr=args.lr, weight_decay=args.weight_decay,
                               state_bits=state_bits)


def learning_rate(step: int, args: argparse.Namespace) -> float:
    """Linear warm-up, then cosine decay to a tenth of the peak."""
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    progress = (step - args.warmup) / max(1, args.steps - args.warmup)
    return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def batch_generator(args: argparse.Namespace, rank: int, step: int) -> torch.Generator:
    """The batch depends only on (seed, rank, step): a resumed run sees the same data."""
    return torch.Generator().manual_seed((args.seed * 1_000_003 + rank) * 1_000_003 + step)


def loss_on(model: Transformer, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(model(inputs).flatten(0, 1).float(), targets.flatten())


@torch.no_grad()
def evaluate(model: Transformer, corpus: Corpus, args: argparse.Namespace, device: torch.device) -> float:
    generator = torch.Generator().manual_seed(10_000 + dist.get_rank())  # the same batches every time
    total = torch.zeros((), device=device)
    for _ in range(args.eval_batches):
        inputs, targets = sample_batch(corpus.val, args.batch_size, args.seq_len, generator)
        total += loss_on(model, inputs.to(device), targets.to(device))
    dist.all_reduce(total)
    return total.item() / (args.eval_batches * dist.get_world_size())


def restarted_by_torchrun() -> bool:
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0)) > 0


# ---------------------------------------------------------------- who owns --out
RUN_RECORD = "run.json"  # in --out: the torchrun job whose checkpoints are there


def torchrun_job() -> str | None:
    """torchrun's id of this job: the same in each of its restarts, new for each torchrun
    on one node (a uuid); on several nodes it is --rdzv-id (None if left at "none")."""
    job = os.environ.get("TORCHELASTIC_RUN_ID", "")
    return None if job in ("", "none") else job


def _owned_by_this_job(out: Path) -> bool:
    """Whether --out's checkpoints were written by this torchrun job (in an earlier
    attempt). Without a job id there is no telling: they are taken as this job's."""
    job = torchrun_job()
    if job is None:
        return True
    try:
        return json.loads((out / RUN_RECORD).read_text()).get("torchrun_job") == job
    except (OSError, ValueError, AttributeError):
        return False


def start_mode(args: argparse.Namespace) -> str:
    """How this process starts: ``"fresh"``, ``"resume"`` or ``"overwrite"``.

    Decided from the files alone, before any process group exists and before any rank
    writes to --out, so every rank decides the same.

    Raises:
        ValueError: --out holds checkpoints of another run, and neither --resume nor
            --overwrite says what to do with them.
    """
    out = Path(args.out)
    found = fsdp_int8.latest_checkpoint(out / "checkpoints")
    if args.resume or (restarted_by_torchrun() and (found is None or _owned_by_this_job(out))):
        return "resume"
    if restarted_by_torchrun():
        raise ValueError(
            f"this torchrun restart found checkpoints of another run in {out / 'checkpoints'} "
            f"(newest: {found.name}) and will not resume them: pass --resume to continue that "
            "run, --overwrite to delete its checkpoints, or use another --out"
        )
    if found is None:
        return "fresh"
    if args.overwrite:
        return "overwrite"
    raise ValueError(
        f"{out / 'checkpoints'} already holds checkpoints of another run (newest: {found.name}): "
        "pass --resume to continue that run, --overwrite to delete them and start over, or "
        "use another --out"
    )


def claim_output(out: Path, mode: str) -> None:
    """On rank 0 of a job's first attempt: make --out this job's (for its restarts)."""
    if mode == "overwrite":
        shutil.rmtree(out / "checkpoints", ignore_errors=True)
    out.mkdir(parents=True, exist_ok=True)
    record = {"torchrun_job": torchrun_job(), "argv": sys.argv[1:], "started": time.time()}
    (out / RUN_RECORD).write_text(json.dumps(record) + "\n")


# ---------------------------------------------------------------- the run
def train(args: argparse.Namespace, corpus: Corpus, mode: str) -> None:
    rank, world, device = setup_distributed()
    chosen = choose_for_hardware(args, device)
    if rank == 0 and chosen:
        print(chosen, flush=True)
    out = Path(args.out)
    checkpoints = out / "checkpoints"
    if rank == 0 and not restarted_by_torchrun():
        claim_output(out, mode)
    dist.barrier()  # --out is claimed (and emptied for --overwrite) before any rank reads it
    model = build_model(args, device)
    optimizer = make_optimizer(args, model)

    start = 0
    if mode == "resume" and fsdp_int8.latest_checkpoint(checkpoints):
        start = fsdp_int8.load_checkpoint(checkpoints, model, optimizer).step
    if start >= args.steps:  # e.g. a restart after the last checkpoint: nothing left to do
        if rank == 0:
            print(f"the run in {out} is complete: its checkpoint is at step {start} and --steps is "
                  f"{args.steps} (raise --steps to train further)", flush=True)
        summary = None
    else:
        summary = run_steps(args, corpus, model, optimizer, start, resumed=mode == "resume")
    del model, optimizer  # free FSDP's state before the process group goes (gloo exit abort)
    gc.collect()
    dist.barrier()
    if rank == 0 and summary is not None:
        report(args, world, *summary)


def run_steps(args: argparse.Namespace, corpus: Corpus, model: Transformer, optimizer: torch.optim.Optimizer,
              start: int, resumed: bool) -> tuple[float, float | None]:
    """Train steps ``start`` to ``--steps``, logging, evaluating and checkpointing; the
    last training loss and validation loss."""
    rank, world = dist.get_rank(), dist.get_world_size()
    device = next(model.parameters()).device
    out = Path(args.out)
    log = MetricsLog(out / "metrics.jsonl", resume_step=start if resumed else None) if rank == 0 else None
    progress = Progress(total=args.steps, initial=start, enabled=rank == 0)
    if rank == 0:
        params = sum(p.numel() for p in model.parameters())
        progress.write(
            f"{args.precision} {args.preset}: {params / 1e6:.2f}M parameters on {world} x {device.type}; "
            f"{corpus.train.numel() / 1e6:.1f} MB of text from {corpus.source}"
            + (f"; resumed at step {start}" if start else "")
        )
        log.write(event="start", step=start, world_size=world, precision=args.precision, preset=args.preset)

    tokens_per_step = args.batch_size * args.seq_len * world
    val = None
    for step in range(start, args.steps):
        began = time.perf_counter()
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(step, args)
        inputs, targets = sample_batch(corpus.train, args.batch_size, args.seq_len, batch_generator(args, rank, step))
        with fsdp_int8.count_collectives() as counter:
            loss = loss_on(model, inputs.to(device), targets.to(device))
            loss.backward()
        if args.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
        optimizer.step()
        optimizer.zero_grad()
        seconds = time.perf_counter() - began
        if rank == 0:
            gathered = counter.total_bytes("all_gather_single")
            progress.update(step, loss.item(), tokens_per_step / seconds, gathered)
            log.write(step=step, loss=loss.item(), lr=learning_rate(step, args), seconds=seconds,
                      tokens_per_s=tokens_per_step / seconds, all_gather_bytes=gathered,
                      collective_bytes=counter.total_bytes())
        done = step + 1
        if done % args.eval_every == 0 or done == args.steps:
            val = evaluate(model, corpus, args, device)
            if rank == 0:
                log.write(step=done, val_loss=val)
                progress.write(f"step {done}: validation loss {val:.4f} ({bits_per_byte(val):.3f} bits/byte)")
        if args.checkpoint_every and (done % args.checkpoint_every == 0 or done == args.steps):
            fsdp_int8.save_checkpoint(out / "checkpoints", model, optimizer, step=done, keep=args.keep,
                                      extra={"argv": sys.argv[1:]})
    progress.close()
    if rank == 0:
        log.write(event="end", step=args.steps, val_loss=val)
        log.close()
    return loss.item(), val


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
    if "RANK" not in os.environ:
        print("launch.train runs under torchrun, e.g.: torchrun --nproc_per_node 2 -m launch.train", file=sys.stderr)
        return 2
    try:  # before the process group exists: bad input fails here on every rank, no hang
        mode = start_mode(args)
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
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
