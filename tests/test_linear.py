"""Int8 matmul mode: int8 GEMMs really run (counted at the dispatcher), exactly, and train."""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from _quant import CountIntMM, compiled_kernels_ran
from torch.utils._python_dispatch import TorchDispatchMode

import fsdp_int8
from fsdp_int8 import Int8MatmulConfig, Int8TrainingConfig, Int8Weight, quantize_
from fsdp_int8._weight import linear as int8_linear


def _linear(config: Int8MatmulConfig | None, seed: int = 0, **fields) -> tuple[nn.Linear, nn.Linear]:
    torch.manual_seed(seed)
    reference = nn.Linear(64, 48)
    quantized = nn.Linear(64, 48)
    quantized.load_state_dict(reference.state_dict())
    fsdp_int8.quantize_(quantized, Int8TrainingConfig(int8_matmul=config, **fields))
    return quantized, reference


@pytest.mark.parametrize("output,grad_input,grad_weight", list(itertools.product([False, True], repeat=3))[1:])  # all off: refused
def test_each_enabled_matmul_runs_one_int8_gemm(output, grad_input, grad_weight):
    config = Int8MatmulConfig(output=output, grad_input=grad_input, grad_weight=grad_weight)
    layer, _ = _linear(config)
    x = torch.randn(3, 7, 64, requires_grad=True)
    with CountIntMM() as forward:
        y = layer(x)
    with CountIntMM() as backward:
        y.square().sum().backward()
    assert forward.calls == int(output)
    assert backward.calls == int(grad_input) + int(grad_weight)
    assert x.grad.shape == x.shape and layer.weight.grad.shape == layer.weight.shape


@pytest.mark.parametrize("config", [None, Int8MatmulConfig(output=False), Int8MatmulConfig(),
                                    Int8MatmulConfig(save_int8_input=True)], ids=["weight-only", "float output",
                                                                                 "int8 output", "int8 input saved"])
def test_outputs_are_no_views(config):
    """A layer's output is a tensor of its own, not a view: FSDP2 warns about a module output
    that is a view (an in-place op on it, ``out += y``, drops the pre-backward hook)."""
    layer, reference = _linear(config)
    x = torch.randn(3, 7, 64, requires_grad=True)
    out = layer(x)
    assert out._base is None and out.shape == reference(x).shape


def test_weight_only_mode_runs_no_int8_gemm():
    layer, _ = _linear(None)
    with CountIntMM() as counter:
        layer(torch.randn(5, 64, requires_grad=True)).sum().backward()
    assert counter.calls == 0


def test_int8_gathered_weights_give_weight_only_results_bit_for_bit(monkeypatch):
    """``int8_gathered_weights``: the weight reaches the matmul int8 and is dequantized
    there; outputs and gradients equal weight-only int8's, and the slow-int8-GEMM warning
    (there is no int8 GEMM) never fires. A matmul config without int8 GEMMs, and the
    constant that named one, are refused naming the option."""
    import warnings

    import fsdp_int8.config
    from fsdp_int8 import hardware

    with pytest.raises(ValueError, match=r"runs no matmul in int8.*Int8TrainingConfig\(int8_gathered_weights=True\)"):
        Int8MatmulConfig(output=False, grad_input=False, grad_weight=False)
    with pytest.raises(AttributeError, match=r"Int8TrainingConfig\(int8_gathered_weights=True\)"):
        fsdp_int8.config.INT8_GATHERED_WEIGHTS
    monkeypatch.setattr(hardware, "_WARNED", set())
    results = []
    for gathered in (False, True):
        layer, _ = _linear(None, int8_gathered_weights=gathered)
        assert layer.weight.int8_gathered_weights is gathered
        x = torch.randn(3, 7, 64, generator=torch.Generator().manual_seed(1), requires_grad=True)
        with warnings.catch_warnings(record=True) as caught, CountIntMM() as counter:
            warnings.simplefilter("always")
            y = layer(x)
            y.square().sum().backward()
        assert counter.calls == 0
        assert not [w for w in caught if "int8 matmuls" in str(w.message)]
        results.append((y.detach(), x.grad, layer.weight.grad, layer.bias.grad))
    for weight_only, no_gemm_result in zip(*results):
        assert torch.equal(weight_only, no_gemm_result)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_large_weight_is_dequantized_in_slices_for_grad_input_with_the_same_bits(monkeypatch, dtype):
    """grad_input's transient weight is rebuilt a slice of input features at a time, never
    more than the bound (or 64 columns) at once; each column of grad_x is still one GEMM
    over all output features, so the result equals the whole weight's bit for bit (GEMMs
    of 8 columns or fewer sum in another order on an AVX2 CPU: slices never are that narrow)."""
    from fsdp_int8._weight import transient

    layer = nn.Linear(200, 700, bias=False)  # an output head's shape, scaled down
    quantize_(layer, Int8TrainingConfig(min_features=1, skip_names=(), compile="off"))
    layer.to(dtype)
    x = torch.randn(33, 200, generator=torch.Generator().manual_seed(0)).to(dtype).requires_grad_()
    grad_y = torch.randn(33, 700, generator=torch.Generator().manual_seed(1)).to(dtype)
    layer(x).backward(grad_y)
    whole = x.grad.clone()
    widths = []
    dequantize = transient.absmax_dequantize

    def recording(rows, scale, **kwargs):
        widths.append(rows.shape[1])
        return dequantize(rows, scale, **kwargs)

    monkeypatch.setattr(transient, "absmax_dequantize", recording)
    # slices of at least 64 columns; a narrower remainder joins the last
    for bound, slices in ((700 * 100, [100, 100]), (700 * 64, [64, 64, 72]), (700 * 10, [64, 64, 72])):
        monkeypatch.setattr(transient, "TRANSIENT_WEIGHT_ELEMENTS", bound)
        widths.clear()
        x.grad = None
        layer(x).backward(grad_y)
        # the forward's whole weight, then grad_input's slices
        assert widths == [200] + slices, widths
        assert torch.equal(x.grad, whole), (bound, (x.grad - whole).abs().max())


