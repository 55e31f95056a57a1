"""``fsdp_int8.weight.int8_grouped_mm``: the grouped int8 GEMMs of experts.

The reference is the library's int8 linear layer run on each expert's rows alone
(``_weight.linear``'s per-layer GEMMs, themselves tested against fp32 matmuls): the grouped
op quantizes each operand once for all experts on the device, which must give the same
values bit for bit (rows are independent; per-channel scales are per expert either way).
Both implementations are checked: the CPU's loop over experts and the Triton kernels a GPU
runs, here in Triton's interpreter (``TRITON_INTERPRET=1``), which must also read no
offsets on the host.
"""

from __future__ import annotations

import pytest
import torch

from fsdp_int8 import Int8MatmulConfig, Int8Weight
from fsdp_int8._quant import grouped_gemm
from fsdp_int8._weight.linear import _int8_grad_weight_of_rows, _quantize_activations, grads_of, output_of
from fsdp_int8.testing import count_host_syncs
from fsdp_int8.weight import int8_grouped_mm

pytest.importorskip("triton")

EXPERTS, OUT, IN = 5, 48, 40
TOKENS_PER_EXPERT = [10, 0, 33, 7, 15]  # an expert without tokens, and 5 rows past the last offset


def _experts(dtype: torch.dtype, config: Int8MatmulConfig | None = None) -> Int8Weight:
    values = torch.randn(EXPERTS, OUT, IN, generator=torch.Generator().manual_seed(0))
    return Int8Weight.from_float(values, int8_matmul=config or Int8MatmulConfig(), dtype=dtype).requires_grad_()


def _offs() -> torch.Tensor:
    return torch.tensor(TOKENS_PER_EXPERT).cumsum(0).to(torch.int32)


def _run(weight: Int8Weight, dtype: torch.dtype):
    generator = torch.Generator().manual_seed(1)
    rows = sum(TOKENS_PER_EXPERT) + 5
    x = torch.randn(rows, IN, generator=generator).to(dtype).requires_grad_()
    grad = torch.randn(rows, OUT, generator=generator).to(dtype)
    weight.grad = None
    out = int8_grouped_mm(x, weight, _offs())
    out.backward(grad)
    return x, grad, out.detach(), x.grad, weight.grad


def _per_expert(weight: Int8Weight, x: torch.Tensor, grad: torch.Tensor):
    """Each expert's rows through the int8 linear layer's GEMMs, alone."""
    x = x.detach()
    out, grad_x = torch.zeros(x.shape[0], OUT, dtype=x.dtype), torch.zeros_like(x)
    grad_w = torch.zeros(EXPERTS, OUT, IN, dtype=x.dtype)
    start = 0
    for expert, count in enumerate(TOKENS_PER_EXPERT):
        rows = slice(start, start + count)
        start += count
        if not count:
            continue
        out[rows] = output_of(x[rows], weight[expert], None)
        grad_x[rows], grad_w[expert] = grads_of(grad[rows], x[rows], weight[expert], need_input=True)
        if weight.int8_matmul.save_int8_input:
            grad_w[expert] = _int8_grad_weight_of_rows(grad[rows], *_quantize_activations(x[rows]), False)
    return out, grad_x, grad_w


@pytest.fixture(params=["loop", "triton", "triton, 16-wide tiles"])
def implementation(request, monkeypatch):
    if request.param.startswith("triton"):
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    else:
        monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    if request.param.endswith("tiles"):  # several tiles per dim and sum steps, as a GPU's 32-wide ones
        monkeypatch.setattr(grouped_gemm, "_tile", lambda device: 16)
    assert grouped_gemm.on_device(torch.device("cpu")) == request.param.startswith("triton")
    return request.param


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("save_int8_input", [False, True])
def test_every_pass_equals_each_experts_int8_linear_bit_for_bit(implementation, dtype, save_int8_input):
    weight = _experts(dtype, Int8MatmulConfig(save_int8_input=save_int8_input))
    x, grad, out, grad_x, grad_w = _run(weight, dtype)
    want_out, want_grad_x, want_grad_w = _per_expert(weight, x, grad)
    assert torch.equal(out, want_out)
    assert torch.equal(grad_x, want_grad_x)
    assert torch.equal(grad_w, want_grad_w)
    past_the_end = slice(sum(TOKENS_PER_EXPERT), None)
    assert not out[past_the_end].any() and not grad_x[past_the_end].any()
    assert not grad_w[1].any()  # the expert without tokens


def test_the_kernels_read_no_offsets_on_the_host_and_the_loop_reads_one_per_pass(monkeypatch):
    weight = _experts(torch.float32)
    reads = {}
    for implementation in ("triton", "loop"):
        if implementation == "triton":
            monkeypatch.setenv("TRITON_INTERPRET", "1")
        else:
            monkeypatch.delenv("TRITON_INTERPRET")
        with count_host_syncs() as counted:
            _run(weight, torch.float32)
        reads[implementation] = counted.count
    # forward, input gradient, weight gradient: one read of the offsets each on the host
    assert reads == {"triton": 0, "loop": 3}, reads


