"""Mixture-of-experts weights: 3-D ``Int8Weight`` ``[experts, out, in]`` in one process.

How transformers 5 and torchtitan compute with their experts (one expert's ``F.linear``,
batched ``bmm``, ``torch._grouped_mm`` on the transposed weight), which modules
``quantize_`` selects (experts yes, routers no) and the warning for a model that stays
mostly full precision; optimizers, pickles and loads of 3-D weights.

Exactness: apart from the int8 GEMMs, every expert op computes on the dequantized values
(``int_data * scale``, exact in fp32), so an int8 model and a plain model holding those
values give bit-identical losses and gradients; they are compared with ``torch.equal``.
"""

from __future__ import annotations

import io
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

import fsdp_int8
from fsdp_int8 import Int8MatmulConfig, Int8TrainingConfig, Int8Weight, quantize_
from fsdp_int8._weight.load_checks import Int8LoadError
from fsdp_int8._weight.census import int8_census
from launch.model import MoE, ModelArgs, Transformer, load_balance_loss, next_token_loss

from _quant import dispatch_into_own_ops


def _experts_weight(experts: int = 4, out: int = 32, k: int = 16, seed: int = 0) -> nn.Parameter:
    values = torch.randn(experts, out, k, generator=torch.Generator().manual_seed(seed))
    return nn.Parameter(Int8Weight.from_float(values), requires_grad=True)


def _plain_copy(weight: Int8Weight) -> nn.Parameter:
    return nn.Parameter(weight.dequantize().detach().clone(), requires_grad=True)


def _values_of(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.dequantize() if isinstance(v, Int8Weight) else v for k, v in model.state_dict().items()}


class _Ops(TorchDispatchMode):
    """The aten ops a region runs, by name, those inside fsdp_int8's own custom ops (the
    grouped GEMMs) included."""

    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(str(func.overloadpacket.__name__))
        return dispatch_into_own_ops(self, func, args, kwargs)


# ---------------------------------------------------------------- the weight
def test_a_3d_weight_has_one_scale_per_expert_and_output_feature():
    values = torch.randn(3, 8, 16)
    values[1, 2] *= 50  # one loud row changes only its own scale
    weight = Int8Weight.from_float(values)
    assert weight.shape == (3, 8, 16) and weight.int_data.shape == (3, 8, 16) and weight.scale.shape == (3, 8)
    for e in range(3):
        alone = Int8Weight.from_float(values[e])  # each expert as its own 2-D weight
        assert torch.equal(weight.int_data[e], alone.int_data) and torch.equal(weight.scale[e], alone.scale)
    assert torch.equal(weight[1].scale, weight.scale[1]) and isinstance(weight[1], Int8Weight)
    with pytest.raises(ValueError, match=r"2-D \[out_features, in_features\] weights and 3-D expert"):
        Int8Weight.from_float(torch.randn(2, 3, 4, 5))


# How a model's code may compute with an expert weight: one expert's F.linear (transformers'
# eager loops, with an int or a 0-d tensor from nonzero()), and the grouped matmul.
FORMS = {
    "linear_int": lambda w, x, offs: F.linear(x, w[1]),
    "linear_0d": lambda w, x, offs: F.linear(x, w[torch.tensor(2)]),
    "int8_grouped_mm": lambda w, x, offs: fsdp_int8.weight.int8_grouped_mm(x, w, offs),
}
# What an int8 expert weight refuses: each would compute on values, out of int8_grouped_mm's
# sight (Int8MatmulConfig ignored); a model's own code calls int8_grouped_mm instead.
REFUSED_FORMS = {
    "index_bmm": lambda w, x, offs: torch.bmm(w[torch.tensor([0, 3, 3, 1, 2])], x[:5].unsqueeze(-1)),
    "grouped_mm": lambda w, x, offs: torch._grouped_mm(x.bfloat16(), w.bfloat16().transpose(-2, -1), offs=offs),
    "F_grouped_mm": lambda w, x, offs: F.grouped_mm(x.bfloat16(), w.bfloat16().mT, offs=offs),
    "matmul": lambda w, x, offs: torch.matmul(x[:4].unsqueeze(1), w.permute(0, 2, 1)),
    "bmm_weight_right": lambda w, x, offs: torch.bmm(x[:4].unsqueeze(1), w),
}


