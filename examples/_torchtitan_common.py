"""What the torchtitan examples share: the model, optimizer and checkpointer built in the
order torchtitan's ``Trainer`` builds them, a synthetic task, and the training loop.

Not an example itself; the scripts import it from their own folder.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import tempfile
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

VOCAB_USED = 64  # the synthetic task's tokens


class TrainState:
    """The step counter torchtitan's Trainer saves as ``train_state``."""

    def __init__(self) -> None:
        self.step = 0

    def state_dict(self) -> dict[str, Any]:
        return {"step": torch.tensor(self.step)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step = int(state["step"])


def arguments(description: str, steps: int) -> argparse.ArgumentParser:
    """The flags both torchtitan examples take: steps, batch, sequence length, learning
    rate, the checkpoint folder."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--steps", type=int, default=steps)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=32)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--dump-folder", default=None, help="default: a temporary folder")
    return parser


def device() -> torch.device:
    """This rank's device: its accelerator under an accelerator's backend (nccl), the CPU under gloo."""
    if dist.get_backend() == "gloo" or not torch.accelerator.is_available():
        return torch.device("cpu")
    return torch.device(torch.accelerator.current_accelerator().type, torch.accelerator.current_device_index())


def build(config: Any, world: int) -> dict[str, Any]:
    """Model, optimizers, scheduler and checkpointer, in the order torchtitan's Trainer uses."""
    import torchtitan.distributed.parallel_dims as parallel_dims_module
    from torchtitan.distributed import ParallelDims
    from torchtitan.distributed import utils as dist_utils

    where = device()
    if where.type == "cpu":
        # torchtitan falls back to "cuda" when it finds no accelerator
        # (torchtitan.tools.utils.get_device_info): point its device mesh at the CPU.
        parallel_dims_module.device_type = "cpu"
    spec = config.model_spec
    parallel_dims = ParallelDims.from_config(config.parallelism, world)
    parallel_dims.build_mesh()
    dist_utils.set_spmd_backend(config.parallelism.spmd_backend)
    spec.model.update_from_config(config=config)  # every module's sharding, expert parallelism included
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
    model.to_empty(device=where)
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    model.train()
    optimizers = config.optimizer.build(model_parts=[model])
    spec.post_optimizer_build_fn(optimizers, [model], parallel_dims)  # fsdp_int8's hook among them
    schedulers = config.lr_scheduler.build(optimizers=optimizers, training_steps=config.training.steps)
    state = TrainState()
    checkpointer = config.checkpoint.build(
        dataloader=None, model_parts=[model], optimizers=optimizers, lr_schedulers=schedulers,
        states={"train_state": state}, sd_adapter=None, base_folder=config.dump_folder,
    )
    return dict(model=model, optimizers=optimizers, schedulers=schedulers, state=state,
                checkpointer=checkpointer, device=where)


def batch(step: int, rank: int, size: int, seq_len: int) -> torch.Tensor:
    """Arithmetic progressions mod ``VOCAB_USED``: learnable next-token prediction."""
    gen = torch.Generator().manual_seed(1000 * step + rank)
    start = torch.randint(0, VOCAB_USED, (size, 1), generator=gen)
    stride = torch.randint(1, 4, (size, 1), generator=gen)
    return (start + stride * torch.arange(seq_len + 1)) % VOCAB_USED


def next_token_loss(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    logits = model(tokens[:, :-1])
    if isinstance(logits, DTensor):
        logits = logits.full_tensor()
    return F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())


def train(run: dict, steps: range, args: argparse.Namespace, rank: int, world: int) -> list[float]:
    """Train ``run``'s model for ``steps`` (each step's batch is fixed by its number)."""
    losses = []
    for step in steps:
        tokens = batch(step, rank, args.batch, args.seq_len).to(run["device"])
        loss = next_token_loss(run["model"], tokens)
        (loss / world).backward()  # gradients are summed over ranks, as in torchtitan
        run["optimizers"].step()
        run["schedulers"].step()
        run["optimizers"].zero_grad()
        run["state"].step = step
        losses.append(float(loss.detach()))
    return losses


def all_ranks(flag: bool) -> bool:
    """Whether ``flag`` holds on every rank."""
    value = torch.tensor(int(flag), device=device())
    dist.all_reduce(value, op=dist.ReduceOp.MIN)
    return bool(value)


def run_on_every_rank(run: Callable[[argparse.Namespace, str, int, int], dict], args: argparse.Namespace) -> dict:
    """``run(args, folder, rank, world)`` inside :func:`process_group_and_folder`; its
    summary, printed by rank 0."""
    with process_group_and_folder(args.dump_folder) as (rank, world, folder):
        summary = run(args, folder, rank, world)
    if rank == 0:
        print(summary)
    return summary


@contextlib.contextmanager
def process_group_and_folder(dump_folder: str | None) -> Iterator[tuple[int, int, str]]:
    """``(rank, world size, folder)``: the process group (started here when not running:
    nccl with one accelerator per local rank where there is one, else gloo) and a folder
    every rank shares (``dump_folder``, or a temporary one, removed after every rank is done)."""
    created = not dist.is_initialized()
    if created:
        where = torch.device("cpu")
        if torch.accelerator.is_available():
            torch.accelerator.set_device_index(int(os.environ.get("LOCAL_RANK", "0")))
            where = torch.accelerator.current_accelerator()
        dist.init_process_group(dist.get_default_backend_for_device(where))
    try:
        with tempfile.TemporaryDirectory() as tmp:
            box = [dump_folder or tmp]
            dist.broadcast_object_list(box, src=0)  # one folder for all ranks (a single host)
            yield dist.get_rank(), dist.get_world_size(), box[0]
            dist.barrier()  # every rank is done with the folder before it is removed
    finally:
        if created:
            dist.destroy_process_group()