def test_int32_product_is_exact():
    """Inputs that are exactly int8 x power-of-two scales quantize back to themselves, so the
    output must equal the int64 reference product with the same scaling, bit for bit."""
    torch.manual_seed(1)
    qx = torch.randint(-127, 128, (9, 64), dtype=torch.int8)
    qx[:, 0] = 127  # each row's absmax is 127 steps: its scale is recovered exactly
    sx = 2.0 ** torch.randint(-6, 2, (9,)).float()
    weight = Int8Weight.from_float(torch.randn(48, 64), int8_matmul=Int8MatmulConfig())
    y = F.linear(qx.float() * sx.unsqueeze(1), weight)
    exact = qx.long() @ weight.int_data.long().t()  # no overflow possible in int64
    assert exact.abs().max() < 2**24  # so its fp32 conversion is exact too
    assert torch.equal(y, exact.float() * sx.unsqueeze(1) * weight.scale.unsqueeze(0))


def test_numerics_differ_from_fp32_the_way_int8_should():
    """Quantizing activations per row adds an error of about one int8 step (1/127 of a
    row's absmax) per element: the output moves from the weight-only result by 0.1-2%
    relative, never zero (zero would mean int8 GEMMs silently did not run)."""
    layer, _ = _linear(Int8MatmulConfig(grad_weight=True))
    weight_only, _ = _linear(None)
    x = torch.randn(16, 64, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_()
    y, y_ref = layer(x), weight_only(x_ref)
    g = torch.randn_like(y)
    y.backward(g)
    y_ref.backward(g)

    def rel(a, b):
        return ((a - b).norm() / b.norm()).item()

    for name, err in (
        ("output", rel(y, y_ref)),
        ("grad_input", rel(x.grad, x_ref.grad)),
        ("grad_weight", rel(layer.weight.grad, weight_only.weight.grad)),
    ):
        assert 1e-3 < err < 2e-2, (name, err)


def test_grad_weight_sums_in_int32_chunks(monkeypatch):
    """Token chunks keep int32 sums from overflowing; each chunk is one more GEMM."""
    monkeypatch.setattr(int8_linear, "_MAX_TOKENS_PER_INT32_SUM", 8)
    layer, _ = _linear(Int8MatmulConfig(output=False, grad_input=False, grad_weight=True))
    whole, _ = _linear(None)
    x = torch.randn(20, 64)
    with CountIntMM() as counter:
        layer(x).sum().backward()
    assert counter.calls == 3  # ceil(20 / 8)
    whole(x).sum().backward()
    # each chunk has its own scales: close to the full-precision weight gradient, int8-close
    rel = (layer.weight.grad - whole.weight.grad).norm() / whole.weight.grad.norm()
    assert rel < 2e-2


def test_int8_matmul_mode_trains_like_weight_only():
    """A small MLP regression: int8 matmuls (the default: all three, and with int8 saved
    inputs) end within 10% of the weight-only run's loss (per-step errors of ~0.5% average
    out over the updates)."""
    def run(config):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 32))
        fsdp_int8.quantize_(model, Int8TrainingConfig(int8_matmul=config, seed=1, skip_names=()))
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
        data = torch.Generator().manual_seed(2)
        target = nn.Linear(32, 32)
        for _ in range(150):
            x = torch.randn(32, 32, generator=data)
            loss = F.mse_loss(model(x), target(x).detach())
            loss.backward()
            opt.step()
            opt.zero_grad()
        return loss.item()

    weight_only, int8_mm = run(None), run(Int8MatmulConfig())
    assert int8_mm < 1.1 * weight_only, (int8_mm, weight_only)
    saved_int8 = run(Int8MatmulConfig(save_int8_input=True))  # the weight gradient from int8 inputs
    assert saved_int8 < 1.1 * weight_only, (saved_int8, weight_only)


