"""Int8 mixture-of-experts models in transformers folders (``fsdp_int8.integrations.hf_quantizer``).

transformers 5 fuses a MoE checkpoint's per-expert weights (``mlp.experts.{e}.gate_proj.weight``,
``up_proj``, ``down_proj``) into 3-D parameters on load and splits them on save. An int8
folder holds the same per-expert entries, each int8 ``[out * in]`` with a ``_scale``
``[out]`` beside it: ``save_pretrained`` of an int8 MoE model, ``from_pretrained`` of that
folder (exact, in a fresh process), quantization while loading a full-precision MoE folder,
refusals of damaged expert entries, and dense folders as before. Tiny models built from
configs (hidden 64, 8 experts, 2 layers); nothing is downloaded. And every MoE family of
transformers, discovered from its model files: each one fsdp_int8 makes int8 trains, saves
in its own checkpoint layout and loads exactly (a representative few by default, the rest
in the exhaustive matrix); the others are named with why.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn as nn

import fsdp_int8
from fsdp_int8 import Int8TrainingConfig, Int8Weight
from fsdp_int8._weight.load_checks import Int8LoadError

transformers = pytest.importorskip("transformers")
from safetensors.torch import load_file, save_file  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _frameworks import VOCAB, tiny_llama  # noqa: E402
from _models import assert_same_model  # noqa: E402

from fsdp_int8.integrations import hf_quantizer as hfq  # noqa: E402  (registers the method)

EXPERTS, HIDDEN, EXPERT_FEATURES = 8, 64, 32


def tiny_qwen3_moe(seed: int = 0) -> nn.Module:
    """A ``Qwen3MoeForCausalLM``: experts ``gate_up_proj [8, 64, 64]``, ``down_proj [8, 64, 32]``."""
    config = transformers.Qwen3MoeConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=128, moe_intermediate_size=EXPERT_FEATURES,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        num_experts=EXPERTS, num_experts_per_tok=2, tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    return transformers.Qwen3MoeForCausalLM(config)


def tiny_mixtral(seed: int = 0) -> nn.Module:
    """A ``MixtralForCausalLM``: its checkpoints name the experts ``block_sparse_moe.experts.{e}.w1/w2/w3``."""
    config = transformers.MixtralConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=EXPERT_FEATURES, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, num_local_experts=EXPERTS, num_experts_per_tok=2,
    )
    torch.manual_seed(seed)
    return transformers.MixtralForCausalLM(config)


def _train(model: nn.Module) -> nn.Module:
    """Two AdamW steps with weight decay: int8 bytes and scales no longer straight from the quantizer."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    tokens = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(1))
    for _ in range(2):
        model(input_ids=tokens, labels=tokens).loss.backward()
        opt.step()
        opt.zero_grad()
    return model


def _experts(model: nn.Module, layer: int = 0) -> nn.Module:
    return model.model.layers[layer].mlp.experts


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict:
    """A trained int8 Qwen3-MoE and Mixtral, each with its saved folder, and a full-precision Qwen3-MoE folder."""
    root = tmp_path_factory.mktemp("moe")
    tiny_qwen3_moe().save_pretrained(root / "float")
    out = {"float": root / "float"}
    for name, build in (("qwen3_moe", tiny_qwen3_moe), ("mixtral", tiny_mixtral)):
        model = _train(fsdp_int8.quantize_(build()))
        model.save_pretrained(root / name)
        out[name] = (model, root / name)
    return out


_LOAD_IN_A_FRESH_PROCESS = """
import sys, torch
import fsdp_int8
from transformers import AutoModelForCausalLM
out = {}
for folder in sys.argv[2:]:
    model = AutoModelForCausalLM.from_pretrained(folder)
    out[folder] = {n: (p.int_data, p.scale) if type(p).__name__ == "Int8Weight" else p.detach()
                   for n, p in model.named_parameters()}
torch.save(out, sys.argv[1])
"""


def _in_a_fresh_process(script: str, tmp_path: Path, *args: str) -> dict:
    """What ``script`` (run in a new interpreter as ``script dump *args``) saved to ``dump``."""
    dump = tmp_path / "loaded.pt"
    fresh = subprocess.run(
        [sys.executable, "-c", script, str(dump), *args], capture_output=True, text=True, timeout=600,
    )
    assert fresh.returncode == 0, fresh.stderr[-3000:]
    return torch.load(dump, weights_only=True)


