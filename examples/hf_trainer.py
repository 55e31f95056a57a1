"""Hugging Face ``Trainer`` with FSDP2 and int8 weights: train, save_model, reload, resume.

    pip install "fsdp_int8[hf]"
    torchrun --nproc-per-node 2 examples/hf_trainer.py

A tiny Llama (from a config, no download) is quantized before the Trainer sees it;
``fsdp_config={"fsdp_version": 2, ...}`` makes accelerate shard it with FSDP2.
``Int8Trainer`` (``fsdp_int8.integrations.hf``) is the stock Trainer except that its model
saves hand safetensors the dequantized weights (safetensors cannot write an int8 weight's
memory as floats) and its checkpoints keep the stochastic-rounding generator. With
``state_dict_type: FULL_STATE_DICT`` ``save_model`` writes a plain ``model.safetensors``
that ``from_pretrained`` loads and ``quantize_`` rounds back to the trained int8 values;
checkpoints (``save_steps``) also hold the exact int8 state dict, and
``train(resume_from_checkpoint=...)`` continues bit-exactly. On CPU, accelerate would pick
DDP: ``_accelerate_cpu`` switches it to FSDP2 (gloo); on GPUs it changes nothing.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

import fsdp_int8
from _accelerate_cpu import accelerate_session, fsdp2_accelerator, on_cpu
from _common import int8_count, tiny_llama

VOCAB, SEQ = 128, 16


class Patterns(torch.utils.data.Dataset):
    """Token sequences stepping by 3 from each start: learnable in a few steps."""

    def __len__(self) -> int:
        return 256

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        tokens = (torch.arange(SEQ) * 3 + i) % VOCAB
        return {"input_ids": tokens, "labels": tokens}


def losses_of(trainer) -> dict[int, float]:
    return {h["step"]: h["loss"] for h in trainer.state.log_history if "loss" in h}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--lr", type=float, default=1e-2)
    args = parser.parse_args(argv)
    from accelerate.utils import FullyShardedDataParallelPlugin
    from transformers import LlamaForCausalLM, TrainingArguments
    from transformers.utils import logging

    from fsdp_int8.integrations.hf import Int8Trainer

    logging.set_verbosity_error()
    with accelerate_session():
        root = tempfile.mkdtemp() if os.environ.get("RANK", "0") == "0" else None
        training = TrainingArguments(
            output_dir=root or "unused", use_cpu=on_cpu(), fsdp=True,
            fsdp_config={
                "fsdp_version": 2, "state_dict_type": "FULL_STATE_DICT",
                "transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"],
            },
            max_steps=args.steps, save_steps=args.steps // 2, per_device_train_batch_size=4,
            learning_rate=args.lr, logging_steps=1, report_to=[], disable_tqdm=True,
        )
        box = [root]
        dist.broadcast_object_list(box, src=0)  # every rank writes into rank 0's folder
        root = training.output_dir = box[0]
        fsdp2_accelerator(FullyShardedDataParallelPlugin(**training.fsdp_plugin_args))
        try:
            trainer = Int8Trainer(model=fsdp_int8.quantize_(tiny_llama(0)), args=training, train_dataset=Patterns())
            trainer.train()
            losses = losses_of(trainer)
            final = os.path.join(root, "final")
            trainer.save_model(final)
            # The trained int8 weights, whole, on rank 0: compare the reload with them.
            full = get_model_state_dict(trainer.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
            reload_exact = None
            if trainer.args.process_index == 0:
                reloaded = fsdp_int8.quantize_(LlamaForCausalLM.from_pretrained(final))
                trained = {k: v for k, v in full.items() if isinstance(v, fsdp_int8.Int8Weight)}
                mine = dict(reloaded.named_parameters())
                reload_exact = len(trained) > 0 and all(
                    torch.equal(mine[k].int_data, w.int_data)
                    and torch.allclose(mine[k].scale, w.scale, rtol=2 ** -23, atol=0)
                    for k, w in trained.items()
                )
            # Resume from the mid-run checkpoint into a model with other weights.
            resumed = Int8Trainer(model=fsdp_int8.quantize_(tiny_llama(1)), args=training, train_dataset=Patterns())
            resumed.train(resume_from_checkpoint=os.path.join(root, f"checkpoint-{args.steps // 2}"))
            half = args.steps // 2
            again = {s: v for s, v in losses_of(resumed).items() if s > half}  # steps run again
            result = {
                "losses": [losses[s] for s in sorted(losses)],
                "int8_weights": int8_count(trainer.model),
                "int8_weights_resumed": int8_count(resumed.model),
                "saved_files": sorted(os.listdir(final)),
                "reload_exact": reload_exact,
                "resumed_losses": [again[s] for s in sorted(again)],
                "resume_matches": len(again) == args.steps - half and all(again[s] == losses[s] for s in again),
            }
            dist.barrier()
        finally:
            if dist.get_rank() == 0:
                shutil.rmtree(root, ignore_errors=True)
    if result["reload_exact"] is not None:
        print(result)
    return result


if __name__ == "__main__":
    main()
