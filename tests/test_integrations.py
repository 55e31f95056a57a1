"""Hugging Face transformers and torchtitan models in one process: copies, saves, layouts
the frameworks use (tied embeddings, GPT-2's Conv1D, torchtitan's layer dict, fused-QKV
state-dict hooks and trunc_normal_ init). The multi-process side (DDP, FSDP2 with tied
embeddings, torchtitan's meta-device path) is tests/distributed/test_integrations_distributed.py.
"""

from __future__ import annotations

import warnings

import copy
import io
import os
import subprocess
import sys

import pytest
import torch

import fsdp_int8
import fsdp_int8.sharding
import fsdp_int8.checkpoint
from fsdp_int8 import Int8TrainingConfig, Int8Weight, quantize_

from _frameworks import VOCAB, hf_loss, tiny_gpt2, tiny_llama, titan_init, titan_loss, titan_model
from _models import fibonacci_mod_task


def _int8(model: torch.nn.Module) -> dict[str, Int8Weight]:
    return {n: p for n, p in model.named_parameters() if isinstance(p, Int8Weight)}


def _same_params(a: torch.nn.Module, b: torch.nn.Module) -> None:
    for (name, x), y in zip(a.state_dict().items(), b.state_dict().values()):
        assert type(x) is type(y), name
        assert torch.equal(x, y), name


# ---------------------------------------------------------------- transformers
def test_hf_quantized_model_deepcopies_and_round_trips_torch_save():
    model = quantize_(tiny_llama())
    assert len(_int8(model)) == 14  # 2 layers x (4 attention + 3 mlp); lm_head stays fp32
    copied = copy.deepcopy(model)
    _same_params(model, copied)
    assert all(c.data_ptr() != w.data_ptr() for c, w in zip(_int8(copied).values(), _int8(model).values()))
    buf = io.BytesIO()
    torch.save(model.state_dict(), buf)
    buf.seek(0)
    fresh = quantize_(tiny_llama(seed=1))
    fresh.load_state_dict(torch.load(buf, weights_only=True))
    _same_params(model, fresh)
    tokens = fibonacci_mod_task(4, 12, vocab=VOCAB)
    assert torch.equal(hf_loss(fresh, tokens), hf_loss(model, tokens))


def test_accelerate_re_maps_the_optimizer_by_data_ptr_onto_the_right_weights():
    """accelerate's FSDP2 prepare keys the optimizer's parameters by data_ptr(), swaps them
    for placeholders, shards the model, and maps them back (every int8 weight was 0)."""
    from accelerate.utils.fsdp_utils import fsdp2_switch_optimizer_parameters

    model = quantize_(tiny_llama())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    old = {name: p.data_ptr() for name, p in model.named_parameters()}  # _get_named_parameters
    assert len(set(old.values())) == len(old)
    for group in opt.param_groups:
        for i, p in enumerate(group["params"]):
            group["params"][i] = torch.empty(1)
            group["params"][i].data_ptr = p.data_ptr()
    new = dict(model.named_parameters())  # (sharding would replace them here)
    fsdp2_switch_optimizer_parameters(opt, {old[name]: new[name] for name in old})
    assert [id(p) for p in opt.param_groups[0]["params"]] == [id(p) for p in model.parameters()]


def test_save_pretrained_of_a_quantized_model_writes_int8_rows_and_scales(tmp_path):
    """quantize_ gives a transformers model fsdp_int8's quantizer: a plain save_pretrained
    writes each int8 weight as its int8 rows plus fp32 scales (test_hf_safetensors.py loads
    them back bit for bit)."""
    from safetensors import safe_open

    model = quantize_(tiny_llama())
    model.save_pretrained(tmp_path)
    files = [name for name in os.listdir(tmp_path) if name.endswith(".safetensors")]
    assert files
    with safe_open(str(tmp_path / files[0]), "pt") as saved:
        for name, weight in _int8(model).items():
            assert torch.equal(saved.get_tensor(name), weight.int_data.reshape(-1)), name  # flat rows
            assert torch.equal(saved.get_tensor(name + "_scale"), weight.scale), name


