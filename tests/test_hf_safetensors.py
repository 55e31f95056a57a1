"""fsdp_int8 as a transformers quantization method (``fsdp_int8.integrations.hf_quantizer``):
int8 rows and fp32 scales in safetensors, ``quantization_config`` in ``config.json``,
bit-exact reloads, quantization while loading from the meta device, and models quantized
by ``quantize_``. Tiny models built from configs; nothing is downloaded.
"""

from __future__ import annotations

import io
import json
import os
import sys
from pathlib import Path

import pytest
import torch
import torch.nn as nn

import fsdp_int8
from fsdp_int8 import Int8TrainingConfig, Int8Weight

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _frameworks import VOCAB, hf_loss, tiny_llama  # noqa: E402
from _matrix import FULL_MATRIX  # noqa: E402
from _models import assert_same_model, fibonacci_mod_task  # noqa: E402

from fsdp_int8.integrations import hf_quantizer as hfq  # noqa: E402  (registers the method)


def tiny_qwen2(seed: int = 0) -> nn.Module:
    """A transformers ``Qwen2ForCausalLM`` (q/k/v with biases): hidden 64, 2 layers."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    return Qwen2ForCausalLM(config)


def tiny_gpt2(seed: int = 0) -> nn.Module:
    """A transformers ``GPT2LMHeadModel``: its linears are ``Conv1D`` (weight ``[in, out]``),
    which ``quantize_`` turns into int8 ``[out, in]`` layers; embeddings tied to the head."""
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(
        n_layer=2, n_embd=64, n_head=2, vocab_size=VOCAB, n_positions=32, bos_token_id=0, eos_token_id=0,
    )
    torch.manual_seed(seed)
    return GPT2LMHeadModel(config)


def _int8(model: nn.Module) -> dict[str, Int8Weight]:
    return {n: p for n, p in model.named_parameters() if isinstance(p, Int8Weight)}


def _train(model: nn.Module, steps: int = 2) -> None:
    """A few AdamW steps with weight decay: scales no longer straight from the quantizer."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    tokens = fibonacci_mod_task(4, 12, vocab=VOCAB)
    for _ in range(steps):
        hf_loss(model, tokens).backward()
        opt.step()
        opt.zero_grad()


def _folder_bytes(path) -> int:
    return sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path) if f.endswith(".safetensors"))


@pytest.mark.parametrize(
    "build, layers", [(tiny_llama, 14), (tiny_qwen2, 14), (tiny_gpt2, 8)], ids=["llama", "qwen2", "gpt2"]
)
def test_save_pretrained_writes_int8_rows_and_scales_and_from_pretrained_restores_them_exactly(tmp_path, build, layers):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    build().save_pretrained(tmp_path / "float")
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "float", quantization_config=hfq.Int8TrainingHfConfig())
    # Llama, Qwen2: 2 layers x (q, k, v, o, gate, up, down); GPT-2: 2 x 4 Conv1D; heads kept
    assert len(_int8(model)) == layers
    _train(model)
    model.save_pretrained(tmp_path / "int8")

    saved = load_file(tmp_path / "int8" / "model.safetensors")
    for name, weight in _int8(model).items():
        # the rows flat (format version 2): a loader without the method refuses the shape
        assert saved[name].dtype == torch.int8 and saved[name].shape == (weight.numel(),), name
        assert torch.equal(saved[name], weight.int_data.reshape(-1)), name
        scale = saved[name + "_scale"]
        assert scale.dtype == torch.float32 and scale.shape == (weight.shape[0],), name
        assert torch.equal(scale, weight.scale), name
    int8_keys = set(_int8(model)) | {k + "_scale" for k in _int8(model)}
    assert all(v.is_floating_point() for k, v in saved.items() if k not in int8_keys)
    recorded = json.loads((tmp_path / "int8" / "config.json").read_text())["quantization_config"]
    assert recorded == {
        "quant_method": "fsdp_int8", "format_version": 2, "stochastic_rounding": True, "seed": 0,
        "skip_names": ["lm_head", "output", "head"], "min_features": 16, "modules_to_not_convert": None,
        "int8_matmul": None, "int8_gathered_weights": False, "compile": "auto", "quantize_embeddings": False,
    }

    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "int8")
    assert_same_model(reloaded, model)
    assert isinstance(reloaded.hf_quantizer, hfq.Int8TrainingHfQuantizer)
    tokens = fibonacci_mod_task(4, 12, vocab=VOCAB)
    assert torch.equal(hf_loss(reloaded, tokens), hf_loss(model, tokens))
    _train(reloaded, 1)  # and it trains on: int8 weights take the optimizer's updates
    assert len(_int8(reloaded)) == layers


