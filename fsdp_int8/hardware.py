"""What is fast on this device: an int8 GEMM (``torch._int_mm``) and a bf16 matmul.

The same configuration runs 10-70x faster or slower depending on whether the hardware has
native int8 GEMMs and bf16 matmuls; the table per device:
docs/performance.md, "Which kernels are fast where". :func:`capability` decides, once per
process and device. Nothing here changes what runs: :func:`warn_if_slow` warns (once per
process and kind of device) when a layer's configuration asks for a kernel this device
runs slowly, and the launcher's ``--precision auto`` reads :func:`capability`.
:data:`GPUS` is the one table of GPU peaks, which ``benchmarks.roofline`` reads too.
:func:`device_type_for` is the one rule for which device a process trains on.
"""

from __future__ import annotations

import dataclasses
import functools
import platform
import time
import warnings
from typing import Callable

import torch
from torch.utils._python_dispatch import _disable_current_modes

from fsdp_int8._dist import device_type_for

__all__ = ["Capability", "FAST_RATIO", "GPUS", "GpuSpec", "best_seconds", "capability", "device_type_for",
           "hardware_line"]

#: A kernel that takes at most this many times an fp32 matmul of the same shape counts as
#: fast when a timing probe decides: native kernels measure 0.1-1x, reference loops
#: 15-90x, so the cut does not depend on noise.
FAST_RATIO = 2.0
_PROBE_SIZE = 128  # m = n = k: a few milliseconds on a reference loop, microseconds natively
# m = n = k of the int8-against-bf16 probe of a GPU the table does not list: large enough
# that both GEMMs run at their tensor cores' rate rather than at the launch latency
_INT8_PROBE_SIZE = 4096


# ``torch._inductor.analysis.device_info`` lists sparse figures for H100 (with
# ``tops_sparsity_factor=2``); the tests check GPUS against its dense values.
@dataclasses.dataclass(frozen=True)
class GpuSpec:
    """One GPU's published dense peaks, from the vendor's data sheet.

    Dense: without 2:4 structured sparsity. NVIDIA's data sheets since Hopper print
    tensor-core rates with sparsity, twice these; they are halved here.

    Attributes:
        key: Short name (``benchmarks.roofline --gpu``).
        name: What tables print.
        compute_capability: CUDA compute capability, ``(major, minor)``.
        bf16_tflops: Dense bf16 tensor-core TFLOP/s (0.0: no bf16 tensor cores).
        int8_tops: Dense int8 tensor-core TOP/s.
        fp8_tflops: Dense fp8 tensor-core TFLOP/s (0.0: no fp8 tensor cores).
        fp32_tflops: FP32 TFLOP/s without tensor cores (what an fp32 matmul gets with TF32
            off, torch's default).
        hbm_gbs: Device memory bandwidth, GB/s.
        interconnect_gbs: GPU-to-GPU bandwidth per GPU in one direction, GB/s: NVLink
            where the part has it (half the bidirectional figure data sheets print), else
            PCIe.
        interconnect: What that link is.
    """

    key: str
    name: str
    compute_capability: tuple[int, int]
    bf16_tflops: float
    int8_tops: float
    fp8_tflops: float
    fp32_tflops: float
    hbm_gbs: float
    interconnect_gbs: float
    interconnect: str

    @property
    def sm(self) -> str:
        """The compute capability as CUDA spells it, e.g. ``"sm_90"``."""
        major, minor = self.compute_capability
        return f"sm_{major}{minor}"

    @property
    def int8_faster_than_bf16(self) -> bool:
        """Whether an int8 GEMM's peak is above a bf16 matmul's on this GPU."""
        return self.int8_tops > self.bf16_tflops