def test_an_int8_moe_folder_holds_per_expert_entries_and_loads_exactly_in_a_fresh_process(folders, tmp_path):
    model, folder = folders["qwen3_moe"]
    saved = load_file(folder / "model.safetensors")
    # The family's own per-expert entries (gate_up_proj is gate_proj's rows, then up_proj's),
    # each int8 rows flat with one fp32 scale per row; no fused entry, the router in full precision.
    for layer in range(2):
        experts, prefix = _experts(model, layer), f"model.layers.{layer}.mlp"
        for e in range(EXPERTS):
            gate_up, down = experts.gate_up_proj, experts.down_proj
            rows = {
                "gate_proj": (gate_up.int_data[e, :EXPERT_FEATURES], gate_up.scale[e, :EXPERT_FEATURES]),
                "up_proj": (gate_up.int_data[e, EXPERT_FEATURES:], gate_up.scale[e, EXPERT_FEATURES:]),
                "down_proj": (down.int_data[e], down.scale[e]),
            }
            for proj, (int_rows, scale) in rows.items():
                key = f"{prefix}.experts.{e}.{proj}.weight"
                assert saved[key].dtype == torch.int8 and torch.equal(saved[key], int_rows.reshape(-1)), key
                assert saved[key + "_scale"].dtype == torch.float32 and torch.equal(saved[key + "_scale"], scale), key
        assert saved[f"{prefix}.gate.weight"].dtype == torch.float32
        assert f"{prefix}.experts.gate_up_proj" not in saved and f"{prefix}.experts.gate_up_proj_scale" not in saved
    mixtral, mixtral_folder = folders["mixtral"]
    mixtral_saved = load_file(mixtral_folder / "model.safetensors")  # Mixtral's names, the same layout
    assert mixtral_saved["model.layers.1.block_sparse_moe.experts.7.w2.weight"].shape == (HIDDEN * EXPERT_FEATURES,)

    # A fresh process with only `import fsdp_int8` before transformers loads both exactly.
    loaded = _in_a_fresh_process(_LOAD_IN_A_FRESH_PROCESS, tmp_path, str(folder), str(mixtral_folder))
    for want, path in ((model, folder), (mixtral, mixtral_folder)):
        got = loaded[str(path)]
        assert got.keys() == dict(want.named_parameters()).keys()
        for name, param in want.named_parameters():
            if isinstance(param, Int8Weight):
                assert torch.equal(got[name][0], param.int_data) and torch.equal(got[name][1], param.scale), name
            else:
                assert torch.equal(got[name], param), name
        assert sum(isinstance(p, Int8Weight) for p in want.parameters()) == 2 * (4 + 2)  # q k v o + experts


def test_quantize_on_load_of_a_full_precision_moe_folder_rounds_each_expert_weight_to_nearest(
    folders, tmp_path, monkeypatch
):
    seen = []  # the shapes the quantize-on-load op is handed
    original = hfq._QuantizeOnLoad.convert

    def spy(self, input_dict, **kwargs):
        seen.extend(tuple((v[0] if isinstance(v, list) else v).shape) for v in input_dict.values())
        return original(self, input_dict, **kwargs)

    monkeypatch.setattr(hfq._QuantizeOnLoad, "convert", spy)
    model = AutoModelForCausalLM.from_pretrained(folders["float"], quantization_config=hfq.Int8TrainingHfConfig())
    # transformers stacks the per-expert entries first: each experts weight arrives whole
    assert seen.count((EXPERTS, 2 * EXPERT_FEATURES, HIDDEN)) == 2  # gate_up_proj of each layer
    assert seen.count((EXPERTS, HIDDEN, EXPERT_FEATURES)) == 2  # down_proj
    experts = _experts(model)
    gate_up = experts.gate_up_proj
    assert isinstance(gate_up, Int8Weight) and gate_up.scale.shape == (EXPERTS, 2 * EXPERT_FEATURES)
    assert type(model.model.layers[0].mlp.gate.weight) is nn.Parameter  # the router: full precision
    reference = AutoModelForCausalLM.from_pretrained(folders["float"])
    want = Int8Weight.from_float(_experts(reference).gate_up_proj)  # round to nearest, per expert and row
    assert torch.equal(gate_up.int_data, want.int_data) and torch.equal(gate_up.scale, want.scale)
    assert_same_model(model, fsdp_int8.quantize_(reference))

    # Saved (its loaded conversions gain those of the scales) and loaded back, exactly; saved again, the same file.
    model.save_pretrained(tmp_path / "int8")
    again = AutoModelForCausalLM.from_pretrained(tmp_path / "int8")
    assert_same_model(again, model)
    again.save_pretrained(tmp_path / "again")
    first = load_file(tmp_path / "int8" / "model.safetensors")
    second = load_file(tmp_path / "again" / "model.safetensors")
    assert first.keys() == second.keys() and all(torch.equal(first[k], second[k]) for k in first)