def test_compiled_quantization_matches_eager():
    x = torch.randn(37, 64) * torch.logspace(-3, 3, 37).unsqueeze(1)
    eager = int8_linear._quantize_activations(x)
    with compiled_kernels_ran():
        compiled = int8_linear._quantize_activations(x, compiled=True)
    assert torch.equal(eager[0], compiled[0])
    torch.testing.assert_close(eager[1], compiled[1], rtol=1e-6, atol=0)


def test_int8_gemms_meet_cuda_shape_rules_exactly(monkeypatch):
    """cuBLASLt's int8 GEMM needs > 16 rows and a reduced dim divisible by 8: simulate
    those rules on CPU and check every GEMM meets them with unchanged results (13 tokens:
    the weight gradient reduces over them)."""
    seen = []

    def strict_int_mm(a, b):
        seen.append((tuple(a.shape), tuple(b.shape)))
        assert a.shape[0] > 16 and a.shape[1] % 8 == 0 and b.shape[1] % 8 == 0, (a.shape, b.shape)
        return original(a, b)

    torch.manual_seed(0)
    layer = torch.nn.Linear(32, 24)
    quantize_(layer, Int8TrainingConfig(int8_matmul=Int8MatmulConfig(grad_weight=True)))
    x = torch.randn(13, 32, requires_grad=True)

    def run():
        layer.weight.grad = x.grad = None
        out = layer(x)
        out.square().sum().backward()
        return out.detach(), x.grad.clone(), layer.weight.grad.clone()

    expected = run()
    original = torch._int_mm
    monkeypatch.setattr(int8_linear, "_has_cuda_gemm_rules", lambda device: True)
    monkeypatch.setattr(torch, "_int_mm", strict_int_mm)
    got = run()
    assert len(seen) == 3
    for e, g in zip(expected, got):
        assert torch.equal(e, g)


def _bf16_layer(config: Int8MatmulConfig | None, compile: str = "off") -> nn.Linear:
    torch.manual_seed(0)
    layer = nn.Linear(64, 48).to(torch.bfloat16)
    fsdp_int8.quantize_(layer, Int8TrainingConfig(int8_matmul=config, compile=compile))
    return layer


def _forward_backward(layer: nn.Linear) -> tuple[torch.Tensor, ...]:
    x = torch.randn(3, 7, 64, generator=torch.Generator().manual_seed(1)).bfloat16().requires_grad_()
    y = layer(x)
    y.float().square().sum().backward()
    return y.detach(), x.grad, layer.weight.grad, layer.bias.grad


@pytest.mark.parametrize("matmuls", ["int8", "weight-only"])
def test_compiled_kernels_give_the_eager_results_bit_for_bit(matmuls):
    """Quantizing activations, dequantizing int32 results (with the bias) and the weight:
    one torch.compile-fused pass each, the same fp32 operations as eagerly."""
    config = Int8MatmulConfig(grad_weight=True) if matmuls == "int8" else None
    eager = _forward_backward(_bf16_layer(config))
    with compiled_kernels_ran(at_least=2):  # at least one pass per direction
        compiled = _forward_backward(_bf16_layer(config, compile="on"))
    for e, c in zip(eager, compiled):
        assert torch.equal(e, c)


def test_int8_gemms_read_the_weight_in_place():
    """No int8 copy of the weight per matmul: on CPU both GEMMs that use it (output and
    grad_input) get views of its own storage (FSDP2's gathered buffer when sharded),
    transposed or not; the third (grad_weight) multiplies two quantized activations."""
    layer = _bf16_layer(Int8MatmulConfig())
    storage = layer.weight.int_data.untyped_storage().data_ptr()
    seen = []

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is torch.ops.aten._int_mm.default:
                seen.append(args[1].untyped_storage().data_ptr())
            return func(*args, **(kwargs or {}))

    with Record():
        _forward_backward(layer)
    assert len(seen) == 3 and seen.count(storage) == 2


def test_default_config_runs_all_three_matmuls_in_int8():
    """The default, like torchao's int8 mixed-precision training: the weight gradient too."""
    config = Int8MatmulConfig()
    assert (config.output, config.grad_input, config.grad_weight) == (True, True, True)


