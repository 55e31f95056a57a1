"""fsdp_int8.integrations.torchtitan in one process: the converter on torchtitan's model
config, the post-optimizer hook's refusal, enable_int8_training's refusal, the
checkpoint manager's model wrapper on the fused-QKV hooks (torchtitan's own wrapper fails
there), and export_full_state_dict in torchtitan's keys and export_hf_state_dict, through its state-dict adapter, in
Hugging Face's. The 2-rank run (torchtitan's FSDP, CheckpointManager save and load) is
tests/distributed/test_examples.py."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from _frameworks import VOCAB, titan_config, titan_init, titan_loss, titan_moe_config
from _models import train_steps
from torchtitan.components.checkpointer.base import ModelWrapper  # noqa: E402
from torchtitan.models.common.linear import Linear  # noqa: E402

import fsdp_int8
import fsdp_int8.checkpoint

# torchtitan is in the test extra: these tests run in CI, never skip
import fsdp_int8.integrations.torchtitan as titan  # noqa: E402
from fsdp_int8 import Int8TrainingConfig, Int8Weight


def _int8_names(model: torch.nn.Module) -> list[str]:
    return sorted(n for n, p in model.named_parameters() if isinstance(p, Int8Weight))


def _build(config, device: str = "cpu") -> torch.nn.Module:
    from torchtitan.models.common.attention import FlexAttention, ScaledDotProductAttention

    for _, _, parent, attr in list(config.traverse(FlexAttention.Config)):
        setattr(parent, attr, ScaledDotProductAttention.Config())  # FlexAttention: no CPU backward
    with torch.device(device):
        return config.build()


def test_converter_selects_what_quantize_selects_and_keeps_module_classes():
    converter = titan.Int8LinearConverter.Config().build()
    model = _build(converter.convert(titan_config()), "meta")
    reference = fsdp_int8.quantize_(_build(titan_config(), "meta"))
    assert _int8_names(model) == _int8_names(reference) and len(_int8_names(model)) == 10
    for name, module in model.named_modules():
        if isinstance(module, Linear):  # still torchtitan's Linear: its TP plans, param_init
            assert isinstance(module.weight, Int8Weight) == (name != "lm_head"), name
    # converting again changes nothing; filter_fqns leaves layers in full precision
    again = converter.convert(converter.convert(titan_config()))
    assert _int8_names(_build(again, "meta")) == _int8_names(model)
    ffn_off = titan.Int8LinearConverter.Config(filter_fqns=["feed_forward"]).build()
    assert _int8_names(_build(ffn_off.convert(titan_config()), "meta")) == [
        n for n in _int8_names(model) if "feed_forward" not in n
    ]


def test_converted_model_initialises_and_trains_with_torchtitans_init():
    training = Int8TrainingConfig(stochastic_rounding=False)
    config = titan.Int8LinearConverter.Config(training=training).build().convert(titan_config())
    model = _build(config, "meta")
    model.to_empty(device="cpu")
    torch.manual_seed(0)
    titan_init(model)  # trunc_normal_ through the int8 weights (fused QKV views)
    weight = model.layers["0"].attention.qkv_linear.wqkv.weight
    assert isinstance(weight, Int8Weight) and not weight.stochastic_rounding
    assert 0.015 < weight.dequantize().std() < 0.025  # torchtitan's std 0.02, rounded to int8
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    tokens = torch.randint(0, VOCAB, (4, 17), generator=torch.Generator().manual_seed(0))
    before = weight.int_data.clone()
    losses = train_steps(model, titan_loss, opt, tokens, 3)
    assert losses[-1] < losses[0] and not torch.equal(before, weight.int_data), losses


def test_converter_warns_when_it_selects_nothing():
    nothing = titan.Int8LinearConverter.Config(training=Int8TrainingConfig(min_features=10**6))
    with pytest.warns(UserWarning, match="selected no linear layer"):
        nothing.build().convert(titan_config())


def test_post_optimizer_hook_refuses_a_model_without_int8_layers():
    with pytest.raises(RuntimeError, match="Int8LinearConverter.Config"):
        titan.int8_post_optimizer_build(None, [_build(titan_config(), "meta")], None)


@pytest.mark.parametrize("quantize_gradients", [False, True])
def test_post_optimizer_hook_installs_the_int8_reduce_scatter_where_the_converter_asks(
    quantize_gradients, monkeypatch
):
    """The converter's ``quantize_gradients`` (torchtitan's spelling of
    ``fsdp_int8.gradients.enable_quantized_reduce_scatter``) reaches the hook that runs
    once the model is sharded: one call per model part, with the converter's seed."""
    calls = []
    monkeypatch.setattr(titan, "enable_quantized_reduce_scatter", lambda model, seed: calls.append((model, seed)))
    converter = titan.Int8LinearConverter.Config(
        training=Int8TrainingConfig(seed=7), quantize_gradients=quantize_gradients
    ).build()
    parts = [_build(converter.convert(titan_config()), "meta") for _ in range(2)]
    titan.int8_post_optimizer_build(None, parts, None)
    assert calls == ([(parts[0], 7), (parts[1], 7)] if quantize_gradients else [])


