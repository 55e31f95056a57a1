"""accelerate's FSDP2 plugin with int8 weights and ``cpu_ram_efficient_loading``.

    pip install "fsdp_int8[hf]"
    torchrun --nproc-per-node 2 examples/accelerate_fsdp2.py

Every process builds a tiny Llama (from a config, no download) and quantizes it before
``accelerator.prepare``. With ``cpu_ram_efficient_loading`` accelerate moves the model to
the meta device, shards it with FSDP2, then rank 0 broadcasts and scatters its full state
dict into the shards: the int8 weights travel as float values and every rank rounds them
back to nearest into int8 shards (exact for weights as quantized), so each rank ends with
rank 0's weights, still int8. The loop trains a few steps; ``accelerator.save_state``
writes a torch.distributed.checkpoint (``SHARDED_STATE_DICT``: each rank its int8 shards,
exactly) or a full ``torch.save`` (``FULL_STATE_DICT``), and ``accelerator.load_state``
restores every int8 byte. ``accelerator.save_model`` writes raw safetensors bytes, which an
int8 weight does not have: ``save_pretrained`` of the gathered state dict writes the int8
rows with their scales instead (``quantize_`` gave the model fsdp_int8's transformers
quantizer), and ``from_pretrained`` reads them back exactly. On CPU,
accelerate would pick DDP: ``_accelerate_cpu`` switches it to FSDP2 (gloo); on GPUs it
changes nothing.
"""

from __future__ import annotations

import argparse
import shutil
import tempfile

import torch
import torch.distributed as dist

import fsdp_int8
from _accelerate_cpu import accelerate_session, fsdp2_accelerator
from _common import int8_count, int8_shards, same, tiny_llama

VOCAB, SEQ = 128, 16


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--lr", type=float, default=1e-2)
    parser.add_argument("--state-dict-type", default="SHARDED_STATE_DICT",
                        choices=["SHARDED_STATE_DICT", "FULL_STATE_DICT"])
    args = parser.parse_args(argv)
    from accelerate.utils import FullyShardedDataParallelPlugin
    from transformers import AutoModelForCausalLM


    with accelerate_session():
        plugin = FullyShardedDataParallelPlugin(
            fsdp_version=2, cpu_ram_efficient_loading=True, state_dict_type=args.state_dict_type,
            auto_wrap_policy="transformer_based_wrap", transformer_cls_names_to_wrap=["LlamaDecoderLayer"],
        )
        accelerator = fsdp2_accelerator(plugin)
        rank = accelerator.process_index
        model = fsdp_int8.quantize_(tiny_llama(seed=rank))  # each rank its own init: rank 0's must win
        optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
        model, optimizer = accelerator.prepare(model, optimizer)

        # What rank 0 loaded, sharded as accelerate sharded it: each rank's rows of it.
        expected = fsdp_int8.quantize_(tiny_llama(seed=0))
        world = accelerator.num_processes
        rows = {key: value.chunk(world)[rank] for key, value in int8_shards(expected).items()}
        loaded_from_rank0 = same(int8_shards(model), rows)

        tokens = (torch.arange(SEQ) * 3 + torch.arange(4)[:, None] + 8 * rank) % VOCAB
        losses = []
        for _ in range(args.steps):
            loss = model(input_ids=tokens, labels=tokens).loss
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())

        box = [tempfile.mkdtemp() if rank == 0 else None]
        dist.broadcast_object_list(box, src=0)
        try:
            accelerator.save_state(box[0])
            saved = int8_shards(model)
            model(input_ids=tokens, labels=tokens).loss.backward()  # one more step moves the weights
            optimizer.step()
            optimizer.zero_grad()
            moved = not same(int8_shards(model), saved)
            accelerator.load_state(box[0])
            reload_exact = moved and same(int8_shards(model), saved)
            # Instead of accelerator.save_model: every rank gathers, rank 0 writes.
            full = accelerator.get_state_dict(model)
            hf_dir = f"{box[0]}/hf"
            accelerator.unwrap_model(model).save_pretrained(
                hf_dir, state_dict=full, is_main_process=accelerator.is_main_process
            )
            accelerator.wait_for_everyone()
            pretrained_exact = None
            if rank == 0:
                trained = {k: v for k, v in full.items() if isinstance(v, fsdp_int8.Int8Weight)}
                pretrained_exact = len(trained) == int8_count(model) and same(
                    int8_shards(AutoModelForCausalLM.from_pretrained(hf_dir)),
                    {f"{k}.{part}": getattr(w, part) for k, w in trained.items() for part in ("int_data", "scale")},
                )
        finally:
            if rank == 0:
                shutil.rmtree(box[0], ignore_errors=True)
        result = {
            "losses": losses,
            "int8_weights": int8_count(model),
            "loaded_from_rank0_exact": loaded_from_rank0,
            "state_dict_type": args.state_dict_type,
            "reload_exact": reload_exact,
            "save_pretrained_exact": pretrained_exact,  # checked on rank 0
        }
    if rank == 0:
        print(result)
    return result


if __name__ == "__main__":
    main()
