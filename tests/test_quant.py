"""Numerics of the row-wise int8 quantizer against analytic values."""

from __future__ import annotations

import contextlib
import math
import warnings

import pytest
import torch
import torch.nn as nn
from _quant import compiled_kernels_ran, dequantize_rowwise, quantize_rowwise

import fsdp_int8
from fsdp_int8._quant.generators import WEIGHT_ROUNDING, seed_for
from fsdp_int8._quant.kernels import INT8_MAX
from fsdp_int8._quant.noise import noise_from_bytes, rounding_noise, rounding_noise_bytes
from fsdp_int8.quant import absmax_dequantize, absmax_quantize

FP32_EPS = torch.finfo(torch.float32).eps  # 2**-23


# ------------------------------------------------------------------ exact values
def test_hand_made_2x4_exact_values_and_scales():
    # Row 0: absmax 1.27 -> scale 0.01; row 1: absmax 2.54 (a negative entry) -> scale 0.02.
    # Every x / scale sits at least 0.2 away from a .5 tie, so fp32 rounding of the
    # division cannot flip a result.
    x = torch.tensor([[1.27, -0.5, 0.254, 0.0], [-2.54, 1.0, 0.3, -0.016]])
    q, s = quantize_rowwise(x)
    assert q.dtype == torch.int8 and s.dtype == torch.float32
    assert q.shape == (2, 4) and s.shape == (2,)
    assert q.tolist() == [[127, -50, 25, 0], [-127, 50, 15, -1]]
    # scale is exactly amax / 127 computed in fp32 ...
    assert torch.equal(s, torch.tensor([1.27, 2.54]) / 127)
    # ... which is the analytic 0.01 / 0.02 up to fp32 rounding.
    torch.testing.assert_close(s, torch.tensor([0.01, 0.02]), rtol=2 * FP32_EPS, atol=0)
    assert INT8_MAX == 127


def test_dequantize_is_int_times_scale_in_requested_dtype():
    q = torch.tensor([[127, -3], [0, 5]], dtype=torch.int8)
    s = torch.tensor([0.5, 0.25])
    assert torch.equal(dequantize_rowwise(q, s), torch.tensor([[63.5, -1.5], [0.0, 1.25]]))
    out = dequantize_rowwise(q, s, torch.bfloat16)
    assert out.dtype == torch.bfloat16
    assert torch.equal(out, torch.tensor([[63.5, -1.5], [0.0, 1.25]], dtype=torch.bfloat16))


@pytest.mark.parametrize("dim, block_size", [(-1, None), (0, None), (-1, 512)])
def test_dequantizing_into_bf16_keeps_its_fp32_products_small(dim, block_size, monkeypatch):
    from torch.distributed._tools.mem_tracker import MemTracker

    import fsdp_int8.quant as quant

    q, scale = absmax_quantize(torch.randn(4096, 1024), dim=dim, block_size=block_size)

    def peak_and_values():
        tracker = MemTracker()
        with tracker:
            out = absmax_dequantize(q, scale, dim=dim, block_size=block_size, dtype=torch.bfloat16)
        return tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"], out

    blocked, values = peak_and_values()
    monkeypatch.setattr(quant, "_FP32_BLOCK_ELEMENTS", q.numel())  # the fp32 products made whole
    whole, expected = peak_and_values()
    # whole: the bf16 result and fp32 products of all of it, 3x the result's bytes (plus
    # torch's own temporaries); blocked: the result and an eighth of the products, 1.25x
    assert blocked <= 0.6 * whole
    assert torch.equal(values, expected)


