"""Lightning's ModelParallelStrategy with int8 weights: fit, save, resume.

    pip install "fsdp_int8[lightning]"
    torchrun --nproc-per-node 2 examples/lightning_model_parallel.py

(``python examples/lightning_model_parallel.py`` works too: Lightning then starts the
second process itself.) The LightningModule's ``configure_model`` calls ``shard_model``
on the strategy's data-parallel mesh: every ``nn.Linear`` becomes an int8 weight, then
FSDP2 shards each block and the root. Lightning picks the backend from the device (gloo
on CPU, nccl on CUDA). ``trainer.save_checkpoint`` writes a distributed checkpoint (each
rank its int8 shards and optimizer state) and ``fit(ckpt_path=...)`` resumes from it,
every int8 byte restored. ``Int8RoundingCheckpoint`` adds every rank's stochastic-rounding
generators to the checkpoint, so the resumed run rounds on from where the saved one
stopped. ``--lean`` trains the lean-memory recipe: ``shard_model(...,
config=Int8TrainingConfig.lean())`` in ``configure_model`` (int8 embedding, int8 gathered
weights, bf16 compute) and ``Int8AdamW.lean`` from ``configure_optimizers`` (8-bit states,
each parameter stepped and clipped inside backward: Lightning's ``optimizer.step(closure)``
runs the closure's backward, then completes the step; leave ``gradient_clip_val`` unset).
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile

import lightning as L
import torch
import torch.distributed as dist
import torch.nn.functional as F
from lightning.pytorch.strategies import ModelParallelStrategy
from torch.distributed.fsdp import FSDPModule
from torch.utils._pytree import tree_leaves
from torch.utils.data import DataLoader, TensorDataset

import fsdp_int8
from fsdp_int8.integrations.lightning import Int8RoundingCheckpoint
from _common import TinyLM as TinyNet, local_state, same

VOCAB, SEQ = 64, 16  # TinyNet's default vocabulary


class TinyLM(L.LightningModule):
    """Trains ``TinyNet``; ``configure_model`` makes it int8 and shards it."""

    def __init__(self, lr: float = 1e-2, lean: bool = False) -> None:
        super().__init__()
        self.lr, self.lean = lr, lean
        self.model = TinyNet()
        self.losses: list[float] = []
        self.state_at_start: dict[str, torch.Tensor] = {}
        self.rounding_at_start: dict = {}
        self.computed: set[torch.dtype] = set()  # the dtypes a block's matmul computes in
        self.updated_in_backward: list[bool] = []

    def configure_model(self) -> None:
        if isinstance(self.model, FSDPModule):
            return  # Lightning calls this hook again for every fit/validate/test
        # The strategy's mesh is (data_parallel, tensor_parallel); FSDP2 shards over the first.
        config = fsdp_int8.Int8TrainingConfig.lean() if self.lean else None
        fsdp_int8.shard_model(self.model, mesh=self.device_mesh["data_parallel"], config=config)
        self.model.layers[0][1].register_forward_hook(lambda m, x, y: self.computed.add(y.dtype))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        tokens, targets = batch
        loss = F.cross_entropy(self.model(tokens).flatten(0, 1), targets.flatten())
        self.losses.append(loss.item())
        return loss

    def _int8_rows(self) -> torch.Tensor:
        return self.model.layers[0][1].weight.to_local().int_data  # this rank's rows of one layer

    def on_train_batch_start(self, batch: object, batch_idx: int) -> None:
        self.before_step = self._int8_rows().clone()

    def on_after_backward(self) -> None:
        # Lightning runs backward inside optimizer.step(closure): a step inside backward
        # has changed the weights already
        self.updated_in_backward.append(not torch.equal(self.before_step, self._int8_rows()))

    def on_train_start(self) -> None:
        # Runs after Lightning restored a checkpoint: what resuming loaded.
        self.state_at_start = local_state(self.model, self.trainer.optimizers[0])
        self.rounding_at_start = rounding_states(self.trainer)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        if self.lean:
            return fsdp_int8.Int8AdamW.lean(self.parameters(), lr=self.lr, weight_decay=0.0)
        return fsdp_int8.Int8AdamW(self.parameters(), lr=self.lr, weight_decay=0.0)


def rounding_states(trainer: L.Trainer) -> dict:
    """Every rank's rounding generators, as ``Int8RoundingCheckpoint`` saves them (a collective)."""
    return next(c for c in trainer.callbacks if isinstance(c, Int8RoundingCheckpoint)).state_dict()


def same_tree(a: object, b: object) -> bool:
    """Whether two nests of dicts and lists hold equal leaves (tensors to the bit)."""
    a, b = tree_leaves(a), tree_leaves(b)
    return len(a) == len(b) and all(
        torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y for x, y in zip(a, b)
    )