def test_save_pretrained_of_the_exported_state_dict_reloads_in_full_and_in_int8(tmp_path):
    from transformers import LlamaForCausalLM

    model = quantize_(tiny_llama(), Int8TrainingConfig(stochastic_rounding=False))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    tokens = fibonacci_mod_task(4, 12, vocab=VOCAB)
    for _ in range(2):  # trained weights: scales no longer straight from the init
        hf_loss(model, tokens).backward()
        opt.step()
        opt.zero_grad()
    model.save_pretrained(tmp_path, state_dict=fsdp_int8.export_full_state_dict(model, torch.float32))
    plain = LlamaForCausalLM.from_pretrained(tmp_path)
    assert not _int8(plain)
    for name, weight in _int8(model).items():
        assert torch.equal(plain.get_parameter(name), weight.dequantize()), name
    torch.testing.assert_close(hf_loss(plain, tokens), hf_loss(model, tokens))
    # The dequantized values load back into a quantized model as the same int8 values.
    again = quantize_(tiny_llama(seed=1))
    fsdp_int8.checkpoint.load_full_state_dict(again, plain.state_dict())
    for name, weight in _int8(model).items():
        got = again.get_parameter(name)
        assert torch.equal(got.int_data, weight.int_data), name
        torch.testing.assert_close(got.scale, weight.scale, rtol=1.2e-7, atol=0)  # <= 1 ulp


def test_tied_embeddings_stay_tied_when_the_filter_includes_the_head():
    model = tiny_llama(tie=True)
    everything = Int8TrainingConfig(module_filter=lambda m, n: isinstance(m, torch.nn.Linear))
    with pytest.warns(UserWarning, match=r"lm_head \(tied to model\.embed_tokens\)"):
        quantize_(model, everything)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert len(_int8(model)) == 14
    model.tie_weights()  # what transformers does after loading: still one plain weight
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert type(model.lm_head.weight.data) is torch.Tensor


def test_the_package_imports_no_framework():
    code = (
        "import sys, fsdp_int8; "
        "found = [m for m in ('transformers', 'accelerate', 'safetensors', 'torchtitan') if m in sys.modules]; "
        "assert not found, found"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_gpt2_conv1d_layers_get_int8_weights_without_a_warning(caplog):
    """GPT-2's Conv1D layers (weight [in, out]) are quantized like nn.Linear: 4 a block
    (c_attn, c_proj, c_fc, mlp.c_proj); tests/test_gpt2.py trains and exports them."""
    model = tiny_gpt2()
    with caplog.at_level("INFO", logger="fsdp_int8"), warnings.catch_warnings():
        warnings.simplefilter("error")
        quantize_(model)
    assert "8 int8 weights" in caplog.text
    assert len(_int8(model)) == 8


# ---------------------------------------------------------------- torchtitan
def test_torchtitan_layer_dict_is_found_and_its_init_runs_on_int8_weights():
    """torchtitan's init draws every linear with trunc_normal_ (the fused QKV through views
    [kv_heads, 3, head_dim, dim] and a cat): on int8 weights it lands within rounding of
    the same init on the plain model."""
    plain = titan_model()
    torch.manual_seed(0)
    titan_init(plain)
    model = titan_model()
    assert [id(b) for b in fsdp_int8.sharding.find_blocks(model)] == [id(b) for b in model.layers.values()]
    quantize_(model)
    assert len(_int8(model)) == 2 * 5  # wqkv, wo, w1, w2, w3 per layer
    torch.manual_seed(0)
    titan_init(model)
    reference = dict(plain.named_parameters())
    for name, weight in _int8(model).items():
        # std 0.02 inside [-2, 2]: nothing truncated, exactly the int8 of the plain init
        assert torch.equal(weight, Int8Weight.from_float(reference[name].detach())), name
    tokens = fibonacci_mod_task(4, 12, vocab=VOCAB)
    torch.testing.assert_close(titan_loss(model, tokens), titan_loss(plain, tokens), rtol=0.02, atol=0)


def test_torchtitan_fused_qkv_state_dict_hooks_round_trip_int8_exactly():
    """Its hooks split wqkv into wq / wk / wv on save ([kv_heads, 3, head_dim, dim] views,
    slices and selects along dim 1) and cat them back on load."""
    model = quantize_(titan_model())
    titan_init(model)
    state = model.state_dict()
    assert "layers.0.attention.qkv_linear.wq.weight" in state
    assert isinstance(state["layers.0.attention.qkv_linear.wk.weight"], Int8Weight)
    fresh = quantize_(titan_model())
    fresh.load_state_dict(state)
    _same_params(model, fresh)