def test_compiled_dequantization_under_a_dispatch_mode_keeps_its_fp32_products_small():
    from torch.distributed._tools.mem_tracker import MemTracker

    # torch.compile runs a function's Python body eagerly under a TorchDispatchMode (dynamo
    # skips the frame), where the compiled kernel's body would make the fp32 products of
    # the whole weight: the eager path, in blocks of rows, runs instead (same bits)
    q, scale = absmax_quantize(torch.randn(4096, 1024))

    def peak_and_values(compiled: bool):
        tracker = MemTracker()
        with tracker:
            out = absmax_dequantize(q, scale, dtype=torch.bfloat16, compiled=compiled)
        return tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"], out

    eager_peak, expected = peak_and_values(False)
    compiled_peak, values = peak_and_values(True)
    # whole products: the bf16 result and fp32 products of all of it, 3x the result's
    # bytes; the blocked path: 1.25x. The same ops, so the same peak to the byte.
    assert compiled_peak == eager_peak, (compiled_peak, eager_peak)
    assert torch.equal(values, expected)


def test_rejects_non_2d_and_integer_inputs():
    with pytest.raises(ValueError, match=r"2-D tensor, got shape \(8,\)"):
        quantize_rowwise(torch.ones(8))
    with pytest.raises(TypeError, match="floating tensor, got torch.int32"):
        quantize_rowwise(torch.ones(2, 2, dtype=torch.int32))


# ------------------------------------------------------------------ symmetric range
def _edge_rows(dtype: torch.dtype) -> torch.Tensor:
    """Rows whose absmax is exactly representable, positive or negative, huge or tiny."""
    info = torch.finfo(dtype)
    rows = [
        [127.0, -127.0, 1.0, -0.5],
        [-1.0, 0.5, 0.25, -0.125],  # negative absmax must map to -127, never -128
        [-2.0, -2.0, -2.0, -2.0],
        [0.5, -0.5, 0.5, -0.5],
        [info.max, -info.max, 1.0, 0.0],
        [-info.tiny, info.tiny / 2, 0.0, info.tiny],
        [-3.0, 2.9999, -2.9999, 3.0],
    ]
    return torch.tensor(rows, dtype=torch.float32).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("stochastic", [False, True])
def test_range_is_symmetric_for_every_input_dtype(dtype, stochastic):
    gen = torch.Generator().manual_seed(1)
    random = torch.randn(512, 64, generator=gen) * torch.logspace(-3, 3, 512)[:, None]
    for x in (_edge_rows(dtype), random.to(dtype)):
        q, s = quantize_rowwise(x, stochastic=stochastic)
        assert q.min() >= -127 and q.max() <= 127
        assert not (q == -128).any()
        assert torch.isfinite(s).all() and (s >= 0).all()
        # The absmax element of every non-zero row lands exactly on +-127.
        nonzero = x.float().abs().amax(1) > 0
        assert (q.abs().amax(1)[nonzero] == 127).all()
        # ... with the sign of that element.
        idx = x.float().abs().argmax(1, keepdim=True)
        signs = torch.sign(x.float().gather(1, idx)).squeeze(1)
        assert torch.equal(torch.sign(q.gather(1, idx).squeeze(1).float())[nonzero], signs[nonzero])


def test_negative_absmax_row_is_minus_127_not_minus_128():
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        x = torch.tensor([[-1.0, 0.25, 0.5, 0.125]], dtype=dtype)
        q, s = quantize_rowwise(x)
        assert q[0, 0].item() == -127
        assert s.item() == pytest.approx(1 / 127, rel=FP32_EPS)


# ------------------------------------------------------------------ zeros, NaN, Inf
def test_all_zero_row_has_zero_scale_and_dequantizes_to_zero():
    x = torch.tensor([[0.0, 0.0, 0.0], [1.0, -2.0, 0.5], [-0.0, 0.0, -0.0]])
    for stochastic in (False, True):
        q, s = quantize_rowwise(x, stochastic=stochastic)
        assert torch.isfinite(s).all()
        assert s[0].item() == 0.0 and s[2].item() == 0.0
        assert (q[0] == 0).all() and (q[2] == 0).all()
        deq = dequantize_rowwise(q, s)
        assert torch.isfinite(deq).all()
        assert (deq[0] == 0).all() and (deq[2] == 0).all()


