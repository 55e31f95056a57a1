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
import tempfile
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.fsdp import FSDPModule

import fsdp_int8
import fsdp_int8.collectives
from fsdp_int8.integrations.torchtitan import Int8LinearConverter, enable_int8_training
from _common import int8_count, int8_names, int8_shards, same

VOCAB_USED = 64  # the synthetic task's tokens (the debug model's vocabulary has 2048)


class _TrainState:
    """The step counter torchtitan's Trainer saves as ``train_state``."""

    def __init__(self) -> None:
        self.step = 0

    def state_dict(self) -> dict[str, Any]:
        return {"step": torch.tensor(self.step)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step = int(state["step"])


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


def _build(config, world: int) -> dict[str, Any]:
    """Model, optimizers, scheduler and checkpointer, in the order torchtitan's Trainer uses."""
    import torchtitan.distributed.parallel_dims as parallel_dims_module
    from torchtitan.distributed import ParallelDims

    if not torch.accelerator.is_available():
        # torchtitan falls back to "cuda" when it finds no accelerator
        # (torchtitan.tools.utils.get_device_info): point its device mesh at the CPU.
        parallel_dims_module.device_type = "cpu"
    spec = config.model_spec
    parallel_dims = ParallelDims.from_config(config.parallelism, world)
    parallel_dims.build_mesh()
    spec.model.update_from_config(config=config)
    with torch.device("meta"):
        model = spec.model.build()
    model = spec.parallelize_fn(
        model, parallel_dims=parallel_dims, training=config.training,
        parallelism=config.parallelism, compile_config=config.compile,
        ac_config=config.activation_checkpoint, dump_folder=config.dump_folder,
    )
    if dist.get_backend() == "gloo":
        # torchtitan turns FSDP2's gradient division off (it divides the loss by the global
        # token count), which FSDP2 sends as PREMUL_SUM, an op gloo lacks: a plain sum.
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.set_force_sum_reduction_for_comms(True)
    model.to_empty(device="cpu")
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    model.train()
    optimizers = config.optimizer.build(model_parts=[model])
    spec.post_optimizer_build_fn(optimizers, [model], parallel_dims)
    schedulers = config.lr_scheduler.build(optimizers=optimizers, training_steps=config.training.steps)
    state = _TrainState()
    checkpointer = config.checkpoint.build(
        dataloader=None, model_parts=[model], optimizers=optimizers, lr_schedulers=schedulers,
        states={"train_state": state}, sd_adapter=None, base_folder=config.dump_folder,
    )
    return dict(model=model, optimizers=optimizers, schedulers=schedulers, state=state,
                checkpointer=checkpointer)


def _batch(step: int, rank: int, batch: int, seq_len: int) -> torch.Tensor:
    """Arithmetic progressions mod ``VOCAB_USED``: learnable next-token prediction."""
    gen = torch.Generator().manual_seed(1000 * step + rank)
    start = torch.randint(0, VOCAB_USED, (batch, 1), generator=gen)
    stride = torch.randint(1, 4, (batch, 1), generator=gen)
    return (start + stride * torch.arange(seq_len + 1)) % VOCAB_USED


def _loss(model: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    logits = model(tokens[:, :-1])
    return F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())


def _all_ranks(flag: bool) -> bool:
    value = torch.tensor(int(flag))
    dist.all_reduce(value, op=dist.ReduceOp.MIN)
    return bool(value)


def main(argv: list[str] | None = None) -> dict:
    """Train, checkpoint and reload; returns the summary the test checks."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=32)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--dump-folder", default=None, help="default: a temporary folder")
    parser.add_argument("--lean", action="store_true", help="the lean recipe (Int8LinearConverter.Config(lean=True))")
    parser.add_argument("--compile", default=None, metavar="BACKEND",
                        help="torchtitan's per-block compile (compile.enable, components ['model']) "
                        "with this torch.compile backend, e.g. inductor")
    args = parser.parse_args(argv)

    created = not dist.is_initialized()
    if created:
        dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    try:
        with tempfile.TemporaryDirectory() as tmp:
            folder = args.dump_folder or _shared_folder(tmp)
            summary = _run(args, folder, rank, world)
            dist.barrier()  # every rank is done with the checkpoint before it is removed
    finally:
        if created:
            dist.destroy_process_group()
    if rank == 0:
        print(summary)
    return summary


def _shared_folder(tmp: str) -> str:
    box = [tmp]
    dist.broadcast_object_list(box, src=0)  # one folder for all ranks (a single host)
    return box[0]


def _run(args: argparse.Namespace, folder: str, rank: int, world: int) -> dict:
    torch.manual_seed(0)
    run = _build(_trainer_config(args, folder), world)
    model = run["model"]

    with torch.no_grad(), fsdp_int8.collectives.count_collectives() as counter:
        model(_batch(0, rank, args.batch, args.seq_len)[:, :-1])
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

    losses = _train(run, range(1, args.steps + 1), args, rank, world)
    int8_weights = int8_count(model)
    run["checkpointer"].save(curr_step=args.steps)
    trained = int8_shards(model)
    probe = _batch(args.steps + 1, rank, args.batch, args.seq_len)
    with torch.no_grad():
        probe_loss = _loss(model, probe)
    more = range(args.steps + 1, args.steps + 3)  # the uninterrupted run goes on
    _train(run, more, args, rank, world)
    went_on = int8_shards(model)

    torch.manual_seed(1)  # a differently initialised model to load into
    fresh = _build(_trainer_config(args, folder), world)
    differed = not same(int8_shards(fresh["model"]), trained)
    loaded = fresh["checkpointer"].load(step=args.steps)
    reloaded, loaded_step = int8_shards(fresh["model"]), fresh["state"].step
    with torch.no_grad():
        same_loss = torch.equal(probe_loss, _loss(fresh["model"], probe))
    _train(fresh, more, args, rank, world)  # resumed: the same steps, stochastic rounding included
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
        "differed_before_load": _all_ranks(differed),
        "reload_exact": _all_ranks(same(reloaded, trained) and same_loss),
        "resume_exact": _all_ranks(resumed_exact),
    }


def _train(run: dict, steps: range, args: argparse.Namespace, rank: int, world: int) -> list[float]:
    """Train ``run``'s model for ``steps`` (each step's batch is fixed by its number)."""
    losses = []
    for step in steps:
        loss = _loss(run["model"], _batch(step, rank, args.batch, args.seq_len))
        (loss / world).backward()  # gradients are summed over ranks, as in torchtitan
        run["optimizers"].step()
        run["schedulers"].step()
        run["optimizers"].zero_grad()
        run["state"].step = step
        losses.append(float(loss.detach()))
    return losses


if __name__ == "__main__":
    main()
