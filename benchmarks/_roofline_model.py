"""The roofline's time model and the peaks it divides by: a GPU's published ones or this
CPU's measured ones.

One op (or fused region) takes ``max(FLOPs / peak of its dtype, bytes / memory bandwidth)``
plus a cost per kernel launch and per host sync: the roofline of
``torch.distributed._tools.runtime_estimator.RuntimeEstimator`` (its
``operator-level-cost-model``), here with a device's peaks given rather than read from
the CUDA device it runs on, and with launches and syncs added. A collective moves
``(W - 1) / W`` of its buffer over the interconnect (a ring over ``W`` ranks) plus a
latency per ring step.

A step is the sum of its ops' times (compute) and of its collectives' (communication).
On a GPU, NCCL runs the collectives on their own streams while compute goes on (FSDP2
prefetches the next all-gather and reduce-scatters behind backward), so the step is
``max(compute, communication)`` plus the part no overlap hides: the first all-gather and
the last reduce-scatter, estimated as two average collectives. On a CPU, gloo's threads
share the cores with the compute: the step is their sum.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Callable

import torch

from benchmarks._op_trace import OpCost
from fsdp_int8.hardware import GpuSpec

__all__ = ["DevicePeaks", "StepEstimate", "collective_seconds", "estimate_step", "gpu_peaks", "measure_cpu_peaks",
           "measure_gemm_rates", "op_seconds"]

GPU_LAUNCH_S = 4e-6  # a kernel launch on the GPU's stream (the host running ahead)
GPU_SYNC_S = 10e-6  # a host read of a device value: the queue drains, the host waits a round trip
NVLINK_STEP_S = 3e-6  # latency per ring step of an NVLink collective (benchmarks.scaling's alpha)


@dataclasses.dataclass(frozen=True)
class DevicePeaks:
    """The rates a roofline divides by (per second) and its fixed costs (seconds).

    Attributes:
        name: What tables print.
        flops: Matmul FLOP/s by dtype name (``"bfloat16"``, ``"float32"``, ``"int8"``, ...).
        attention_flops: Attention kernels' FLOP/s by dtype name (default: ``flops``).
        memory: Bytes/s of the device memory.
        link: Bytes/s per rank and direction of the collectives' interconnect.
        launch_s: Cost of one kernel launch.
        sync_s: Cost of one host read of a device value.
        link_step_s: Latency of one ring step of a collective.
        overlap: Whether collectives overlap compute (GPUs: True).
        measured: Where the figures come from, for the output.
        gemm_rates: FLOP/s of 2-D GEMMs by ``(dtype, m, k, n, a transposed, b transposed)``
            (``benchmarks._flops.gemm_shape``), measured where the rate depends on the
            shape and layout (a CPU's reference loops); any other GEMM runs at ``flops``' rate.
    """

    name: str
    flops: dict[str, float]
    memory: float
    link: float
    launch_s: float
    sync_s: float
    link_step_s: float
    overlap: bool
    measured: str
    attention_flops: dict[str, float] = dataclasses.field(default_factory=dict)
    gemm_rates: dict[tuple, float] = dataclasses.field(default_factory=dict)

    def flop_rate(self, dtype: str, attention: bool = False) -> float:
        """FLOP/s of a matmul (or attention kernel) in ``dtype``; a dtype without a rate of
        its own (float64, ...) runs at the fp32 rate."""
        if attention and dtype in self.attention_flops:
            return self.attention_flops[dtype]
        return self.flops.get(dtype, self.flops["float32"])


def gpu_peaks(spec: GpuSpec, *, launch_s: float = GPU_LAUNCH_S, sync_s: float = GPU_SYNC_S) -> DevicePeaks:
    """A GPU's published dense peaks (``fsdp_int8.hardware.GPUS``) as roofline rates."""
    flops = {"bfloat16": spec.bf16_tflops * 1e12, "float16": spec.bf16_tflops * 1e12,
             "float32": spec.fp32_tflops * 1e12, "int8": spec.int8_tops * 1e12}
    if spec.fp8_tflops:
        flops.update(float8_e4m3fn=spec.fp8_tflops * 1e12, float8_e5m2=spec.fp8_tflops * 1e12)
    return DevicePeaks(
        name=spec.name, flops=flops, memory=spec.hbm_gbs * 1e9, link=spec.interconnect_gbs * 1e9,
        launch_s=launch_s, sync_s=sync_s, link_step_s=NVLINK_STEP_S, overlap=True,
        measured=(f"published dense peaks: bf16 {spec.bf16_tflops:g} TFLOP/s, int8 {spec.int8_tops:g} TOP/s, "
                  f"fp32 {spec.fp32_tflops:g} TFLOP/s, memory {spec.hbm_gbs:g} GB/s, "
                  f"{spec.interconnect} {spec.interconnect_gbs:g} GB/s per direction"))


def op_seconds(name: str, cost: OpCost, peaks: DevicePeaks) -> float:
    """Roofline time of ``cost`` (one op's calls, summed) on ``peaks``; a collective's
    time is :func:`collective_seconds`'s."""
    attention = "attention" in name
    flops = dict(cost.flops)
    compute = 0.0
    for key, calls in cost.gemms.items():  # GEMMs at their own shape's rate, where measured
        dtype, m, k, n = key[:4]
        if key in peaks.gemm_rates and flops.get(dtype):
            gemm_flops = min(2 * m * k * n * calls, flops[dtype])
            compute += gemm_flops / peaks.gemm_rates[key]
            flops[dtype] -= gemm_flops
    compute += sum(f / peaks.flop_rate(dtype, attention) for dtype, f in flops.items() if f > 0)
    memory = cost.bytes / peaks.memory
    return max(compute, memory) + cost.launches * peaks.launch_s + cost.host_syncs * peaks.sync_s


def collective_seconds(cost: OpCost, peaks: DevicePeaks, world: int) -> float:
    """A ring's time for ``cost``'s collectives over ``world`` ranks: each moves
    ``(world - 1) / world`` of its buffer and waits ``world - 1`` ring steps."""
    if world <= 1:
        return 0.0
    share = (world - 1) / world
    return cost.collective_bytes * share / peaks.link + cost.calls * (world - 1) * peaks.link_step_s


@dataclasses.dataclass(frozen=True)
class StepEstimate:
    """One step's estimate: total, compute and communication seconds, and each op's."""

    seconds: float
    compute: float
    communication: float
    per_op: dict[str, float]


def estimate_step(costs: dict[str, OpCost], peaks: DevicePeaks, world: int) -> StepEstimate:
    """The step time of ``costs`` (one step's ops by name) on ``peaks`` (module doc)."""
    per_op, compute, communication, collectives = {}, 0.0, 0.0, 0
    for name, cost in costs.items():
        if cost.collective:
            seconds = collective_seconds(cost, peaks, world)
            communication += seconds
            collectives += cost.calls
        else:
            seconds = op_seconds(name, cost, peaks)
            compute += seconds
        per_op[name] = seconds
    if peaks.overlap:
        exposed = 2 * communication / collectives if collectives else 0.0
        total = max(compute, communication) + exposed
    else:
        total = compute + communication
    return StepEstimate(total, compute, communication, per_op)


# ---------------------------------------------------------------- this CPU's peaks
def _best(fn: Callable[[], object], repeats: int) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def _gemm_rates(size: int) -> dict[str, float]:
    gen = torch.Generator().manual_seed(0)
    a, b = torch.randn(size, size, generator=gen), torch.randn(size, size, generator=gen)
    flops = 2 * size ** 3
    ha, hb = a.bfloat16(), b.bfloat16()
    qa, qb = (t.mul(40).round().clamp(-127, 127).to(torch.int8) for t in (a, b))
    return {"float32": flops / _best(lambda: a @ b, 5), "bfloat16": flops / _best(lambda: ha @ hb, 2),
            "int8": flops / _best(lambda: torch._int_mm(qa, qb), 2)}


def measure_gemm_rates(shapes, threads: int = 1) -> dict[tuple, float]:
    """FLOP/s of each 2-D GEMM ``(dtype, m, k, n, a transposed, b transposed)`` in
    ``shapes`` on this CPU, ``threads`` threads: ``torch.mm`` (``torch._int_mm`` for int8)
    on operands of that layout, the best of two calls."""
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    rates = {}
    gen = torch.Generator().manual_seed(0)

    def operand(rows: int, cols: int, dtype: str, transposed: bool) -> torch.Tensor:
        t = torch.randn(cols, rows, generator=gen).t() if transposed else torch.randn(rows, cols, generator=gen)
        if dtype == "int8":
            return t.mul(40).round().clamp(-127, 127).to(torch.int8)
        return t.to(getattr(torch, dtype))

    try:
        for key in sorted(set(shapes)):
            dtype, m, k, n, a_t, b_t = key
            a, b = operand(m, k, dtype, a_t), operand(k, n, dtype, b_t)
            gemm = torch._int_mm if dtype == "int8" else torch.mm
            rates[key] = 2 * m * k * n / _best(lambda: gemm(a, b), 2)  # noqa: B023 -- called at once
    finally:
        torch.set_num_threads(previous)
    return rates


def _attention_rates(heads: int, seq: int, head_dim: int, batch: int) -> dict[str, float]:
    import torch.nn.functional as F

    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(batch, heads, seq, head_dim, generator=gen) for _ in range(3))
    flops = 4 * batch * heads * seq * seq * head_dim / 2  # causal: half the square
    rates = {}
    for dtype in (torch.float32, torch.bfloat16):
        qd, kd, vd = (t.to(dtype) for t in (q, k, v))
        rates[str(dtype).removeprefix("torch.")] = flops / _best(
            lambda: F.scaled_dot_product_attention(qd, kd, vd, is_causal=True), 3)
    return rates