# Data sheets: NVIDIA T4, A10, L4, A100 (SXM4 80 GB), H100 (SXM5), H200 (SXM), HGX B200,
# HGX B300 and GB300 NVL72 (per GPU).
#: The GPUs users train on, by key (``t4``, ``a10``, ``l4``, ``a100``, ``h100``, ``h200``,
#: ``b200``, ``b300``, ``gb300``): the one table of GPU numbers. :func:`capability` reads it
#: for the int8 rule and ``benchmarks.roofline`` for its peaks, so a corrected figure
#: changes both. Blackwell Ultra (sm_103: B300, GB300) has about 0.15 dense int8 POPS,
#: under its bf16 rate: ``GPUS["b300"].int8_faster_than_bf16`` is False.
GPUS: dict[str, GpuSpec] = {spec.key: spec for spec in (
    GpuSpec("t4", "T4", (7, 5), bf16_tflops=0.0, int8_tops=130.0, fp8_tflops=0.0, fp32_tflops=8.1,
            hbm_gbs=320.0, interconnect_gbs=16.0, interconnect="PCIe 3.0 x16"),
    GpuSpec("a10", "A10", (8, 6), bf16_tflops=125.0, int8_tops=250.0, fp8_tflops=0.0, fp32_tflops=31.2,
            hbm_gbs=600.0, interconnect_gbs=32.0, interconnect="PCIe 4.0 x16"),
    GpuSpec("l4", "L4", (8, 9), bf16_tflops=121.0, int8_tops=242.5, fp8_tflops=242.5, fp32_tflops=30.3,
            hbm_gbs=300.0, interconnect_gbs=32.0, interconnect="PCIe 4.0 x16"),
    GpuSpec("a100", "A100 SXM4 80GB", (8, 0), bf16_tflops=312.0, int8_tops=624.0, fp8_tflops=0.0,
            fp32_tflops=19.5, hbm_gbs=2039.0, interconnect_gbs=300.0, interconnect="NVLink 3"),
    GpuSpec("h100", "H100 SXM", (9, 0), bf16_tflops=989.5, int8_tops=1979.0, fp8_tflops=1979.0,
            fp32_tflops=67.0, hbm_gbs=3350.0, interconnect_gbs=450.0, interconnect="NVLink 4"),
    GpuSpec("h200", "H200 SXM", (9, 0), bf16_tflops=989.5, int8_tops=1979.0, fp8_tflops=1979.0,
            fp32_tflops=67.0, hbm_gbs=4800.0, interconnect_gbs=450.0, interconnect="NVLink 4"),
    GpuSpec("b200", "B200 (HGX)", (10, 0), bf16_tflops=2250.0, int8_tops=4500.0, fp8_tflops=4500.0,
            fp32_tflops=75.0, hbm_gbs=8000.0, interconnect_gbs=900.0, interconnect="NVLink 5"),
    GpuSpec("b300", "B300 (HGX)", (10, 3), bf16_tflops=2250.0, int8_tops=150.0, fp8_tflops=4500.0,
            fp32_tflops=75.0, hbm_gbs=8000.0, interconnect_gbs=900.0, interconnect="NVLink 5"),
    GpuSpec("gb300", "GB300 (NVL72)", (10, 3), bf16_tflops=2500.0, int8_tops=165.0, fp8_tflops=5000.0,
            fp32_tflops=80.0, hbm_gbs=8000.0, interconnect_gbs=900.0, interconnect="NVLink 5"),
)}


def gpus_with_capability(major: int, minor: int) -> tuple[GpuSpec, ...]:
    """The GPUs of :data:`GPUS` with compute capability ``(major, minor)`` (empty if none)."""
    return tuple(spec for spec in GPUS.values() if spec.compute_capability == (major, minor))
_INT8_TENSOR_CORES = (7, 5)  # the first compute capability with int8 tensor cores
_BF16_TENSOR_CORES = (8, 0)
_CPU_FEATURES = (  # (name printed, torch's query)
    ("avx2", "_is_avx2_supported"),
    ("avx512", "_is_avx512_supported"),
    ("vnni", "_is_vnni_supported"),
    ("avx512_bf16", "_is_avx512_bf16_supported"),
    ("amx", "_is_amx_tile_supported"),
)


@dataclasses.dataclass(frozen=True)
class Capability:
    """What one kind of device runs fast, and why we think so (:func:`capability`).

    Attributes:
        device_type: ``"cpu"``, ``"cuda"``, ...
        name: The CPU model, or the GPU's name.
        features: The CPU features torch reports present (``avx2``, ``avx512``, ``vnni``,
            ``avx512_bf16``, ``amx``), or ``("sm_90",)`` on a GPU.
        int8_gemm_fast: Whether ``torch._int_mm`` runs fast here.
        bf16_matmul_fast: Whether a bf16 matmul runs fast here.
        int8_evidence: What decided, e.g. ``"vnni"``, ``"sm_90: dense int8 above bf16
            (H100 SXM 1979 TOPS > 989.5 TFLOPS; ...)"``, ``"probe: 18.2x the fp32 matmul"``.
        bf16_evidence: Likewise for bf16.
    """

    device_type: str
    name: str
    features: tuple[str, ...]
    int8_gemm_fast: bool
    bf16_matmul_fast: bool
    int8_evidence: str
    bf16_evidence: str


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown CPU"


def _cpu_features() -> tuple[str, ...]:
    return tuple(name for name, query in _CPU_FEATURES if getattr(torch.cpu, query, lambda: False)())


def _synchronize(device: torch.device) -> None:
    if device.type != "cpu":
        torch.accelerator.synchronize(device)