@pytest.mark.parametrize("family", ["gpt_oss", "dbrx"])
def test_a_full_precision_folder_of_transposed_experts_quantizes_on_load_as_quantize_does(family, tmp_path):
    """gpt-oss's ``[E, in, out]`` experts and DBRX's ``w2`` arrive in the model's layout and are
    each rounded over their transpose, as ``quantize_`` of the loaded plain model rounds them."""
    with warnings.catch_warnings():  # a tiny model is mostly full precision: quantize_ says so
        warnings.simplefilter("ignore", UserWarning)
        _tiny_family(family).save_pretrained(tmp_path)
        model = AutoModelForCausalLM.from_pretrained(tmp_path, quantization_config=hfq.Int8TrainingHfConfig())
        reference = fsdp_int8.quantize_(AutoModelForCausalLM.from_pretrained(tmp_path))
    assert sum(isinstance(p, Int8Weight) for n, p in model.named_parameters() if "expert" in n) >= 2
    assert_same_model(model, reference)


@pytest.mark.parametrize(
    "entry, damage, message",
    [
        ("model.layers.1.mlp.experts.5.up_proj.weight", lambda t: t.__setitem__(70, -128), r"int8 value\(s\) are -128"),
        ("model.layers.0.mlp.experts.2.down_proj.weight_scale", lambda t: t.__setitem__(3, float("nan")),
         r"row scales are NaN"),
    ],
    ids=["minus-128", "nan-scale"],
)
def test_a_damaged_expert_entry_is_refused_naming_the_entry_and_its_file(folders, tmp_path, entry, damage, message):
    _, folder = folders["qwen3_moe"]
    tensors = load_file(folder / "model.safetensors")
    tensors[entry] = tensors[entry].clone()
    damage(tensors[entry])
    (tmp_path / "config.json").write_text((folder / "config.json").read_text())
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    weight = entry.removesuffix("_scale")
    with pytest.raises(Int8LoadError, match=rf"{weight} \(in {tmp_path / 'model.safetensors'}\): .*{message}"):
        AutoModelForCausalLM.from_pretrained(tmp_path)


def test_a_loader_without_the_method_refuses_int8_experts_and_with_it_they_load(tmp_path, monkeypatch):
    from transformers.quantizers import auto

    only_experts = Int8TrainingConfig(module_filter=lambda module, name: name.endswith(".experts"))
    model = fsdp_int8.quantize_(tiny_qwen3_moe(), only_experts)
    assert {n for n, p in model.named_parameters() if isinstance(p, Int8Weight)} == {
        f"model.layers.{i}.mlp.experts.{p}" for i in range(2) for p in ("gate_up_proj", "down_proj")
    }
    model.save_pretrained(tmp_path)
    with monkeypatch.context() as unknown:  # transformers without the method: it skips the config
        unknown.delitem(auto.AUTO_QUANTIZER_MAPPING, "fsdp_int8")
        unknown.delitem(auto.AUTO_QUANTIZATION_CONFIG_MAPPING, "fsdp_int8")
        # the flat per-expert rows fail the shape check of the fused parameters, loudly
        with pytest.raises(RuntimeError, match="mismatched_sizes"):
            AutoModelForCausalLM.from_pretrained(tmp_path)
    assert_same_model(AutoModelForCausalLM.from_pretrained(tmp_path), model)


def test_a_conversion_that_would_move_int8_values_across_rows_is_refused_and_the_fused_layout_saves(tmp_path):
    from transformers.core_model_loading import MergeModulelist, Transpose, WeightConverter

    model = fsdp_int8.quantize_(tiny_qwen3_moe())
    model._weight_conversions = [
        WeightConverter(
            "mlp.experts.*.down_proj.weight", "mlp.experts.down_proj", [MergeModulelist(dim=0), Transpose(1, 2)]
        )
    ]
    with pytest.raises(ValueError, match=r"down_proj .*save_original_format=False"):
        model.save_pretrained(tmp_path / "refused")
    assert not list((tmp_path / "refused").iterdir())  # refused before anything is written
    # The model's own fused layout: [E, out * in] int8 rows with [E, out] scales, which from_pretrained loads.
    model.save_pretrained(tmp_path / "fused", save_original_format=False)
    saved = load_file(tmp_path / "fused" / "model.safetensors")
    assert saved["model.layers.0.mlp.experts.down_proj"].shape == (EXPERTS, HIDDEN * EXPERT_FEATURES)
    assert saved["model.layers.0.mlp.experts.down_proj_scale"].shape == (EXPERTS, HIDDEN)
    assert_same_model(AutoModelForCausalLM.from_pretrained(tmp_path / "fused"), model)


