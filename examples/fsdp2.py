"""Plain PyTorch FSDP2 with int8 weights: what fsdp_int8 changes in an existing training loop.

    pip install fsdp_int8
    torchrun --nproc-per-node 2 examples/fsdp2.py

Three calls replace their FSDP2 counterparts: ``shard_model`` (quantize every ``nn.Linear``,
then ``fully_shard`` each block and the root), ``Int8AdamW`` (torch's AdamW works too) and
``save_checkpoint`` / ``load_checkpoint`` (int8 bytes, optimizer state and rounding
generators, exact). ``export_full_state_dict`` gives the unquantized model's plain float
state dict. CPU with gloo, or one GPU per rank with nccl. ``launch/train.py`` is the full demo.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import fsdp_int8
from _common import TinyLM, job_folder, local_state, same

VOCAB, SEQ = 64, 16  # TinyLM's default vocabulary


def batch(generator: torch.Generator, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Random tokens; the target of each is a fixed permutation of it (learnt in a few steps)."""
    tokens = torch.randint(0, VOCAB, (8, SEQ), generator=generator)
    return tokens.to(device), ((tokens * 5 + 3) % VOCAB).to(device)


def pick_device() -> torch.device:
    """One accelerator per local rank where there is one, else the CPU."""
    if not torch.accelerator.is_available():
        return torch.device("cpu")
    index = int(os.environ.get("LOCAL_RANK", "0"))
    torch.accelerator.set_device_index(index)
    return torch.device(torch.accelerator.current_accelerator().type, index)


def build(device: torch.device) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)  # the same initial weights on every rank
    model = fsdp_int8.shard_model(TinyLM().to(device))  # was: fully_shard per block + root
    return model, fsdp_int8.Int8AdamW(model.parameters(), lr=1e-2, weight_decay=0.0)


def loss_of(model: nn.Module, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(model(tokens).flatten(0, 1), targets.flatten())


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args(argv)

    device = pick_device()
    with job_folder("fsdp2_example_", device) as (rank, directory):
        model, optimizer = build(device)
        data = torch.Generator().manual_seed(rank)  # each rank its own batches
        losses = []
        for _ in range(args.steps):
            loss = loss_of(model, *batch(data, device))
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())

        fsdp_int8.save_checkpoint(directory, model, optimizer, step=args.steps)
        resumed, resumed_optimizer = build(device)  # a fresh run, as after a restart
        info = fsdp_int8.load_checkpoint(directory, resumed, resumed_optimizer)
        saved, loaded = local_state(model, optimizer), local_state(resumed, resumed_optimizer)

        # A plain float state dict ({} on ranks > 0): the unquantized model loads it as it is
        # and computes what the sharded int8 model computes.
        full = fsdp_int8.export_full_state_dict(model, dtype=torch.float32)
        tokens, _ = batch(torch.Generator().manual_seed(1234), device)  # one batch for all ranks
        with torch.no_grad():
            logits = model(tokens)
            export_max_diff = None
            if rank == 0:
                plain = TinyLM().to(device)
                plain.load_state_dict(full)
                export_max_diff = ((plain(tokens) - logits).abs().max() / logits.abs().max()).item()
        summary = {
            "rank": rank,
            "losses": losses,
            "int8_weights": sum(k.endswith(".int_data") for k in saved),
            "resumed_step": info.step,
            "restored_exactly": same(saved, loaded),
            "export_max_diff": export_max_diff,  # relative to the largest logit
        }
        dist.barrier()  # every rank is done with the checkpoint before rank 0 removes it
        return summary


if __name__ == "__main__":
    summary = main()
    if summary["rank"] == 0:
        print(summary)