def best_seconds(fn: Callable[[], object], device: torch.device, repeats: int) -> float:
    """The best of ``repeats`` timed calls of ``fn()`` on ``device``, in seconds.

    One untimed warm-up call first; the device is synchronized around each call. The timer
    the probe and the benchmarks use.

    Args:
        fn: The work to time, called ``repeats + 1`` times.
        device: Where ``fn`` runs (synchronized around each call).
        repeats: Timed calls (>= 1).
    """
    fn()  # warm-up: first-call dispatch and allocation
    best = float("inf")
    for _ in range(repeats):
        _synchronize(device)
        start = time.perf_counter()
        fn()
        _synchronize(device)
        best = min(best, time.perf_counter() - start)
    return best


def _probe(device: torch.device, kind: str) -> float:
    """Time of ``kind`` ("int8" or "bf16") over an fp32 matmul's, same shape, this device.

    Runs outside every active dispatch mode (a caller's GEMM counter, fake tensors) and
    autograd: the probe is not part of the caller's computation. On a CPU it runs on one
    thread: a multi-threaded fp32 matmul on cores other jobs share waits for its slowest
    thread, which can make it slower than a single-threaded reference loop and the ratio
    meaningless.
    """
    threads = torch.get_num_threads()
    if device.type == "cpu":
        torch.set_num_threads(1)
    try:
        with torch.no_grad(), _disable_current_modes():
            return _timed_ratio(device, kind)
    finally:
        torch.set_num_threads(threads)


def _timed_ratio(device: torch.device, kind: str) -> float:
    n = _PROBE_SIZE
    gen = torch.Generator().manual_seed(0)
    a, b = torch.randn(n, n, generator=gen).to(device), torch.randn(n, n, generator=gen).to(device)
    fp32 = best_seconds(lambda: a @ b, device, repeats=5)
    if kind == "int8":
        qa, qb = (t.mul(40).round().clamp(-127, 127).to(torch.int8) for t in (a, b))
        kernel = functools.partial(torch._int_mm, qa, qb)
    else:
        ha, hb = a.to(torch.bfloat16), b.to(torch.bfloat16)
        kernel = lambda: ha @ hb  # noqa: E731
    return best_seconds(kernel, device, repeats=2) / fp32


def _probe_int8_vs_bf16(device: torch.device) -> float:
    """Time of an int8 GEMM over a bf16 matmul's, ``_INT8_PROBE_SIZE``^3, on ``device``.

    Runs outside every active dispatch mode and autograd, like :func:`_probe`.
    """
    n = _INT8_PROBE_SIZE
    with torch.no_grad(), _disable_current_modes():
        gen = torch.Generator().manual_seed(0)
        a, b = torch.randn(n, n, generator=gen), torch.randn(n, n, generator=gen)
        ha, hb = a.to(device, torch.bfloat16), b.to(device, torch.bfloat16)
        qa, qb = (t.mul(40).round().clamp(-127, 127).to(device, torch.int8) for t in (a, b))
        bf16 = best_seconds(lambda: ha @ hb, device, repeats=5)
        return best_seconds(functools.partial(torch._int_mm, qa, qb), device, repeats=5) / bf16


def _cuda_int8(device: torch.device, major: int, minor: int) -> tuple[bool, str]:
    """Whether int8 GEMMs beat bf16 matmuls on a CUDA device of this capability, and why."""
    sm = f"sm_{major}{minor}"
    if (major, minor) < _INT8_TENSOR_CORES:
        return False, f"{sm} < sm_75 (no int8 tensor cores)"
    listed = gpus_with_capability(major, minor)
    if listed:
        fast = all(spec.int8_faster_than_bf16 for spec in listed)
        sign = ">" if fast else "<="
        peaks = "; ".join(f"{spec.name} {spec.int8_tops:g} TOPS {sign} {spec.bf16_tflops:g} TFLOPS" for spec in listed)
        return fast, f"{sm}: dense int8 {'above' if fast else 'not above'} bf16 ({peaks})"
    ratio = _probe_int8_vs_bf16(device)
    return ratio < 1.0, f"{sm} not in the GPU table; probe: int8 GEMM {ratio:.2f}x the bf16 matmul's time"


def _decide(flag_evidence: str | None, device: torch.device, kind: str) -> tuple[bool, str]:
    if flag_evidence is not None:
        return True, flag_evidence
    ratio = _probe(device, kind)
    return ratio <= FAST_RATIO, f"probe: {ratio:.1f}x the fp32 matmul"


def _first(features: tuple[str, ...], wanted: tuple[str, ...]) -> str | None:
    return next((f for f in wanted if f in features), None)