def test_a_renaming_of_int8_experts_renames_their_scales_and_a_folder_with_them_apart_is_refused_for_what_it_is(
    tmp_path
):
    # GraniteMoE's checkpoints name the fused experts block_sparse_moe.input_linear.weight / output_linear.weight,
    # a renaming (not a converter) of experts.gate_up_proj / down_proj: the scales are renamed with the rows.
    model = _train_family(fsdp_int8.quantize_(_tiny_family("granitemoe"), _NO_COMPILE))
    model.save_pretrained(tmp_path / "granite")
    saved = load_file(tmp_path / "granite" / "model.safetensors")
    prefix = "model.layers.0.block_sparse_moe"
    for entry, weight in (("input_linear", "gate_up_proj"), ("output_linear", "down_proj")):
        int8 = getattr(model.model.layers[0].block_sparse_moe.experts, weight)
        assert torch.equal(saved[f"{prefix}.{entry}.weight"], int8.int_data.flatten(-2)), entry
        assert torch.equal(saved[f"{prefix}.{entry}.weight_scale"], int8.scale), entry
    assert not [k for k in saved if ".experts." in k]
    assert_same_model(type(model).from_pretrained(tmp_path / "granite"), model)

    # A folder whose rows and scales went apart (as fsdp_int8 once wrote GraniteMoE's) is refused for what
    # is inconsistent: its config.json says fsdp_int8 wrote it, so no blame on "another tool".
    parted = {k.replace(f"{prefix}.input_linear.weight_scale", f"{prefix}.experts.gate_up_proj_scale"): v
              for k, v in saved.items()}
    (tmp_path / "parted").mkdir()
    (tmp_path / "parted" / "config.json").write_text((tmp_path / "granite" / "config.json").read_text())
    save_file(parted, tmp_path / "parted" / "model.safetensors", metadata={"format": "pt"})
    message = r"input_linear\.weight .*no row scales .*config\.json says fsdp_int8 wrote it"
    with pytest.raises(Int8LoadError, match=message) as refused:
        type(model).from_pretrained(tmp_path / "parted")
    assert "another tool" not in str(refused.value)

    # Conversions that would part int8 rows from their scales anyway are refused before anything is written.
    from transformers.core_model_loading import WeightRenaming

    class _Rename(WeightRenaming):  # a renaming fsdp_int8 does not copy for the scales
        pass

    model._weight_conversions = [_Rename(r"block_sparse_moe\.w1", "block_sparse_moe.experts.gate_up_proj")]
    with pytest.raises(ValueError, match=r"block_sparse_moe\.w1 .*no row scales.*save_original_format=False"):
        model.save_pretrained(tmp_path / "refused")
    assert not list((tmp_path / "refused").iterdir())


def test_a_dense_model_saves_the_flat_layout_and_keeps_its_weight_conversions(tmp_path):
    model = fsdp_int8.quantize_(tiny_llama())
    model.save_pretrained(tmp_path)
    saved = load_file(tmp_path / "model.safetensors")
    written = hfq.int8_safetensors_state_dict(model.state_dict())
    assert saved.keys() == written.keys()
    for key, value in written.items():
        assert saved[key].dtype == value.dtype and torch.equal(saved[key], value), key
    int8 = {n: p for n, p in model.named_parameters() if isinstance(p, Int8Weight)}
    assert len(int8) == 14  # format version 2: [out * in] int8 rows, [out] fp32 scales
    for name, weight in int8.items():
        assert saved[name].shape == (weight.numel(),) and saved[name + "_scale"].shape == weight.shape[:1], name
    assert getattr(model, "_weight_conversions", None) is None  # nothing of the experts' conversions added


