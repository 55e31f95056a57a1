"""``python -m benchmarks.ratios --experts <model>``: one block's experts alone, int8 against
bf16 ``torch._grouped_mm``, timed side by side, with each row's kernels and host reads per
call (benchmarks.experts_gemm). Run here on its tiny smoke shape."""

from __future__ import annotations

import re

import pytest

from benchmarks import ratios

pytest.importorskip("triton")


def test_the_experts_row_times_both_and_counts_the_gpu_path_without_host_reads(capsys):
    result = ratios.main(["--experts", "tiny", "--batch-size", "2", "--seq-len", "8", "--steps", "2", "--warmup", "1"])
    text = "\n".join(result["experts"])
    assert capsys.readouterr().out.strip() == text
    assert re.search(r"^int8-mm\s+[\d.]+\s+[\d.]+x", text, re.M), text
    counts = dict(re.findall(r"^  (.+?): aten kernels \d+, triton launches (\d+, host reads \d+)", text, re.M))
    # forward, input gradient, weight gradient of two grouped matmuls: 6 GEMMs per call
    assert counts["int8-mm, Triton kernels (a GPU's path)"] == "6, host reads 0", text
    assert counts["int8-mm, loop over experts"] == "0, host reads 6", text
    weight_mb = dict(re.findall(r"^  (.+?): .*expert weights read ([\d.]+) MB", text, re.M))
    assert float(weight_mb["int8-mm, loop over experts"]) * 2 == pytest.approx(float(weight_mb["bf16 torch._grouped_mm"]))


def test_an_unknown_model_name_is_refused(capsys):
    with pytest.raises(SystemExit):
        ratios.main(["--experts", "qwen9"])
    assert "'qwen9' is neither a number of experts nor one of qwen3-30b-a3b, tiny" in capsys.readouterr().err
