"""Published dense peaks of the GPUs users train on: the one table of GPU numbers.

Both the int8 rule of :mod:`fsdp_int8.hardware` (int8 GEMMs only where a GPU's int8 rate
is above its bf16 rate) and the benchmarks' roofline (``benchmarks.roofline``) read this
table, so a corrected figure changes both.

Every figure is a vendor data-sheet peak **without** 2:4 structured sparsity. NVIDIA's
data sheets since Hopper print tensor-core rates with sparsity (marked "with sparsity"),
twice the dense rate; those are halved here. ``torch._inductor.analysis.device_info``
lists the sparse figures for H100 (with ``tops_sparsity_factor=2``); the tests check this
table against its dense values. ``fp32_tflops`` is the non-tensor-core FP32 rate (what an
fp32 matmul gets with TF32 off, torch's default); a rate the GPU does not have is 0.0.
``interconnect_gbs`` is the GPU-to-GPU bandwidth per GPU in one direction: NVLink where
the part has it (half the bidirectional figure data sheets print), else PCIe.
"""

from __future__ import annotations

import dataclasses

__all__ = ["GPUS", "GpuSpec", "gpus_with_capability"]


@dataclasses.dataclass(frozen=True)
class GpuSpec:
    """One GPU's published dense peaks.

    Attributes:
        key: Short name (``benchmarks.roofline --gpu``).
        name: What tables print.
        compute_capability: CUDA compute capability, ``(major, minor)``.
        bf16_tflops: Dense bf16 tensor-core TFLOP/s (0.0: no bf16 tensor cores).
        int8_tops: Dense int8 tensor-core TOP/s.
        fp8_tflops: Dense fp8 tensor-core TFLOP/s (0.0: no fp8 tensor cores).
        fp32_tflops: FP32 TFLOP/s without tensor cores.
        hbm_gbs: Device memory bandwidth, GB/s.
        interconnect_gbs: GPU-to-GPU bandwidth per GPU and direction, GB/s.
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
# HGX B300 and GB300 NVL72 (per GPU). Blackwell Ultra (sm_103) cut dense int8 to about
# 0.15 POPS, under its bf16 rate: int8 GEMMs are slower than bf16 there.
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