def test_enable_int8_training_refuses_a_foreign_checkpoint_manager_before_changing_anything():
    from torchtitan.components.checkpointer import CheckpointManager
    from torchtitan.models.llama3.config_registry import llama3_debugmodel

    class MyManager(CheckpointManager):
        from dataclasses import dataclass

        @dataclass(kw_only=True, slots=True)
        class Config(CheckpointManager.Config):
            pass

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        config = llama3_debugmodel()
        config.checkpoint = MyManager.Config()
    model_config = config.model_spec.model
    with pytest.raises(TypeError, match="Int8CheckpointManager"):
        titan.enable_int8_training(config)
    assert config.model_spec.model is model_config and config.model_spec.post_optimizer_build_fn is None
    config.checkpoint = CheckpointManager.Config(interval=7)
    titan.enable_int8_training(config)
    assert type(config.checkpoint) is titan.Int8CheckpointManager.Config
    assert config.checkpoint.interval == 7
    assert config.model_spec.post_optimizer_build_fn is titan.int8_post_optimizer_build
    assert any(titan.is_int8_config(c) for _, c, _, _ in config.model_spec.model.traverse(Linear.Config))


def test_the_lean_converter_trains_int8_embeddings_with_int8_adamw_lean_in_torchtitans_container():
    """The lean recipe's parts that torchtitan takes, in one process: the converter's int8
    embedding and gathered weights, Int8AdamW.lean's 8-bit states through torchtitan's
    container and its flat, FQN-keyed optimizer state dict (2 ranks, torchtitan's FSDP with
    bf16 compute and its checkpoints: tests/distributed/test_examples.py)."""
    from torchtitan.components.optimizer import ParamGroupConfig

    from fsdp_int8.optim.adamw import LEAN_STEP_ELEMENTS

    config = titan.Int8LinearConverter.Config(lean=True).build().convert(titan_config())
    model = _build(config, "meta")
    model.to_empty(device="cpu")
    torch.manual_seed(0)
    titan_init(model)
    wqkv = model.layers["0"].attention.qkv_linear.wqkv.weight
    assert isinstance(model.tok_embeddings.weight, Int8Weight)
    assert wqkv.int8_matmul is None and wqkv.int8_gathered_weights and not isinstance(model.lm_head.weight, Int8Weight)
    group = ParamGroupConfig(pattern=".*", optimizer_name="Int8AdamW.lean", optimizer_kwargs={"lr": 1e-2})
    optimizers = titan.Int8OptimizersContainer.Config(param_groups=[group]).build(model_parts=[model])
    (optimizer,) = optimizers.optimizers
    assert isinstance(optimizer, fsdp_int8.Int8AdamW) and optimizer.param_groups[0]["state_bits"] == 8
    # torchtitan's Trainer clips after backward: the step stays there
    assert not optimizer.step_in_backward and optimizer._step_elements == LEAN_STEP_ELEMENTS
    tokens = torch.randint(0, VOCAB, (4, 17), generator=torch.Generator().manual_seed(0))
    losses = train_steps(model, titan_loss, optimizers, tokens, 3)
    assert losses[-1] < losses[0], losses
    state = optimizer.state[wqkv]
    assert state["exp_avg_int8"].dtype == torch.int8 and state["exp_avg_sq_sqrt_uint8"].dtype == torch.uint8
    saved = copy.deepcopy(optimizers.state_dict())
    train_steps(model, titan_loss, optimizers, tokens, 1)
    assert not torch.equal(state["exp_avg_int8"], saved["state.layers.0.attention.qkv_linear.wqkv.weight.exp_avg_int8"])
    optimizers.load_state_dict(saved)
    for key, value in optimizer.state[wqkv].items():
        assert torch.equal(value, saved[f"state.layers.0.attention.qkv_linear.wqkv.weight.{key}"]), key


