"""``quantize_``: which layers it swaps, idempotence, meta-device init, refusal on sharded
models, and that a quantized model holds no hidden full-precision copy."""

from __future__ import annotations

import warnings
from collections import OrderedDict

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from _quant import quantize_rowwise

import fsdp_int8
from fsdp_int8 import Int8TrainingConfig, Int8Weight, quantize_
from fsdp_int8._quant.generators import WEIGHT_ROUNDING


class Mixed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(32, 64)  # quantized
        self.edge = nn.Linear(16, 16)  # min == min_features (16): quantized
        self.narrow_out = nn.Linear(64, 8)  # out 8 < 16: kept
        self.narrow_in = nn.Linear(15, 64)  # in 15 < 16: kept
        self.lm_head = nn.Linear(64, 100)  # skipped by name
        self.output = nn.Linear(64, 64)  # skipped by name
        self.sub = nn.Sequential(
            OrderedDict(lm_head=nn.Linear(32, 32), inner=nn.Linear(32, 32, bias=False))
        )
        self.frozen = nn.Linear(32, 32)
        self.frozen.weight.requires_grad_(False)
        self.emb = nn.Embedding(10, 32)  # not a Linear
        self.conv = nn.Conv1d(32, 32, 3)  # not a Linear


QUANTIZED_BY_DEFAULT = {"proj", "edge", "sub.inner", "frozen"}


def _int8_names(model: nn.Module) -> set[str]:
    return {
        name for name, m in model.named_modules()
        if isinstance(getattr(m, "weight", None), Int8Weight)
    }


def test_default_filter_swaps_eligible_linears_only():
    torch.manual_seed(0)
    model = Mixed()
    originals = {n: m.weight.detach().clone() for n, m in model.named_modules() if hasattr(m, "weight")}
    biases = {n: m.bias.detach().clone() for n, m in model.named_modules() if getattr(m, "bias", None) is not None}
    assert quantize_(model) is model
    assert _int8_names(model) == QUANTIZED_BY_DEFAULT
    for name, module in model.named_modules():
        if not hasattr(module, "weight"):
            continue
        weight = module.weight
        assert isinstance(weight, nn.Parameter), name
        if name in QUANTIZED_BY_DEFAULT:
            q, s = quantize_rowwise(originals[name])  # round to nearest
            assert torch.equal(weight.int_data, q) and torch.equal(weight.scale, s), name
            assert weight.dtype == torch.float32 and weight.stochastic_rounding is True
        else:
            assert type(weight.data) is torch.Tensor and torch.equal(weight.detach(), originals[name]), name
    for name, b in biases.items():  # biases are never touched
        assert torch.equal(model.get_submodule(name).bias.detach(), b)
    assert model.frozen.weight.requires_grad is False
    assert model.proj.weight.requires_grad is True


def test_config_thresholds_and_rounding_are_honoured():
    model = quantize_(Mixed(), Int8TrainingConfig(min_features=8, stochastic_rounding=False))
    # narrow_out (min 8) now qualifies; narrow_in (15) too; the names are still skipped.
    assert _int8_names(model) == QUANTIZED_BY_DEFAULT | {"narrow_out", "narrow_in"}
    assert model.proj.weight.stochastic_rounding is False
    model = quantize_(Mixed(), Int8TrainingConfig(skip_names=(), min_features=64))
    assert _int8_names(model) == {"output", "lm_head"}  # min(in, out) >= 64 only


def test_custom_module_filter():
    seen = []

    def only_heads(module: nn.Module, name: str) -> bool:
        seen.append(name)
        return name.endswith("lm_head")

    model = quantize_(Mixed(), Int8TrainingConfig(module_filter=only_heads))
    # The filter overrides both the skip names and the size threshold ...
    assert _int8_names(model) == {"lm_head", "sub.lm_head"}
    # ... and is asked about nn.Linear modules only, by fully qualified name.
    assert set(seen) == {
        "proj", "edge", "narrow_out", "narrow_in", "lm_head", "output", "sub.lm_head",
        "sub.inner", "frozen",
    }


def test_config_validation():
    with pytest.raises(ValueError, match="min_features must be >= 1, got 0"):
        Int8TrainingConfig(min_features=0)
    with pytest.raises(TypeError, match="seed must be an int, got float"):
        Int8TrainingConfig(seed=1.5)
    cfg = Int8TrainingConfig()
    assert cfg.should_quantize(nn.Linear(16, 16), "a.b") is True
    assert cfg.should_quantize(nn.Linear(16, 16), "a.lm_head") is False
    assert cfg.should_quantize(nn.Conv1d(16, 16, 1), "conv") is False


