"""Single-process checks of ``fsdp_int8.integrations.hf`` and of ``load_state_dict(assign=True)``
into a quantized model (the multi-process flows are in tests/distributed/test_examples.py).
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
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
        return 8

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        tokens = (torch.arange(16) * 3 + i) % VOCAB
        return {"input_ids": tokens, "labels": tokens}


def _trainer(cls, root: str):
    from transformers import TrainingArguments

    args = TrainingArguments(output_dir=root, use_cpu=True, max_steps=2, report_to=[], disable_tqdm=True)
    return cls(model=fsdp_int8.quantize_(tiny_llama()), args=args, train_dataset=_Patterns())


def test_stock_trainer_save_is_refused_naming_the_fix_and_int8_trainer_saves():
    from transformers import LlamaForCausalLM, Trainer

    from fsdp_int8.integrations.hf import Int8Trainer

    with tempfile.TemporaryDirectory() as root:
        with pytest.raises(RuntimeError, match="Int8Trainer"):
            _trainer(Trainer, root).save_model(f"{root}/stock")
        trainer = _trainer(Int8Trainer, root)
        trainer.save_model(f"{root}/int8")
        plain = LlamaForCausalLM.from_pretrained(f"{root}/int8")
        for name, param in trainer.model.named_parameters():
            reloaded = plain.get_parameter(name)
            if isinstance(param, Int8Weight):  # the dequantized values, in the weight's dtype
                assert reloaded.dtype == param.dtype and torch.equal(reloaded, param.dequantize()), name
            else:
                assert torch.equal(reloaded, param), name
        requantized = fsdp_int8.quantize_(plain)
        for name, param in trainer.model.named_parameters():
            if isinstance(param, Int8Weight):
                assert torch.equal(requantized.get_parameter(name).int_data, param.int_data), name


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


def test_the_hf_integration_is_not_imported_by_the_package():
    code = "import sys, fsdp_int8; print('transformers' in sys.modules or 'accelerate' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
