"""The per-device capability check and the slow-kernel warnings (fsdp_int8/hardware.py).

CI runs on one kind of CPU, so the decision is tested with its inputs patched: the CPU
features torch reports, the timing probe, the CUDA compute capability.
"""

from __future__ import annotations

import dataclasses
import warnings

import pytest
import torch
import torch.nn as nn

import fsdp_int8
from fsdp_int8 import hardware as _hardware

AVX2_ONLY = ("avx2",)
VNNI_BF16 = ("avx2", "avx512", "vnni", "avx512_bf16")
SLOW, FAST = 20.0, 0.4  # probe ratios like the measured ones: reference loops / native kernels


@pytest.fixture
def fresh(monkeypatch):
    """A process that has decided nothing and warned nothing yet; restored afterwards."""
    monkeypatch.setattr(_hardware, "_WARNED", set())
    _hardware._capability.cache_clear()
    yield monkeypatch
    _hardware._capability.cache_clear()


def _cpu(monkeypatch, features, probe_ratio=None):
    probed = []

    def probe(device, kind):
        if probe_ratio is None:
            raise AssertionError(f"probed {kind} although the CPU features decide it")
        probed.append(kind)
        return probe_ratio

    monkeypatch.setattr(_hardware, "_cpu_features", lambda: features)
    monkeypatch.setattr(_hardware, "_probe", probe)
    return probed


def test_cpu_features_decide_without_a_probe(fresh):
    _cpu(fresh, VNNI_BF16)
    found = _hardware.capability("cpu")
    assert found.int8_gemm_fast and found.bf16_matmul_fast
    assert (found.int8_evidence, found.bf16_evidence) == ("vnni", "avx512_bf16")


@pytest.mark.parametrize("ratio,fast", [(SLOW, False), (FAST, True), (_hardware.FAST_RATIO, True)])
def test_without_the_features_a_probe_decides(fresh, ratio, fast):
    probed = _cpu(fresh, AVX2_ONLY, probe_ratio=ratio)
    found = _hardware.capability("cpu")
    assert (found.int8_gemm_fast, found.bf16_matmul_fast) == (fast, fast)
    assert found.int8_evidence == f"probe: {ratio:.1f}x the fp32 matmul"
    _hardware.capability("cpu")
    assert sorted(probed) == ["bf16", "int8"]  # once per process: the second call is cached


def _cuda(monkeypatch, sm, probe_ratio=None):
    """A CUDA device of compute capability ``sm``; the int8-against-bf16 probe returns
    ``probe_ratio`` (``None``: it must not run). Returns the devices probed."""
    probed = []

    def probe(device):
        if probe_ratio is None:
            raise AssertionError(f"probed int8 on sm_{sm[0]}{sm[1]} although the GPU table decides it")
        probed.append(device)
        return probe_ratio

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: sm)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "a GPU")
    monkeypatch.setattr(_hardware, "_probe_int8_vs_bf16", probe)
    return probed


@pytest.mark.parametrize("sm,int8,bf16", [
    ((7, 0), False, False),  # no int8 tensor cores
    ((7, 5), True, False),   # T4: int8 tensor cores, no bf16 ones
    ((8, 0), True, True),    # A100
    ((8, 6), True, True),
    ((8, 9), True, True),
    ((9, 0), True, True),    # H100, H200
    ((10, 0), True, True),   # B200
    ((10, 3), False, True),  # B300 / GB300: dense int8 about 15x below dense bf16
])
def test_cuda_compute_capability_decides_from_the_gpu_table(fresh, sm, int8, bf16):
    _cuda(fresh, sm)
    found = _hardware._capability("cuda", 0)
    assert (found.int8_gemm_fast, found.bf16_matmul_fast) == (int8, bf16)
    assert found.features == (f"sm_{sm[0]}{sm[1]}",)
    assert found.int8_evidence.startswith(f"sm_{sm[0]}{sm[1]}")


def test_blackwell_ultra_names_its_peaks(fresh):
    _cuda(fresh, (10, 3))
    evidence = _hardware._capability("cuda", 0).int8_evidence
    assert "not above" in evidence and "150 TOPS" in evidence and "2250 TFLOPS" in evidence


@pytest.mark.parametrize("ratio,fast", [(0.5, True), (1.0, False), (6.0, False)])
def test_an_unknown_capability_is_probed_against_bf16(fresh, ratio, fast):
    probed = _cuda(fresh, (12, 7), probe_ratio=ratio)
    found = _hardware._capability("cuda", 0)
    assert found.int8_gemm_fast is fast and found.bf16_matmul_fast
    assert "not in the GPU table" in found.int8_evidence and f"{ratio:.2f}x" in found.int8_evidence
    _hardware._capability("cuda", 0)
    assert len(probed) == 1  # once per process and device