@pytest.mark.parametrize("stochastic", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_nan_and_inf_raise_with_shape_and_count(stochastic, dtype):
    x = torch.randn(3, 5)
    x[0, 1] = float("nan")
    x[2, 4] = float("inf")
    x[2, 0] = float("-inf")
    with pytest.raises(ValueError, match=r"shape \(3, 5\).*holds 3 non-finite values"):
        quantize_rowwise(x.to(dtype), stochastic=stochastic)
    y = torch.zeros(2, 7)
    y[1, 3] = float("nan")
    with pytest.raises(ValueError, match=r"shape \(2, 7\).*holds 1 non-finite values"):
        quantize_rowwise(y.to(dtype), stochastic=stochastic)


# ------------------------------------------------------------------ round to nearest
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_round_to_nearest_error_is_at_most_half_a_step(dtype):
    gen = torch.Generator().manual_seed(2)
    x = (torch.randn(64, 96, generator=gen) * torch.logspace(-2, 2, 64)[:, None]).to(dtype)
    q, s = quantize_rowwise(x)
    err = (dequantize_rowwise(q, s) - x.float()).abs()
    # Exact arithmetic gives err <= scale/2. In fp32, x / scale and q * scale are each
    # rounded once (relative error <= eps/2 of values up to 127 * scale), so allow a few
    # eps of the row's absmax on top; this is ~1e-7 of the bound, far below any real bug.
    slack = 4 * FP32_EPS * 127 * s[:, None]
    assert (err <= s[:, None] / 2 + slack).all(), (err / s[:, None]).max()
    # And the bound is tight: some elements are close to half a step away.
    assert (err / s[:, None]).max() > 0.45


# ------------------------------------------------------------------ stochastic rounding
def _between_grid_points(gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """A 4x64 tensor whose rows have scales 1e-3, 0.05, 1 and 7; element 0 is the absmax
    (exactly 127 steps), the others sit at ``k + f`` steps with ``f`` in [0.05, 0.95]."""
    scales = torch.tensor([1e-3, 0.05, 1.0, 7.0])
    k = torch.randint(-120, 120, (4, 64), generator=gen).float()
    f = 0.05 + 0.9 * torch.rand(4, 64, generator=gen)
    steps = k + f
    steps[:, 0] = 127.0
    return steps * scales[:, None], scales


def test_stochastic_rounding_is_unbiased():
    WEIGHT_ROUNDING.manual_seed(1234, 0)
    x, _ = _between_grid_points(torch.Generator().manual_seed(3))
    n = 4000
    total = torch.zeros_like(x, dtype=torch.float64)
    for _ in range(n):
        q, s = quantize_rowwise(x, stochastic=True)
        total += dequantize_rowwise(q, s).double()
    mean = total / n
    s = quantize_rowwise(x)[1].double()[:, None]
    # One SR draw of an element at k + f steps is (k + Bernoulli(f)) * scale: variance
    # f (1 - f) scale^2 <= scale^2 / 4, so the mean of n draws has sigma <= scale / (2 sqrt n).
    # 5 sigma: a two-sided normal tail of 5.7e-7 per element, 1.5e-4 over all 256
    # elements (Bonferroni) -- the run is seeded, so this is a margin, not a flake rate.
    # RTN would miss by up to 0.45 scale here, ~57x this bound.
    sigma = s / (2 * math.sqrt(n))
    float_slack = 4 * FP32_EPS * 127 * s  # fp32 rounding of x / scale and q * scale
    bias = (mean - x.double()).abs()
    assert (bias <= 5 * sigma + float_slack).all(), (bias / sigma).max()
    # Sanity: the draws really spread over two grid points (not RTN in disguise).
    q_rtn, _ = quantize_rowwise(x)
    assert not torch.equal(quantize_rowwise(x, stochastic=True)[0], q_rtn)


def test_stochastic_rounding_rounds_up_with_probability_of_the_fraction():
    WEIGHT_ROUNDING.manual_seed(99, 0)
    scale = 0.01
    x = torch.full((1, 64), 10.3 * scale)
    x[0, 0] = 127 * scale  # absmax: scale is 0.01 up to fp32 rounding
    q_rtn, _ = quantize_rowwise(x)
    assert (q_rtn[0, 1:] == 10).all()  # round to nearest always goes down from 10.3
    n = 2000
    ups = 0
    for _ in range(n):
        q, _ = quantize_rowwise(x, stochastic=True)
        assert ((q[0, 1:] == 10) | (q[0, 1:] == 11)).all()  # only the two neighbours
        ups += int((q[0, 1:] == 11).sum())
    frac = ups / (63 * n)
    # Binomial(126000, 0.3): sigma = sqrt(0.21 / 126000) = 0.0013; 0.01 is ~7.7 sigma.
    assert abs(frac - 0.3) < 0.01, frac


# ------------------------------------------------------------------ SR generator
def _draw(x: torch.Tensor) -> torch.Tensor:
    return quantize_rowwise(x, stochastic=True)[0]


def test_sr_stream_reproducible_per_seed_and_rank():
    x = torch.randn(8, 64, generator=torch.Generator().manual_seed(4))
    WEIGHT_ROUNDING.manual_seed(7, 0)
    a1, a2 = _draw(x), _draw(x)
    WEIGHT_ROUNDING.manual_seed(7, 0)
    b1, b2 = _draw(x), _draw(x)
    assert torch.equal(a1, b1) and torch.equal(a2, b2)
    assert not torch.equal(a1, a2)  # the stream advances between draws
    WEIGHT_ROUNDING.manual_seed(7, 1)
    assert not torch.equal(_draw(x), a1)  # another shard rank draws other noise
    WEIGHT_ROUNDING.manual_seed(8, 0)
    assert not torch.equal(_draw(x), a1)  # another seed too
    assert seed_for(7, 0) != seed_for(7, 1) != seed_for(8, 0)


def test_a_stream_seeded_before_sharding_adopts_the_first_shard_coordinate_it_sees():
    """``quantize_`` seeds without a mesh; FSDP2's first all-gather names this rank's shard
    (``adopt_shard_coordinate``). Coordinate 0 keeps its stream; another one switches to
    the stream it would have had if seeded with the mesh; later calls, a seed with a
    known coordinate and a restored state are never overridden."""
    from types import SimpleNamespace

    x = torch.randn(8, 64, generator=torch.Generator().manual_seed(4))

    def draws_after(seed_coordinate, adopt=(), restore=None) -> torch.Tensor:
        WEIGHT_ROUNDING.manual_seed(7, seed_coordinate)
        if restore is not None:
            WEIGHT_ROUNDING.set_state(restore)
        for coordinate in adopt:  # a 1-D shard mesh on which this rank sits at `coordinate`
            WEIGHT_ROUNDING.adopt_shard_coordinate(SimpleNamespace(ndim=1, get_local_rank=lambda dim, c=coordinate: c))
        return _draw(x)

    shard0, shard1 = draws_after(0), draws_after(1)
    assert not torch.equal(shard0, shard1)
    assert torch.equal(draws_after(None, adopt=[0]), shard0)
    assert torch.equal(draws_after(None, adopt=[1]), shard1)
    assert torch.equal(draws_after(None, adopt=[1, 0]), shard1)  # the first one counts
    assert torch.equal(draws_after(0, adopt=[1]), shard0)  # seeded with a mesh: known
    WEIGHT_ROUNDING.manual_seed(7, 0)
    saved = WEIGHT_ROUNDING.get_state()
    assert torch.equal(draws_after(None, adopt=[1], restore=saved), shard0)


def test_sr_stream_is_independent_of_torch_global_rng():
    x = torch.randn(8, 64, generator=torch.Generator().manual_seed(4))
    WEIGHT_ROUNDING.manual_seed(3, 0)
    torch.manual_seed(100)
    a = _draw(x)
    WEIGHT_ROUNDING.manual_seed(3, 0)
    torch.manual_seed(200)
    assert torch.equal(_draw(x), a)
    # ... and SR draws do not consume the global stream (dropout etc. stay reproducible).
    before = torch.get_rng_state()
    _draw(x)
    assert torch.equal(torch.get_rng_state(), before)


def test_rounding_rng_state_roundtrip():
    x = torch.randn(8, 64, generator=torch.Generator().manual_seed(4))
    WEIGHT_ROUNDING.manual_seed(11, 0)
    _draw(x)  # make sure the cpu generator exists and has advanced
    state = WEIGHT_ROUNDING.get_state()
    assert "cpu" in state and state["cpu"].dtype == torch.uint8
    first, second = _draw(x), _draw(x)
    WEIGHT_ROUNDING.set_state(state)
    assert torch.equal(_draw(x), first)
    assert torch.equal(_draw(x), second)
    # The returned state is a copy: drawing did not change it, so restoring twice works.
    WEIGHT_ROUNDING.set_state(state)
    assert torch.equal(_draw(x), first)


# ---------------------------------------------------------------- the core's other layouts
def test_blocks_within_rows_have_their_own_scales_and_a_short_last_block():
    x = torch.arange(1.0, 11.0).view(1, 10)  # blocks of 4: [1..4], [5..8], [9, 10]
    q, scale = absmax_quantize(x, block_size=4)
    torch.testing.assert_close(scale, torch.tensor([[4.0, 8.0, 10.0]]) / INT8_MAX, rtol=0, atol=0)
    assert q[0, 3] == q[0, 7] == q[0, 9] == INT8_MAX  # each block's absmax maps to 127
    back = absmax_dequantize(q, scale, block_size=4)
    assert ((back - x).abs() <= scale.repeat_interleave(4, dim=1)[:, :10] / 2 + 1e-6).all()


def test_one_scale_per_column_equals_rows_of_the_transpose():
    x = torch.randn(37, 12) * torch.logspace(-2, 2, 12)
    q_cols, s_cols = absmax_quantize(x, dim=0)
    q_rows, s_rows = absmax_quantize(x.t().contiguous())
    assert torch.equal(q_cols, q_rows.t()) and torch.equal(s_cols, s_rows)
    assert torch.equal(absmax_dequantize(q_cols, s_cols, dim=0), absmax_dequantize(q_rows, s_rows).t())


def test_unsigned_uses_0_to_255():
    x = torch.rand(8, 64) * 3
    q, scale = absmax_quantize(x, signed=False)
    assert q.dtype == torch.uint8 and int(q.max()) == 255 and int(q.min()) >= 0
    torch.testing.assert_close(absmax_dequantize(q, scale), x, rtol=0, atol=float(scale.max()) / 2 + 1e-6)


def test_non_finite_policies():
    x = torch.randn(3, 8)
    x[1, 2] = float("nan")
    x[2, 5] = float("inf")
    with pytest.raises(ValueError, match="holds 2 non-finite"):
        absmax_quantize(x)
    q, scale = absmax_quantize(x, nonfinite="propagate")
    assert torch.isfinite(scale[0]) and not torch.isfinite(scale[1:]).any()  # carried by the scale
    assert int(q.abs().max()) <= INT8_MAX  # values stay defined
    assert not torch.isfinite(absmax_dequantize(q, scale)[1:]).any()
    absmax_quantize(x, nonfinite="unchecked")  # no check, no device sync


def test_out_receives_the_values_in_place_even_strided():
    x = torch.randn(4, 6)
    buffer = torch.zeros(4, 10, dtype=torch.int8)
    q, _ = absmax_quantize(x, out=buffer[:, :6])
    assert q.data_ptr() == buffer.data_ptr() and torch.equal(buffer[:, :6], absmax_quantize(x)[0])
    assert not buffer[:, 6:].any()


# ------------------------------------------------------------------ compiled kernels
def test_compiled_kernels_match_eager_bit_for_bit():
    """The fused kernels run the eager arithmetic in the same order: the same values,
    scales and stochastic draws (from the same generator state)."""
    x = torch.randn(37, 64, generator=torch.Generator().manual_seed(5)) * torch.logspace(-3, 3, 37)[:, None]
    x[4] = 0.0
    results = {}
    for compiled in (False, True):
        WEIGHT_ROUNDING.manual_seed(21, 0)
        with compiled_kernels_ran(at_least=3) if compiled else contextlib.nullcontext():
            nearest = quantize_rowwise(x, compiled=compiled)
            stochastic = quantize_rowwise(x, stochastic=True, compiled=compiled)
            results[compiled] = (*nearest, *stochastic, dequantize_rowwise(*stochastic, torch.bfloat16, compiled))
    for eager, fused in zip(results[False], results[True]):
        assert torch.equal(eager, fused)


def test_dequantize_rows_into_writes_absmax_dequantize_values_in_place():
    """FSDP2's weight-only unshard: strided int8 rows (a view of the gathered buffer)
    written into an existing tensor, eagerly and compiled, equal ``absmax_dequantize``'s
    values (fp32 products rounded once) bit for bit, without replacing the tensor."""
    gathered = torch.randint(-127, 128, (40, 36), dtype=torch.int8, generator=torch.Generator().manual_seed(3))
    q = gathered[:37, :32]  # padding rows and scale bytes cut off: strided
    scale = torch.logspace(-4, 1, 37)
    for compiled in (False, True):
        # compiled: one kernel call per dtype, checked against the eager absmax_dequantize
        with compiled_kernels_ran(at_least=2) if compiled else contextlib.nullcontext():
            for dtype in (torch.bfloat16, torch.float32):
                out = torch.nn.Parameter(torch.full((37, 32), float("nan"), dtype=dtype))
                pointer = out.data_ptr()
                fsdp_int8.quant.dequantize_rows_into(q, scale, out, compiled=compiled)
                assert out.data_ptr() == pointer and out.requires_grad
                expected = fsdp_int8.quant.absmax_dequantize(q.contiguous(), scale, dtype=dtype)
                assert torch.equal(out.detach(), expected), (compiled, dtype)
    with pytest.raises(ValueError, match="one scale per row"):
        fsdp_int8.quant.dequantize_rows_into(q, scale[:5], torch.empty(37, 32))


@pytest.mark.parametrize("asked", ["explicitly", "auto"])
def test_a_failing_compile_falls_back_to_eager_once(monkeypatch, caplog, asked):
    """``compile="on"`` (a model quantized with it sets ``warn_on_failure``): the failure
    warns once. ``compile="auto"`` chose the kernels: eager is a fine outcome, logged
    with no warning."""
    from fsdp_int8._quant import kernels as _kernels

    def broken(function):
        def run(*args):
            raise RuntimeError("no C++ compiler")
        return run

    x = torch.randn(8, 16)
    expected = quantize_rowwise(x, compiled=True)
    monkeypatch.setattr(_kernels, "_compile_failed", False)  # restored after the test
    monkeypatch.setattr(_kernels, "_warn_on_failure", False)
    if asked == "explicitly":
        fsdp_int8.quantize_(nn.Sequential(nn.Linear(16, 16)), fsdp_int8.Int8TrainingConfig(compile="on"))
    monkeypatch.setattr(_kernels, "compiled", broken)
    if asked == "explicitly":
        with pytest.warns(RuntimeWarning, match="no C.. compiler"):
            got = quantize_rowwise(x, compiled=True)
    else:
        with warnings.catch_warnings(), caplog.at_level("INFO", logger=_kernels.__name__):
            warnings.simplefilter("error")
            got = quantize_rowwise(x, compiled=True)
        assert "no C++ compiler" in caplog.text
    assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])
    assert _kernels.compile_failed()
    # every later call that asks for a compiled kernel (any weight with compiled=True)
    # runs eagerly, without trying (and warning) again
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert not _kernels.use_compiled(True, x)
        assert torch.equal(quantize_rowwise(x, compiled=True)[0], expected[0])
        assert torch.equal(_kernels.run_compiled(_kernels.int8_rows_nearest, x)[0], expected[0])