def test_the_int8_folder_is_about_half_the_bf16_one(tmp_path):
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=128, intermediate_size=512, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(tmp_path / "bf16")
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "bf16", quantization_config=hfq.Int8TrainingHfConfig())
    assert all(w.dtype == torch.bfloat16 for w in _int8(model).values())  # the outer dtype is kept
    model.save_pretrained(tmp_path / "int8")
    ratio = _folder_bytes(tmp_path / "int8") / _folder_bytes(tmp_path / "bf16")
    # The int8 layers: 1 byte per value + 4 per row (scale), against 2 per value, so
    # 0.5 + 2 / in_features of a layer; the embedding, the head and the norms stay bf16.
    # 0.546 for this model (0.543 from the sizes, plus the headers).
    print(f"int8 / bf16 safetensors bytes: {ratio:.3f}")
    assert 0.5 < ratio < 0.57


def test_from_pretrained_quantizes_on_the_meta_device_one_weight_at_a_time(tmp_path, monkeypatch):
    from transformers import AutoModelForCausalLM

    tiny_llama().save_pretrained(tmp_path)
    seen = []  # per weight quantized: (int8 layers already loaded, still meta, tensors handed in)
    original = hfq._QuantizeOnLoad.convert

    def spy(self, input_dict, model=None, **kwargs):
        targets = [m.weight for m in model.modules() if isinstance(m, nn.Linear) and isinstance(m.weight, Int8Weight)]
        assert len(targets) == 14  # the skeleton has every int8 layer from the start
        seen.append((sum(not w.is_meta for w in targets), sum(w.is_meta for w in targets), len(input_dict)))
        return original(self, input_dict, model=model, **kwargs)

    monkeypatch.setattr(hfq._QuantizeOnLoad, "convert", spy)
    model = AutoModelForCausalLM.from_pretrained(tmp_path, quantization_config=hfq.Int8TrainingHfConfig())
    # Built on the meta device; each full-precision weight is quantized as it is read, one
    # at a time, into int8 storage: the model never holds a full-precision int8 layer.
    assert seen == [(i, 14 - i, 1) for i in range(14)], seen
    assert all(not w.is_meta for w in _int8(model).values()) and len(_int8(model)) == 14
    # The same bytes as loading in full precision and quantizing afterwards.
    assert_same_model(model, fsdp_int8.quantize_(AutoModelForCausalLM.from_pretrained(tmp_path)))


def test_a_model_quantized_by_quantize_saves_the_same_way_once_attached(tmp_path):
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM

    model = fsdp_int8.quantize_(tiny_llama())
    with pytest.raises(RuntimeError, match="attach_hf_quantizer"):  # raw bytes: refused, naming the fix
        save_file({"w": model.model.layers[0].mlp.up_proj.weight.detach()}, tmp_path / "refused.safetensors")
    hfq.attach_hf_quantizer(model)
    _train(model)
    model.save_pretrained(tmp_path / "int8")
    assert_same_model(AutoModelForCausalLM.from_pretrained(tmp_path / "int8"), model)
    model.save_pretrained(tmp_path / "shards", max_shard_size="100KB")  # several files, an index
    assert len([f for f in os.listdir(tmp_path / "shards") if f.endswith(".safetensors")]) > 1
    assert_same_model(AutoModelForCausalLM.from_pretrained(tmp_path / "shards"), model)
    # Trainer's resume: load_state_dict of the safetensors file, int8 rows and scales included.
    fresh = hfq.attach_hf_quantizer(fsdp_int8.quantize_(tiny_llama(seed=1)))
    result = fresh.load_state_dict(load_file(tmp_path / "int8" / "model.safetensors"))
    assert not result.missing_keys and not result.unexpected_keys
    assert_same_model(fresh, model)
    # model.state_dict() is untouched: Int8Weight values, for torch.save, DCP and accelerate.
    state = model.state_dict()
    assert isinstance(state["model.layers.0.mlp.up_proj.weight"], Int8Weight)
    assert not any(k.endswith("_scale") for k in state)
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    again = fsdp_int8.quantize_(tiny_llama(seed=2))
    again.load_state_dict(torch.load(buf, weights_only=True))
    assert_same_model(again, model)


