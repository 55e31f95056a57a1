"""``python -m benchmarks.quality_curves``: the per-seed table and its means from launcher
run folders (written here as the launcher writes ``metrics.jsonl``), the plot, and the
refusals."""

from __future__ import annotations

import json

import pytest

from benchmarks import quality_curves


def _run(folder, losses: dict[int, float], validation: dict[int, float]):
    folder.mkdir()
    records = [{"event": "start", "step": 0}]
    records += [{"step": step, "loss": loss} for step, loss in losses.items()]
    records += [{"step": step, "val_loss": loss} for step, loss in validation.items()]
    records.append({"event": "end", "step": max(losses)})
    (folder / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in records))
    return str(folder)


def test_the_table_gives_each_seed_the_means_and_the_gap(tmp_path):
    train = {step: 3.0 - step / 100 for step in range(0, 201)}
    base = [_run(tmp_path / f"b{seed}", train, {100: 2.0 + seed, 200: 1.0 + seed}) for seed in (0, 1)]
    other = [_run(tmp_path / f"o{seed}", train, {100: 2.2 + seed, 200: 1.1 + seed}) for seed in (0, 1)]
    plot = tmp_path / "curves.png"
    lines = quality_curves.main(["--row", "base", *base, "--row", "other", *other, "--plot", str(plot)])
    assert lines[2] == "| 100 | 2.0000, 3.0000: **2.5000** | 2.2000, 3.2000: **2.7000** | other +8.00% |"
    assert lines[3] == "| 200 | 1.0000, 2.0000: **1.5000** | 1.1000, 2.1000: **1.6000** | other +6.67% |"
    assert plot.stat().st_size > 0


def test_rows_of_unequal_seeds_and_runs_without_validation_are_refused(tmp_path):
    train = {0: 3.0, 1: 2.0}
    one = _run(tmp_path / "one", train, {1: 2.0})
    two = _run(tmp_path / "two", train, {1: 2.0})
    with pytest.raises(ValueError, match="same number of runs"):
        quality_curves.main(["--row", "a", one, "--row", "b", one, two])
    with pytest.raises(ValueError, match="no validation loss"):
        quality_curves.main(["--row", "a", one, "--row", "b", _run(tmp_path / "none", train, {})])
    with pytest.raises(SystemExit):
        quality_curves.main(["--row", "a", one])