def _copy_bandwidth(megabytes: int = 256) -> float:
    src = torch.ones(megabytes * (1 << 20) // 4)
    dst = torch.empty_like(src)
    return 2 * src.numel() * 4 / _best(lambda: dst.copy_(src), 5)


def _launch_seconds(calls: int = 2000) -> float:
    a, b = torch.ones(4), torch.ones(4)
    torch.add(a, b)
    start = time.perf_counter()
    for _ in range(calls):
        torch.add(a, b)
    return (time.perf_counter() - start) / calls


def _gloo_body(rank: int, world: int, megabytes: int) -> float:
    import torch.distributed as dist

    shard = torch.ones(megabytes * (1 << 20) // 4 // world)
    out = torch.empty(shard.numel() * world)
    dist.all_gather_into_tensor(out, shard)
    best = float("inf")
    for _ in range(3):
        dist.barrier()
        start = time.perf_counter()
        dist.all_gather_into_tensor(out, shard)
        best = min(best, time.perf_counter() - start)
    return out.numel() * 4 * (world - 1) / world / best


def measure_cpu_peaks(gemm_size: int, *, threads: int = 1, world: int = 2,
                      attention: tuple[int, int, int, int] = (4, 256, 64, 4)) -> DevicePeaks:
    """This CPU's rates, measured now with ``threads`` threads: fp32, bf16 and int8 GEMMs
    (``torch.mm`` / ``torch._int_mm``) at ``gemm_size``^3, causal attention
    (``attention``: heads, sequence, head dim, batch) in fp32 and bf16, memory bandwidth
    (a 256 MB copy), the cost of one small op (dispatch: the CPU's "launch") and gloo's
    all-gather bandwidth between ``world`` processes (``world > 1``)."""
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        flops = _gemm_rates(gemm_size)
        attention_flops = _attention_rates(*attention)
        memory = _copy_bandwidth()
        launch_s = _launch_seconds()
    finally:
        torch.set_num_threads(previous)
    link = memory
    if world > 1:
        from fsdp_int8.testing import run_distributed

        link = run_distributed(_gloo_body, world, 64, timeout=300)[0]
    text = (f"measured on this CPU, {threads} thread(s): GEMM {gemm_size}^3 fp32 {flops['float32'] / 1e9:.1f}, "
            f"bf16 {flops['bfloat16'] / 1e9:.2f}, int8 {flops['int8'] / 1e9:.2f} GFLOP/s (GOP/s); causal "
            f"attention fp32 {attention_flops['float32'] / 1e9:.1f}, bf16 {attention_flops['bfloat16'] / 1e9:.2f} "
            f"GFLOP/s; copy {memory / 1e9:.1f} GB/s; {launch_s * 1e6:.1f} us per small op; gloo all-gather "
            f"{link / 1e9:.2f} GB/s per rank ({world} processes)")
    return DevicePeaks(name="this CPU", flops=flops, attention_flops=attention_flops, memory=memory, link=link,
                       launch_s=launch_s, sync_s=0.0, link_step_s=0.0, overlap=False, measured=text)