def test_enable_int8_training_with_lean_names_int8_adamw_lean_and_refuses_a_foreign_optimizer():
    from torchtitan.components.optimizer import OptimizersContainer, default_adamw
    from torchtitan.models.common.embedding import Embedding
    from torchtitan.models.llama3.config_registry import llama3_debugmodel

    class MyOptimizers(OptimizersContainer):
        from dataclasses import dataclass

        @dataclass(kw_only=True, slots=True)
        class Config(OptimizersContainer.Config):
            pass

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        config = llama3_debugmodel()
    model_config, lean = config.model_spec.model, titan.Int8LinearConverter.Config(lean=True)
    config.optimizer = MyOptimizers.Config(param_groups=default_adamw(lr=3e-4).param_groups)
    with pytest.raises(TypeError, match="cannot adapt a .*MyOptimizers.Config optimizer"):
        titan.enable_int8_training(config, lean)
    assert config.model_spec.model is model_config and type(config.optimizer) is MyOptimizers.Config
    config.optimizer = default_adamw(lr=3e-4)
    titan.enable_int8_training(config, lean)
    assert type(config.optimizer) is titan.Int8OptimizersContainer.Config
    (group,) = config.optimizer.param_groups
    assert group.optimizer_name == "Int8AdamW.lean" and group.optimizer_kwargs["lr"] == 3e-4
    assert all(titan.is_int8_config(c) for _, c, _, _ in config.model_spec.model.traverse(Embedding.Config))
    # without lean the groups keep torchtitan's optimizer (and may name Int8AdamW)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plain = titan.enable_int8_training(llama3_debugmodel())
    assert [g.optimizer_name for g in plain.optimizer.param_groups] == ["AdamW"]
    assert not any(titan.is_int8_config(c) for _, c, _, _ in plain.model_spec.model.traverse(Embedding.Config))


def test_model_wrapper_keeps_the_fused_qkv_split_current_where_torchtitans_cannot_run():
    config = titan.Int8LinearConverter.Config().build().convert(titan_config())
    model = _build(config)
    titan_init(model)
    with pytest.raises(RuntimeError, match="storage"):  # why Int8CheckpointManager exists
        ModelWrapper(model).state_dict()
    wrapper = titan._Int8ModelWrapper(model)
    key = "layers.0.attention.qkv_linear.wq.weight"  # made by torchtitan's split hook
    cached = wrapper.state_dict()[key]
    wqkv = model.layers["0"].attention.qkv_linear.wqkv.weight
    with torch.no_grad():
        wqkv.mul_(0.5)  # scales halve exactly: the split's values must follow
    state = wrapper.state_dict()
    assert state[key] is cached and isinstance(cached, Int8Weight)  # same tensor, refreshed
    assert torch.equal(cached.dequantize(), model.state_dict()[key].dequantize())
    wo, own = state["layers.0.attention.wo.weight"], model.layers["0"].attention.wo.weight
    # an unfused int8 weight passes through as its own int8 bytes and scales
    assert isinstance(wo, Int8Weight) and torch.equal(wo.int_data, own.int_data) and torch.equal(wo.scale, own.scale)