@pytest.mark.parametrize("form", sorted(FORMS))
def test_each_expert_form_equals_the_plain_weight_in_values_and_gradients(form):
    weight = _experts_weight()
    plain = _plain_copy(weight)
    x = torch.randn(11, 16, generator=torch.Generator().manual_seed(1))
    offs = torch.tensor([3, 5, 9, 11], dtype=torch.int32)
    out, ref = FORMS[form](weight, x, offs), FORMS[form](plain, x, offs)
    assert type(out) is torch.Tensor and torch.equal(out, ref)
    out.float().pow(2).sum().backward()
    ref.float().pow(2).sum().backward()
    assert type(weight.grad) is torch.Tensor and torch.equal(weight.grad, plain.grad)
    assert isinstance(weight, Int8Weight)  # the parameter stays int8


@pytest.mark.parametrize("int8_matmul", [None, Int8MatmulConfig()], ids=["weight-only", "int8-matmuls"])
@pytest.mark.parametrize("form", sorted(REFUSED_FORMS))
def test_other_expert_forms_are_refused_naming_int8_grouped_mm(form, int8_matmul):
    weight = Int8Weight.from_float(torch.randn(4, 32, 16), int8_matmul=int8_matmul)
    x, offs = torch.randn(11, 16), torch.tensor([3, 5, 9, 11], dtype=torch.int32)
    with pytest.raises(NotImplementedError, match=r"fsdp_int8\.weight\.int8_grouped_mm\(x, w, offs\)"):
        REFUSED_FORMS[form](weight, x, offs)


def test_a_transposed_2d_weight_is_still_refused():
    with pytest.raises(NotImplementedError, match="whole int8 rows"):
        Int8Weight.from_float(torch.randn(8, 16)).t()


# ---------------------------------------------------------------- transformers 5
def _qwen3_moe(implementation: str, **overrides):
    transformers = pytest.importorskip("transformers")
    config = transformers.Qwen3MoeConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        num_experts=8, num_experts_per_tok=2, tie_word_embeddings=False, **overrides,
    )
    config._experts_implementation = implementation
    torch.manual_seed(0)
    return transformers.Qwen3MoeForCausalLM(config)


@pytest.mark.parametrize("implementation", ["eager", "batched_mm", "grouped_mm"])
def test_qwen3_moe_trains_on_int8_experts_as_on_their_values(implementation):
    """Whatever ``experts_implementation`` names, int8 experts compute through
    ``int8_grouped_mm``, the function transformers' own implementation computes on the
    values of a plain model."""
    model = quantize_(_qwen3_moe(implementation))
    experts = model.model.layers[0].mlp.experts
    assert isinstance(experts.gate_up_proj, Int8Weight) and experts.gate_up_proj.scale.shape == (8, 64)
    assert type(model.model.layers[0].mlp.gate.weight) is nn.Parameter  # the router: full precision
    reference = _qwen3_moe(implementation)
    reference.load_state_dict(_values_of(model))
    ids = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(2))
    with _Ops() as ops:
        loss = model(ids, labels=ids).loss
    assert ops.names.count("int8_grouped_mm") == 2 * 2  # two projections in each of two blocks
    ref_loss = reference(ids, labels=ids).loss
    loss.backward()
    ref_loss.backward()
    # the same products of the same fp32 values, summed in another order per implementation
    # (eager adds each token's experts with index_add_): a few fp32 ulps. Gradients differ
    # by under 1e-6 of each one's largest entry (measured 8e-7); 1e-5 leaves a margin.
    torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=0)
    ref_params = dict(reference.named_parameters())
    for name, param in model.named_parameters():
        expected = ref_params[name].grad
        torch.testing.assert_close(param.grad, expected, rtol=0, atol=1e-5 * expected.abs().max().item(), msg=name)
    opt = fsdp_int8.Int8AdamW(model.parameters(), lr=1e-2)
    before = experts.down_proj.dequantize()
    opt.step()
    assert isinstance(experts.down_proj, Int8Weight) and not torch.equal(experts.down_proj.dequantize(), before)


