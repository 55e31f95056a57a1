"""The quantized reduce-scatter's arithmetic, in one process (no process group needed).

The all-to-all is simulated by transposing the ranks' send buffers: row ``j`` of rank
``i``'s buffer is what rank ``j`` receives from rank ``i``.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist

from fsdp_int8.gradients import QuantizedReduceScatter, enable_quantized_reduce_scatter
from fsdp_int8.gradients._reduce_op import op_multiplier
from fsdp_int8.gradients._wire import pack_segments, segment_bytes, unpack_and_sum
from fsdp_int8.quant import absmax_dequantize, absmax_quantize


def _simulated_reduce_scatter(
    inputs: torch.Tensor, block_size: int, generators: list[torch.Generator]
) -> torch.Tensor:
    """``inputs[i]`` is rank i's flat ``[world * S]`` buffer; returns ``[world, S]`` sums."""
    world = inputs.shape[0]
    numel = inputs.shape[1] // world
    sends = [
        pack_segments(inputs[i].view(world, numel), i, block_size, generator=generators[i])
        for i in range(world)
    ]
    outputs = []
    for j in range(world):
        received = torch.stack([sends[i][j] for i in range(world)])
        outputs.append(unpack_and_sum(received, inputs[j].view(world, numel)[j], j, block_size))
    return torch.stack(outputs)


def _block_scales(values: torch.Tensor, block_size: int) -> torch.Tensor:
    """Reference scales: pad each row to whole blocks with zeros (they never win an absmax)."""
    rows, numel = values.shape
    padded = torch.nn.functional.pad(values.float(), (0, -numel % block_size))
    return padded.view(rows, -1, block_size).abs().amax(dim=2) / 127


# ---------------------------------------------------------------- block quantize / dequantize
@pytest.mark.parametrize("numel", [512, 600, 5, 256, 257])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_round_to_nearest_roundtrip(numel: int, dtype: torch.dtype) -> None:
    block = 256
    values = (torch.randn(3, numel) * torch.logspace(-3, 2, numel)).to(dtype)
    q, scales = absmax_quantize(values, block_size=block, nonfinite="propagate")
    assert q.dtype == torch.int8 and q.shape == values.shape
    assert scales.dtype == torch.float32 and scales.shape == (3, math.ceil(numel / block))
    torch.testing.assert_close(scales, _block_scales(values, block), rtol=0, atol=0)
    assert int(q.abs().max()) == 127 and int(q.min()) >= -127  # symmetric: never -128
    restored = absmax_dequantize(q, scales, block_size=block)
    step = scales.repeat_interleave(block, dim=1)[:, :numel]
    # round to nearest: at most half a step, plus the fp32 rounding of the division
    assert ((restored - values.float()).abs() <= step * (0.5 + 1e-5)).all()


def test_partial_last_block_has_its_own_scale() -> None:
    """600 = 2 full blocks of 256 + 88: the tail's scale is the absmax of those 88 only."""
    values = torch.randn(2, 600)
    values[:, :512] *= 1000.0  # the full blocks are much larger than the tail
    q, scales = absmax_quantize(values, block_size=256, nonfinite="propagate")
    assert scales.shape == (2, 3)
    torch.testing.assert_close(scales[:, 2], values[:, 512:].abs().amax(dim=1) / 127, rtol=0, atol=0)
    assert (q[:, 512:].abs().amax(dim=1) == 127).all()  # the tail uses its full int8 range
    restored = absmax_dequantize(q, scales, block_size=256)
    assert ((restored[:, 512:] - values[:, 512:]).abs() <= scales[:, 2:] * 0.5001).all()
    # a block size larger than the slice: one partial block
    q, scales = absmax_quantize(values[:, :7], block_size=256, nonfinite="propagate")
    assert scales.shape == (2, 1) and (q.abs().amax(dim=1) == 127).all()


def test_all_zero_blocks() -> None:
    values = torch.zeros(2, 700)
    values[0, 300:400] = torch.randn(100)  # block 1 of row 0 only (columns 256..511)
    for stochastic in (False, True):
        q, scales = absmax_quantize(
            values, block_size=256, rounding="stochastic" if stochastic else "nearest", nonfinite="propagate"
        )
        assert scales[0, 1] > 0
        assert (scales[0, [0, 2]] == 0).all() and (scales[1] == 0).all()
        assert (q[0, :256] == 0).all() and (q[0, 512:] == 0).all() and (q[1] == 0).all()
        restored = absmax_dequantize(q, scales, block_size=256)
        assert torch.isfinite(restored).all()
        assert (restored[values == 0][: 300] == 0).all() and (restored[1] == 0).all()
    # a whole simulated reduce-scatter of zeros is exactly zero
    gens = [torch.Generator().manual_seed(i) for i in range(3)]
    out = _simulated_reduce_scatter(torch.zeros(3, 3 * 100), 64, gens)
    assert (out == 0).all()