def test_quantize_is_idempotent():
    model = quantize_(Mixed())
    params = {name: p for name, p in model.named_parameters()}
    snapshot = {name: p.detach().clone() for name, p in params.items()}
    ptrs = {n: p.int_data.data_ptr() for n, p in params.items() if isinstance(p, Int8Weight)}
    quantize_(model)
    after = dict(model.named_parameters())
    assert after.keys() == params.keys()
    for name, p in after.items():
        assert p is params[name], name  # the very same Parameter objects
        assert torch.equal(p, snapshot[name]), name
        if isinstance(p, Int8Weight):
            assert p.int_data.data_ptr() == ptrs[name]
    assert _int8_names(model) == QUANTIZED_BY_DEFAULT


def test_tied_linear_weights_stay_tied():
    """A weight shared by two ``nn.Linear`` modules stays one int8 parameter (untied, the
    optimizer would train two copies apart, with twice the memory)."""
    a, b = nn.Linear(32, 32), nn.Linear(32, 32)
    b.weight = a.weight
    model = nn.ModuleDict({"a": a, "b": b})
    n_params = len(list(model.parameters()))
    quantize_(model)
    assert isinstance(model.a.weight, Int8Weight) and isinstance(model.b.weight, Int8Weight)
    assert len(list(model.parameters())) == n_params
    assert model.a.weight is model.b.weight