def dataset(size: int) -> TensorDataset:
    """Random tokens; the target of each is a fixed permutation of it (learnable in a few steps)."""
    tokens = torch.randint(0, VOCAB, (size, SEQ), generator=torch.Generator().manual_seed(0))
    return TensorDataset(tokens, (tokens * 5 + 3) % VOCAB)


def fit(args: argparse.Namespace, max_steps: int, ckpt_path: str | None = None) -> tuple[L.Trainer, TinyLM]:
    torch.manual_seed(0)  # the same initial weights on every rank
    model = TinyLM(lean=args.lean)
    trainer = L.Trainer(
        accelerator="auto",  # CPU here, with gloo; one GPU per process, with nccl
        devices=2,
        # Plain FSDP2: all ranks shard (Lightning's default puts them all on tensor_parallel).
        strategy=ModelParallelStrategy(
            data_parallel_size=2, tensor_parallel_size=1, save_distributed_checkpoint=not args.single_file
        ),
        precision=args.precision,
        max_steps=max_steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[Int8RoundingCheckpoint()],  # the rounding generators go into checkpoints
    )
    # One epoch is --steps steps (8 sequences per rank and step); Lightning gives each rank
    # its part (a DistributedSampler over the data-parallel ranks).
    data = DataLoader(dataset(2 * 8 * args.steps), batch_size=8, shuffle=True)
    trainer.fit(model, data, ckpt_path=ckpt_path, weights_only=True)
    return trainer, model


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=10, help="steps before the save; as many after")
    parser.add_argument("--precision", default="32-true", help="Lightning's precision (e.g. bf16-mixed)")
    parser.add_argument("--single-file", action="store_true",
                        help="rank 0 saves one full checkpoint file instead of a directory of shards")
    parser.add_argument("--lean", action="store_true",
                        help="the lean recipe: Int8TrainingConfig.lean() and Int8AdamW.lean")
    args = parser.parse_args(argv)

    created = not dist.is_initialized()
    environ = dict(os.environ)
    if not created:  # a caller's process group on one node: Lightning must not start processes
        os.environ.setdefault("LOCAL_RANK", str(dist.get_rank()))
    directory = [None]
    try:
        trainer, model = fit(args, args.steps)  # creates the process group if there is none
        rank = trainer.global_rank
        directory = [tempfile.mkdtemp(prefix="lightning_example_") if rank == 0 else None]
        dist.broadcast_object_list(directory)  # every rank saves into rank 0's directory
        path = os.path.join(directory[0], "tiny.ckpt")
        trainer.save_checkpoint(path, weights_only=False)  # weights, optimizer, loops
        rounding_saved = rounding_states(trainer)

        resumed_trainer, resumed = fit(args, 2 * args.steps, ckpt_path=path)
        optimizer = trainer.optimizers[0]
        saved, loaded = local_state(model.model, optimizer), resumed.state_at_start
        after = local_state(resumed.model, resumed_trainer.optimizers[0])
        summary = {
            "rank": rank,
            "losses": model.losses,
            "resumed_losses": resumed.losses,
            "int8_weights": sum(k.endswith(".int_data") for k in saved),
            "resumed_int8_weights": sum(k.endswith(".int_data") for k in after),
            "resumed_from_step": resumed_trainer.global_step - len(resumed.losses),
            "restored_exactly": same(saved, loaded),
            "rounding_restored": same_tree(  # the weights' generators (torch's global one moves on)
                [r["rounding"] for r in rounding_saved["ranks"]],
                [r["rounding"] for r in resumed.rounding_at_start["ranks"]],
            ),
            # sharded: a directory (each rank's shards + Lightning's meta.pt); --single-file: a file
            "checkpoint": sorted(os.listdir(path)) if os.path.isdir(path) else "file",
            "updated_in_backward": model.updated_in_backward,
            "int8_embedding": isinstance(model.model.embed.weight.to_local(), fsdp_int8.Int8Weight),
            "compute_dtypes": sorted(str(d) for d in model.computed),
            "optimizer": f"{type(optimizer).__name__}(step_in_backward={optimizer.step_in_backward}, "
                         f"max_grad_norm={optimizer.max_grad_norm})",
            "state_dtypes": sorted({str(v.dtype) for state in optimizer.state.values() for v in state.values()}),
        }
        dist.barrier()  # every rank is done with the checkpoint before rank 0 removes it
        return summary
    finally:  # no collective here: a rank that failed must exit, not wait for the others
        if directory[0] is not None:
            shutil.rmtree(directory[0], ignore_errors=True)
        if created and dist.is_initialized():
            dist.destroy_process_group()
        os.environ.clear()  # Lightning's environment removes WORLD_SIZE on teardown
        os.environ.update(environ)


if __name__ == "__main__":
    summary = main()
    if summary["rank"] == 0:
        print(summary)
