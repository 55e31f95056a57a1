"""Single-process checks of transformers' ``Trainer`` and accelerate on int8 models, and of
``load_state_dict(assign=True)`` into a quantized model (the multi-process flows are in
tests/distributed/test_integrations_distributed.py and tests/distributed/test_examples.py).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch
import torch.nn as nn

import fsdp_int8
from fsdp_int8 import Int8Weight

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _frameworks import VOCAB, tiny_llama  # noqa: E402


class _Patterns(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 16

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        tokens = (torch.arange(16) * 3 + i) % VOCAB
        return {"input_ids": tokens, "labels": tokens}


def _args(output_dir, steps: int = 4):
    from transformers import TrainingArguments

    return TrainingArguments(
        output_dir=str(output_dir), use_cpu=True, max_steps=steps, save_steps=steps // 2,
        per_device_train_batch_size=4, learning_rate=1e-2, logging_steps=1, report_to=[], disable_tqdm=True,
    )


def _losses(trainer) -> dict[int, float]:
    return {h["step"]: h["loss"] for h in trainer.state.log_history if "loss" in h}


def _int8_bytes(model: nn.Module) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    return {n: (p.int_data.clone(), p.scale.clone()) for n, p in model.named_parameters() if isinstance(p, Int8Weight)}


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(x, y) for k in a for x, y in zip(a[k], b[k]))


def _from_pretrained_int8(tmp_path):
    from transformers import AutoModelForCausalLM

    from fsdp_int8.integrations.hf_quantizer import Int8TrainingHfConfig

    if not (tmp_path / "float").exists():
        tiny_llama().save_pretrained(tmp_path / "float")
    return AutoModelForCausalLM.from_pretrained(tmp_path / "float", quantization_config=Int8TrainingHfConfig())


def test_the_stock_trainer_checkpoints_saves_and_resumes_an_int8_model(tmp_path):
    """A model loaded with quantization_config (quantize_ + attach_hf_quantizer: the DDP case
    of tests/distributed/test_integrations_distributed.py)."""
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM, Trainer

    trainer = Trainer(model=_from_pretrained_int8(tmp_path), args=_args(tmp_path / "run"), train_dataset=_Patterns())
    trainer.train()
    with safe_open(tmp_path / "run" / "checkpoint-2" / "model.safetensors", framework="pt") as saved:
        assert saved.get_tensor("model.layers.0.mlp.up_proj.weight").dtype == torch.int8
        assert saved.get_tensor("model.layers.0.mlp.up_proj.weight_scale").dtype == torch.float32
    trainer.save_model(tmp_path / "final")
    trained = _int8_bytes(trainer.model)
    assert len(trained) == 14 and _same(_int8_bytes(AutoModelForCausalLM.from_pretrained(tmp_path / "final")), trained)

    # resume_from_checkpoint: load_state_dict of the int8 rows and scales, then train on.
    resumed = Trainer(model=_from_pretrained_int8(tmp_path), args=_args(tmp_path / "run"), train_dataset=_Patterns())
    at_checkpoint = {}
    original = resumed._load_from_checkpoint

    def load_and_look(*args, **kwargs):
        original(*args, **kwargs)
        at_checkpoint.update(_int8_bytes(resumed.model))

    resumed._load_from_checkpoint = load_and_look
    resumed.train(resume_from_checkpoint=str(tmp_path / "run" / "checkpoint-2"))
    from_file = AutoModelForCausalLM.from_pretrained(tmp_path / "run" / "checkpoint-2")
    assert _same(at_checkpoint, _int8_bytes(from_file))  # every byte of the checkpoint came back
    assert len(_int8_bytes(resumed.model)) == 14
    # Step 3 runs on exactly the checkpoint's weights; later steps round with another stream.
    assert _losses(resumed)[3] == _losses(trainer)[3]


def test_int8_trainer_resumes_bit_exactly_and_attaches_the_quantizer_itself(tmp_path):
    from fsdp_int8.integrations.hf import Int8Trainer
    from fsdp_int8.integrations.hf_quantizer import Int8TrainingHfQuantizer

    def run(**kwargs):
        model = fsdp_int8.quantize_(tiny_llama())  # no quantizer: Int8Trainer attaches it
        trainer = Int8Trainer(model=model, args=_args(tmp_path), train_dataset=_Patterns())
        assert isinstance(trainer.model.hf_quantizer, Int8TrainingHfQuantizer)
        trainer.train(**kwargs)
        return trainer

    first = run()
    assert os.path.isfile(tmp_path / "checkpoint-2" / "int8_rounding_0.pth")
    resumed = run(resume_from_checkpoint=str(tmp_path / "checkpoint-2"))
    assert [_losses(resumed)[s] for s in (3, 4)] == [_losses(first)[s] for s in (3, 4)]
    assert _same(_int8_bytes(resumed.model), _int8_bytes(first.model))


def _lean_trainer(tmp_path, trainer_class, *, trainer_clip: float = 1.0, **optimizer_changes):
    """The lean recipe's documented Trainer call: a tiny Llama quantized with
    ``Int8TrainingConfig.lean()``, ``Int8AdamW.lean`` passed in ``optimizers``, bf16 autocast."""
    from transformers import TrainingArguments

    model = fsdp_int8.quantize_(tiny_llama(), fsdp_int8.Int8TrainingConfig.lean())
    optimizer = fsdp_int8.Int8AdamW.lean(model.parameters(), lr=1e-2, **optimizer_changes)
    args = TrainingArguments(
        output_dir=str(tmp_path), use_cpu=True, max_steps=6, per_device_train_batch_size=4, bf16=True,
        max_grad_norm=trainer_clip, logging_steps=1, save_strategy="no", report_to=[], disable_tqdm=True,
    )
    return trainer_class(model=model, args=args, train_dataset=_Patterns(), optimizers=(optimizer, None))


def test_int8_trainer_trains_the_lean_recipe_and_logs_the_optimizers_gradient_norm(tmp_path):
    """The optimizer steps inside backward: the Trainer's clipping and norm logging would read
    gradients already applied (transformers 5.23 computes the norm even with max_grad_norm=0)."""
    from transformers import Trainer, TrainerCallback

    from fsdp_int8.integrations.hf import Int8Trainer

    measured = []

    class Measure(TrainerCallback):  # after optimizer.step(), before the step is logged
        def on_step_end(self, args, state, control, optimizer=None, **kwargs):
            measured.append(optimizer.optimizer.grad_norm)

    trainer = _lean_trainer(tmp_path, Int8Trainer)
    trainer.add_callback(Measure())
    trainer.train()
    model, optimizer = trainer.model, trainer.optimizer.optimizer
    assert isinstance(model.model.embed_tokens.weight, Int8Weight)  # int8 embeddings
    up = model.model.layers[0].mlp.up_proj.weight
    assert isinstance(up, Int8Weight) and up.int8_matmul is None and up.int8_gathered_weights
    assert optimizer.step_in_backward and optimizer.max_grad_norm == 1.0
    state = optimizer.state[up]  # 8-bit moments
    assert state["exp_avg_int8"].dtype == torch.int8 and state["exp_avg_sq_sqrt_uint8"].dtype == torch.uint8
    losses = _losses(trainer)
    assert len(losses) == 6 and losses[6] < losses[1], losses
    logged = [h["grad_norm"] for h in trainer.state.log_history if "loss" in h]
    # each step logs the norm the optimizer measured inside backward: positive, finite
    assert logged == measured and all(0 < g < float("inf") for g in logged), (logged, measured)

    # The stock Trainer reads the applied gradients (its norm logging): refused, naming the fix.
    with pytest.raises(RuntimeError, match=r"use fsdp_int8\.integrations\.hf\.Int8Trainer, or put Int8SaveMixin"):
        _lean_trainer(tmp_path, Trainer).train()


def test_int8_trainer_refuses_clipping_an_optimizer_stepping_in_backward_does_not_do(tmp_path):
    from fsdp_int8.integrations.hf import Int8Trainer

    trainer = _lean_trainer(tmp_path, Int8Trainer, trainer_clip=0.5, max_grad_norm=None)
    with pytest.raises(ValueError, match=r"TrainingArguments\(max_grad_norm=0.5\).*give the optimizer max_grad_norm=0.5"):
        trainer.train()
    assert trainer.state.global_step == 0  # refused before any step
    trainer = _lean_trainer(tmp_path, Int8Trainer, trainer_clip=0.0, max_grad_norm=None)
    trainer.train()  # no clipping asked, none done; no norm measured, none logged
    assert trainer.state.global_step == 6 and not any("grad_norm" in h for h in trainer.state.log_history)
    # under FSDP, accelerate would shard the model after the optimizer hooked its parameters
    trainer = _lean_trainer(tmp_path, Int8Trainer)
    trainer.is_fsdp_enabled = True  # as FSDP in TrainingArguments sets it on several processes
    with pytest.raises(ValueError, match=r"shard the model before the Trainer, fsdp_int8\.shard_model"):
        trainer.create_optimizer()  # what train() calls before accelerate shards the model


def test_accelerate_saves_through_save_pretrained_and_state_through_torch_save(tmp_path):
    """accelerate's safetensors writers read raw bytes: save_model and the unsharded
    save_state refuse an int8 weight, naming what works instead (both tested here)."""
    from accelerate import Accelerator
    from transformers import AutoModelForCausalLM

    accelerator = Accelerator(cpu=True)
    from fsdp_int8.integrations.hf_quantizer import attach_hf_quantizer

    model = attach_hf_quantizer(fsdp_int8.quantize_(tiny_llama()))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, optimizer = accelerator.prepare(model, optimizer)
    with pytest.raises(RuntimeError, match=r"unwrap_model\(model\)\.save_pretrained"):
        accelerator.save_model(model, tmp_path / "refused")
    with pytest.raises(RuntimeError, match="safe_serialization=False"):
        accelerator.save_state(tmp_path / "refused")

    accelerator.unwrap_model(model).save_pretrained(tmp_path / "hf", state_dict=accelerator.get_state_dict(model))
    saved = _int8_bytes(model)
    assert _same(_int8_bytes(AutoModelForCausalLM.from_pretrained(tmp_path / "hf")), saved)
    accelerator.save_state(tmp_path / "state", safe_serialization=False)
    tokens = (torch.arange(16) * 3) % VOCAB
    accelerator.backward(model(input_ids=tokens[None], labels=tokens[None]).loss)
    optimizer.step()
    assert not _same(_int8_bytes(model), saved)
    accelerator.load_state(tmp_path / "state")
    assert _same(_int8_bytes(model), saved)


def test_assigning_a_float_weight_keeps_the_layer_int8():
    torch.manual_seed(0)
    model = fsdp_int8.quantize_(nn.Sequential(nn.Linear(64, 32), nn.Linear(32, 64)))
    values = torch.randn(32, 64)
    state = {"0.weight": values, "0.bias": torch.zeros(32), "1.weight": model[1].weight.clone(), "1.bias": torch.zeros(64)}
    kept = model[1].weight
    model.load_state_dict(state, assign=True)
    assert isinstance(model[0].weight, Int8Weight) and isinstance(model[0].weight, nn.Parameter)
    assert torch.equal(model[0].weight.int_data, Int8Weight.from_float(values).int_data)
    assert model[0].weight.requires_grad
    assert isinstance(model[1].weight, Int8Weight) and torch.equal(model[1].weight, kept)
    with pytest.raises(ValueError, match="non-finite"):  # a NaN never becomes an int8 weight
        model.load_state_dict({**state, "0.weight": torch.full((32, 64), float("nan"))}, assign=True)