class TiedHead(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(64, 32)
        self.proj = nn.Linear(32, 128)  # most of the elements: int8 (no "mostly full precision" warning)
        self.lm_head = nn.Linear(32, 64, bias=False)
        self.lm_head.weight = self.embed.weight  # tie_word_embeddings


def test_weight_tied_to_an_embedding_stays_tied_in_full_precision_with_one_warning():
    """Quantizing the head's weight would untie it from the embedding (which needs a plain
    weight for its lookup): it is left alone, and named once."""
    everything = Int8TrainingConfig(module_filter=lambda m, n: True)
    model = TiedHead()
    with pytest.warns(UserWarning, match=r"1 weight\(s\).*lm_head \(tied to embed\).*Untie") as record:
        quantize_(model, everything)
    assert len(record) == 1
    assert model.lm_head.weight is model.embed.weight and type(model.embed.weight.data) is torch.Tensor
    assert isinstance(model.proj.weight, Int8Weight)
    model = TiedHead()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the default filter skips lm_head: nothing to say
        quantize_(model)
    assert model.lm_head.weight is model.embed.weight


class Conv1D(nn.Module):
    """transformers.pytorch_utils.Conv1D's layout (GPT-2): weight [in, out], addmm."""

    def __init__(self, nf: int, nx: int) -> None:
        super().__init__()
        self.nf, self.nx = nf, nx
        self.weight = nn.Parameter(torch.randn(nx, nf))
        self.bias = nn.Parameter(torch.zeros(nf))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.addmm(self.bias, x.view(-1, x.size(-1)), self.weight).view(*x.shape[:-1], self.nf)


def test_conv1d_layers_are_quantized_per_output_feature_by_the_same_rule(caplog):
    """GPT-2's Conv1D (recognised without importing transformers) follows nn.Linear's
    selection, with nx in and nf out features; tests/test_gpt2.py covers the real one."""
    from fsdp_int8._weight.conv1d import Int8Conv1D

    model = nn.ModuleDict({
        "c_attn": Conv1D(96, 32), "c_proj": Conv1D(32, 32), "mlp": nn.Linear(32, 32),
        "narrow": Conv1D(8, 32),  # nf 8 < min_features: kept, silently (as a Linear would be)
        "head": Conv1D(32, 32),  # skipped by name
    })
    before = {name: m.weight.detach().clone() for name, m in model.items()}
    bias = model.c_attn.bias
    x = torch.randn(3, 32)
    expected = model.c_attn(x)
    with caplog.at_level("INFO", logger="fsdp_int8"), warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing left behind that could have been int8
        quantize_(model)
    assert "3 int8 weights, 5,120 of 6,600 parameter elements (78%) int8" in caplog.text
    assert _int8_names(model) == {"c_attn", "c_proj", "mlp"}
    layer = model.c_attn
    assert type(layer) is Int8Conv1D and (layer.in_features, layer.out_features) == (32, 96)
    assert layer.bias is bias and (layer.nf, layer.nx) == (96, 32)
    q, s = quantize_rowwise(before["c_attn"].t())  # [out, in]: one scale per output feature
    assert torch.equal(layer.weight.int_data, q) and torch.equal(layer.weight.scale, s)
    # the same product as the float layer, up to the int8 rounding of the weight
    bound = x.abs().sum(-1, keepdim=True) * s / 2
    assert ((layer(x) - expected).abs() <= bound * (1 + 1e-4) + 1e-6).all()
    for name in ("narrow", "head"):
        assert type(model[name]) is Conv1D and torch.equal(model[name].weight, before[name])
    # the filter is offered Conv1D layers too, and decides alone
    seen = []
    model = nn.ModuleDict({"c_attn": Conv1D(96, 32), "narrow": Conv1D(8, 32)})
    quantize_(model, Int8TrainingConfig(module_filter=lambda m, n: seen.append((type(m), n)) or n == "narrow"))
    assert seen == [(Conv1D, "c_attn"), (Conv1D, "narrow")] and _int8_names(model) == {"narrow"}


def test_conv1d_layers_that_cannot_be_converted_are_named_once():
    tied = Conv1D(32, 32)
    embed = nn.Embedding(32, 32)
    embed.weight = tied.weight  # its int8 weight would be the transpose: no tie survives it
    hooked = Conv1D(32, 32)
    hooked.forward = lambda x: x  # as accelerate's hooks replace it, bound to addmm
    # "fine" holds most of the elements: the model is mostly int8 (no third warning)
    model = nn.ModuleDict({"tied": tied, "embed": embed, "hooked": hooked, "fine": Conv1D(128, 128)})
    with pytest.warns(UserWarning) as record:
        quantize_(model)
    messages = sorted(str(w.message) for w in record)
    assert len(messages) == 2
    assert "1 layer(s) in full precision that it cannot convert: hooked (its forward is replaced on the instance" in messages[0]
    assert "1 weight(s) in full precision because they are tied to a module that is not quantized: tied (tied to embed)" in messages[1]
    assert _int8_names(model) == {"fine"} and model.tied.weight is model.embed.weight


def test_quantize_seeds_the_rounding_stream_from_config():
    x = torch.randn(8, 64)
    quantize_(nn.Linear(32, 32), Int8TrainingConfig(seed=42))
    a = quantize_rowwise(x, stochastic=True)[0]
    WEIGHT_ROUNDING.manual_seed(42, 0)
    assert torch.equal(quantize_rowwise(x, stochastic=True)[0], a)
    quantize_(nn.Linear(32, 32), Int8TrainingConfig(seed=43))
    assert not torch.equal(quantize_rowwise(x, stochastic=True)[0], a)


def test_meta_device_model_then_to_empty_and_reset_parameters():
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 4))
    quantize_(model)
    assert isinstance(model[0].weight, Int8Weight) and model[0].weight.device.type == "meta"
    assert model[0].weight.int_data.is_meta and model[0].weight.scale.is_meta
    model.to_empty(device="cpu")
    torch.manual_seed(0)
    for module in model:
        if isinstance(module, nn.Linear):
            module.reset_parameters()
    for idx, fan_in in ((0, 32), (2, 64)):
        w = model[idx].weight
        assert isinstance(w, Int8Weight) and isinstance(w, nn.Parameter)
        assert w.device.type == "cpu" and w.int_data.device.type == "cpu"
        assert w.int_data.dtype == torch.int8 and w.scale.dtype == torch.float32
        assert w.int_data.min() >= -127 and w.int_data.max() <= 127
        assert (w.int_data.abs().amax(1) == 127).all()  # every row re-initialised
        deq = w.dequantize()
        assert torch.isfinite(deq).all() and torch.isfinite(w.scale).all() and (w.scale > 0).all()
        # kaiming_uniform_(a=sqrt(5)) draws from U(-1/sqrt(fan_in), 1/sqrt(fan_in)).
        assert deq.abs().max() <= fan_in ** -0.5 + 1e-6
        assert deq.std() > 0.3 * fan_in ** -0.5  # uniform std is 0.58 of the bound
    assert type(model[4].weight.data) is torch.Tensor and torch.isfinite(model[4].weight).all()
    out = model(torch.randn(3, 32))
    assert out.shape == (3, 4) and torch.isfinite(out).all()


