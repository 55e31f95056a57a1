"""The benchmarks' one timing loop (``benchmarks.timing``), their row registry
(``benchmarks.rows``) and their dated logs (``benchmarks.report.log_run``); then
``python -m benchmarks.ratios`` at a tiny shape on 2 ranks, with its default rows: bf16
FSDP2, the library's default call and its lean call."""

from __future__ import annotations

import datetime
import math

import pytest

from benchmarks import ratios, report, rows, timing


def test_rows_are_interleaved_in_rotating_order_and_warmup_is_not_timed():
    order = []
    steps = {name: (lambda i, name=name: order.append((i, name))) for name in "abc"}
    times = timing.interleave(steps, steps=3, warmup=1)
    # every step runs each row once before any row's next step, starting one row later each time
    assert order == [(0, "a"), (0, "b"), (0, "c"), (1, "b"), (1, "c"), (1, "a"),
                     (2, "c"), (2, "a"), (2, "b"), (3, "a"), (3, "b"), (3, "c")]
    assert list(times) == ["a", "b", "c"] and all(len(t) == 3 for t in times.values())  # warm-up dropped
    with pytest.raises(ValueError, match="steps >= 1"):
        timing.interleave(steps, steps=0)


def test_ratios_are_medians_of_ratios_within_a_step():
    # the machine slows step 2 for both rows: pairs cancel it, the medians alone do not
    times = {"base": [1.0, 1.0, 4.0, 4.0], "row": [0.5, 0.5, 2.0, 2.0]}
    assert timing.paired_ratio(times, "row", "base") == 0.5
    lines = timing.ratio_lines(times, "base", {"row": "the row"})
    assert "the row" in lines[2] and "0.500x" in lines[2] and "1.000x" in lines[1]
    with pytest.raises(ValueError, match="same steps"):
        timing.paired_ratio({"base": [1.0], "row": [1.0, 2.0]}, "row", "base")


def test_the_registry_names_the_library_calls_and_every_recipe():
    default, lean, bf16 = rows.row("default"), rows.row("lean"), rows.row("bf16")
    assert (default.optimizer, default.clip) == ("fused AdamW", True)
    # the lean optimizer clips inside backward (max_grad_norm): the train step must not clip again
    assert (lean.optimizer, lean.clip) == ("Int8AdamW.lean", False)
    assert (bf16.label, bf16.optimizer) == ("bf16 FSDP2", "fused AdamW")
    assert rows.row("torchao").optimizer == "torch AdamW"
    assert rows.row("int8-mm:compile=off", optimizer="8-bit AdamW").optimizer == "8-bit AdamW"
    # a recipe's kernels: the row's own compile= option, else the word the caller gives (on by default)
    assert rows.row("int8-mm").compile == "on" and rows.row("int8-mm", compile="auto").compile == "auto"
    assert rows.row("int8-mm:compile=off").label == "int8 matmuls (compile=off)"
    assert set(ratios.DEFAULT_ROWS) == {"bf16", "default", "lean"}
    for bad, message in (("int8-mm-all", "or a library call: default, lean"), ("int8:fp16", "unknown option"),
                         ("int8-mm:eager", "is spelled compile=off")):
        with pytest.raises(ValueError, match=message):
            rows.row(bad)
    with pytest.raises(ValueError, match="unknown optimizer"):
        rows.row("bf16", optimizer="Adam")


def test_a_log_appends_a_dated_section_and_keeps_what_was_there(tmp_path):
    first = report.log_run("performance.md", "Step-time ratios", "python -m benchmarks.ratios", ["CPU x", "table 1"],
                           folder=tmp_path)
    report.log_run("performance.md", "Step-time ratios", "python -m benchmarks.ratios --dim 512", ["CPU x", "table 2"],
                   folder=tmp_path)
    text = first.read_text()
    today = datetime.date.today().isoformat()
    assert text.startswith("# Results: performance") and text.count(f"## {today}: Step-time ratios") == 2
    assert text.index("table 1") < text.index("--dim 512") < text.index("table 2")  # newest last
    assert "Load average" in text


def test_ratios_times_bf16_fsdp2_the_default_call_and_the_lean_call(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(report, "RESULTS", tmp_path)
    result = ratios.main(["--dim", "64", "--n-layers", "1", "--seq-len", "32", "--batch-size", "2", "--steps", "2",
                          "--warmup", "1", "--baseline", "bf16", "--log"])
    times = result["times"]
    assert list(times) == ["bf16", "default", "lean"] and all(len(t) == 2 for t in times.values())
    assert all(math.isfinite(timing.paired_ratio(times, row, "bf16")) for row in times)
    shown = capsys.readouterr().out
    assert "default: fsdp_int8 default call, fused AdamW" in shown and "lean: fsdp_int8 lean call" in shown
    logged = (tmp_path / "performance.md").read_text()
    assert "python -m benchmarks.ratios --dim 64" in logged and "CPU " in logged and "median of ratios" in logged


@pytest.mark.exhaustive  # a variant: another model under the rows the test above builds and times
def test_ratios_builds_the_rows_on_a_hugging_face_llama(capsys):
    """``--model hf-llama``: the same rows on transformers' LlamaForCausalLM of the shape;
    recipes it does not build are refused by name."""
    result = ratios.main(["--model", "hf-llama", "--rows", "int8-mm", "--dim", "64", "--n-layers", "1",
                          "--seq-len", "16", "--batch-size", "2", "--steps", "1", "--warmup", "0",
                          "--baseline", "bf16"])
    assert list(result["times"]) == ["bf16", "int8-mm"]
    assert "model: Hugging Face LlamaForCausalLM, dim 64, 1 blocks" in capsys.readouterr().out
    with pytest.raises(ValueError, match="not built on the Hugging Face Llama"):
        rows.build("torchao", ratios.shape(ratios.settings_for(64, [], steps=1, warmup=0, n_layers=1)),
                   model=rows.HF_LLAMA)


def test_a_benchmark_that_prints_as_it_goes_logs_what_it_printed(tmp_path, monkeypatch, capsys):
    from fsdp_int8.hardware import hardware_line

    monkeypatch.setattr(report, "RESULTS", tmp_path)
    log = report.RunLog("memory.md", "Peak memory", "benchmarks.memory", ["--rows", "lean"])
    print("lean peak 5.10")
    path = log.finish()
    print("after the log")  # printing goes back to the terminal alone
    text = path.read_text()
    assert "python -m benchmarks.memory --rows lean" in text and "lean peak 5.10" in text
    assert hardware_line() in text  # the machine, which this output did not print itself
    assert "after the log" not in text and "lean peak 5.10" in capsys.readouterr().out


def test_compiled_block_rows_are_also_compared_with_compiled_bf16():
    times = {"bf16": [2.0], "int8-mm": [1.5], "bf16:blocks": [1.6], "int8-mm:blocks": [1.2]}
    assert list(ratios.compiled_block_rows(times)) == ["bf16:blocks", "int8-mm:blocks"]
    assert ratios.compiled_block_rows({"bf16": [2.0], "int8-mm:blocks": [1.2]}) == {}  # no compiled baseline
    assert ratios.compiled_block_rows({"bf16": [2.0], "bf16:blocks": [1.6]}) == {}  # nothing to compare
    lines = timing.ratio_lines(ratios.compiled_block_rows(times), ratios.COMPILED_BASELINE)
    assert "0.750x" in lines[2]