def test_stochastic_rounding_picks_a_neighbour() -> None:
    values = torch.randn(4, 1000)
    q, scales = absmax_quantize(
        values, block_size=128, rounding="stochastic", generator=torch.Generator().manual_seed(0),
        nonfinite="propagate",
    )
    scaled = values / scales.repeat_interleave(128, dim=1)[:, :1000]
    # floor or floor + 1 of x / scale (one ulp of slack for the division)
    assert ((q.float() - scaled) > -1 - 1e-5).all() and ((q.float() - scaled) < 1 + 1e-5).all()
    assert int(q.abs().max()) <= 127


def test_non_finite_values_arrive_non_finite() -> None:
    """A NaN or Inf poisons its block (never raises: a raising rank would hang the others)."""
    values = torch.randn(1, 512)
    values[0, 10] = float("inf")
    values[0, 300] = float("nan")
    q, scales = absmax_quantize(values, block_size=256, rounding="stochastic", nonfinite="propagate")
    assert int(q.abs().max()) <= 127 and int(q.min()) >= -127
    restored = absmax_dequantize(q, scales, block_size=256)
    assert not torch.isfinite(restored[0, 0]) and not torch.isfinite(restored[0, 256])
    assert (~torch.isfinite(restored)).sum() >= 2


def test_errors() -> None:
    with pytest.raises(ValueError, match="block_size must be >= 1"):
        absmax_quantize(torch.ones(1, 4), block_size=0)
    with pytest.raises(TypeError, match="block_size must be an int"):
        QuantizedReduceScatter(2.5)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="2-D"):
        absmax_quantize(torch.ones(4), block_size=2)
    with pytest.raises(TypeError, match="floating"):
        absmax_quantize(torch.ones(1, 4, dtype=torch.int32), block_size=2)
    with pytest.raises(ValueError, match="need scales of shape"):
        absmax_dequantize(torch.zeros(1, 10, dtype=torch.int8), torch.zeros(1, 1), block_size=4)
    with pytest.raises(ValueError, match="async_op=False"):
        QuantizedReduceScatter()(torch.empty(2), torch.empty(4), None, dist.ReduceOp.SUM, async_op=True)
    with pytest.raises(ValueError, match="holds no FSDP module"):
        enable_quantized_reduce_scatter(torch.nn.Linear(2, 2))


# ---------------------------------------------------------------- wire format and ops
def test_segment_bytes() -> None:
    assert segment_bytes(512, 256) == 512 + 8
    assert segment_bytes(600, 256) == 600 + 12  # the partial block costs one scale, no padding
    assert segment_bytes(1, 256) == 5
    assert segment_bytes(0, 256) == 0


def test_op_multiplier() -> None:
    assert op_multiplier(dist.ReduceOp.SUM, 4) is None
    assert op_multiplier(dist.ReduceOp.AVG, 4) == 0.25
    assert op_multiplier(dist.ReduceOp.AVG, 1) is None
    assert op_multiplier(dist.ReduceOp.PREMUL_SUM(0.125), 4) == 0.125
    assert float(op_multiplier(dist.ReduceOp.PREMUL_SUM(torch.tensor(0.5)), 4)) == 0.5
    with pytest.raises(ValueError, match="SUM, AVG and PREMUL_SUM"):
        op_multiplier(dist.ReduceOp.MAX, 4)
    with pytest.raises(ValueError, match="needs its factor"):
        op_multiplier(dist.ReduceOp.PREMUL_SUM, 4)


@pytest.mark.parametrize("world,numel,block", [(2, 600, 256), (4, 37, 8), (3, 256, 256), (4, 1, 256)])
def test_simulated_reduce_scatter_is_within_one_step_per_peer(world: int, numel: int, block: int) -> None:
    """Hard bound: stochastic rounding moves each value by less than one step of its block,
    so rank j's sum is off by less than the sum of the peers' steps; its own slice is exact."""
    inputs = torch.randn(world, world * numel) * torch.rand(world, 1) * 10
    gens = [torch.Generator().manual_seed(100 + i) for i in range(world)]
    out = _simulated_reduce_scatter(inputs, block, gens)
    slices = inputs.view(world, world, numel)  # [sender, receiver, S]
    exact = slices.double().sum(dim=0)
    steps = torch.stack([
        _block_scales(slices[:, j], block).repeat_interleave(block, dim=1)[:, :numel] for j in range(world)
    ], dim=1)  # [sender, receiver, S]
    own = torch.eye(world, dtype=torch.bool).unsqueeze(2)
    bound = steps.masked_fill(own, 0).sum(dim=0).double()
    slack = 1e-6 * slices.abs().sum(dim=0).double()  # fp32 summation
    assert ((out.double() - exact).abs() <= bound + slack).all()
    if numel > 1:  # (a one-value block is its own absmax: exact)
        assert ((out.double() - exact).abs() > slack).any()  # it did quantize


def test_own_slice_is_exact_with_one_rank() -> None:
    inputs = torch.randn(1, 300)
    out = _simulated_reduce_scatter(inputs, 256, [torch.Generator().manual_seed(0)])
    assert torch.equal(out, inputs)