def test_qwen3_moe_experts_run_grouped_int8_gemms_under_every_implementation():
    """With ``Int8MatmulConfig`` every implementation runs the same grouped int8 GEMMs
    (forward and backward): bit-identical losses and gradients, within int8 rounding of
    the plain model."""
    config = Int8TrainingConfig(int8_matmul=Int8MatmulConfig())
    ids = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(2))
    runs = {}
    for implementation in ("eager", "batched_mm", "grouped_mm"):
        model = quantize_(_qwen3_moe(implementation), config)
        with _Ops() as ops:
            loss = model(ids, labels=ids).loss
            loss.backward()
        assert ops.names.count("int8_grouped_mm_backward") == 2 * 2, implementation
        runs[implementation] = (loss, model.model.layers[0].mlp.experts.gate_up_proj.grad)
    eager_loss, eager_grad = runs["eager"]
    assert all(torch.equal(loss, eager_loss) and torch.equal(grad, eager_grad) for loss, grad in runs.values())
    reference = _qwen3_moe("eager")
    reference.load_state_dict(_values_of(model))
    ref_loss = reference(ids, labels=ids).loss
    # activations rounded to int8 per row: ~0.4% per matmul; the loss of a random model
    # (ln 128 = 4.85) moves by far less than 1%
    assert abs(eager_loss.item() - ref_loss.item()) / ref_loss.item() < 1e-2


def test_expert_parallel_sentinels_add_nothing_as_in_transformers():
    """Under transformers' expert parallelism a token routed to another rank's expert
    carries an id ``>= E`` (a sentinel): it adds nothing, biases included, as in
    transformers' grouped_mm (gpt-oss: experts with biases, stored transposed)."""
    transformers = pytest.importorskip("transformers")
    from transformers.integrations.moe import grouped_mm_experts_forward
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

    config = transformers.GptOssConfig(hidden_size=64, intermediate_size=32, num_local_experts=4)
    torch.manual_seed(0)
    experts, reference = GptOssExperts(config), GptOssExperts(config)
    for parameter in experts.parameters():  # a bare module: transformers initialises whole models only
        nn.init.normal_(parameter, std=0.1)
    quantize_(nn.ModuleDict({"experts": experts}))
    reference.load_state_dict(fsdp_int8.export_full_state_dict(experts, torch.float32))
    experts._is_expert_parallel = reference._is_expert_parallel = True
    hidden = torch.randn(6, 64, generator=torch.Generator().manual_seed(4))
    index = torch.tensor([[0, 4], [3, 4], [4, 4], [3, 1], [2, 4], [1, 0]])  # 4: another rank's expert
    weights = torch.rand(6, 2, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        out, expected = experts(hidden, index, weights), grouped_mm_experts_forward(reference, hidden, index, weights)
    assert torch.equal(out[2], torch.zeros(64))  # a token with no local expert
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)  # fp32 sums in another order


class TransposedExperts(nn.Module):  # transformers' is_transposed layout, [E, in, out], with its own code
    def __init__(self):
        super().__init__()
        self.num_experts, self.is_transposed = 4, True
        self.gate_up_proj = nn.Parameter(torch.randn(4, 32, 64))

    def forward(self, x):
        return torch.bmm(x, self.gate_up_proj)