@pytest.mark.parametrize("grad_weight", [True, False])
def test_compiled_passes_run_int8_gemms_and_no_float_gemm(grad_weight):
    """With the compiled kernels, each direction is one compiled call: the profiler (which
    sees the aten calls inductor's code makes) must count one int8 GEMM per enabled
    matmul, a float GEMM only for a matmul left in bf16, and the eager results."""
    from torch.profiler import ProfilerActivity, profile

    config = Int8MatmulConfig(grad_weight=grad_weight)
    eager = _forward_backward(_bf16_layer(config))
    layer = _bf16_layer(Int8MatmulConfig(grad_weight=grad_weight), compile="on")
    _forward_backward(layer)  # compile outside the profiled run
    layer.weight.grad = layer.bias.grad = None
    with compiled_kernels_ran(at_least=2), profile(activities=[ProfilerActivity.CPU]) as prof:
        compiled = _forward_backward(layer)
    counts = {e.key: e.count for e in prof.key_averages()}
    assert counts.get("aten::_int_mm", 0) == 2 + int(grad_weight)
    assert counts.get("aten::mm", 0) == int(not grad_weight)
    for e, c in zip(eager, compiled):
        assert torch.equal(e, c)


# ---------------------------------------------------------------- int8 saved inputs
SAVE_INT8 = Int8MatmulConfig(save_int8_input=True)


def test_saving_the_int8_input_changes_only_the_weight_gradient():
    layer, _ = _linear(SAVE_INT8)
    standard, _ = _linear(Int8MatmulConfig())
    weight_only, _ = _linear(None)
    x = torch.randn(4, 5, 64)
    outs, grads = [], []
    for model in (layer, standard, weight_only):
        xi = x.clone().requires_grad_()
        y = model(xi)
        y.backward(torch.ones_like(y) + y.detach())
        outs.append(y.detach())
        grads.append((xi.grad, model.weight.grad))
    # the same quantized input, GEMM and epilogue: the output and grad_input bit for bit
    assert torch.equal(outs[0], outs[1]) and torch.equal(grads[0][0], grads[1][0])
    # grad_weight reads x's forward rounding (per token) instead of a per-channel one: both
    # about one int8 step (~0.5%) from the float weight gradient
    reference = grads[2][1]
    for grad_w in (grads[0][1], grads[1][1]):
        assert (grad_w - reference).norm() / reference.norm() < 2e-2
    assert not torch.equal(grads[0][1], grads[1][1])


def test_grad_weight_of_saved_rows_sums_in_int32_chunks(monkeypatch):
    monkeypatch.setattr(int8_linear, "_MAX_TOKENS_PER_INT32_SUM", 8)
    layer, reference = _linear(SAVE_INT8)
    x = torch.randn(20, 64)
    with CountIntMM() as counter:
        layer(x).sum().backward()
    assert counter.calls == 1 + 3  # output, ceil(20 / 8) weight-gradient chunks (x needs no gradient)
    reference(x).sum().backward()
    assert (layer.weight.grad - reference.weight.grad).norm() / reference.weight.grad.norm() < 2e-2


def test_layers_reading_one_input_save_one_int8_copy_of_it():
    """q / k / v on one bf16 input: autograd keeps the input once, as int8 rows (1 byte a
    value) and per-token fp32 scales, instead of the bf16 input (2 bytes a value)."""
    def saved_input_bytes(config) -> int:
        torch.manual_seed(0)
        qkv = nn.ModuleList(nn.Linear(64, 64, bias=False) for _ in range(3))
        fsdp_int8.quantize_(qkv, Int8TrainingConfig(int8_matmul=config))
        x = torch.randn(8, 32, 64, dtype=torch.bfloat16, requires_grad=True).to(torch.bfloat16)
        x = x * 1  # a non-leaf activation, as inside a model
        storages: dict[int, int] = {}

        def pack(tensor):
            if not isinstance(tensor, nn.Parameter) and not isinstance(tensor, Int8Weight):
                storage = tensor.untyped_storage()
                storages[storage.data_ptr()] = storage.nbytes()
            return tensor

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            for layer in qkv:
                layer(x)
        return sum(storages.values())

    tokens = 8 * 32
    assert saved_input_bytes(Int8MatmulConfig()) == tokens * 64 * 2  # the bf16 input, once
    assert saved_input_bytes(SAVE_INT8) == tokens * 64 + tokens * 4  # int8 rows + fp32 scales, once


def test_saved_int8_input_needs_its_two_gemms_and_pickles():
    with pytest.raises(ValueError, match="output=True and grad_weight=True"):
        Int8MatmulConfig(grad_weight=False, save_int8_input=True)
    layer, _ = _linear(SAVE_INT8)
    import io
    buffer = io.BytesIO()
    torch.save(layer.weight, buffer)
    buffer.seek(0)
    assert torch.load(buffer, weights_only=True).int8_matmul == SAVE_INT8