def test_the_rule_reads_the_gpu_table(fresh):
    # one source of truth: change a listed GPU's int8 peak and the rule follows
    h100 = _hardware.GPUS["h100"]
    fresh.setitem(_hardware.GPUS, "h100", dataclasses.replace(h100, int8_tops=h100.bf16_tflops / 2))
    _cuda(fresh, (9, 0))
    assert not _hardware._capability("cuda", 0).int8_gemm_fast


def test_the_gpu_table_holds_dense_peaks():
    gpus = _hardware.GPUS
    for key in ("a100", "h100", "h200", "b200", "b300"):
        spec = gpus[key]
        assert spec.key == key and spec.hbm_gbs > 0 and spec.interconnect_gbs > 0 and spec.fp32_tflops > 0
    assert gpus["h100"].compute_capability == gpus["h200"].compute_capability == (9, 0)
    assert (gpus["b200"].sm, gpus["b300"].sm) == ("sm_100", "sm_103")
    assert gpus["b300"].bf16_tflops / gpus["b300"].int8_tops == 15.0
    assert gpus["h200"].hbm_gbs > gpus["h100"].hbm_gbs


@pytest.mark.parametrize("key,torch_name", [("h100", "NVIDIA H100"), ("a100", "NVIDIA A100")])
def test_the_gpu_table_agrees_with_torchs_dense_figures(key, torch_name):
    # torch's device_info prints H100's tensor-core rates with 2:4 sparsity; its dense
    # figures are those over tops_sparsity_factor
    device_info = pytest.importorskip("torch._inductor.analysis.device_info")
    info = device_info.lookup_device_info(torch_name)
    dense = {dtype: info.tops[dtype] / info.tops_sparsity_factor for dtype in (torch.bfloat16, torch.int8)}
    spec = _hardware.GPUS[key]
    assert spec.bf16_tflops == pytest.approx(dense[torch.bfloat16], rel=0.01)
    assert spec.int8_tops == pytest.approx(dense[torch.int8], rel=0.01)
    assert spec.hbm_gbs == pytest.approx(info.dram_bw_gbs, rel=0.01)


def test_the_probe_measures_this_machine():
    # the real probe, once: a positive ratio (its value is the machine's)
    assert _hardware._probe(torch.device("cpu"), "int8") > 0


def test_the_cpu_probe_runs_on_one_thread(monkeypatch):
    # a multi-threaded fp32 matmul on shared cores can be slower than a reference loop
    seen = []
    monkeypatch.setattr(_hardware, "_timed_ratio", lambda device, kind: seen.append(torch.get_num_threads()) or 1.0)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        _hardware._probe(torch.device("cpu"), "bf16")
        assert seen == [1] and torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


def test_the_int8_against_bf16_probe_runs(monkeypatch):
    # the unknown-GPU probe's code, on the CPU at a small size: a positive ratio
    monkeypatch.setattr(_hardware, "_INT8_PROBE_SIZE", 32)
    assert _hardware._probe_int8_vs_bf16(torch.device("cpu")) > 0


def _train_step(int8_matmul, dtype=torch.float32) -> list[str]:
    model = fsdp_int8.quantize_(
        nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 16)),
        fsdp_int8.Int8TrainingConfig(int8_matmul=int8_matmul, min_features=1),
    ).to(dtype)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            model(torch.randn(4, 16, dtype=dtype)).sum().backward()
    return [str(w.message) for w in caught if "fsdp_int8:" in str(w.message)]


def test_int8_matmuls_warn_once_on_a_cpu_without_a_fast_int8_gemm(fresh):
    _cpu(fresh, AVX2_ONLY, probe_ratio=SLOW)
    assert _train_step(None) == []  # weight-only in fp32: nothing slow configured
    messages = _train_step(fsdp_int8.Int8MatmulConfig())
    assert len(messages) == 1  # two layers, two steps: once per process
    assert "int8 matmuls" in messages[0] and "20.0x the fp32 matmul" in messages[0]
    assert "Weight-only int8" in messages[0]
    assert _train_step(fsdp_int8.Int8MatmulConfig()) == []


def test_bf16_compute_warns_on_a_cpu_without_fast_bf16(fresh):
    _cpu(fresh, AVX2_ONLY, probe_ratio=SLOW)
    messages = _train_step(None, torch.bfloat16)
    assert len(messages) == 1 and "bf16 compute" in messages[0] and "fp32" in messages[0]


def test_nothing_warns_on_a_cpu_with_native_kernels(fresh):
    _cpu(fresh, VNNI_BF16)
    assert _train_step(fsdp_int8.Int8MatmulConfig(), torch.bfloat16) == []


def test_hardware_line_names_the_cpu_and_every_feature(fresh):
    _cpu(fresh, AVX2_ONLY)
    line = _hardware.hardware_line()
    assert line.startswith("CPU ") and torch.__version__ in line
    assert "avx2" in line and "no vnni" in line and "no avx512_bf16" in line and "no amx" in line