def test_fsdp_int8_checkpoint_functions_name_the_working_path_for_fused_qkv_hooks(tmp_path):
    """torch's get_model_state_dict cannot map the hook's wq / wk / wv keys, with or without
    int8: our checkpoint functions say so and name what works instead (the export: below).
    Loading a plain state dict (unsharded) goes through the model's own load_state_dict,
    whose hook merges the keys."""
    from _frameworks import titan_model

    fsdp_int8.save_checkpoint(tmp_path / "other", torch.nn.Linear(4, 4), step=1)  # to load from
    for model in (titan_model(), fsdp_int8.quantize_(titan_model())):
        calls = (
            lambda: fsdp_int8.save_checkpoint(tmp_path / "titan", model, step=1),
            lambda: fsdp_int8.load_checkpoint(tmp_path / "other", model),
        )
        for call in calls:
            with pytest.raises(fsdp_int8.checkpoint.CheckpointError, match="fused QKV.*Int8CheckpointManager"):
                call()
    plain = titan_model()
    titan_init(plain)
    model = fsdp_int8.quantize_(titan_model())
    fsdp_int8.checkpoint.load_full_state_dict(model, plain.state_dict())  # wq / wk / wv keys
    wqkv = model.layers["1"].attention.qkv_linear.wqkv.weight
    expected = Int8Weight.from_float(plain.layers["1"].attention.qkv_linear.wqkv.weight)
    assert torch.equal(wqkv.int_data, expected.int_data) and torch.equal(wqkv.scale, expected.scale)


def test_rounding_streams_round_trip_through_dcp_and_are_found_only_for_this_rank(tmp_path):
    """The checkpoint manager's rounding entry: dcp saves and loads it (the stream goes on
    where it was saved), and a checkpoint without this rank's key (another layout, or
    torchtitan's own manager) is told apart, so the load leaves the entry out."""
    import torch.distributed.checkpoint as dcp

    from fsdp_int8._quant.generators import WEIGHT_ROUNDING

    model = fsdp_int8.quantize_(torch.nn.Sequential(torch.nn.Linear(64, 64)), Int8TrainingConfig(min_features=1))
    streams = titan._RoundingStreams([model])
    dcp.save({titan.ROUNDING_STATES: streams}, checkpoint_id=str(tmp_path / "with"))
    expected = torch.rand(4, generator=WEIGHT_ROUNDING.generator("cpu"))
    dcp.load({titan.ROUNDING_STATES: streams}, checkpoint_id=str(tmp_path / "with"))
    assert torch.equal(torch.rand(4, generator=WEIGHT_ROUNDING.generator("cpu")), expected)
    key = streams.key()
    assert key == "world1_unsharded_tp1_rank0"  # the layout names the key
    assert titan._holds_rounding_states(str(tmp_path / "with"), False, key)
    # another layout at the same world size and rank finds no entry of its own
    assert not titan._holds_rounding_states(str(tmp_path / "with"), False, "world1_dp1_tp1_rank0")

    dcp.save({"other": torch.zeros(2)}, checkpoint_id=str(tmp_path / "without"))
    assert not titan._holds_rounding_states(str(tmp_path / "without"), False, key)
    assert not titan._holds_rounding_states(str(tmp_path / "with"), True, key)