def test_experts_a_module_filter_kept_in_full_precision_are_recorded_and_stay_so_on_load(folders):
    no_experts = Int8TrainingConfig(module_filter=lambda module, name: not name.endswith((".experts", "lm_head")))
    with pytest.warns(UserWarning, match="only 8 int8 weights"):  # attention only: mostly full precision
        model = fsdp_int8.quantize_(tiny_qwen3_moe(), no_experts)
    recorded = hfq.Int8TrainingHfConfig.from_training_config(no_experts, model)
    assert recorded.modules_to_not_convert == [f"model.layers.{i}.mlp.experts" for i in range(2)] + ["lm_head"]
    with pytest.warns(UserWarning, match="only 8 int8 weights"):
        loaded = AutoModelForCausalLM.from_pretrained(folders["float"], quantization_config=recorded)
    int8 = {n for n, p in model.named_parameters() if isinstance(p, Int8Weight)}
    assert {n for n, p in loaded.named_parameters() if isinstance(p, Int8Weight)} == int8
    assert not any("experts" in n for n in int8) and len(int8) == 8


def test_load_state_dict_takes_the_int8_rows_and_scales_of_experts(folders):
    """The two safetensors entries of an expert weight (``[E, out * in]`` int8 rows and
    ``[E, out]`` scales: what Trainer checkpoints hold in the fused layout) load through
    ``load_state_dict`` byte for byte; a -128 among them is refused."""
    trained, _ = folders["qwen3_moe"]
    entries = hfq.int8_safetensors_state_dict(trained.state_dict())
    key = "model.layers.0.mlp.experts.gate_up_proj"
    assert entries[key].shape == (EXPERTS, 2 * EXPERT_FEATURES * HIDDEN) and entries[key + "_scale"].shape == (
        EXPERTS, 2 * EXPERT_FEATURES)
    model = fsdp_int8.quantize_(tiny_qwen3_moe(seed=1))
    model.load_state_dict(entries)
    assert_same_model(model, trained)
    damaged = {**entries, key: entries[key].clone()}
    damaged[key][3, 5] = -128
    with pytest.raises(Int8LoadError, match=r"experts\.gate_up_proj: 1 int8 value\(s\) are -128"):
        fsdp_int8.quantize_(tiny_qwen3_moe(seed=1)).load_state_dict(damaged)


# ------------------------------------------------------------ every MoE family transformers ships
# A family: a model type of transformers' CONFIG_MAPPING whose modeling file defines a class
# named *Experts. Each one fsdp_int8 makes int8 is built tiny from its config, quantized,
# trained 3 Int8AdamW steps, saved with save_pretrained (the family's own checkpoint layout,
# through transformers' weight conversions) and loaded in a fresh process: its logits on a
# fixed input equal the trained model's. The others are named in _NOT_TRAINED with why.

