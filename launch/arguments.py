"""The launcher's command line: every flag of ``launch.train``, and the checks of each
against the others, all before any process group exists (bad input fails on every rank
with exit code 2, no hang)."""

from __future__ import annotations

import argparse
import os

from fsdp_int8.config import AUTO, COMPILE_CHOICES
from launch import parallel, pipeline
from launch.compile_policy import BLOCKS_FLAG, check_blocks, compile_choice
from launch.model import PRESETS, check_pp, check_tp, model_args
from launch.precisions import LAUNCHER_PRECISIONS, PRECISIONS


def parse(argv: list[str] | None = None, *, description: str | None = None) -> argparse.Namespace:
    """``launch.train``'s arguments (``argv``: ``sys.argv[1:]`` by default), each checked
    against the others; an argparse error (exit 2) names what does not fit. ``--lean`` and
    the defaults that depend on other flags are resolved; ``args.model`` is the model's shape."""
    parser = argparse.ArgumentParser(
        prog="torchrun --nproc_per_node N -m launch.train",
        description=description,
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
    train.add_argument("--optimizer", choices=("adamw", "int8-adamw", "int8-adamw-8bit", "int8-adamw-4bit"),
                       help="torch AdamW (the default), fsdp_int8's fused AdamW (one requantization per step), "
                       "or the same with 8-bit Adam states (the default with --lean) or 4-bit ones")
    train.add_argument("--lr", type=float, default=3e-3, help="AdamW peak learning rate")
    train.add_argument("--weight-decay", type=float, default=0.1, help="AdamW weight decay")
    train.add_argument("--warmup", type=int, default=20, help="linear warm-up steps, then cosine")
    train.add_argument("--grad-clip", type=float, default=1.0,
                       help="max gradient norm (0: off; default 1.0); with --step-in-backward, by the step's norm as estimated "
                       "when each gradient arrives (Int8AdamW's max_grad_norm: the step's own norm does not exist inside backward)")
    train.add_argument("--step-in-backward", action="store_true",
                       help="with fsdp_int8's optimizer (--optimizer int8-adamw*): update each parameter inside "
                       "backward as soon as its gradient is reduced, and free the gradient (gradients never "
                       "all live at once; --grad-clip by the step's norm as estimated so far; not with --pp)")
    train.add_argument("--bf16-grads", action="store_true",
                       help="with fsdp_int8's optimizer (--optimizer int8-adamw*): keep gradients in bf16 from their "
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
                       "step's gradient norm as estimated when each gradient arrives; docs/memory.md); with "
                       "--optimizer int8-adamw-4bit, the leanest")
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
        return "--bf16-grads needs fsdp_int8's optimizer: --optimizer int8-adamw, int8-adamw-8bit or int8-adamw-4bit"
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
        return "--step-in-backward needs fsdp_int8's optimizer: --optimizer int8-adamw, int8-adamw-8bit or int8-adamw-4bit"
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