def test_same_seed_same_bytes() -> None:
    slices = torch.randn(4, 300)
    a = pack_segments(slices, 1, 64, generator=torch.Generator().manual_seed(7))
    b = pack_segments(slices, 1, 64, generator=torch.Generator().manual_seed(7))
    c = pack_segments(slices, 1, 64, generator=torch.Generator().manual_seed(8))
    assert torch.equal(a, b) and not torch.equal(a, c)
    assert (a[1] == 0).all()  # the sender's own slot carries nothing


# ---------------------------------------------------------------- unbiasedness
def test_stochastic_rounding_reduction_is_unbiased() -> None:
    """Mean over T reductions of fixed inputs converges to the exact fp32 sum.

    Bound: one peer's rounding error on a value is s * (q - x/s) with q one of the two
    neighbours of x/s, a Bernoulli of variance s^2 p (1 - p) <= s^2 / 4. Peers draw
    independent noise, so the sum's variance is <= sum_i s_i^2 / 4, and the mean of T
    independent reductions has std sigma <= sqrt(sum_i s_i^2 / (4 T)). With T = 2000 the
    mean is a sum of 2000 bounded terms, close to normal; each of the 3 * 600 checked
    values then exceeds 6 sigma with probability ~2e-9 (all of them together: ~4e-6), and
    the seeds are fixed, so the test is deterministic.

    Power: round to nearest, on the same inputs, is off by 0.3 step per peer on the
    designed values (0.9 step in all, ~46 sigma), so it must fail the same bound.
    """
    world, numel, block, trials = 4, 600, 256, 2000
    step = 1.0 / 127
    inputs = torch.randn(world, world, numel) * 0.2
    inputs[:, :, 0] = 1.0  # absmax of block 0 (and of the partial block, via column 512)
    inputs[:, :, 512] = 1.0
    inputs[:, :, 1:50] = 0.3 * step  # round to nearest sends these to 0: biased
    inputs[:, :, 520:560] = -0.3 * step
    exact = inputs.double().sum(dim=0)  # [receiver, S]

    mean = torch.zeros(world, numel, dtype=torch.float64)
    gen = torch.Generator().manual_seed(1234)
    for receiver in range(world):
        peers = torch.cat([inputs[:receiver, receiver], inputs[receiver + 1:, receiver]])  # [W-1, S]
        repeated = peers.repeat(trials, 1)  # [T * (W-1), S]: T independent reductions at once
        q, scales = absmax_quantize(
            repeated, block_size=block, rounding="stochastic", generator=gen, nonfinite="propagate"
        )
        peer_sums = absmax_dequantize(q, scales, block_size=block).view(trials, world - 1, numel).sum(dim=1)
        mean[receiver] = (peer_sums.double() + inputs[receiver, receiver].double()).mean(dim=0)

    def scale_sum_sq(values: torch.Tensor) -> torch.Tensor:
        return _block_scales(values, block).repeat_interleave(block, dim=1)[:, :numel].double().pow(2).sum(dim=0)

    sigma = torch.stack([
        (scale_sum_sq(torch.cat([inputs[:r, r], inputs[r + 1:, r]])) / (4 * trials)).sqrt()
        for r in range(world)
    ])
    error = (mean - exact).abs()
    assert (error <= 6 * sigma + 1e-9).all(), float((error / sigma.clamp_min(1e-30)).max())
    # Aggregate: the standardized errors of 2400 values have mean ~N(0, 1/2400) if
    # unbiased; a bias of even 0.2 sigma everywhere would show as a mean of ~0.2.
    z = ((mean - exact) / sigma.clamp_min(1e-30))[sigma > 0]
    assert abs(float(z.mean())) < 5 / math.sqrt(z.numel()), float(z.mean())

    # round to nearest fails the same bound on the designed values
    rtn = torch.zeros(world, numel, dtype=torch.float64)
    for receiver in range(world):
        peers = torch.cat([inputs[:receiver, receiver], inputs[receiver + 1:, receiver]])
        q, scales = absmax_quantize(peers, block_size=block, nonfinite="propagate")
        rtn[receiver] = absmax_dequantize(q, scales, block_size=block).double().sum(dim=0) + inputs[receiver, receiver]
    assert ((rtn - exact).abs()[:, 1:50] > 6 * sigma[:, 1:50]).all()


def test_noise_generator_state_round_trip() -> None:
    comm = QuantizedReduceScatter(seed=5)
    gen = comm._generator(torch.device("cpu"))
    state = comm.rng_state()
    first = torch.rand(8, generator=gen)
    comm.set_rng_state(state)
    assert torch.equal(torch.rand(8, generator=gen), first)
    other = QuantizedReduceScatter(seed=6)._generator(torch.device("cpu"))
    assert not torch.equal(torch.rand(8, generator=other), first)
    assert repr(comm) == "QuantizedReduceScatter(block_size=256, seed=5)"