# ------------------------------------------------------------------ export_full_state_dict (torchtitan keys, HF keys)
def _trained_int8_titan() -> torch.nn.Module:
    """A converted debug model, initialised by torchtitan and trained two steps (int8 rows
    written by the optimizer's stochastic rounding, not only by the init)."""
    model = _build(titan.Int8LinearConverter.Config().build().convert(titan_config()))
    torch.manual_seed(0)
    titan_init(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    tokens = torch.randint(0, VOCAB, (4, 17), generator=torch.Generator().manual_seed(0))
    for _ in range(2):
        titan_loss(model, tokens).backward()
        opt.step()
        opt.zero_grad()
    return model


def _values(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter's values as a plain fp32 tensor (int8 weights dequantized)."""
    return {
        name: p.dequantize(torch.float32) if isinstance(p, Int8Weight) else p.detach()
        for name, p in model.named_parameters()
    }


def test_export_full_state_dict_loads_strictly_into_a_plain_torchtitan_model_with_the_int8_values():
    """torch's get_model_state_dict cannot map the fused-QKV hook's keys: the export falls
    back to the model's own state dict, whose keys the plain model loads."""
    model = _trained_int8_titan()
    exported = fsdp_int8.export_full_state_dict(model, torch.float32)
    plain = _build(titan_config())  # unconverted: fp32 Linear weights, the fused-QKV hooks
    assert list(exported) == list(plain.state_dict())  # wq / wk / wv, not wqkv
    assert not any(isinstance(v, Int8Weight) for v in exported.values())
    plain.load_state_dict(exported, strict=True)  # its own hook merges wq / wk / wv
    ours, theirs = _values(model), _values(plain)
    assert ours.keys() == theirs.keys()
    for name, value in ours.items():  # int8 * scale in fp32, bit for bit
        assert torch.equal(theirs[name], value), name
    assert all(v.dtype == torch.bfloat16 for v in fsdp_int8.export_full_state_dict(model).values() if v.is_floating_point())


def _hf_llama_like_titan_config():
    """transformers' Llama with titan_config()'s shapes, RoPE (theta 500000, llama3 scaling)
    and RMSNorm eps: the model torchtitan's Llama3StateDictAdapter converts to."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=192, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5,
        max_position_embeddings=8192, tie_word_embeddings=False,
        rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                         "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 8192},
    )
    return LlamaForCausalLM(config)


def test_export_hf_state_dict_through_torchtitans_adapter_gives_a_hugging_face_llama():
    """The HF export (keys, and the Q / K rows permuted for HF's RoPE) computes what the
    int8 torchtitan model computes: the same fp32 values, only the order of fp32 sums may
    differ (a wrong permutation or row would move logits by their own size)."""
    from torchtitan.models.llama3.state_dict_adapter import Llama3StateDictAdapter

    model = _trained_int8_titan()
    config = titan.Int8LinearConverter.Config().build().convert(titan_config())
    adapter = Llama3StateDictAdapter(config, None)
    hf_state = titan.export_hf_state_dict(model, adapter, torch.float32)
    assert "model.layers.1.self_attn.q_proj.weight" in hf_state
    hf = _hf_llama_like_titan_config()
    hf.load_state_dict(hf_state, strict=True)
    # the adapter's way back gives the torchtitan export exactly (permutation undone)
    native = fsdp_int8.export_full_state_dict(model, torch.float32)
    back = adapter.from_hf(dict(hf_state))
    assert back.keys() == native.keys() and all(torch.equal(back[k], native[k]) for k in native)
    tokens = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours, theirs = model(tokens), hf(tokens).logits
    torch.testing.assert_close(theirs, ours, rtol=0, atol=1e-5 * ours.abs().max().item())


def _qwen3_moe(flavor: str):
    from torchtitan.models.qwen3 import model_registry

    return model_registry(flavor).model  # _build swaps its FlexAttention for SDPA (CPU backward)


def test_converter_makes_torchtitans_moe_experts_int8_and_keeps_routers():
    converter = titan.Int8LinearConverter.Config().build()
    model = _build(converter.convert(_qwen3_moe("debugmodel_moe")), "meta")
    names = _int8_names(model)
    assert {"layers.0.moe.routed_experts.inner_experts.w1_EFD", "layers.0.moe.routed_experts.inner_experts.w2_EDF",
            "layers.0.moe.routed_experts.inner_experts.w3_EFD"} <= set(names), names
    assert not any("router" in n for n in names)  # the router's gate stays in full precision
    experts = model.layers["0"].moe.routed_experts.inner_experts
    assert experts.w1_EFD.dim() == 3 and experts.w1_EFD.scale.shape == experts.w1_EFD.shape[:2]
    # the converter and quantize_ select the same weights
    assert names == _int8_names(fsdp_int8.quantize_(_build(_qwen3_moe("debugmodel_moe"), "meta")))


def test_qwen3_30b_a3b_in_torchtitan_is_over_95_percent_int8():
    from fsdp_int8._weight.census import int8_census

    converter = titan.Int8LinearConverter.Config().build()
    census = int8_census(_build(converter.convert(_qwen3_moe("30B-A3B")), "meta"))
    assert census.total_elements > 30e9 and census.int8_elements / census.total_elements >= 0.95, census


@pytest.mark.parametrize("int8_matmul", [None, fsdp_int8.Int8MatmulConfig()])
def test_torchtitans_moe_trains_on_int8_experts(int8_matmul):
    from _quant import CountIntMM

    training = Int8TrainingConfig(stochastic_rounding=False, int8_matmul=int8_matmul)
    config = titan.Int8LinearConverter.Config(training=training).build().convert(titan_moe_config())
    model = _build(config, "meta")
    model.to_empty(device="cpu")
    torch.manual_seed(0)
    titan_init(model)
    experts = model.layers["0"].moe.routed_experts.inner_experts
    before = experts.w2_EDF.int_data.clone()
    opt = fsdp_int8.Int8AdamW(model.parameters(), lr=1e-2)
    tokens = torch.randint(0, VOCAB, (2, 17), generator=torch.Generator().manual_seed(0))
    with CountIntMM() as gemms:
        losses = train_steps(model, titan_loss, opt, tokens, 3)
    assert losses[-1] < losses[0] and not torch.equal(before, experts.w2_EDF.int_data), losses
    # int8 GEMMs: attention's four linears and each expert's three grouped matmuls, 3 a step
    assert (gemms.calls > 3 * 3 * 2 * 4) == (int8_matmul is not None), gemms.calls


@pytest.mark.parametrize("int8_matmul", [None, fsdp_int8.Int8MatmulConfig()])
def test_torchtitans_moe_blocks_compile_whole_like_eager(int8_matmul):
    """Each block ``torch.compile(fullgraph=True)``d, torchtitan's per-block compile: the
    experts' grouped GEMMs are one opaque op each (their per-expert loop reads the offsets
    at run time), so a block is one graph with no break, and ``aot_eager`` (the eager
    kernels through AOTAutograd) gives the eager loss and gradients bit for bit."""
    from torch._dynamo.utils import counters

    training = Int8TrainingConfig(stochastic_rounding=False, int8_matmul=int8_matmul)
    model = _build(titan.Int8LinearConverter.Config(training=training).build().convert(titan_moe_config()), "meta")
    model.to_empty(device="cpu")
    torch.manual_seed(0)
    titan_init(model)
    eager = copy.deepcopy(model)
    torch._dynamo.reset()
    counters.clear()
    for name, block in list(model.layers.items()):
        model.layers[name] = torch.compile(block, fullgraph=True, backend="aot_eager")
    tokens = torch.randint(0, VOCAB, (2, 17), generator=torch.Generator().manual_seed(0))
    losses = [titan_loss(m, tokens) for m in (eager, model)]
    for loss in losses:
        loss.backward()
    assert torch.equal(losses[0], losses[1]), losses
    assert not counters["graph_break"] and counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])
    for (name, theirs), (_, ours) in zip(eager.named_parameters(), model.named_parameters()):
        assert torch.equal(theirs.grad, ours.grad), name