@pytest.fixture
def one_rank_group():
    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_refuses_model_with_dtensor_parameters(one_rank_group):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (1,))
    model = nn.Sequential(nn.Linear(32, 32))
    model[0].weight = nn.Parameter(distribute_tensor(model[0].weight.detach(), mesh, [Shard(0)]))
    with pytest.raises(RuntimeError, match=r"already sharded.*Quantize first, then shard"):
        quantize_(model)
    assert not isinstance(model[0].weight.to_local(), Int8Weight)


def test_refuses_fsdp_module(one_rank_group):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (1,))
    model = nn.Sequential(nn.Linear(32, 32))
    fully_shard(model, mesh=mesh)
    with pytest.raises(RuntimeError, match=r"already sharded \(fully_shard or DTensor parameters\)"):
        quantize_(model)


# ------------------------------------------------------------------ no hidden precision
def _storage_bytes(model: nn.Module) -> int:
    """Bytes of every distinct storage reachable from the model's parameters."""
    seen: dict[int, int] = {}

    def add(t: torch.Tensor) -> None:
        storage = t.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()

    for p in model.parameters():
        if isinstance(p, Int8Weight):
            add(p.int_data)
            add(p.scale)
        else:
            add(p)
    return sum(seen.values())


def _tensor_attrs(w: Int8Weight) -> set[str]:
    return {k for k, v in vars(w).items() if isinstance(v, torch.Tensor)}


def test_no_hidden_precision():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 96), nn.ReLU(), nn.Linear(96, 8))
    quantize_(model)
    quantized = [model[0], model[2]]
    plain = [model[4]]
    expected = sum(m.out_features * m.in_features + 4 * m.out_features for m in quantized)  # int8 + fp32 scales
    expected += sum(4 * m.bias.numel() for m in quantized)  # fp32 biases
    expected += sum(4 * (m.weight.numel() + m.bias.numel()) for m in plain)  # fp32 last layer
    assert expected == (64 * 128 + 4 * 128) + (128 * 96 + 4 * 96) + 4 * (128 + 96) + 4 * (96 * 8 + 8)

    def check() -> None:
        assert _storage_bytes(model) == expected
        for m in quantized:
            w = m.weight
            assert isinstance(w, Int8Weight)
            assert w.storage_bytes() == m.out_features * m.in_features + 4 * m.out_features
            assert _tensor_attrs(w) == {"int_data", "scale"}, vars(w).keys()
            assert w.int_data.untyped_storage().nbytes() == w.int_data.numel()  # no padding/extra

    check()
    # Still true after forward, backward and an optimizer step: nothing gets cached on the
    # weight (no dequantized copy, no fp32 master), and the optimizer writes in place.
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x, y = torch.randn(16, 64), torch.randn(16, 8)
    for _ in range(2):
        loss = F.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    check()
    # Gradients and optimizer states are full precision and separate (by design), but
    # they are not hung off the weight.
    assert type(model[0].weight.grad) is torch.Tensor


class _PickledBlock(nn.Module):
    """A model class of a user's, for a whole-model ``torch.save``."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(16, 16) for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.relu(layer(x))
        return x


@pytest.mark.parametrize("int8_matmul", [None, fsdp_int8.Int8MatmulConfig()], ids=["weight-only", "int8-matmul"])
def test_a_whole_quantized_model_loads_with_weights_only(tmp_path, int8_matmul):
    """torch.load(weights_only=True) of a whole model needs the model's own classes and
    torch.nn's allow-listed; fsdp_int8 registers its own (Int8Weight, the load hook, the
    matmul config)."""
    torch.manual_seed(0)
    model = quantize_(_PickledBlock(), Int8TrainingConfig(int8_matmul=int8_matmul, min_features=1))
    torch.save(model, tmp_path / "model.pt")
    with torch.serialization.safe_globals([_PickledBlock, nn.ModuleList, nn.Linear]):
        loaded = torch.load(tmp_path / "model.pt", weights_only=True)
    for (name, saved), again in zip(model.state_dict().items(), loaded.state_dict().values()):
        assert type(saved) is type(again) and torch.equal(saved, again), name
    x = torch.randn(4, 16)
    assert torch.equal(loaded(x), model(x))
    loaded.load_state_dict(model.state_dict(), assign=True)  # the loaded hook still keeps int8
    assert isinstance(loaded.layers[0].weight, Int8Weight)
