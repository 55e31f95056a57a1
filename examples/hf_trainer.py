"""Hugging Face ``Trainer`` with FSDP2 and int8 weights: load, train, save_model, reload, resume.

    pip install "fsdp_int8[hf]"
    torchrun --nproc-per-node 2 examples/hf_trainer.py

A tiny Llama (from a config, no download) is written to a folder, standing in for a Hub
checkpoint, and loaded the transformers way: ``from_pretrained(..., quantization_config=
Int8TrainingHfConfig())`` quantizes each weight as it is read, on the meta device first.
The stock ``transformers.Trainer`` then needs nothing else: ``fsdp_config={"fsdp_version":
2, ...}`` makes accelerate shard the int8 weights with FSDP2, checkpoints (``save_steps``)
and ``save_model`` write the int8 rows with their fp32 scales (``model.safetensors``) and
``quantization_config`` into ``config.json``, and ``from_pretrained`` of the saved folder
gives back the same int8 bytes. ``Int8Trainer`` (``fsdp_int8.integrations.hf``) adds the
stochastic-rounding generator to the checkpoints, so that ``train(resume_from_checkpoint=
...)`` repeats the uninterrupted run's losses bit for bit. Last, the lean-memory recipe:
``shard_model(model, config=Int8TrainingConfig.lean())`` before the Trainer (accelerate
keeps a model FSDP2 already shards, with the config's bf16 compute), ``Int8AdamW.lean``
on its sharded parameters, and ``Int8Trainer``, which takes that optimizer in
``optimizers=`` (the stock Trainer refuses it under FSDP), leaves clipping to it (it
steps inside backward) and logs its gradient norm. On CPU, accelerate would pick DDP:
``_accelerate_cpu`` switches it to FSDP2 (gloo); on GPUs it changes nothing.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

import fsdp_int8
from _accelerate_cpu import accelerate_session, fsdp2_accelerator, on_cpu
from _common import int8_count, tiny_llama

if TYPE_CHECKING:
    from transformers import TrainingArguments

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


def same_int8(model, trained: dict[str, fsdp_int8.Int8Weight]) -> bool:
    mine = dict(model.named_parameters())
    return len(trained) > 0 and all(
        isinstance(mine[k], fsdp_int8.Int8Weight)
        and torch.equal(mine[k].int_data, w.int_data) and torch.equal(mine[k].scale, w.scale)
        for k, w in trained.items()
    )


def lean_run(base: str, args: "TrainingArguments", lr: float) -> dict:
    """The lean recipe under ``Int8Trainer`` with FSDP2: what it trained and what it holds."""
    from transformers import AutoModelForCausalLM

    from fsdp_int8.integrations.hf import Int8Trainer

    model = AutoModelForCausalLM.from_pretrained(base)
    fsdp_int8.shard_model(model, config=fsdp_int8.Int8TrainingConfig.lean())  # before the Trainer
    computed = set()  # the dtype a block's matmuls compute in
    model.model.layers[0].mlp.down_proj.register_forward_hook(lambda m, x, y: computed.add(y.dtype))
    optimizer = fsdp_int8.Int8AdamW.lean(model.parameters(), lr=lr)  # the sharded parameters
    trainer = Int8Trainer(model=model, args=args, train_dataset=Patterns(), optimizers=(optimizer, None))
    trainer.train()
    optimizer = trainer.optimizer.optimizer  # inside accelerate's wrapper
    up = trainer.model.model.layers[0].mlp.up_proj.weight
    losses = losses_of(trainer)
    return {
        "losses": [losses[s] for s in sorted(losses)],
        "grad_norms": [h["grad_norm"] for h in trainer.state.log_history if "loss" in h],
        "int8_weights": int8_count(trainer.model),
        "int8_embedding": isinstance(trainer.model.model.embed_tokens.weight.to_local(), fsdp_int8.Int8Weight),
        "compute_dtypes": sorted(str(d) for d in computed),
        "optimizer": f"{type(optimizer).__name__}(step_in_backward={optimizer.step_in_backward}, "
                     f"max_grad_norm={optimizer.max_grad_norm})",
        "state_dtypes": sorted(str(v.dtype) for k, v in optimizer.state[up].items() if k.startswith("exp_avg")),
    }


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--lr", type=float, default=1e-2)
    args = parser.parse_args(argv)
    from accelerate.utils import FullyShardedDataParallelPlugin
    from transformers import AutoModelForCausalLM, Trainer, TrainingArguments
    from transformers.utils import logging

    from fsdp_int8.integrations.hf import Int8Trainer
    from fsdp_int8.integrations.hf_quantizer import Int8TrainingHfConfig

    logging.set_verbosity_error()
    half = args.steps // 2
    with accelerate_session():

        def training(output_dir: str, **changes) -> TrainingArguments:
            options = dict(
                output_dir=output_dir, use_cpu=on_cpu(), fsdp=True,
                fsdp_config={
                    "fsdp_version": 2, "state_dict_type": "FULL_STATE_DICT",
                    "transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"],
                },
                max_steps=args.steps, save_steps=half, per_device_train_batch_size=4,
                learning_rate=args.lr, logging_steps=1, report_to=[], disable_tqdm=True,
            )
            out = TrainingArguments(**{**options, **changes})
            fsdp2_accelerator(FullyShardedDataParallelPlugin(**out.fsdp_plugin_args))
            return out

        def int8_llama():  # quantized while loading: no full-precision copy of the model
            return AutoModelForCausalLM.from_pretrained(base, quantization_config=Int8TrainingHfConfig())

        plain_args = training("unused")  # also starts the process group (accelerate's state)
        box = [tempfile.mkdtemp() if dist.get_rank() == 0 else None]
        dist.broadcast_object_list(box, src=0)  # every rank writes into rank 0's folder
        root = box[0]
        plain_args.output_dir = os.path.join(root, "plain")
        try:
            base = os.path.join(root, "base")
            if dist.get_rank() == 0:
                tiny_llama(0).save_pretrained(base)
            dist.barrier()
            # 1. The stock Trainer: train, checkpoint, save_model, reload.
            trainer = Trainer(model=int8_llama(), args=plain_args, train_dataset=Patterns())
            trainer.train()
            final = os.path.join(root, "final")
            trainer.save_model(final)
            # The trained int8 weights, whole, on rank 0: compare the reload with them.
            full = get_model_state_dict(trainer.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
            reload_exact = None
            if trainer.args.process_index == 0:
                trained = {k: v for k, v in full.items() if isinstance(v, fsdp_int8.Int8Weight)}
                reload_exact = same_int8(AutoModelForCausalLM.from_pretrained(final), trained)
            # 2. Int8Trainer, the same run, then resumed from its mid-run checkpoint.
            exact_args = training(os.path.join(root, "exact"))
            exact = Int8Trainer(model=int8_llama(), args=exact_args, train_dataset=Patterns())
            exact.train()
            resumed = Int8Trainer(model=int8_llama(), args=exact_args, train_dataset=Patterns())
            resumed.train(resume_from_checkpoint=os.path.join(root, "exact", f"checkpoint-{half}"))
            # 3. The lean recipe: int8 embeddings and gathered weights, 8-bit states, the
            # optimizer step inside backward, bf16 compute.
            # FSDP2, nothing left to wrap: shard_model sharded the model (accelerate would look
            # for LlamaDecoderLayer, which fully_shard renamed FSDPLlamaDecoderLayer)
            lean_args = training(os.path.join(root, "lean"), save_strategy="no",
                                 fsdp_config={"fsdp_version": 2, "auto_wrap_policy": "NO_WRAP"})
            lean = lean_run(base, lean_args, args.lr)
            losses, exact_losses = losses_of(trainer), losses_of(exact)
            again = {s: v for s, v in losses_of(resumed).items() if s > half}  # steps run again
            result = {
                "losses": [losses[s] for s in sorted(losses)],
                "int8_weights": int8_count(trainer.model),
                "int8_weights_resumed": int8_count(resumed.model),
                "saved_files": sorted(os.listdir(final)),
                "reload_exact": reload_exact,
                "int8_trainer_matches_trainer": exact_losses == losses,
                "resumed_losses": [again[s] for s in sorted(again)],
                "resume_matches": len(again) == args.steps - half
                and all(again[s] == exact_losses[s] for s in again),
                "lean": lean,
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