# set wherever a config or one of its sub-configs has the field (hidden 32, 2 layers, 4 experts, vocab 64)
_SMALL = dict(
    vocab_size=64, hidden_size=32, intermediate_size=64, moe_intermediate_size=32, expert_intermediate_size=32,
    ffn_hidden_size=64, shared_expert_intermediate_size=32, num_hidden_layers=2, num_layers=2, depth=1,
    num_attention_heads=4, num_heads=4, num_key_value_heads=4, head_dim=8, num_experts=4, num_local_experts=4,
    n_routed_experts=4, moe_num_experts=4, num_experts_per_tok=2, num_experts_per_token=2, top_k=2, moe_topk=2,
    n_shared_experts=1, num_shared_experts=1, n_group=1, topk_group=1, first_k_dense_replace=0,
    decoder_sparse_step=1, moe_layer_freq=1, mlp_only_layers=[], kv_lora_rank=16, q_lora_rank=16,
    qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8, o_lora_rank=16, linear_head_dim=8, linear_num_heads=4,
    index_n_heads=2, index_head_dim=8, hc_sinkhorn_iters=2, vocab_size_per_layer_input=64,
    hidden_size_per_layer_input=8, d_model=32, d_ff=64, d_kv=8, encoder_layers=1, decoder_layers=1,
    encoder_ffn_dim=64, decoder_ffn_dim=64, encoder_attention_heads=4, decoder_attention_heads=4,
    num_decoder_layers=1, max_position_embeddings=64, tie_word_embeddings=False, pad_token_id=0,
    bos_token_id=1, eos_token_id=2, use_cache=False,
)
_SPARSE = ["sparse", "sparse"]  # both layers MoE where a config lists each layer's MLP
# what a family needs besides _SMALL (a sub-config's fields under its name)
_OVERRIDES = {
    "beam": dict(mlp_layer_types=_SPARSE),
    # clip_qkv set: transformers 5.23's DbrxAttention clamps by it, and its default None fails
    "dbrx": dict(d_model=32, n_heads=4, n_layers=2, max_seq_len=64, attn_config=dict(kv_n_heads=4, rope_theta=1e4, clip_qkv=8.0),
                 ffn_config=dict(ffn_hidden_size=32, moe_num_experts=4, moe_top_k=2)),
    "deepseek_ocr2": dict(text_config=dict(mlp_layer_types=_SPARSE)),
    "diffusion_gemma": dict(text_config=dict(enable_moe_block=True, top_k_experts=2)),
    "dots3_note": dict(
        text_config=dict(mlp_layer_types=_SPARSE),
        vision_config=dict(mlp_layer_types=["dense", "dense"], adapter_in_dim=32, adapter_out_dim=32),
        audio_config=dict(adapter_input_size=32, adapter_out_dim=32),
    ),
    "dots3_note_text": dict(mlp_layer_types=_SPARSE),
    "ernie4_5_moe": dict(moe_k=2, moe_layer_start_index=0, moe_layer_interval=1, moe_num_shared_experts=1),
    "ernie4_5_vl_moe": dict(text_config=dict(
        moe_intermediate_size=[32, 32], moe_k=2, moe_layer_start_index=0,
        rope_parameters={"rope_theta": 500000.0, "rope_type": "default", "mrope_section": [1, 1, 2]},
    )),
    "gemma4": dict(text_config=dict(enable_moe_block=True, top_k_experts=2)),
    "gemma4_text": dict(enable_moe_block=True, top_k_experts=2),
    "glm4v_moe": dict(text_config=dict(rope_parameters={
        "rope_theta": 10000.0, "partial_rotary_factor": 0.5, "rope_type": "default", "mrope_section": [1, 1, 0],
    })),
    "glm5_next": dict(text_config=dict(
        qk_rope_head_dim=0, head_dim=8, mlp_layer_types=_SPARSE, index_topk=4, index_kpool=4,
    )),
    "granitemoehybrid": dict(
        mamba_n_heads=4, mamba_d_head=16, mamba_n_groups=1, mamba_d_state=8, mamba_chunk_size=8,
        layer_types=["mamba", "attention"],
    ),
    "inkling2": dict(vision_config=dict(text_hidden_size=32)),
    "lfm2_moe": dict(num_dense_layers=0, layer_types=["conv", "full_attention"]),
    "longcat_flash": dict(expert_ffn_hidden_size=32, zero_expert_num=2),
    "mimo_v2_flash": dict(num_key_value_heads=2),
    "muse_spark": dict(out_hidden_size=32, audio_config=dict(
        num_hidden_layers=4, hidden_sizes=[8, 8, 16, 32], depths=[1, 1, 1, 1], out_hidden_size=32,
    )),
    "step3p7": dict(text_config=dict(mlp_layer_types=_SPARSE, sliding_window=16)),
    "switch_transformers": dict(num_decoder_layers=2, num_sparse_encoder_layers=1, num_sparse_decoder_layers=1),
    "zaya": dict(num_experts_per_tok=1),
}
# parts of a family's config (a tower, its text model) without a model with a head of their own
_PARTS = {
    "deepseek_ocr2": ["deepseek_ocr2_encoder", "deepseek_ocr2_sam_vision_model", "deepseek_ocr2_text",
                      "deepseek_ocr2_vision"],
    "diffusion_gemma": ["diffusion_gemma_text"],
    "dots3_note": ["dots3_note_audio_encoder", "dots3_note_vision_encoder"],
    "ernie4_5_vl_moe": ["ernie4_5_vl_moe_text", "ernie4_5_vl_moe_vision"],
    "gemma4": ["gemma4_audio", "gemma4_vision"],
    "glm4v_moe": ["glm4v_moe_text", "glm4v_moe_vision"],
    "glm5_next": ["glm5_next_text", "glm5_next_vision"],
    "inkling2": ["inkling2_vision"],
    "inkling_mm_model": ["inkling_audio", "inkling_vision"],
    "llama4": ["llama4_vision_model"],
    "minimax_m3_vl": ["minimax_m3_vl_vision"],
    "mistral_large4": ["mistral_large4_text"],
    "muse_spark": ["muse_spark_audio", "muse_spark_text", "muse_spark_vision"],
    "qwen3_5_moe": ["qwen3_5_moe_vision"],
    "qwen3_omni_moe": ["qwen3_omni_moe_talker_code_predictor", "qwen3_omni_moe_talker_text"],
    "qwen3_omni_moe_thinker": ["qwen3_omni_moe_audio_encoder", "qwen3_omni_moe_text", "qwen3_omni_moe_vision_encoder"],
    "qwen3_vl_moe": ["qwen3_vl_moe_text", "qwen3_vl_moe_vision"],
    "qwen4_exp": ["qwen4_exp_vision"],
    "step3p7": ["step3p5", "step3p5_vision"],
    "unlimited_ocr": ["unlimited_ocr_sam_vision_model", "unlimited_ocr_text", "unlimited_ocr_vision",
                      "unlimited_ocr_vision_encoder"],
}
# the families not trained here, by name: why
_NOT_TRAINED = {
    "qwen3_omni_moe": "transformers cannot build Qwen3OmniMoeForConditionalGeneration from a config (its talker "
                      "reads fields its config lacks); its trainable MoE model is qwen3_omni_moe_thinker",
    **{part: f"a part of {family}'s config without a model with a head of its own (its experts are {family}'s)"
       for family, parts in _PARTS.items() for part in parts},
}
_NO_COMPILE = Int8TrainingConfig(compile="off")  # tiny weights: compiling the rounding would be most of the time  # checked to stay so: a change making them int8 fails here
# the default run's families, one of each kind of conversion; the rest run in the exhaustive matrix
_DEFAULT_FAMILIES = (
    "granitemoe",  # renamings of the fused experts' full names (input_linear.weight)
    "qwen3_vl_moe",  # a check_dims Transpose of the fused experts
    "mixtral",  # per-expert w1 / w3 / w2 stacked and concatenated
    "deepseek_v3",  # per-expert gate / up / down (qwen2_moe's mapping), shared experts, MLA
    "inkling_text",  # interleaved gate / up rows, a fused shared-expert weight chunked
    "ernie4_5_vl_moe",  # text and vision experts fused and split by one op
    "unlimited_ocr",  # a fused qkv split into three int8 layers, a vision tower
    "longcat_flash",  # experts counted by num_routed_experts, zero-compute experts' rows in gate_up_proj
    "dbrx",  # 2-D experts [E * ffn, hidden], w2 held as each expert's transpose
)


