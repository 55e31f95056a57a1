"""benchmarks.roofline: the op counts, the time model and a tiny end-to-end run.

The counts are checked on ops whose FLOPs and bytes are known by hand; the time model on
a hand-computed example; the CLI on a tiny shape (every recipe traced on fake tensors).
Nothing here times anything.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from _matrix import FULL_MATRIX
from torch._subclasses.fake_tensor import FakeTensorMode

from benchmarks import roofline
from benchmarks._op_trace import OpCost, OpCounter
from benchmarks._roofline_model import DevicePeaks, collective_seconds, estimate_step, gpu_peaks, op_seconds
from benchmarks._roofline_trace import trace_row_blocks
from fsdp_int8.hardware import GPUS

M, K, N = 8, 16, 4


def _count(fn) -> dict[str, OpCost]:
    with OpCounter() as counter:
        fn()
    return counter.costs


@pytest.mark.parametrize("dtype,name,size", [(torch.float32, "float32", 4), (torch.bfloat16, "bfloat16", 2)])
def test_an_mm_counts_its_flops_and_bytes(dtype, name, size):
    a, b = torch.ones(M, K, dtype=dtype), torch.ones(K, N, dtype=dtype)
    cost = _count(lambda: torch.mm(a, b))["aten.mm"]
    assert dict(cost.flops) == {name: 2 * M * K * N}
    assert (cost.bytes_read, cost.bytes_written) == ((M * K + K * N) * size, M * N * size)
    assert (cost.launches, cost.host_syncs) == (1, 0)


def test_an_int_mm_counts_int8_flops():
    a, b = torch.ones(32, K, dtype=torch.int8), torch.ones(K, N * 2, dtype=torch.int8)
    cost = _count(lambda: torch._int_mm(a, b))["aten._int_mm"]
    assert dict(cost.flops) == {"int8": 2 * 32 * K * N * 2}
    assert (cost.bytes_read, cost.bytes_written) == (32 * K + K * N * 2, 32 * N * 2 * 4)  # int32 out


def test_elementwise_ops_count_bytes_not_flops():
    x, y = torch.ones(M, K), torch.ones(M, K)
    costs = _count(lambda: (x + y, x.add_(y), x.copy_(y), x.t(), x.view(-1)))
    add, add_, copy_ = costs["aten.add"], costs["aten.add_"], costs["aten.copy_"]
    nbytes = M * K * 4
    assert not add.flops and (add.bytes_read, add.bytes_written) == (2 * nbytes, nbytes)
    assert (add_.bytes_read, add_.bytes_written) == (2 * nbytes, nbytes)  # reads x and y, writes x
    assert (copy_.bytes_read, copy_.bytes_written) == (nbytes, nbytes)  # the destination is not read
    assert costs["aten.t"].launches == costs["aten.view"].launches == 0  # views launch nothing
    assert costs["aten.t"].bytes == 0


def test_a_broadcast_operand_counts_once():
    x, row = torch.ones(M, K), torch.ones(K).expand(M, K)
    assert _count(lambda: x * row)["aten.mul"].bytes_read == M * K * 4 + K * 4


def test_item_is_a_host_sync():
    x = torch.full((3,), 2.0)
    with OpCounter() as counter:
        value = x.sum().item()
    assert value == 6.0
    assert counter.costs["aten._local_scalar_dense"].host_syncs == 1
    assert counter.costs["aten._local_scalar_dense"].launches == 0


def test_fake_tensors_reads_are_answered_and_counted():
    with FakeTensorMode(), OpCounter(answer_reads=True) as counter:
        x = torch.ones(4)
        flags = (bool(torch.isfinite(x).all()), int(x.long().sum()), float(x.sum()))
    assert flags == (True, 1, 1.0)
    assert counter.costs["aten._local_scalar_dense"].host_syncs == 3


def test_a_grouped_mm_counts_each_token_against_one_expert():
    tokens, experts = 32, 4
    with FakeTensorMode(), OpCounter(answer_reads=True) as counter:
        x = torch.ones(tokens, K, dtype=torch.bfloat16)
        w = torch.ones(experts, K, N * 4, dtype=torch.bfloat16)
        counts = torch.bincount(torch.zeros(tokens, dtype=torch.long), minlength=experts)  # values unknown
        torch._grouped_mm(x, w, offs=torch.cumsum(counts, 0, dtype=torch.int32))
    assert counts.shape == (experts,)
    assert dict(counter.costs["aten._grouped_mm"].flops) == {"bfloat16": 2 * tokens * K * N * 4}


def test_a_measured_rate_per_gemm_shape_replaces_the_dtypes_rate():
    a, b = torch.ones(M, K), torch.ones(K, N)
    cost = _count(lambda: (torch.mm(a, b), torch.mm(b.t(), a.t())))["aten.mm"]
    assert dict(cost.gemms) == {("float32", M, K, N, False, False): 1, ("float32", N, K, M, True, True): 1}
    rates = {("float32", M, K, N, False, False): 1e3}  # the other shape runs at the dtype's rate
    peaks = DevicePeaks(name="t", flops={"float32": 1e6}, memory=1e12, link=1.0, launch_s=0.0, sync_s=0.0,
                        link_step_s=0.0, overlap=False, measured="", gemm_rates=rates)
    flops = 2 * M * K * N
    assert op_seconds("aten.mm", cost, peaks) == pytest.approx(flops / 1e3 + flops / 1e6)


def test_a_fused_region_is_one_kernel_around_its_matmuls():
    x, w = torch.ones(M, K), torch.ones(N, K)

    def body(x, w):
        h = (x * 2 + 1).relu()  # three ops: one fused kernel reading x, writing h for the mm
        out = h @ w.t()
        return out.mul(3).add(1)  # two ops: one fused kernel reading out, writing the result

    with OpCounter() as counter:
        with counter.fused("body", (x, w)) as region:
            region.done(body(x, w))
    fused, mm = counter.costs["fused body"], counter.costs["aten.mm"]
    assert (fused.calls, fused.launches) == (2, 2)
    assert fused.bytes_read == M * K * 4 + M * N * 4  # x; the mm's output
    assert fused.bytes_written == M * K * 4 + M * N * 4  # h; the result
    assert dict(mm.flops) == {"float32": 2 * M * K * N} and mm.launches == 1
    assert "aten.mul" not in counter.costs and "aten.relu" not in counter.costs


PEAKS = DevicePeaks(name="test", flops={"bfloat16": 1e12, "float32": 1e11, "int8": 2e12}, memory=1e11, link=1e10,
                    launch_s=1e-6, sync_s=1e-5, link_step_s=1e-6, overlap=True, measured="by hand")


def test_the_time_model_by_hand():
    gemm = OpCost(calls=2, bytes_read=6e7, bytes_written=4e7, launches=2, host_syncs=1)
    gemm.flops["bfloat16"] = 2e9
    assert op_seconds("aten.mm", gemm, PEAKS) == pytest.approx(2e-3 + 2e-6 + 1e-5)  # compute-bound
    pointwise = OpCost(calls=1, bytes_read=3e8, launches=1)
    assert op_seconds("aten.add", pointwise, PEAKS) == pytest.approx(3e-3 + 1e-6)  # memory-bound
    gather = OpCost(calls=2, collective="all_gather", collective_bytes=8e8)
    assert collective_seconds(gather, PEAKS, world=8) == pytest.approx(8e8 * 7 / 8 / 1e10 + 2 * 7 * 1e-6)
    step = estimate_step({"aten.mm": gemm, "aten.add": pointwise, "c10d._allgather_base_": gather}, PEAKS, world=8)
    compute, comm = 2e-3 + 2e-6 + 1e-5 + 3e-3 + 1e-6, 8e8 * 7 / 8 / 1e10 + 14e-6
    assert step.compute == pytest.approx(compute) and step.communication == pytest.approx(comm)
    assert step.seconds == pytest.approx(max(compute, comm) + 2 * comm / 2)  # two collectives' share exposed
    serial = estimate_step({"aten.add": pointwise, "c10d._allgather_base_": gather},
                           DevicePeaks(**{**PEAKS.__dict__, "overlap": False}), world=8)
    assert serial.seconds == pytest.approx(3e-3 + 1e-6 + comm)


def test_gpu_peaks_come_from_the_gpu_table():
    peaks = gpu_peaks(GPUS["b300"])
    assert peaks.flop_rate("bfloat16") == 2250e12 and peaks.flop_rate("int8") == 150e12
    assert peaks.memory == GPUS["b300"].hbm_gbs * 1e9 and peaks.link == 900e9
    assert peaks.flop_rate("float64") == peaks.flop_rate("float32")


def test_extrapolating_blocks_matches_a_whole_trace():
    shape = roofline.shapes()["tiny"]
    args = dataclasses.replace(shape.args, n_layers=3)
    whole = trace_row_blocks("bf16", args, batch=shape.batch, seq=shape.seq, world=2, whole=True).costs
    extrapolated = trace_row_blocks("bf16", args, batch=shape.batch, seq=shape.seq, world=2).costs
    for name in ("aten.mm", "aten.mul", "c10d._allgather_base_", "c10d._reduce_scatter_base_"):
        a, b = whole[name], extrapolated[name]
        assert (a.calls, a.launches, a.bytes, dict(a.flops), a.collective_bytes) == pytest.approx(
            (b.calls, b.launches, b.bytes, dict(b.flops), b.collective_bytes)), name


def test_the_cli_estimates_every_recipe_on_a_tiny_shape(capsys):
    # CI: the rows the assertions compare (the lean call's trace is test_a_gpu_trace_...'s)
    rows = [] if FULL_MATRIX else ["--rows", "bf16", "int8", "int8-mm"]
    result = roofline.main(["--gpu", "h100", "--shape", "tiny", "--world-size", "2", *rows])
    estimates = result["estimates"]
    assert list(estimates) == ["bf16", "int8", "int8-mm", "lean"][:None if FULL_MATRIX else 3]
    totals = {row: e.totals() for row, e in estimates.items()}
    assert totals["int8-mm"].flops["int8"] > 0 and totals["bf16"].flops.get("int8", 0) == 0
    assert totals["bf16"].flops["bfloat16"] > totals["int8-mm"].flops["bfloat16"]
    # int8 weights + fp32 row scales on the wire: fewer all-gather bytes than bf16's
    assert estimates["int8"].collective_bytes("all_gather") < estimates["bf16"].collective_bytes("all_gather")
    assert all(e.step.seconds > 0 for e in estimates.values())
    out = capsys.readouterr().out
    assert "ESTIMATES" in out and "the 10 largest costs" in out and "1.000x" in out
    assert "traced whole (2 blocks)" in out


def test_a_gpu_trace_takes_the_librarys_accelerator_paths():
    # on the CPU the lean call reads each update's finite verdict (free there) and its step
    # counters; for a GPU the verdicts are deferred to the step's one check and the counters,
    # host tensors on GPUs too, are not device syncs
    shape = roofline.shapes()["tiny"]
    one_block = dataclasses.replace(shape.args, n_layers=1)
    syncs = {}
    for accelerator in (False, True):
        costs = trace_row_blocks("lean", one_block, batch=shape.batch, seq=shape.seq, world=2,
                                 accelerator=accelerator).costs
        syncs[accelerator] = sum(cost.host_syncs for cost in costs.values())
    assert 1 <= syncs[True] < syncs[False]