def test_long_sums_split_into_int32_safe_chunks_the_same_way_in_both(monkeypatch):
    # a chunk of 8 rows stands in for 2**17: both implementations sum each expert's rows
    # in int32 parts scaled into fp32, and agree bit for bit; the result is the float64
    # product of the quantized operands up to fp32 roundings of the parts and their sum:
    # each within 2**-24 of a magnitude at most sum(|a| |b|) scaled, 5 parts at most, so
    # 1e-6 of that bound
    monkeypatch.setattr(grouped_gemm, "MAX_ROWS_PER_INT32_SUM", 8)
    generator = torch.Generator().manual_seed(2)
    rows = sum(TOKENS_PER_EXPERT)
    a = torch.randint(-127, 128, (rows, OUT), generator=generator, dtype=torch.int8)
    b = torch.randint(-127, 128, (rows, IN), generator=generator, dtype=torch.int8)
    scale_a, scale_b = torch.rand(EXPERTS, OUT, generator=generator), torch.rand(EXPERTS, IN, generator=generator)
    results = {}
    for implementation in ("loop", "triton"):
        monkeypatch.setenv("TRITON_INTERPRET", "1" if implementation == "triton" else "0")
        results[implementation] = grouped_gemm.grouped_sums(a, b, _offs(), scale_a, scale_b, torch.float32)
    assert torch.equal(results["loop"], results["triton"])
    ends = _offs().tolist()
    for expert, (start, end) in enumerate(zip([0, *ends[:-1]], ends)):
        scales = scale_a[expert, :, None].double() * scale_b[expert].double()
        exact = a[start:end].double().t() @ b[start:end].double() * scales
        bound = a[start:end].double().abs().t() @ b[start:end].double().abs() * scales
        assert ((results["loop"][expert].double() - exact).abs() <= 1e-6 * bound).all(), expert


@pytest.mark.parametrize("config", [Int8MatmulConfig(grad_weight=False), Int8MatmulConfig(output=False),
                                    Int8MatmulConfig(grad_input=False, grad_weight=False)],
                         ids=["grad_weight", "output", "grads"])
def test_passes_left_in_the_compute_dtype_match_each_experts_linear(config):
    # the int8 passes bit for bit; the dense ones are torch._grouped_mm against per-expert
    # torch.matmul of the same values: fp32 sums in another order (1e-5 relative)
    weight = _experts(torch.float32, config)
    x, grad, *got = _run(weight, torch.float32)
    for name, value, want in zip(("out", "grad_x", "grad_w"), got, _per_expert(weight, x, grad)):
        dense = {"out": not config.output, "grad_x": not config.grad_input, "grad_w": not config.grad_weight}[name]
        if dense:
            torch.testing.assert_close(value, want, rtol=1e-5, atol=1e-5, msg=name)
        else:
            assert torch.equal(value, want), name


def test_bad_offsets_and_shapes_are_refused():
    x = torch.randn(4, IN)
    with pytest.raises(ValueError, match=r"offs must be \[5\] int32"):
        int8_grouped_mm(x, _experts(torch.float32), _offs().long())
    with pytest.raises(ValueError, match=r"cannot multiply experts of shape \(5, 48, 40\)"):
        int8_grouped_mm(torch.randn(4, IN + 1), _experts(torch.float32), _offs())
    with pytest.raises(ValueError, match=r"takes expert weights \[E, out, in\]"):
        int8_grouped_mm(x, torch.randn(OUT, IN), _offs())


def _rows_of_each_expert(values: torch.Tensor, x: torch.Tensor, grad: torch.Tensor):
    """``torch._grouped_mm``'s function computed per expert with ``F.linear`` in fp32:
    outputs, input and weight gradients; rows past the last offset zero."""
    out, grad_x, grad_w = torch.zeros(x.shape[0], OUT), torch.zeros_like(x), torch.zeros_like(values)
    start = 0
    for expert, count in enumerate(TOKENS_PER_EXPERT):
        rows = slice(start, start + count)
        start += count
        out[rows] = x[rows] @ values[expert].T
        grad_x[rows] = grad[rows] @ values[expert]
        grad_w[expert] = grad[rows].T @ x[rows]
    return out, grad_x, grad_w


@pytest.mark.parametrize("kind", ["weight-only Int8Weight", "plain tensor"])
def test_weight_only_and_plain_experts_compute_on_their_values(kind):
    """Weight-only int8 experts (every pass on the values) and plain ones (what FSDP2
    all-gathers for weight-only int8) give the same bits, and ``torch._grouped_mm``'s
    function: against a loop over experts in fp32, within fp32 reassociation (1e-5
    relative; the sums are 40 and at most 33 terms long)."""
    int8 = _experts(torch.float32)
    weight = (Int8Weight(int8.int_data, int8.scale, int8.meta.replace(int8_matmul=None), dtype=torch.float32)
              .requires_grad_())
    plain = int8.dequantize().detach().requires_grad_()
    got = _run(weight if kind.startswith("weight-only") else plain, torch.float32)
    x, grad = got[0].detach(), got[1]
    other = _run(plain if kind.startswith("weight-only") else weight, torch.float32)
    assert all(torch.equal(a, b) for a, b in zip(got[2:], other[2:]))  # the same kernels on the same values
    expected = _rows_of_each_expert(int8.dequantize(), x, grad)
    for value, reference in zip(got[2:], expected):
        torch.testing.assert_close(value, reference, rtol=1e-5, atol=1e-5)


def test_plain_experts_of_any_width_run_torch_grouped_mm():
    """torch's CPU kernel needs 16-byte strides: a plain weight of 6 input features (24
    bytes a row) runs all the same, padded with zeros."""
    values = torch.randn(2, 5, 6, requires_grad=True)
    x = torch.randn(7, 6, requires_grad=True)
    offs = torch.tensor([3, 7], dtype=torch.int32)
    out = int8_grouped_mm(x, values, offs)
    torch.testing.assert_close(out, torch.cat([x[:3] @ values[0].detach().T, x[3:] @ values[1].detach().T]))
    out.pow(2).sum().backward()
    assert values.grad.shape == (2, 5, 6) and x.grad.shape == (7, 6)