def test_noise_is_16_bits_four_to_a_draw():
    """One 64-bit draw of the generator gives four 16-bit noise values (a quarter of the
    draws of an fp32 uniform per element); their low and high bytes are uniform (a byte
    that never changed would leave rounding biased)."""
    gen, reference = torch.Generator().manual_seed(3), torch.Generator().manual_seed(3)
    rounding_noise((3, 4), gen, torch.device("cpu"))
    torch.empty(3, dtype=torch.int64).random_(-(2**63), None, generator=reference)
    assert torch.equal(gen.get_state(), reference.get_state())
    noise = rounding_noise((256, 1000), gen, torch.device("cpu"))
    assert noise.dtype == torch.int16 and noise.shape == (256, 1000)
    values = noise.int() + 32768  # 0..65535
    for byte in (values & 255, values >> 8):
        counts = torch.bincount(byte.flatten(), minlength=256).double()
        # 256000 draws over 256 bins: 1000 expected each, sigma ~31.6
        assert ((counts - 1000).abs() < 6 * 31.7).all()


@pytest.mark.parametrize("stochastic", [True, False])
def test_adamw_update_fused_when_compiled_gives_the_eager_bits(stochastic, monkeypatch):
    """torch AdamW's last op, ``param.addcdiv_``, is one compiled pass (dequantize, update,
    requantize) with the compiled kernels on: the same int8 values and scales as the
    general eager path after several steps (same generator state, same noise)."""
    from fsdp_int8 import Int8Weight
    from fsdp_int8._weight.ops import updates

    fused_calls = []
    original = updates._fused_addcdiv_
    monkeypatch.setattr(updates, "_fused_addcdiv_", lambda *a, **k: fused_calls.append(1) or original(*a, **k))

    def train(compiled: bool) -> tuple[torch.Tensor, torch.Tensor]:
        weight = torch.nn.Parameter(Int8Weight.from_float(
            torch.randn(24, 80, generator=torch.Generator().manual_seed(0)), stochastic_rounding=stochastic,
            compiled=compiled))
        WEIGHT_ROUNDING.manual_seed(3, 0)
        optimizer = torch.optim.AdamW([weight], lr=1e-2, weight_decay=0.1)
        grads = torch.Generator().manual_seed(1)
        for _ in range(4):
            weight.grad = torch.randn(24, 80, generator=grads)
            optimizer.step()
        return weight.int_data.clone(), weight.scale.clone()

    eager = train(False)
    assert not fused_calls
    with compiled_kernels_ran(at_least=4):
        compiled = train(True)
    assert len(fused_calls) == 4
    assert torch.equal(eager[0], compiled[0]) and torch.equal(eager[1], compiled[1])


