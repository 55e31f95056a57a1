"""LoRA (Hugging Face PEFT) on a frozen int8 base: train the adapter, save it, merge it.

    pip install "fsdp_int8[hf]"
    python examples/peft_lora.py                            # one process
    torchrun --nproc-per-node 2 examples/peft_lora.py       # FSDP2 (gloo on CPU, nccl on GPUs)

The "8-bit base + LoRA" recipe with fsdp_int8: ``quantize_`` makes every linear weight of
the base int8 (rows + one fp32 scale per row), then PEFT's ``get_peft_model`` freezes the
base and adds LoRA's full-precision A and B matrices, the only parameters that train. On
several processes ``shard_model`` shards the PEFT model with FSDP2: the all-gathers carry
the base's int8 bytes beside the LoRA parameters, and only LoRA gradients are
reduce-scattered. It quantizes nothing more: the base is int8 already, and PEFT's adapter
layers (LoRA's A and B) are never quantized, whatever their rank.

Then the adapter is saved the PEFT way (``save_pretrained``: the adapter only; under FSDP2
from ``export_full_state_dict``), loaded onto a freshly quantized base, and merged twice:
``merge_and_unload()`` on the int8 model rounds the merged weights into int8 (one
requantization, measured here), while merging into a full-precision copy of the base
(``export_full_state_dict`` into the plain model) is exact.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
import torch.nn as nn
from peft import LoraConfig, PeftModel, get_peft_model

import fsdp_int8
import fsdp_int8.collectives
from _common import int8_names, int8_shards, job_folder, same, tiny_llama

VOCAB, SEQ = 128, 16
# The base is frozen: its weights never take an optimizer update, so the only rounding
# left is the merge's, and round to nearest is the better one-off rounding.
BASE = fsdp_int8.Int8TrainingConfig(stochastic_rounding=False)


def batch(seed: int, device: torch.device) -> torch.Tensor:
    """Chains ``x[t + 1] = (5 x[t] + 3) mod VOCAB`` from random starts: a fixed permutation
    of the vocabulary to learn (the frozen base does not know it)."""
    tokens = torch.randint(0, VOCAB, (8, SEQ), generator=torch.Generator().manual_seed(seed))
    for t in range(1, SEQ):
        tokens[:, t] = (5 * tokens[:, t - 1] + 3) % VOCAB
    return tokens.to(device)


def int8_base(device: torch.device) -> nn.Module:
    """The pretrained model stand-in (the same weights on every rank), quantized."""
    return fsdp_int8.quantize_(tiny_llama(seed=0, vocab=VOCAB, seq=SEQ).to(device), BASE)


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    """``|a - b|`` over ``|b|`` in root mean square: how far logits ``a`` moved from ``b``."""
    return ((a - b).pow(2).mean().sqrt() / b.pow(2).mean().sqrt()).item()


def wire_bytes_expected(model: nn.Module) -> int:
    """One forward's all-gathers if every int8 weight travels as int8 rows and one fp32
    scale per row and everything else (LoRA, norms, embedding, head) in fp32."""
    int8 = set(int8_names(model))
    return sum(p.numel() + 4 * p.shape[0] if n in int8 else 4 * p.numel() for n, p in model.named_parameters())


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--lora-rank", type=int, default=16)
    parser.add_argument("--lr", type=float, default=1e-2)
    args = parser.parse_args(argv)

    device = torch.device("cpu")
    if torch.accelerator.is_available():  # torchrun's LOCAL_RANK, else the caller's device
        index = int(os.environ.get("LOCAL_RANK", torch.accelerator.current_device_index()))
        torch.accelerator.set_device_index(index)
        device = torch.device(torch.accelerator.current_accelerator().type, index)
    with job_folder("peft_lora_", device, one_process_ok=True) as (rank, folder):
        sharded = dist.is_initialized()
        torch.manual_seed(0)  # LoRA's A matrices: the same on every rank
        lora = LoraConfig(r=args.lora_rank, lora_alpha=2 * args.lora_rank, target_modules="all-linear")
        model = get_peft_model(int8_base(device), lora)  # base frozen, LoRA trainable
        if sharded:
            # the base is int8 already and PEFT's adapter layers are never quantized: shard_model
            # only shards (the same config: the same seed for the weights' rounding stream)
            fsdp_int8.shard_model(model, config=BASE)
        base_before = int8_shards(model)
        optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)  # the base has no grads
        losses = []
        for step in range(args.steps):
            tokens = batch(1000 * step + rank, device)
            with fsdp_int8.collectives.count_collectives() as forward:
                loss = model(input_ids=tokens, labels=tokens).loss
            with fsdp_int8.collectives.count_collectives() as backward:
                loss.backward()
            if step == 0:
                gathers = forward  # every group gathered once, from its shards
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
        trainable = [p for p in model.parameters() if p.requires_grad]
        summary = {
            "rank": rank,
            "losses": losses,
            "int8_weights": len(int8_names(model)),
            "trainable_names": [n for n, p in model.named_parameters() if p.requires_grad],
            "trainable_elements": sum(p.numel() for p in trainable),
            "base_unchanged": same(int8_shards(model), base_before),
            "optimizer_states": len(optimizer.state),
            "states_only_for_trainable": all(p.requires_grad for p in optimizer.state),
            # gradients that crossed: LoRA's only (fp32), the frozen base sends none
            "reduce_scatter_bytes_per_step": backward.total_bytes("reduce_scatter_single"),
        }
        if sharded:
            summary["all_gather_bytes_per_forward"] = gathers.total_bytes("all_gather_single") + gathers.total_bytes(
                "all_gather_into_tensor"
            )
            summary["all_gather_bytes_expected"] = wire_bytes_expected(model)

        # The adapter, the PEFT way: a few KB of LoRA matrices (sharded: from the full state dict).
        full = fsdp_int8.export_full_state_dict(model, torch.float32) if sharded else None  # every rank
        probe = batch(-1, device)
        with torch.no_grad():
            trained_logits = model(probe).logits
        if rank == 0:
            model.save_pretrained(folder, state_dict=full)
            summary.update(merges(folder, probe, trained_logits, device))
        if sharded:
            dist.barrier()  # rank 0 is done with the folder
        return summary


def merges(folder: str, probe: torch.Tensor, trained_logits: torch.Tensor, device: torch.device) -> dict:
    """Reload the adapter onto a fresh int8 base in this process; merge it into int8 and
    into a full-precision copy of the base; how far each moves the logits."""
    reloaded = PeftModel.from_pretrained(int8_base(device), folder)
    with torch.no_grad():
        unmerged = reloaded(probe).logits
        with reloaded.disable_adapter():
            base_only = reloaded(probe).logits
    # exact: the base's int8 values, dequantized into the plain model, plus B @ A in fp32
    plain = tiny_llama(seed=1, vocab=VOCAB, seq=SEQ).to(device)
    plain.load_state_dict(fsdp_int8.export_full_state_dict(int8_base(device), torch.float32))
    merged_float = PeftModel.from_pretrained(plain, folder).merge_and_unload()
    # int8: each merged row gets a new scale and is rounded to nearest (BASE) into int8
    merged_int8 = reloaded.merge_and_unload()
    with torch.no_grad():
        float_logits, int8_logits = merged_float(probe).logits, merged_int8(probe).logits
    return {
        "adapter_files": sorted(os.listdir(folder)),
        "reload_max_diff": (unmerged - trained_logits).abs().max().item(),
        "merged_int8_weights": len(int8_names(merged_int8)),
        "adapter_effect": relative(unmerged, base_only),  # what LoRA changed
        "merge_int8_change": relative(int8_logits, unmerged),
        "merge_int8_max_change": ((int8_logits - unmerged).abs().max() / unmerged.abs().max()).item(),
        "merge_float_change": relative(float_logits, unmerged),
    }


if __name__ == "__main__":
    result = main()
    if result["rank"] == 0:
        print({k: v for k, v in result.items() if k != "trainable_names"})