def test_transposed_experts_of_unknown_code_stay_full_precision_with_a_warning():
    """Held as their transpose, ``[E, in, out]`` experts could not be read by the module's
    own code: ``quantize_`` makes them int8 only in the modules whose function it computes
    (transformers' experts classes, Llama 4, DBRX)."""
    model = nn.Sequential(TransposedExperts(), nn.Linear(64, 64))
    with pytest.warns(UserWarning, match=r"0 \(experts stored \[E, in, out\] by a module whose forward"):
        quantize_(model)
    assert type(model[0].gate_up_proj) is nn.Parameter and isinstance(model[1].weight, Int8Weight)


def _saved(obj) -> bytes:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


@pytest.mark.parametrize("int8_matmul", [None, Int8MatmulConfig()], ids=["weight-only", "int8-matmuls"])
@pytest.mark.parametrize("implementation", ["eager", "grouped_mm"])
def test_gpt_oss_experts_become_int8_and_compute_as_their_values(implementation, int8_matmul):
    """gpt-oss's ``GptOssExperts`` (``is_transposed``) through transformers' eager loop
    (``x @ w[e]``) and its ``grouped_mm`` path: the logits of an fp32 model holding the int8
    model's values (weight-only: the same products, fp32 rounding apart; int8 GEMMs: their
    activation rounding, under 2%)."""
    transformers = pytest.importorskip("transformers")
    config = transformers.GptOssConfig(
        hidden_size=64, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, vocab_size=128, num_local_experts=4, num_experts_per_tok=2,
        layer_types=["full_attention"])
    torch.manual_seed(0)
    model = transformers.GptOssForCausalLM(config).eval()
    model.set_experts_implementation(implementation)
    reference = transformers.GptOssForCausalLM(config).eval()
    reference.set_experts_implementation(implementation)
    values = model.model.layers[0].mlp.experts.gate_up_proj.detach().clone()  # [E, in, out]
    quantize_(model, Int8TrainingConfig(stochastic_rounding=False, int8_matmul=int8_matmul))
    experts = model.model.layers[0].mlp.experts
    stored = experts._parameters["gate_up_proj"]
    assert isinstance(stored, Int8Weight) and stored.shape == (4, 128, 64) and stored.scale.shape == (4, 128)
    # one scale per output feature: the absmax over the last dim of the model's layout
    torch.testing.assert_close(stored.scale * 127, values.abs().amax(dim=1))
    assert dict(model.named_parameters())["model.layers.0.mlp.experts.gate_up_proj"] is stored
    assert isinstance(experts._parameters["down_proj"], Int8Weight)  # square: [4, 64, 64]
    plain = fsdp_int8.export_full_state_dict(model, torch.float32)  # the model's [E, in, out] layout
    assert plain["model.layers.0.mlp.experts.gate_up_proj"].shape == (4, 64, 128)
    reference.load_state_dict(plain)
    tokens = torch.randint(0, 128, (2, 16))
    with torch.no_grad():
        error = (model(tokens).logits - reference(tokens).logits).norm() / reference(tokens).logits.norm()
    assert error < (1e-6 if int8_matmul is None else 2e-2), error
    # a whole-module pickle names the swapped class by its original's path
    copy = torch.load(io.BytesIO(_saved(experts)), weights_only=False)
    hidden, index, weights = torch.randn(6, 64), torch.randint(0, 4, (6, 2)), torch.rand(6, 2)
    with torch.no_grad():
        assert type(copy) is type(experts) and torch.equal(copy(hidden, index, weights), experts(hidden, index, weights))
    model.train()
    optimizer = fsdp_int8.Int8AdamW(model.parameters(), lr=1e-2)
    before = experts._parameters["gate_up_proj"].int_data.clone()
    model(tokens, labels=tokens).loss.backward()
    optimizer.step()
    assert not torch.equal(experts._parameters["gate_up_proj"].int_data, before)