def test_a_loader_without_the_method_refuses_the_folder_import_fsdp_int8_suffices_and_version_1_folders_still_load(tmp_path):
    import subprocess

    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM

    model = hfq.attach_hf_quantizer(fsdp_int8.quantize_(tiny_llama()))
    _train(model)
    model.save_pretrained(tmp_path / "int8")
    # One fresh process (a start-up of torch and transformers is most of this test's time):
    # with transformers alone the method is unknown (transformers skips it) and the flat int8
    # rows fail the plain model's shape check, loudly; once fsdp_int8 is imported (after
    # transformers: the harder order) the folder loads exactly. The adapter module is
    # imported by transformers' first use of the method, not before.
    load = (
        "import sys, torch; {first}; "
        "from transformers import AutoModelForCausalLM\n"
        "if {plain_first}:\n"
        "    try:\n"
        "        AutoModelForCausalLM.from_pretrained(sys.argv[1])\n"
        "    except Exception as error:\n"
        "        print('refused:', error)\n"
        "    else:\n"
        "        print('loaded without fsdp_int8')\n"
        "{second}; assert 'fsdp_int8.integrations.hf_quantizer' not in sys.modules\n"
        "model = AutoModelForCausalLM.from_pretrained(sys.argv[1])\n"
        "torch.save({{n: (p.int_data, p.scale) for n, p in model.named_parameters() "
        "if type(p).__name__ == 'Int8Weight'}}, sys.argv[2])"
    )
    orders = [("import fsdp_int8", "import transformers"), ("import transformers", "import fsdp_int8")]
    for order in orders if FULL_MATRIX else orders[1:]:  # CI: transformers first, the harder order
        loaded = tmp_path / "loaded.pt"
        plain_first = order[0] == "import transformers"
        fresh = subprocess.run(
            [sys.executable, "-c", load.format(first=order[0], second=order[1], plain_first=plain_first),
             str(tmp_path / "int8"), str(loaded)],
            capture_output=True, text=True, timeout=300,
        )
        assert fresh.returncode == 0, fresh.stderr[-3000:]
        if plain_first:
            assert "refused:" in fresh.stdout and "mismatch" in fresh.stdout.lower(), fresh.stdout[-2000:]
        rows = torch.load(loaded, weights_only=True)
        assert rows.keys() == _int8(model).keys(), order
        for name, weight in _int8(model).items():
            assert torch.equal(rows[name][0], weight.int_data) and torch.equal(rows[name][1], weight.scale), name
    # A folder of format version 1 ([out, in] rows) loads exactly, and saves as version 2.
    old = tmp_path / "version1"
    old.mkdir()
    config = json.loads((tmp_path / "int8" / "config.json").read_text())
    config["quantization_config"]["format_version"] = 1
    (old / "config.json").write_text(json.dumps(config))
    tensors = load_file(tmp_path / "int8" / "model.safetensors")
    int8 = _int8(model)
    save_file({k: v.view(int8[k].shape) if k in int8 else v for k, v in tensors.items()},
              old / "model.safetensors", metadata={"format": "pt"})
    reloaded = AutoModelForCausalLM.from_pretrained(old)
    assert_same_model(reloaded, model)
    reloaded.save_pretrained(tmp_path / "again")
    again = json.loads((tmp_path / "again" / "config.json").read_text())["quantization_config"]
    assert again["format_version"] == 2
    assert_same_model(AutoModelForCausalLM.from_pretrained(tmp_path / "again"), model)


def test_int8_embeddings_and_their_tied_head_save_and_load_exactly(tmp_path):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    model = fsdp_int8.quantize_(tiny_llama(tie=True), Int8TrainingConfig(quantize_embeddings=True))
    embedding = model.model.embed_tokens.weight
    assert isinstance(embedding, Int8Weight) and model.lm_head.weight is embedding
    _train(model)
    model.save_pretrained(tmp_path / "int8")
    saved = load_file(tmp_path / "int8" / "model.safetensors")
    assert torch.equal(saved["model.embed_tokens.weight"], embedding.int_data.reshape(-1))
    assert torch.equal(saved["model.embed_tokens.weight_scale"], embedding.scale)
    assert not any(k.startswith("lm_head") for k in saved)  # the tie is written once
    recorded = json.loads((tmp_path / "int8" / "config.json").read_text())["quantization_config"]
    assert recorded["quantize_embeddings"] is True

    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "int8")
    assert_same_model(reloaded, model)
    assert reloaded.lm_head.weight is reloaded.model.embed_tokens.weight  # tied again, int8
    tokens = fibonacci_mod_task(4, 12, vocab=VOCAB)
    assert torch.equal(hf_loss(reloaded, tokens), hf_loss(model, tokens))

    # A full-precision folder quantizes its embedding while loading; the head follows the tie.
    tiny_llama(tie=True).save_pretrained(tmp_path / "float")
    loaded = AutoModelForCausalLM.from_pretrained(
        tmp_path / "float", quantization_config=hfq.Int8TrainingHfConfig(quantize_embeddings=True)
    )
    assert_same_model(
        loaded, fsdp_int8.quantize_(tiny_llama(tie=True), Int8TrainingConfig(quantize_embeddings=True))
    )
    assert loaded.lm_head.weight is loaded.model.embed_tokens.weight


