"""The per-device capability check and the slow-kernel warnings (fsdp_int8/hardware.py).

CI runs on one kind of CPU, so the decision is tested with its inputs patched: the CPU
features torch reports, the timing probe, the CUDA compute capability.
"""

from __future__ import annotations

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


@pytest.mark.parametrize("sm,int8,bf16", [((7, 0), False, False), ((7, 5), True, False), ((9, 0), True, True)])
def test_cuda_compute_capability_decides(fresh, sm, int8, bf16):
    fresh.setattr(torch.cuda, "get_device_capability", lambda device=None: sm)
    fresh.setattr(torch.cuda, "get_device_name", lambda device=None: "a GPU")
    found = _hardware._capability("cuda", 0)
    assert (found.int8_gemm_fast, found.bf16_matmul_fast) == (int8, bf16)
    assert found.features == (f"sm_{sm[0]}{sm[1]}",)


def test_the_probe_measures_this_machine():
    # the real probe, once: a positive ratio (its value is the machine's)
    assert _hardware._probe(torch.device("cpu"), "int8") > 0


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
