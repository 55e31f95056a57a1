"""LoRA (Hugging Face PEFT) on a frozen int8 base, in one process: only the adapter trains
(the base's int8 bytes and scales stay bit-identical and get no optimizer state),
``merge_and_unload`` rounds the merged weights into int8 within a stated bound, and the
example runs. The 2-rank side (shard_model, int8 bytes on the wire) is
tests/distributed/test_peft_distributed.py.

peft is in the ``hf`` extra (and so in ``test``): these tests run in CI, never skip.
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import pytest
import torch
import torch.nn as nn
from _frameworks import VOCAB, hf_loss, tiny_llama
from _models import fibonacci_mod_task, train_steps
from peft import LoraConfig, get_peft_model

import fsdp_int8
from fsdp_int8 import Int8TrainingConfig, Int8Weight
from fsdp_int8._quant.generators import WEIGHT_ROUNDING
from fsdp_int8.sharding import find_blocks

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
RANK = 16  # >= Int8TrainingConfig.min_features: LoRA's own layers pass quantize_'s default filter
STEPS = 20
BASE_INT8 = 14  # 2 layers x (q, k, v, o, gate, up, down); lm_head stays in full precision


def _lora(model: nn.Module) -> nn.Module:
    return get_peft_model(model, LoraConfig(r=RANK, lora_alpha=2 * RANK, target_modules="all-linear"))


def _snapshot(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter's stored bytes: an int8 weight's int8 data and scales, else the values."""
    out = {}
    for name, p in model.named_parameters():
        if isinstance(p, Int8Weight):
            out[name + ".int_data"], out[name + ".scale"] = p.int_data.clone(), p.scale.clone()
        else:
            out[name] = p.detach().clone()
    return out


@pytest.fixture(scope="module")
def trained():
    """A tiny Llama quantized with the default config (stochastic rounding), LoRA on every
    linear but the head, trained STEPS AdamW steps over *all* its parameters."""
    torch.manual_seed(0)
    WEIGHT_ROUNDING.manual_seed(0, 0)
    model = _lora(fsdp_int8.quantize_(tiny_llama()))
    before = _snapshot(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)  # as users write it
    tokens = fibonacci_mod_task(16, 16, vocab=VOCAB, seed=0)
    losses = train_steps(model, hf_loss, optimizer, tokens, STEPS)
    model.eval()
    return {"model": model, "before": before, "optimizer": optimizer, "losses": losses, "tokens": tokens}


def test_only_lora_trains_and_the_int8_base_stays_bit_identical(trained):
    model, before, optimizer = trained["model"], trained["before"], trained["optimizer"]
    losses = trained["losses"]
    assert losses[-1] < losses[0] - 0.5, losses  # measured 4.86 -> 3.86
    int8 = [n for n, p in model.named_parameters() if isinstance(p, Int8Weight)]
    assert len(int8) == BASE_INT8 and all(n.endswith(".base_layer.weight") for n in int8)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert len(trainable) == 2 * BASE_INT8 and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    after = _snapshot(model)
    changed = {k for k in after if not torch.equal(after[k], before[k])}
    assert changed == trainable, sorted(changed ^ trainable)  # every LoRA matrix, nothing else
    # the frozen base (int8 weights, embedding, norms, head) has no gradient, so no state
    assert {id(p) for p in optimizer.state} == {id(p) for p in model.parameters() if p.requires_grad}
    assert all(p.grad is None for n, p in model.named_parameters() if n not in trainable)


def _dequantized_copy(model: nn.Module) -> nn.Module:
    """``model`` with every int8 weight a plain fp32 parameter of its dequantized values."""
    model = copy.deepcopy(model)
    for module in model.modules():
        weight = module._parameters.get("weight")
        if isinstance(weight, Int8Weight):
            module.weight = nn.Parameter(weight.dequantize(torch.float32), requires_grad=False)
    return model


def _int8_weights(model: nn.Module) -> dict[str, Int8Weight]:
    return {n: p for n, p in model.named_parameters() if isinstance(p, Int8Weight)}


def _rms_change(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).pow(2).mean().sqrt() / b.pow(2).mean().sqrt()).item()


