"""Int8 training of torchtitan's Llama 3 debug model on CPU, checkpointed by torchtitan.

Shows ``fsdp_int8.integrations.torchtitan``: ``enable_int8_training`` switches torchtitan's
own ``llama3_debugmodel()`` trainer config to int8 (the ``Int8LinearConverter`` on the model
config, ``int8_post_optimizer_build`` as the model spec's ``post_optimizer_build_fn``, the
``Int8CheckpointManager`` as checkpoint component). The model is then built as torchtitan's
``Trainer`` builds it (meta device, the spec's ``parallelize_fn``, which shards with
``apply_fsdp_to_decoder``, ``to_empty``, ``init_weights``; the optimizer, the
post-optimizer hook, the LR scheduler and the checkpoint manager from the config), trained
a few steps on a synthetic task, saved with the checkpoint manager and loaded into a
freshly built model, whose int8 bytes are compared with the trained ones; then both the
original run and the resumed one train two more steps, and their bytes must agree (the
checkpoint holds the stochastic-rounding generators).

CPU changes to the debug config: SDPA instead of FlexAttention (no CPU backward), short
sequences, fp32 compute. The Trainer itself is not run: it needs a tokenizer and a
dataset that are not part of the torchtitan package.

``--lean``: the lean-memory recipe as far as torchtitan's Trainer takes it,
``enable_int8_training(config, Int8LinearConverter.Config(lean=True))``: int8 embedding
and gathered weights, the AdamW groups as ``Int8AdamW.lean``'s (8-bit states), torchtitan's
own bf16 compute (``mixed_precision_param``); the optimizer steps after backward, where
torchtitan's Trainer clips (``training.max_norm``).

Install: ``pip install "fsdp_int8[torchtitan]"``
Run:     ``torchrun --nproc-per-node 2 examples/torchtitan_debug.py [--steps 6]``
"""

from __future__ import annotations

import argparse

import torch

import fsdp_int8
import fsdp_int8.collectives
from fsdp_int8.integrations.torchtitan import Int8LinearConverter, enable_int8_training
import _torchtitan_common as tt
from _common import int8_count, int8_names, int8_shards, same


def _trainer_config(args: argparse.Namespace, dump_folder: str):
    from torchtitan.models.common.attention import FlexAttention, ScaledDotProductAttention
    from torchtitan.models.llama3.config_registry import llama3_debugmodel

    config = llama3_debugmodel()
    enable_int8_training(config, Int8LinearConverter.Config(lean=args.lean))  # the one int8 switch
    for _, _, parent, attr in list(config.model_spec.model.traverse(FlexAttention.Config)):
        setattr(parent, attr, ScaledDotProductAttention.Config())
    config.training.seq_len = args.seq_len
    config.training.local_batch_size = args.batch
    config.training.steps = args.steps
    config.training.mixed_precision_param = "bfloat16" if args.lean else "float32"
    # FSDP2 on plain parameters; torchtitan's default ("spmd_types") stops in fully_shard on
    # this CPU setup with or without int8 ("all parameters must be DTensors on the full
    # SPMD mesh").
    config.parallelism.spmd_backend = "partial_dtensor"
    config.optimizer.param_groups[0].optimizer_kwargs["lr"] = args.lr
    config.dump_folder = dump_folder
    config.checkpoint.enable = True
    config.checkpoint.interval = args.steps
    if args.compile:  # torchtitan compiles each block after AC wrapping and before FSDP
        config.compile.enable, config.compile.components, config.compile.backend = True, ["model"], args.compile
    return config


def main(argv: list[str] | None = None) -> dict:
    """Train, checkpoint and reload; returns the summary the test checks."""
    parser = tt.arguments(__doc__.splitlines()[0], steps=6)
    parser.add_argument("--lean", action="store_true", help="the lean recipe (Int8LinearConverter.Config(lean=True))")
    parser.add_argument("--compile", default=None, metavar="BACKEND",
                        help="torchtitan's per-block compile (compile.enable, components ['model']) "
                        "with this torch.compile backend, e.g. inductor")
    return tt.run_on_every_rank(_run, parser.parse_args(argv))


def _run(args: argparse.Namespace, folder: str, rank: int, world: int) -> dict:
    torch.manual_seed(0)
    run = tt.build(_trainer_config(args, folder), world)
    model = run["model"]

    with torch.no_grad(), fsdp_int8.collectives.count_collectives() as counter:
        model(tt.batch(0, rank, args.batch, args.seq_len).to(run["device"])[:, :-1])
    param_bytes = sum(p.numel() * 4 for p in model.parameters())  # in fp32 (global sizes)
    # what one forward gathers if every int8 weight travels as int8 rows + one fp32 scale
    # per row and every other parameter in the compute dtype (fp32; bf16 with --lean; the
    # debug model's shards need no padding)
    int8_weight_names, plain = set(int8_names(model)), 2 if args.lean else 4
    int8_gather_bytes = sum(
        p.numel() + 4 * p.shape[0] if name in int8_weight_names else plain * p.numel()
        for name, p in model.named_parameters()
    )
    computed = set()  # the dtypes a block's matmul computes in
    model.layers["0"].feed_forward.w2.register_forward_hook(lambda m, x, y: computed.add(y.dtype))

    losses = tt.train(run, range(1, args.steps + 1), args, rank, world)
    int8_weights = int8_count(model)
    run["checkpointer"].save(curr_step=args.steps)
    trained = int8_shards(model)
    probe = tt.batch(args.steps + 1, rank, args.batch, args.seq_len).to(run["device"])
    with torch.no_grad():
        probe_loss = tt.next_token_loss(model, probe)
    more = range(args.steps + 1, args.steps + 3)  # the uninterrupted run goes on
    tt.train(run, more, args, rank, world)
    went_on = int8_shards(model)

    torch.manual_seed(1)  # a differently initialised model to load into
    fresh = tt.build(_trainer_config(args, folder), world)
    differed = not same(int8_shards(fresh["model"]), trained)
    loaded = fresh["checkpointer"].load(step=args.steps)
    reloaded, loaded_step = int8_shards(fresh["model"]), fresh["state"].step
    with torch.no_grad():
        same_loss = torch.equal(probe_loss, tt.next_token_loss(fresh["model"], probe))
    tt.train(fresh, more, args, rank, world)  # resumed: the same steps, stochastic rounding included
    resumed_exact = same(int8_shards(fresh["model"]), went_on)
    for part in (run, fresh):
        part["checkpointer"].close()
    optimizer = run["optimizers"].optimizers[0]  # inside torchtitan's container
    return {
        "int8_embedding": isinstance(model.tok_embeddings.weight.to_local(), fsdp_int8.Int8Weight),
        "compute_dtypes": sorted(str(d) for d in computed),
        "optimizer": type(optimizer).__name__,
        "state_dtypes": sorted({str(v.dtype) for state in optimizer.state.values() for v in state.values()}),
        "losses": losses,
        "int8_weights": int8_weights,
        "int8_weights_after_load": int8_count(fresh["model"]),
        "all_gather_bytes_per_forward": counter.total_bytes("all_gather_into_tensor")
        + counter.total_bytes("all_gather_single"),
        "fp32_param_bytes": param_bytes,
        "int8_all_gather_bytes_expected": int8_gather_bytes,
        "checkpoint_loaded": loaded,
        "step_after_load": loaded_step,
        "differed_before_load": tt.all_ranks(differed),
        "reload_exact": tt.all_ranks(same(reloaded, trained) and same_loss),
        "resume_exact": tt.all_ranks(resumed_exact),
    }


if __name__ == "__main__":
    main()