def test_llama4_experts_stored_transposed_without_a_flag_become_int8():
    """Llama 4 stores ``gate_up_proj`` ``[E, hidden, 2 * inner]`` and ``down_proj`` ``[E, inner,
    hidden]`` with no ``is_transposed`` and multiplies them with ``bmm``: recognised by their
    shapes, held as their transposes, computing what their values compute."""
    transformers = pytest.importorskip("transformers")
    from transformers.models.llama4.modeling_llama4 import Llama4TextMoe

    config = transformers.Llama4TextConfig(hidden_size=32, intermediate_size=48, num_local_experts=4,
                                           num_experts_per_tok=1, num_attention_heads=4, head_dim=8)
    torch.manual_seed(0)
    moe, reference = Llama4TextMoe(config), Llama4TextMoe(config)
    for parameter in moe.parameters():  # a bare block: transformers initialises whole models only
        nn.init.normal_(parameter, std=0.1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # mostly int8: no low-share warning
        quantize_(nn.Sequential(moe, nn.Linear(32, 32)))
    stored = moe.experts._parameters["gate_up_proj"]
    assert isinstance(stored, Int8Weight) and stored.shape == (4, 96, 32) and stored.scale.shape == (4, 96)
    assert type(moe.router.weight) is nn.Parameter
    reference.load_state_dict(fsdp_int8.export_full_state_dict(moe, torch.float32))
    x = torch.randn(2, 5, 32)
    with torch.no_grad():
        torch.testing.assert_close(moe(x)[0], reference(x)[0], rtol=1e-5, atol=1e-6)


def _dbrx_ffn(experts: int = 4, ffn: int = 48, top_k: int = 2) -> nn.Module:
    """transformers' ``DbrxFFN`` (router and experts, hidden 32), its weights drawn (a bare
    block: transformers initialises whole models only)."""
    transformers = pytest.importorskip("transformers")
    from transformers.models.dbrx.modeling_dbrx import DbrxFFN

    config = transformers.DbrxConfig(
        d_model=32, ffn_config={"ffn_hidden_size": ffn, "moe_num_experts": experts, "moe_top_k": top_k})
    torch.manual_seed(0)
    block = DbrxFFN(config)
    for parameter in block.parameters():
        nn.init.normal_(parameter, std=0.1)
    return block.eval()


def test_dbrx_experts_are_int8_per_output_feature_and_the_router_full_precision():
    """DBRX's 2-D ``w1`` / ``v1`` ``[E * ffn, hidden]`` keep their layout (a row is an output
    feature); ``w2``, read per expert as ``[ffn, hidden]`` (in, out), is held as each expert's
    transpose ``[E * hidden, ffn]``. ``router.layer`` (``nn.Linear(hidden, E)`` under a block
    without ``num_experts``) passes ``min_features`` and still stays full precision."""
    ffn = _dbrx_ffn()
    original = {name: p.detach().clone() for name, p in ffn.named_parameters()}
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # mostly int8: no low-share warning
        quantize_(nn.Sequential(ffn, nn.Linear(32, 32)), Int8TrainingConfig(min_features=16))
    mlp = ffn.experts.mlp
    assert type(ffn.router.layer.weight) is nn.Parameter
    assert [tuple(mlp._parameters[n].shape) for n in ("w1", "v1", "w2")] == [(192, 32), (192, 32), (128, 48)]
    assert all(isinstance(mlp._parameters[n], Int8Weight) for n in ("w1", "v1", "w2"))
    w2 = original["experts.mlp.w2"].view(4, 48, 32)  # expert e's [in, out]
    stored = mlp.w2.dequantize().view(4, 32, 48)  # its [out, in], one scale per output feature
    torch.testing.assert_close(stored, w2.transpose(1, 2), atol=0.5 * float(w2.abs().max()) / 127, rtol=0)
    assert mlp.w2.scale.shape == (128,)
    torch.testing.assert_close(mlp.w2.scale.view(4, 32), w2.abs().amax(dim=1) / 127)


@pytest.mark.parametrize("int8_matmul", [None, Int8MatmulConfig()], ids=["weight-only", "int8-matmuls"])
def test_dbrx_experts_compute_what_their_values_compute(int8_matmul):
    """The swapped ``DbrxExperts.forward`` (grouped over the int8 layout) against
    transformers' own loop on an fp32 block holding the int8 values: outputs and gradients
    within fp32 rounding (the same products, summed per token in the same expert order;
    the GEMMs' row blocks differ), int8 GEMMs within their activation rounding (2%)."""
    ffn, reference = _dbrx_ffn(), _dbrx_ffn()
    quantize_(ffn, Int8TrainingConfig(min_features=16, int8_matmul=int8_matmul, compile="off"))
    assert type(ffn.experts).__name__.startswith("Int8Dbrx__") and type(reference.experts).__name__ == "DbrxExperts"
    reference.load_state_dict(fsdp_int8.export_full_state_dict(ffn, torch.float32))
    x = torch.randn(3, 7, 32)
    x_int8, x_ref = x.clone().requires_grad_(), x.clone().requires_grad_()
    out, want = ffn(x_int8), reference(x_ref)
    (out.square().sum()).backward()
    (want.square().sum()).backward()
    tolerance = 1e-6 if int8_matmul is None else 2e-2

    def relative(a, b):
        return float((a - b).detach().norm() / b.detach().norm())

    assert relative(out, want) < tolerance
    assert relative(x_int8.grad, x_ref.grad) < tolerance
    mlp, plain = ffn.experts.mlp, reference.experts.mlp
    assert mlp.w2.grad.shape == mlp.w2.shape  # the gradient of the stored layout
    assert relative(mlp.w2.grad.view(4, 32, 48).transpose(1, 2).reshape(192, 32), plain.w2.grad) < tolerance
    assert relative(mlp.w1.grad, plain.w1.grad) < tolerance


def test_dbrx_experts_save_in_the_model_layout_and_load_back_exactly():
    """``export_full_state_dict`` writes ``w2`` as the model's ``[E * ffn, hidden]``; loading it
    into another quantized block gives the same int8 bytes and scales; a whole-block pickle
    loads (the swapped classes rebuilt by name) and computes the same output."""
    ffn, other = _dbrx_ffn(), _dbrx_ffn()
    config = Int8TrainingConfig(min_features=16, compile="off")
    quantize_(ffn, config)
    exported = fsdp_int8.export_full_state_dict(ffn, torch.float32)
    assert {k: tuple(v.shape) for k, v in exported.items()} == {k: tuple(v.shape) for k, v in other.state_dict().items()}
    quantize_(other, config)
    other.load_state_dict(exported)
    for name in ("w1", "v1", "w2"):
        mine, theirs = getattr(ffn.experts.mlp, name), getattr(other.experts.mlp, name)
        assert torch.equal(mine.int_data, theirs.int_data) and torch.equal(mine.scale, theirs.scale), name
    loaded = torch.load(io.BytesIO(_saved(ffn)), weights_only=False)
    x = torch.randn(2, 5, 32)
    with torch.no_grad():
        assert torch.equal(loaded(x), ffn(x))


def test_routers_are_found_by_name_or_by_one_output_per_expert():
    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.experts = type("Experts", (nn.Module,), {})()
            self.experts.num_experts = 16
            self.experts.weights = nn.Parameter(torch.randn(16, 32, 32))
            self.router_mlp = nn.Sequential(nn.Linear(32, 32), nn.Linear(32, 17))  # a named router
            self.score = nn.Linear(32, 16)  # one logit per expert
            self.up_proj = nn.Linear(32, 32)  # a shared expert
            self.gate_proj = nn.Linear(32, 32)

    block = quantize_(nn.Sequential(Block()))[0]
    assert isinstance(block.experts.weights, Int8Weight)
    assert all(type(m.weight) is nn.Parameter for m in (*block.router_mlp, block.score))
    assert isinstance(block.up_proj.weight, Int8Weight) and isinstance(block.gate_proj.weight, Int8Weight)


# ---------------------------------------------------------------- selection and census
def test_qwen3_30b_a3b_shape_is_over_95_percent_int8_on_the_meta_device():
    transformers = pytest.importorskip("transformers")
    config = transformers.Qwen3MoeConfig(  # Qwen3-30B-A3B's shape
        vocab_size=151936, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
        num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
        num_experts=128, num_experts_per_tok=8, tie_word_embeddings=False,
    )
    with torch.device("meta"):
        model = transformers.Qwen3MoeForCausalLM(config)
    census = int8_census(quantize_(model))
    assert census.total_elements > 30e9
    assert census.int8_elements / census.total_elements >= 0.95, census
    routers = [m.gate.weight for m in model.modules() if hasattr(m, "gate") and hasattr(m, "experts")]
    assert len(routers) == 48 and all(type(w) is nn.Parameter for w in routers)


def test_a_model_left_mostly_full_precision_warns_naming_its_largest_parameters():
    class Unknown(nn.Module):  # 3-D experts under names fsdp_int8 cannot recognise
        def __init__(self):
            super().__init__()
            self.bank = nn.Parameter(torch.randn(16, 64, 64))
            self.proj = nn.Linear(64, 64)

    with pytest.warns(UserWarning, match=r"only 1 int8 weights, 4,096 of .* \(6%\) int8; the largest "
                                         r"full-precision parameters are bank \(16, 64, 64\)"):
        quantize_(Unknown())
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a model that is mostly int8 says nothing
        quantize_(nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64)))