def _moe_families() -> list[str]:
    """Every model type of transformers whose modeling file defines a class named *Experts."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES, model_type_to_module_name

    models = Path(transformers.__file__).parent / "models"
    found = []
    for model_type in CONFIG_MAPPING_NAMES:
        folder = models / model_type_to_module_name(model_type)
        sources = sorted(folder.glob("modeling_*.py")) if folder.is_dir() else []
        if any(re.search(r"^class \w*Experts\(", f.read_text(), re.M) for f in sources):
            found.append(model_type)
    return found


_FAMILIES = _moe_families()
_TRAINED = [f for f in _FAMILIES if f not in _NOT_TRAINED]


def _small_config(cls: type, overrides: dict):
    """``cls`` with :data:`_SMALL`'s fields it has, ``overrides``, and its sub-configs likewise."""
    fields = {f.name for f in dataclasses.fields(cls)}
    kwargs = {k: v for k, v in _SMALL.items() if k in fields}
    for name, sub in (getattr(cls, "sub_configs", None) or {}).items():
        if name in fields:
            sub = type(getattr(cls(), name)) if sub is transformers.AutoConfig else sub  # the default's class
            kwargs[name] = _small_config(sub, overrides.get(name, {}))
    kwargs.update({k: v for k, v in overrides.items() if not (isinstance(v, dict) and k in kwargs)})
    return cls(**kwargs)


def _tiny_family(family: str) -> nn.Module:
    """The family's model with a head (image-text-to-text, causal LM, seq2seq or token classification)."""
    from transformers.models.auto import modeling_auto as auto
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    heads = (auto.MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES, auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
             auto.MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES, auto.MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING_NAMES)
    name = next(mapping[family] for mapping in heads if family in mapping)
    config = _small_config(CONFIG_MAPPING[family], _OVERRIDES.get(family, {}))
    torch.manual_seed(0)
    return getattr(transformers, name)(config)


_FAMILY_TOKENS = torch.randint(3, 64, (2, 8), generator=torch.Generator().manual_seed(1))


