"""GPT-2's ``Conv1D`` (weight ``[in, out]``, ``addmm``) quantized: int8 weights per output
feature, training, export to a plain GPT-2 state dict and back, pickling, and
``shard_model`` (one spawn).

The model is a tiny ``GPT2LMHeadModel`` built from its config (no weights downloaded).
"""

from __future__ import annotations

import copy
import io
import warnings

import pytest
import torch
import torch.nn as nn
from _models import fibonacci_mod_task, train_steps

import fsdp_int8
from fsdp_int8 import Int8TrainingConfig, Int8Weight, quantize_
from fsdp_int8._weight.conv1d import Int8Conv1D
from fsdp_int8._weight.ops.math import dequantize_all
from fsdp_int8.checkpoint import load_full_state_dict

VOCAB = 128
CONV1D = ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")  # per block
# [in, out] of each: c_attn 64 -> 192, c_proj 64 -> 64 (square: the layout cannot be told
# from the shape), c_fc 64 -> 256, mlp.c_proj 256 -> 64
SHAPES = {"attn.c_attn": (64, 192), "attn.c_proj": (64, 64), "mlp.c_fc": (64, 256), "mlp.c_proj": (256, 64)}


def tiny_gpt2(seed: int = 0) -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(
        n_layer=2, n_embd=64, n_head=2, vocab_size=VOCAB, n_positions=32,
        bos_token_id=0, eos_token_id=0,  # inside the tiny vocabulary (transformers checks)
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,  # deterministic forwards to compare
    )
    torch.manual_seed(seed)
    return GPT2LMHeadModel(config)


def _conv1d_names(n_layer: int = 2) -> list[str]:
    return [f"transformer.h.{i}.{layer}" for i in range(n_layer) for layer in CONV1D]


def _tokens() -> torch.Tensor:
    return fibonacci_mod_task(8, 16, vocab=VOCAB)