def test_merge_and_unload_rounds_the_merged_weights_into_int8_within_one_requantization(trained):
    """merge_and_unload adds B @ A * scaling to each int8 weight: our ``add_`` computes
    ``int8 * scale + delta`` in fp32 (the exact merged weight W*, which a merge into the
    dequantized base also gives), takes each row's new scale and rounds with the weight's
    own rounding. So:

    * with round to nearest the merged int8 weights are bit for bit ``quantize_`` of W*;
    * with stochastic rounding (the default) every value is within one step of its row's
      new scale of W*, and the logits move from the unmerged model's by at most 2x what
      rounding W* to nearest moves them (rms over all logits). Why 2x: a stochastic
      rounding error has variance p(1 - p) steps^2 for a value p of a step past the grid
      (1/6 on average), round to nearest's (1/12): sqrt(2) in rms (measured: 1.44x), and
      the logits sum many such errors; 2 leaves room, and the run is seeded.
    """
    model, tokens = trained["model"], trained["tokens"]
    with torch.no_grad():
        unmerged = model(tokens).logits
    exact = _dequantized_copy(model).merge_and_unload()  # W* in fp32
    with torch.no_grad():
        exact_logits = exact(tokens).logits
    assert _rms_change(exact_logits, unmerged) < 1e-5  # only the order of fp32 sums differs
    nearest_reference = fsdp_int8.quantize_(copy.deepcopy(exact), Int8TrainingConfig(stochastic_rounding=False))
    with torch.no_grad():
        nearest_change = _rms_change(nearest_reference(tokens).logits, unmerged)

    nearest = copy.deepcopy(model)
    for name, weight in _int8_weights(nearest).items():  # the same rows, rounding to nearest
        owner, attr = name.rsplit(".", 1)
        to_nearest = weight.with_tensors(weight.int_data, weight.scale, stochastic_rounding=False)
        setattr(nearest.get_submodule(owner), attr, nn.Parameter(to_nearest, requires_grad=weight.requires_grad))
    nearest = nearest.merge_and_unload()
    reference = _int8_weights(nearest_reference)
    merged_nearest = _int8_weights(nearest)
    assert merged_nearest.keys() == reference.keys() and len(reference) == BASE_INT8
    for name, weight in merged_nearest.items():
        assert torch.equal(weight.int_data, reference[name].int_data), name
        assert torch.equal(weight.scale, reference[name].scale), name

    merged = _int8_weights(copy.deepcopy(model).merge_and_unload())  # stochastic, as trained
    targets = dict(exact.named_parameters())
    for name, weight in merged.items():
        error = (weight.dequantize(torch.float32) - targets[name]).abs()
        assert torch.equal(weight.scale, reference[name].scale), name  # the same new scales
        assert (error <= weight.scale[:, None]).all(), name
    stochastic_model = copy.deepcopy(model).merge_and_unload()
    with torch.no_grad():
        stochastic_change = _rms_change(stochastic_model(tokens).logits, unmerged)
    assert 0 < nearest_change and stochastic_change <= 2 * nearest_change, (stochastic_change, nearest_change)
    assert stochastic_change < 0.05  # measured 0.025 (nearest: 0.017) on this run


def test_shard_models_block_discovery_sees_through_the_peft_wrapper():
    """PeftModel forwards ``_no_split_modules`` to the transformers model it wraps: the
    blocks shard_model wraps are the decoder layers, LoRA layers inside them."""
    model = _lora(fsdp_int8.quantize_(tiny_llama()))
    blocks = find_blocks(model)
    assert [type(b).__name__ for b in blocks] == ["LlamaDecoderLayer"] * 2
    assert blocks[0] is model.base_model.model.model.layers[0]


def test_default_quantize_leaves_peft_adapter_layers_alone():
    """quantize_'s default filter chooses by name and size; LoRA's lora_A / lora_B at rank
    16 pass both, but PEFT names them as adapter layers: they stay in full precision."""
    model = _lora(fsdp_int8.quantize_(tiny_llama()))
    fsdp_int8.quantize_(model)  # what shard_model(model) does first
    assert len(_int8_weights(model)) == BASE_INT8


def test_example_single_process():
    sys.path.insert(0, str(EXAMPLES))
    try:
        import peft_lora
    finally:
        sys.path.remove(str(EXAMPLES))
    out = peft_lora.main(["--steps", str(STEPS)])
    assert out["losses"][-1] < out["losses"][0] - 0.4, out["losses"]  # measured 4.88 -> 4.20
    assert out["int8_weights"] == out["merged_int8_weights"] == BASE_INT8
    assert all(".lora_A." in n or ".lora_B." in n for n in out["trainable_names"])
    assert out["base_unchanged"] and out["states_only_for_trainable"]
    assert out["optimizer_states"] == len(out["trainable_names"]) == 2 * BASE_INT8
    assert "adapter_model.safetensors" in out["adapter_files"]
    assert out["reload_max_diff"] == 0  # the saved adapter on a fresh int8 base: the same logits
    assert out["merge_float_change"] < 1e-5  # merged into the dequantized base: exact
    assert 0 < out["merge_int8_change"] < 0.05 * out["adapter_effect"]  # measured 0.011 vs 1.5