@functools.lru_cache(maxsize=None)
def _capability(device_type: str, index: int | None) -> Capability:
    device = torch.device(device_type, index) if index is not None else torch.device(device_type)
    if device_type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        sm = f"sm_{major}{minor}"
        bf16_fast = (major, minor) >= _BF16_TENSOR_CORES
        int8_fast, int8_evidence = _cuda_int8(device, major, minor)
        return Capability(
            device_type, torch.cuda.get_device_name(device), (sm,),
            int8_gemm_fast=int8_fast, bf16_matmul_fast=bf16_fast, int8_evidence=int8_evidence,
            bf16_evidence=f"{sm} {'>=' if bf16_fast else '<'} sm_80 (bf16 tensor cores)",
        )
    features = _cpu_features() if device_type == "cpu" else ()
    name = _cpu_name() if device_type == "cpu" else device_type
    int8_fast, int8_evidence = _decide(_first(features, ("vnni", "amx")), device, "int8")
    bf16_fast, bf16_evidence = _decide(_first(features, ("avx512_bf16", "amx")), device, "bf16")
    return Capability(device_type, name, features, int8_fast, bf16_fast, int8_evidence, bf16_evidence)


def _key(device: torch.device | str) -> tuple[str, int | None]:
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        return "cuda", torch.cuda.current_device()
    return device.type, device.index


def capability(device: torch.device | str = "cpu") -> Capability:
    """What ``device`` runs fast, decided once per process and device and cached.

    - CUDA: bf16 is fast from sm_80. Int8 is fast where :data:`GPUS` lists the compute
      capability with a dense int8 peak above the bf16 one (sm_75, sm_80, sm_86, sm_89,
      sm_90 and sm_100 yes; sm_103, Blackwell Ultra, no); below sm_75 never (no int8
      tensor cores). A capability the table does not list is measured: a 4096^3 int8 GEMM
      against a bf16 matmul, fast if it takes less time.
    - CPU: a feature torch reports says fast (VNNI or AMX for int8, AVX-512 BF16 or AMX
      for bf16).
    - Otherwise (a CPU without those features, other devices): a timing probe of the
      kernel against an fp32 matmul of the same 128^3 shape, on one CPU thread, against
      :data:`FAST_RATIO`.

    Probes run outside any active dispatch mode and autograd.

    Args:
        device: A device or its name; its type (and CUDA index) is the cache key.

    Example::

        int8_matmul = Int8MatmulConfig() if capability("cuda").int8_gemm_fast else None
    """
    return _capability(*_key(device))


def hardware_line(device: torch.device | str = "cpu") -> str:
    """One line naming the hardware a measurement ran on, for every benchmark result.

    CPU: its model and the features that decide the kernels, present and absent
    (``"CPU AMD EPYC ... (avx2, no avx512, no vnni, no avx512_bf16, no amx), torch
    2.13.0"``); GPU: its name and compute capability. No probe runs: this only reads what
    torch reports.

    Args:
        device: The device measured (a CUDA device names its GPU; any other, the CPU).
    """
    device = torch.device(device)
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        return f"GPU {torch.cuda.get_device_name(device)}, sm_{major}{minor}, torch {torch.__version__}"
    features = _cpu_features()
    flags = ", ".join(name if name in features else f"no {name}" for name, _ in _CPU_FEATURES)
    return f"CPU {_cpu_name()} ({flags}), torch {torch.__version__}"


_WARNED: set[tuple[str, str]] = set()


def warn_if_slow(device: torch.device, compute_dtype: torch.dtype, *, int8_matmul: bool) -> None:
    """Warn once per process and kind of device if the configured kernels run slowly here.

    Int8 matmuls on a device without a fast int8 GEMM, and bf16 compute on a device without
    a fast bf16 matmul: the user's configuration is honoured, and told what to change.
    """
    wanted = (("int8",) if int8_matmul else ()) + (("bf16",) if compute_dtype == torch.bfloat16 else ())
    for kind in wanted:
        if (kind, device.type) in _WARNED or device.type == "meta":
            continue
        _WARNED.add((kind, device.type))
        found = capability(device)
        if kind == "int8" and not found.int8_gemm_fast:
            warnings.warn(
                f"fsdp_int8: int8 matmuls (Int8MatmulConfig) run slowly on this {found.name} "
                f"({found.int8_evidence}). Weight-only "
                "int8 (Int8TrainingConfig(int8_matmul=None)) keeps the int8 weights and the "
                "int8 all-gather and runs the matmuls in the compute dtype. See "
                "docs/performance.md.",
                UserWarning, stacklevel=3,
            )
        if kind == "bf16" and not found.bf16_matmul_fast:
            warnings.warn(
                f"fsdp_int8: bf16 compute runs slowly on this {found.name} "
                f"({found.bf16_evidence}: no native bf16 matmul here). Compute in fp32 "
                "(no MixedPrecisionPolicy param_dtype, or --compute-dtype fp32 in the "
                "launcher); the weights stay int8 either way. See docs/performance.md.",
                UserWarning, stacklevel=3,
            )