def _loss(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    return model(input_ids=tokens, labels=tokens).loss


def _int8(model: nn.Module) -> dict[str, Int8Weight]:
    return {n: p for n, p in model.named_parameters() if isinstance(p, Int8Weight)}


def _same_int8(a: nn.Module, b: nn.Module, scale_ulps: bool = False) -> None:
    assert _int8(a).keys() == _int8(b).keys()
    for name, weight in _int8(a).items():
        other = b.get_parameter(name)
        assert torch.equal(weight.int_data, other.int_data), name
        if scale_ulps:  # a scale recomputed from dequantized values: 127 * s / 127, <= 1 ulp
            torch.testing.assert_close(other.scale, weight.scale, rtol=1.2e-7, atol=0)
        else:
            assert torch.equal(weight.scale, other.scale), name


# ------------------------------------------------------------------ quantize_
def test_conv1d_layers_get_int8_weights_per_output_feature_under_gpt2_keys():
    plain = tiny_gpt2()
    model = copy.deepcopy(plain)
    keys = list(plain.state_dict())
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing is left behind: no warning
        quantize_(model)
    assert sorted(_int8(model)) == sorted(f"{n}.weight" for n in _conv1d_names())
    for name in _conv1d_names():
        before, layer = plain.get_submodule(name), model.get_submodule(name)
        n_in, n_out = SHAPES[name.split(".", 3)[3]]
        assert isinstance(layer, Int8Conv1D) and isinstance(layer, nn.Linear), name
        assert (layer.in_features, layer.out_features, layer.nx, layer.nf) == (n_in, n_out, n_in, n_out)
        # [out, in] with one scale per output feature: the transpose of GPT-2's weight
        expected = Int8Weight.from_float(before.weight.detach().t().contiguous())
        assert layer.weight.shape == (n_out, n_in) and layer.weight.scale.shape == (n_out,)
        assert torch.equal(layer.weight.int_data, expected.int_data), name
        assert torch.equal(layer.weight.scale, expected.scale), name
        assert layer.weight.int_data.is_contiguous() and layer.weight.requires_grad
    # the state-dict keys are GPT-2's; the embeddings and the (tied) head stay as they were
    assert list(model.state_dict()) == keys
    assert model.lm_head.weight is model.transformer.wte.weight
    assert type(model.transformer.wte.weight.data) is torch.Tensor
    quantize_(model)  # idempotent: the same weights, no second swap
    assert all(w is model.get_parameter(n) for n, w in _int8(model).items())


def test_a_meta_device_gpt2_is_quantized_then_initialised_by_transformers():
    """The ``shard_model`` path: build on meta, quantize, ``to_empty``, the model's own init
    (GPT-2's: std 0.02, and 0.02 / sqrt(2 * n_layer) for the residual projections)."""
    with torch.device("meta"):
        model = tiny_gpt2()
    quantize_(model)
    model.to_empty(device="cpu")
    model.init_weights()
    for name, weight in _int8(model).items():
        assert (weight.int_data.abs().amax(1) == 127).all(), name  # every row drawn
        std = 0.01 if name.endswith("c_proj.weight") else 0.02
        assert abs(weight.dequantize().std().item() - std) < 0.1 * std, name


def test_a_layer_computes_what_conv1d_computes_forward_and_backward():
    from transformers.pytorch_utils import Conv1D

    torch.manual_seed(0)
    float_layer = Conv1D(48, 32)  # nf=48 out, nx=32 in
    nn.init.normal_(float_layer.bias)
    int8_layer = quantize_(nn.ModuleDict({"c": copy.deepcopy(float_layer)}))["c"]
    assert isinstance(int8_layer, Int8Conv1D)
    # Conv1D over the very values the int8 layer holds: the same product, fp32 rounding apart
    same_values = copy.deepcopy(float_layer)
    with torch.no_grad():
        same_values.weight.copy_(int8_layer.weight.dequantize().t())
    x = torch.randn(4, 5, 32, requires_grad=True)
    grad_y = torch.randn(4, 5, 48)
    results = {}
    for key, layer in (("int8", int8_layer), ("same", same_values), ("float", float_layer)):
        x.grad = None
        y = layer(x)
        y.backward(grad_y)
        results[key] = (y.detach(), x.grad.clone(), layer.weight.grad, layer.bias.grad)
    y, gx, gw, gb = results["int8"]
    sy, sgx, sgw, sgb = results["same"]
    torch.testing.assert_close(y, sy, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(gx, sgx, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(gw, sgw.t(), rtol=1e-5, atol=1e-5)  # [out, in]: the transpose
    torch.testing.assert_close(gb, sgb)
    # Against the float layer, within the int8 error: each weight moved by at most half a
    # step (scale / 2) of its output feature's row, so |dy| <= sum_k |x_k| * scale / 2.
    fy, fgx, fgw, _ = results["float"]
    bound = x.detach().abs().sum(-1, keepdim=True) * int8_layer.weight.scale / 2
    assert ((y - fy).abs() <= bound * (1 + 1e-4) + 1e-6).all()
    assert (gx - fgx).abs().max() > 0  # the int8 weight is used, not the float one
    torch.testing.assert_close(gw, fgw.t(), rtol=1e-5, atol=1e-5)  # grad_w needs no weight


def test_training_lowers_the_loss_and_changes_only_int8_bytes():
    model = quantize_(tiny_gpt2())
    weights = _int8(model)
    start = {n: (w.int_data.clone(), w.scale.clone(), w.int_data.data_ptr()) for n, w in weights.items()}
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    tokens = _tokens()
    losses = train_steps(model, _loss, opt, tokens, 6)
    assert losses[-1] < losses[0] - 0.5, losses
    for name, weight in _int8(model).items():
        int_data, scale, pointer = start[name]
        assert weight is weights[name] and isinstance(model.get_submodule(name[: -len(".weight")]), Int8Conv1D)
        # updated in place, in its int8 bytes and fp32 scales: nothing else holds the values
        assert weight.int_data.data_ptr() == pointer and weight.int_data.dtype == torch.int8
        assert not torch.equal(weight.int_data, int_data), name
        assert {k for k, v in vars(weight).items() if isinstance(v, torch.Tensor)} == {"int_data", "scale"}
        assert weight.storage_bytes() == weight.numel() + 4 * weight.shape[0]


# ------------------------------------------------------------------ state dicts
def _trained(seed: int = 0) -> nn.Module:
    model = quantize_(tiny_gpt2(seed), Int8TrainingConfig(stochastic_rounding=False))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(2):  # trained: scales no longer those of the init
        _loss(model, _tokens()).backward()
        opt.step()
        opt.zero_grad()
    return model.eval()


def test_export_loads_into_a_plain_gpt2_whose_logits_match(tmp_path):
    from transformers import GPT2LMHeadModel

    model = _trained()
    exported = fsdp_int8.export_full_state_dict(model, torch.float32)
    plain = tiny_gpt2(seed=1).eval()
    plain.load_state_dict(exported)  # strict: every key, GPT-2's [in, out] shapes
    model.save_pretrained(tmp_path, state_dict=dict(exported))  # safetensors: contiguous only
    reloaded = GPT2LMHeadModel.from_pretrained(tmp_path)  # (save_pretrained empties the dict)
    for name in _conv1d_names():
        int8 = model.get_submodule(name).weight
        assert exported[f"{name}.weight"].is_contiguous()
        assert torch.equal(plain.get_submodule(name).weight, int8.dequantize().t()), name
        assert torch.equal(reloaded.get_submodule(name).weight, int8.dequantize().t()), name
    tokens = _tokens()
    with torch.no_grad():
        # The exported fp32 weights are exactly the values the int8 model multiplies by
        # (q * scale in fp32, checked above); only the matmul differs (addmm with [in, out]
        # against F.linear with [out, in]: other summation orders), so fp32 rounding apart.
        torch.testing.assert_close(plain(tokens).logits, model(tokens).logits, rtol=1e-5, atol=1e-5)


def test_a_gpt2_state_dict_loads_into_the_quantized_model_both_ways():
    plain = tiny_gpt2(seed=2)
    reference = quantize_(copy.deepcopy(plain))  # quantized straight from the float weights
    for load in (load_full_state_dict, lambda m, sd: m.load_state_dict(sd)):
        model = quantize_(tiny_gpt2(seed=3))
        load(model, plain.state_dict())
        _same_int8(reference, model)
    # export -> load: the same int8 values, scales within one ulp
    model = _trained()
    again = quantize_(tiny_gpt2(seed=4))
    load_full_state_dict(again, fsdp_int8.export_full_state_dict(model, torch.float32))
    _same_int8(model, again, scale_ulps=True)
    # assign=True (accelerate's low-memory loading): rounded into new int8 weights
    assigned = quantize_(tiny_gpt2(seed=5))
    assigned.load_state_dict(plain.state_dict(), assign=True)
    _same_int8(reference, assigned)


LAYOUT = r"c_attn\.weight: a plain tensor .* GPT-2's layout \[in, out\] = \[64, 192\]"


def test_a_plain_weight_in_the_int8_layout_is_refused_with_the_layout_named():
    model = quantize_(tiny_gpt2())
    state = dequantize_all(model.state_dict())  # [out, in]: not GPT-2's
    with pytest.raises(RuntimeError, match=LAYOUT):
        model.load_state_dict(state)
    with pytest.raises(ValueError, match=LAYOUT):
        load_full_state_dict(model, state)


def test_torch_save_and_load_of_the_quantized_model():
    model = _trained()
    tokens = _tokens()
    with torch.no_grad():
        expected = model(tokens).logits
    buffer = io.BytesIO()
    torch.save(model.state_dict(), buffer)
    buffer.seek(0)
    fresh = quantize_(tiny_gpt2(seed=1)).eval()
    fresh.load_state_dict(torch.load(buffer, weights_only=True))
    _same_int8(model, fresh)
    buffer = io.BytesIO()
    torch.save(model, buffer)  # the whole module: Int8Conv1D pickles by its class
    buffer.seek(0)
    whole = torch.load(buffer, weights_only=False)
    assert isinstance(whole.transformer.h[0].attn.c_attn, Int8Conv1D)
    with torch.no_grad():
        assert torch.equal(fresh(tokens).logits, expected)
        assert torch.equal(whole(tokens).logits, expected)


# ------------------------------------------------------------------ FSDP2, one spawn
def _reshard(model: nn.Module) -> None:
    """The root and last block stay gathered after a forward without backward: shard them
    again, so that parameters() (the optimizer's, the checkpoint's) are the sharded ones."""
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


def _sharded(rank: int, world: int, root: str) -> None:
    plain = tiny_gpt2()
    model = copy.deepcopy(plain)
    fsdp_int8.shard_model(model, config=Int8TrainingConfig(stochastic_rounding=False))
    weight = model.transformer.h[0].attn.c_attn.weight  # [out, in] rows split across ranks
    assert weight.shape == (192, 64) and weight.to_local().shape == (192 // world, 64)
    reference = quantize_(copy.deepcopy(plain), Int8TrainingConfig(stochastic_rounding=False))
    tokens = _tokens()
    with torch.no_grad():  # the all-gather moves the int8 bytes: the very same weights
        torch.testing.assert_close(model(tokens).logits, reference(tokens).logits, rtol=0, atol=0)
    _reshard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(2):
        _loss(model, tokens).backward()
        opt.step()
        opt.zero_grad()
    exported = fsdp_int8.export_full_state_dict(model, torch.float32)  # rank 0 only
    fresh = fsdp_int8.shard_model(tiny_gpt2(seed=1))
    wrong = {k: v.t() for k, v in exported.items() if k.endswith("c_attn.weight")}
    with pytest.raises(ValueError, match=LAYOUT):  # every rank, though only rank 0 can see it
        load_full_state_dict(fresh, {**exported, **wrong})
    load_full_state_dict(fresh, exported)  # rank 0 transposes, torch scatters the rows
    for name, param in model.named_parameters():
        if isinstance(param.to_local(), Int8Weight):
            mine, theirs = param.to_local(), fresh.get_parameter(name).to_local()
            assert torch.equal(mine.int_data, theirs.int_data), name
    with torch.no_grad():
        logits = model(tokens).logits  # every rank: the forward all-gathers
    _reshard(model)
    if rank == 0:
        gpt2 = tiny_gpt2(seed=2)
        gpt2.load_state_dict(exported)
        with torch.no_grad():  # fp32 rounding apart, as in the unsharded test
            torch.testing.assert_close(gpt2(tokens).logits, logits, rtol=1e-5, atol=1e-5)
    path = fsdp_int8.save_checkpoint(root, model, opt, step=2)
    again = fsdp_int8.shard_model(tiny_gpt2(seed=3))
    fsdp_int8.load_checkpoint(path, again, torch.optim.AdamW(again.parameters(), lr=1e-2))
    for name, param in model.named_parameters():
        if isinstance(param.to_local(), Int8Weight):
            assert torch.equal(param.to_local().int_data, again.get_parameter(name).to_local().int_data), name


# _sharded runs on 2 ranks inside tests/distributed/test_integrations_distributed.py's spawn
# (which imports transformers already): a spawn of its own cost ~8 s, nearly all imports.


def test_example_trains_and_exports_to_a_plain_gpt2():
    import sys
    from pathlib import Path

    examples = str(Path(__file__).resolve().parents[1] / "examples")
    sys.path.insert(0, examples)
    try:
        import gpt2 as example
    finally:
        sys.path.remove(examples)
    out = example.main(["--steps", "20"])
    assert out["int8_weights"] == 8  # 4 Conv1D layers a block, 2 blocks
    assert out["losses"][-1] < out["losses"][0] - 0.5, out["losses"]
    # the exported fp32 values are the ones the int8 model multiplies by: only the order of
    # fp32 sums differs
    assert out["export_logit_difference"] <= 1e-5 * out["scale"], out