def test_fused_update_refuses_a_non_finite_result():
    from fsdp_int8 import Int8Weight

    weight = Int8Weight.from_float(torch.randn(4, 16), compiled=True)
    before = weight.int_data.clone()
    with pytest.raises(ValueError, match="non-finite"):
        weight.addcdiv_(torch.ones(4, 16), torch.zeros(4, 16))  # 1 / 0: Inf
    assert torch.equal(weight.int_data, before)


@pytest.mark.parametrize("shape", [(5, 7), (2, 3, 6)])
def test_eager_noise_is_the_compiled_kernels_decoding_of_the_same_bytes(shape):
    """The eager path's int16 noise and the compiled kernels' decoding of the raw bytes
    (high bytes, then low bytes, per row) give every element the same value, from the
    same generator state: what keeps the two paths bit-identical."""
    eager = rounding_noise(shape, torch.Generator().manual_seed(5), torch.device("cpu"))
    raw = rounding_noise_bytes(shape, torch.Generator().manual_seed(5), torch.device("cpu"))
    assert eager.dtype == torch.int16 and eager.shape == shape and raw.shape == (*shape[:-1], 2 * shape[-1])
    assert torch.equal(eager.int(), noise_from_bytes(raw))
    # the low byte of element j is byte K + j of its row, the high byte is byte j
    high, low = raw[..., : shape[-1]].int(), raw[..., shape[-1]:].int() & 255
    assert torch.equal(eager.int(), high * 256 + low)