def _family_logits(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    """The logits of ``tokens`` (also the decoder's input where the model takes one: seq2seq, block
    diffusion, whose forward otherwise draws a random canvas); as _LOGITS_IN_A_FRESH_PROCESS computes them."""
    forward = inspect.signature(model.forward).parameters
    extra = {"decoder_input_ids": tokens} if "decoder_input_ids" in forward else {}
    return model(input_ids=tokens, use_cache=False, **extra).logits


_LOGITS_IN_A_FRESH_PROCESS = """
import inspect, sys, torch
import fsdp_int8, transformers
torch.set_num_threads(1)  # one reduction order, as the parent computes them
tokens, out = torch.load(sys.argv[2]), {}
for folder, name in zip(sys.argv[3::2], sys.argv[4::2]):
    model = getattr(transformers, name).from_pretrained(folder).eval()
    extra = {"decoder_input_ids": tokens} if "decoder_input_ids" in inspect.signature(model.forward).parameters else {}
    with torch.no_grad():
        for p in model.parameters():  # memory of its own, as the trained model's (some CPU kernels round by alignment)
            p.data = p.data.clone()
        out[folder] = model(input_ids=tokens, use_cache=False, **extra).logits
torch.save(out, sys.argv[1])
"""


def _train_family(model: nn.Module) -> nn.Module:
    """Three Int8AdamW steps on the next-token loss of :data:`_FAMILY_TOKENS`."""
    opt = fsdp_int8.Int8AdamW(model.parameters(), lr=1e-2)
    for _ in range(3):
        logits = _family_logits(model, _FAMILY_TOKENS)
        if logits.shape[:-1] == _FAMILY_TOKENS.shape:
            targets = (_FAMILY_TOKENS % logits.shape[-1]).flatten()
            loss = torch.nn.functional.cross_entropy(logits.flatten(0, -2).float(), targets)
        else:  # a block-diffusion canvas
            loss = logits.float().square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
    return model


def _save_and_load_each(families: list[str], tmp_path: Path) -> None:
    """Build, quantize, train, save each of ``families``; load them all in one fresh process; compare logits."""
    failures, trained = {}, {}
    for family in families:
        try:
            with warnings.catch_warnings():  # a tiny model is mostly full precision: quantize_ says so
                warnings.simplefilter("ignore", UserWarning)
                model = fsdp_int8.quantize_(_tiny_family(family), _NO_COMPILE)
            experts = [n for n, m in model.named_modules() if type(m).__name__.endswith("Experts")]
            if not any(isinstance(p, Int8Weight) for e in experts for p in model.get_submodule(e).parameters()):
                failures[family] = "its experts stayed full precision: name it in _NOT_TRAINED with why"
                continue
            _train_family(model)
            threads = torch.get_num_threads()
            torch.set_num_threads(1)  # a CPU kernel's sums split over threads by the load: one order
            try:
                with torch.no_grad():
                    trained[family] = _family_logits(model.eval(), _FAMILY_TOKENS)
            finally:
                torch.set_num_threads(threads)
            model.save_pretrained(tmp_path / family)
        except Exception as error:  # noqa: BLE001 (each family's failure is reported below)
            failures[family] = f"{type(error).__name__}: {error}"
    torch.save(_FAMILY_TOKENS, tmp_path / "tokens.pt")
    args = [str(tmp_path / "tokens.pt")]
    for family in trained:  # each folder with the class that saved it
        config = json.loads((tmp_path / family / "config.json").read_text())
        args += [str(tmp_path / family), config["architectures"][0]]
    loaded = _in_a_fresh_process(_LOGITS_IN_A_FRESH_PROCESS, tmp_path, *args) if trained else {}
    for family, want in trained.items():
        got = loaded[str(tmp_path / family)]
        if not torch.equal(got, want):
            failures[family] = f"loaded logits differ by up to {float((got - want).abs().max())}"
    assert not failures, "\n".join(f"{family}: {why}" for family, why in failures.items())


def test_every_moe_family_is_trained_here_or_named_with_why():
    assert set(_DEFAULT_FAMILIES) <= set(_TRAINED)
    stale = set(_NOT_TRAINED) - set(_FAMILIES)
    assert not stale, f"named in _NOT_TRAINED, yet not MoE families of this transformers: {sorted(stale)}"


def test_int8_moe_families_save_and_load_exactly_in_a_fresh_process(tmp_path):
    _save_and_load_each(list(_DEFAULT_FAMILIES), tmp_path)


@pytest.mark.exhaustive
def test_every_other_int8_moe_family_saves_and_loads_exactly_in_a_fresh_process(tmp_path):
    _save_and_load_each([f for f in _TRAINED if f not in _DEFAULT_FAMILIES], tmp_path)