def test_a_launcher_moe_router_stays_full_precision_however_many_experts():
    args = ModelArgs(dim=64, n_layers=1, n_heads=4, n_experts=32, top_k=2)
    model = quantize_(Transformer(args))
    moe = model.layers[0].feed_forward
    assert isinstance(moe, MoE) and moe.router.out_features == 32
    assert type(moe.router.weight) is nn.Parameter  # 64 x 32 passes min_features, and still stays
    assert all(isinstance(getattr(moe.experts, n), Int8Weight) for n in ("w1", "w2", "w3"))
    # an explicit module_filter decides for routers too
    everything = quantize_(Transformer(args), Int8TrainingConfig(module_filter=lambda m, n: True))
    assert isinstance(everything.layers[0].feed_forward.router.weight, Int8Weight)


def test_torchtitan_grouped_experts_compute_on_int8_weights():
    pytest.importorskip("torchtitan")
    from torchtitan.models.common.moe import GroupedExperts

    torch.manual_seed(0)
    experts = GroupedExperts(GroupedExperts.Config(dim=32, hidden_dim=48, num_experts=4))
    for weight in (experts.w1_EFD, experts.w2_EDF, experts.w3_EFD):
        nn.init.normal_(weight, std=0.02)
    holder = quantize_(nn.ModuleDict({"experts": experts}))
    assert {n for n, p in holder.named_parameters() if isinstance(p, Int8Weight)} == {
        "experts.w1_EFD", "experts.w2_EDF", "experts.w3_EFD"}
    reference = GroupedExperts(GroupedExperts.Config(dim=32, hidden_dim=48, num_experts=4))
    reference.load_state_dict(_values_of(experts))
    x = torch.randn(10, 32)
    counts = torch.tensor([3, 0, 5, 2])
    out, ref = experts(x, counts), reference(x, counts)
    assert torch.equal(out, ref)
    out.float().sum().backward()
    ref.float().sum().backward()
    assert torch.equal(experts.w2_EDF.grad, reference.w2_EDF.grad)


