"""``python -m benchmarks.gpu --dry-run``: the GPU evidence kit's code path, on the CPU at tiny
shapes, so that it cannot rot before a GPU comes (docs/gpu.md)."""

from __future__ import annotations

import json
import math

from benchmarks import gpu


def test_dry_run_checks_gemms_and_training_and_writes_its_report(tmp_path):
    out = tmp_path / "gpu.md"
    results = gpu.main(["--dry-run", "--out", str(out)])
    assert results["checks"] and all(v.startswith("pass") for v in results["checks"].values()), results["checks"]
    assert [(r["tokens"], r["k"], r["n"]) for r in results["gemm"]] == gpu.DRY_GEMM_SHAPES
    for row in results["gemm"]:
        assert all(row[f"{what} ratio"] > 0 for what in ("raw", "linear forward", "linear fwd+bwd")), row
    trained = results["train"]["rows"]
    assert set(trained) == set(gpu.TRAIN_ROWS)
    assert all(math.isfinite(r["loss"]) and r["tokens_per_s"] > 0 for r in trained.values()), trained
    assert trained["bf16"]["ratio"] == 1.0 and trained["bf16:blocks"]["ratio"] == 1.0  # baselines against themselves
    # the lean recipe and bf16 each built and stepped alone (peaks are CUDA-only)
    assert results["train"]["memory"] == {row: None for row in gpu.MEMORY_ROWS}
    text = out.read_text()
    assert text.startswith("# fsdp_int8 on GPUs") and "| check | result |" in text and "Goals" in text
    assert "| lean | n/a (CPU) | - |" in text
    (run,) = json.loads(out.with_suffix(".json").read_text())
    assert run["hardware"].startswith("CPU ") and run["argv"][0] == "--dry-run"
