"""Int8 mixture-of-experts models in transformers folders (``fsdp_int8.integrations.hf_quantizer``).

transformers 5 fuses a MoE checkpoint's per-expert weights (``mlp.experts.{e}.gate_proj.weight``,
``up_proj``, ``down_proj``) into 3-D parameters on load and splits them on save. An int8
folder holds the same per-expert entries, each int8 ``[out * in]`` with a ``_scale``
``[out]`` beside it: ``save_pretrained`` of an int8 MoE model, ``from_pretrained`` of that
folder (exact, in a fresh process), quantization while loading a full-precision MoE folder,
refusals of damaged expert entries, and dense folders as before. Tiny models built from
configs (hidden 64, 8 experts, 2 layers); nothing is downloaded.
"""

from __future__ import annotations

import subprocess
import sys
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
    dump = tmp_path / "loaded.pt"
    fresh = subprocess.run(
        [sys.executable, "-c", _LOAD_IN_A_FRESH_PROCESS, str(dump), str(folder), str(mixtral_folder)],
        capture_output=True, text=True, timeout=300,
    )
    assert fresh.returncode == 0, fresh.stderr[-3000:]
    loaded = torch.load(dump, weights_only=True)
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
    # The model's own fused layout: [E, out * in] int8 rows with [E, out] scales, which from_pretrained loads.
    model.save_pretrained(tmp_path / "fused", save_original_format=False)
    saved = load_file(tmp_path / "fused" / "model.safetensors")
    assert saved["model.layers.0.mlp.experts.down_proj"].shape == (EXPERTS, HIDDEN * EXPERT_FEATURES)
    assert saved["model.layers.0.mlp.experts.down_proj_scale"].shape == (EXPERTS, HIDDEN)
    assert_same_model(AutoModelForCausalLM.from_pretrained(tmp_path / "fused"), model)


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