# ---------------------------------------------------------------- the launcher's MoE
def test_the_moe_preset_trains_on_int8_experts_as_on_their_values():
    args = ModelArgs(dim=32, n_layers=2, n_heads=2, n_experts=4, top_k=2, shared_expert=True)
    model, reference = Transformer(args), Transformer(args)
    model.init_weights(0)
    quantize_(model, Int8TrainingConfig(min_features=1))
    reference.load_state_dict(_values_of(model))
    tokens = torch.randint(0, 256, (4, 17), generator=torch.Generator().manual_seed(3))
    losses = []
    for net in (model, reference):
        loss = next_token_loss(net, tokens[:, :-1], tokens[:, 1:])
        balance = load_balance_loss(net)
        (loss + balance).backward()
        losses.append((loss, balance, net.layers[0].feed_forward.tokens_per_expert))
    (loss, balance, counts), (ref_loss, ref_balance, ref_counts) = losses
    assert torch.equal(loss, ref_loss) and torch.equal(balance, ref_balance) and torch.equal(counts, ref_counts)
    assert int(counts.sum()) == 4 * 16 * 2  # every token routed to top_k = 2 experts
    # the balance loss, n_experts * sum f_e p_e (1.0 when balanced) times its weight 0.01
    assert 0.005 < balance.item() < 0.05
    for (name, param), ref in zip(model.named_parameters(), reference.parameters()):
        assert torch.equal(param.grad, ref.grad), name