def test_a_tie_saved_from_a_gathered_state_dict_is_written_once_and_a_folder_holding_it_twice_loads_tied(tmp_path):
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM

    from fsdp_int8._weight.load_checks import Int8LoadError

    model = fsdp_int8.quantize_(tiny_llama(tie=True), Int8TrainingConfig(quantize_embeddings=True))
    _train(model)
    model.save_pretrained(tmp_path / "one")
    one = load_file(tmp_path / "one" / "model.safetensors")
    # A gathered full state dict (FSDP's get_model_state_dict, accelerate's get_state_dict)
    # holds each end of the tie as its own tensor: the folder is still one process's.
    copies = {key: value.clone() for key, value in model.state_dict().items()}
    assert copies["lm_head.weight"] is not copies["model.embed_tokens.weight"]
    model.save_pretrained(tmp_path / "gathered", state_dict=copies)
    assert load_file(tmp_path / "gathered" / "model.safetensors").keys() == one.keys()

    # A folder holding both ends (int8 rows and scales twice, as such saves wrote them
    # without the rule above) loads exactly, tied, when the copies agree ...
    twice = dict(one, **{"lm_head.weight": one["model.embed_tokens.weight"].clone(),
                         "lm_head.weight_scale": one["model.embed_tokens.weight_scale"].clone()})
    save_file(twice, tmp_path / "one" / "model.safetensors", metadata={"format": "pt"})
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "one")
    assert_same_model(reloaded, model)
    assert reloaded.lm_head.weight is reloaded.model.embed_tokens.weight
    # ... and is refused, naming the tie, when the scales differ (the rows alone are equal).
    twice["lm_head.weight_scale"][3] *= 2
    save_file(twice, tmp_path / "one" / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(Int8LoadError, match="lm_head.weight .* tied to model.embed_tokens.weight"):
        AutoModelForCausalLM.from_pretrained(tmp_path / "one")


def test_a_custom_module_filter_is_recorded_by_name_and_the_checkpoint_decides(tmp_path):
    from transformers import AutoModelForCausalLM

    config = Int8TrainingConfig(module_filter=lambda m, n: isinstance(m, nn.Linear) and "mlp" in n)
    model = hfq.attach_hf_quantizer(fsdp_int8.quantize_(tiny_llama(), config), config)
    assert len(_int8(model)) == 6
    kept = model.config.quantization_config.modules_to_not_convert
    assert "lm_head" in kept and "model.layers.1.self_attn.q_proj" in kept and len(kept) == 9
    model.save_pretrained(tmp_path)
    assert_same_model(AutoModelForCausalLM.from_pretrained(tmp_path), model)


def test_a_full_precision_export_saves_and_loads_as_the_plain_model(tmp_path):
    """save_pretrained(state_dict=...) writes what it is given, the quantizer attached or not."""
    from transformers import AutoModelForCausalLM

    model = hfq.attach_hf_quantizer(fsdp_int8.quantize_(tiny_llama()))
    exported = fsdp_int8.export_full_state_dict(model, torch.float32)
    model.save_pretrained(tmp_path, state_dict=exported)
    plain = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert not _int8(plain) and getattr(plain, "hf_quantizer", None) is None
    assert not hasattr(plain.config, "quantization_config")
    for key, value in exported.items():
        assert torch.equal(plain.state_dict()[key], value), key


def test_configs_round_trip_and_wrong_uses_are_refused():
    matmul = fsdp_int8.Int8MatmulConfig(grad_weight=False)
    config = Int8TrainingConfig(stochastic_rounding=False, seed=3, min_features=32, int8_matmul=matmul, compile="on")
    hf_config = hfq.Int8TrainingHfConfig.from_training_config(config)
    assert hf_config.to_training_config() == config
    assert hfq.Int8TrainingHfConfig.from_dict(hf_config.to_dict()).to_dict() == hf_config.to_dict()
    # a config.json of fsdp_int8 0.1.0 records compile as a bool: it reads as the word; in code a bool is refused
    for recorded, word in ((True, "on"), (False, "off")):
        assert hfq.Int8TrainingHfConfig.from_dict({**hf_config.to_dict(), "compile": recorded}).compile == word
    with pytest.raises(TypeError, match="use compile='on'"):
        hfq.Int8TrainingHfConfig(compile=True)
    with pytest.raises(ValueError, match="format_version"):
        hfq.Int8TrainingHfConfig(format_version=3)
    with pytest.raises(TypeError, match="PreTrainedModel"):
        hfq.attach_hf_quantizer(fsdp_int8.quantize_(nn.Sequential(nn.Linear(32, 32))))
    with pytest.raises(ValueError, match="no int8 weights"):
        hfq.attach_hf_quantizer(tiny_llama())


def test_quantize_attaches_the_quantizer_to_transformers_models():
    model = fsdp_int8.quantize_(tiny_llama())
    assert isinstance(model.hf_quantizer, hfq.Int8TrainingHfQuantizer)