# ---------------------------------------------------------------- optimizers, pickles, loads
@pytest.mark.parametrize("optimizer", ["adamw", "int8-adamw-8bit", "int8-adamw-in-backward", "int8-sgd"])
def test_optimizers_update_3d_weights_in_place(optimizer):
    weight = _experts_weight()
    make = {
        "adamw": lambda p: torch.optim.AdamW(p, lr=1e-2),
        "int8-adamw-8bit": lambda p: fsdp_int8.Int8AdamW(p, lr=1e-2, state_bits=8),
        "int8-adamw-in-backward": lambda p: fsdp_int8.Int8AdamW(p, lr=1e-2, state_bits=8, step_in_backward=True),
        "int8-sgd": lambda p: fsdp_int8.Int8SGD(p, lr=1e-1),
    }[optimizer]
    opt = make([weight])
    before = weight.dequantize().clone()
    x, offs = torch.randn(6, 16), torch.tensor([1, 3, 4, 6], dtype=torch.int32)
    for _ in range(2):
        (F.linear(x, weight[1]).sum() + fsdp_int8.weight.int8_grouped_mm(x, weight, offs).pow(2).sum()).backward()
        opt.step()
        opt.zero_grad()
    assert isinstance(weight, Int8Weight) and weight.shape == (4, 32, 16) and weight.scale.shape == (4, 32)
    moved = (weight.dequantize() - before).abs().amax(dim=(1, 2))
    assert bool((moved > 0).all())  # every expert got a gradient


def test_a_3d_weight_pickles_and_loads_back_bit_exactly():
    weight = _experts_weight()
    buffer = io.BytesIO()
    torch.save({"w": weight}, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=True)["w"]
    assert isinstance(loaded, Int8Weight) and loaded.shape == weight.shape
    assert torch.equal(loaded.int_data, weight.int_data) and torch.equal(loaded.scale, weight.scale)


def test_load_state_dict_checks_3d_entries_and_rounds_plain_ones():
    args = ModelArgs(dim=32, n_layers=1, n_heads=2, n_experts=4)
    model = quantize_(Transformer(args))
    name = "layers.0.feed_forward.experts.w1"
    state = {k: v.clone() for k, v in model.state_dict().items()}
    state[name].int_data[2, 3, 4] = -128
    before = model.get_parameter(name).int_data.clone()
    with pytest.raises(Int8LoadError, match=r"experts\.w1: 1 int8 value\(s\) are -128"):
        model.load_state_dict(state)
    assert torch.equal(model.get_parameter(name).int_data, before)  # a refused load changes nothing
    values = _values_of(Transformer(args))  # plain floats: rounded to nearest on the way in
    model.load_state_dict(values, assign=True)
    loaded = model.get_parameter(name)
    assert isinstance(loaded, Int8Weight) and torch.equal(loaded.dequantize(), Int8Weight.from_float(values[name]).dequantize())
