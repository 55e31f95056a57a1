"""Quality of recipes against a baseline over seeds, from the launcher's run folders.

    python -m benchmarks.quality_curves --row bf16 runs/bf16_s1 runs/bf16_s2 runs/bf16_s3 \\
        --row lean-4bit runs/lean4_s1 runs/lean4_s2 runs/lean4_s3 --plot docs/img/quality.png --log

Each ``--row NAME FOLDER...`` names a recipe and its runs (``launch.train --out FOLDER``),
one per seed, in the same seed order for every row: the first row is the baseline. For
each validation step that every run logged, the table gives each row's validation loss per
seed, the mean over seeds and the mean's difference from the baseline's (each seed shared
by the rows it compares, so the seeds' own spread cancels from the difference); the last
column gives the gap at each step, so whether it grows with steps reads down it. ``--plot``
draws each row's training loss (mean over seeds, smoothed over 20 steps) and validation
points side by side, and below them each row's validation gap to the baseline by step.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from benchmarks.report import RunLog
from fsdp_int8.hardware import hardware_line

SMOOTHING_STEPS = 20


def read_run(folder: Path) -> tuple[dict[int, float], dict[int, float]]:
    """``(training loss by step, validation loss by step)`` of one launcher run."""
    train, validation = {}, {}
    for line in (folder / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        if "event" in record:
            continue
        if "loss" in record:
            train[record["step"]] = record["loss"]
        if "val_loss" in record:
            validation[record["step"]] = record["val_loss"]
    if not validation:
        raise ValueError(f"{folder} logged no validation loss: run launch.train with --eval-every")
    return train, validation


Run = tuple[dict[int, float], dict[int, float]]


def validation_means(runs: list[Run]) -> dict[int, float]:
    """Mean validation loss over a row's runs at each step that all of them logged."""
    steps = sorted(set.intersection(*(set(v) for _, v in runs)))
    return {step: statistics.fmean(v[step] for _, v in runs) for step in steps}


def compare(runs: dict[str, list[Run]]) -> list[str]:
    """The table's lines: validation loss per row and seed at each shared step."""
    seeds = {len(v) for v in runs.values()}
    if len(seeds) != 1:
        raise ValueError(f"every row needs the same number of runs (one per seed), got {seeds}")
    steps = sorted(set.intersection(*(set(v) for r in runs.values() for _, v in r)))
    baseline = next(iter(runs))
    header = "| step | " + " | ".join(f"{name} (per seed: mean)" for name in runs) + " | vs " + baseline + " |"
    lines = [header, "|" + "---|" * (len(runs) + 2)]
    row_means = {name: validation_means(r) for name, r in runs.items()}
    for step in steps:
        means = {name: row_means[name][step] for name in runs}
        cells = [", ".join(f"{v[step]:.4f}" for _, v in r) + f": **{means[name]:.4f}**" for name, r in runs.items()]
        gaps = ", ".join(f"{name} {100 * (means[name] / means[baseline] - 1):+.2f}%"
                         for name in runs if name != baseline)
        lines.append(f"| {step} | " + " | ".join(cells) + f" | {gaps} |")
    return lines


def plot(runs_by_row: dict[str, list[Run]], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (axis, gap_axis) = plt.subplots(2, 1, figsize=(7, 6.5), sharex=True, height_ratios=(3, 2))
    baseline_name = next(iter(runs_by_row))
    baseline = validation_means(runs_by_row[baseline_name])
    for name, runs in runs_by_row.items():
        steps = sorted(set.intersection(*(set(t) for t, _ in runs)))
        mean = [statistics.fmean(t[s] for t, _ in runs) for s in steps]
        smooth = [statistics.fmean(mean[max(0, i - SMOOTHING_STEPS + 1):i + 1]) for i in range(len(mean))]
        line, = axis.plot(steps, smooth, label=f"{name} (training, mean of {len(runs)})")
        validation = validation_means(runs)
        axis.plot(list(validation), list(validation.values()), "o", color=line.get_color(),
                  label=f"{name} (validation)")
        shared = [step for step in validation if step in baseline]
        gap_axis.plot(shared, [100 * (validation[s] / baseline[s] - 1) for s in shared], "o-",
                      color=line.get_color(), label=name)
    axis.set_ylabel("loss (nats per byte)")
    axis.set_ylim(top=min(3.0, axis.get_ylim()[1]))
    axis.legend(fontsize="small")
    gap_axis.axhline(0.0, color="black", linewidth=0.8)
    gap_axis.set_xlabel("step")
    gap_axis.set_ylabel(f"validation vs {baseline_name} (%)")
    for each in (axis, gap_axis):
        each.grid(alpha=0.3)
    figure.tight_layout()
    figure.savefig(out, dpi=100)


def main(argv: list[str] | None = None) -> list[str]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--row", nargs="+", action="append", required=True, metavar=("NAME", "FOLDER"),
                        help="a recipe's name and its run folders, one per seed (the first row: the baseline)")
    parser.add_argument("--plot", type=Path, help="write the curves to this PNG")
    parser.add_argument("--log", action="store_true", help="append the table to benchmarks/results/memory.md")
    args = parser.parse_args(argv)
    if any(len(row) < 2 for row in args.row) or len(args.row) < 2:
        parser.error("give at least two --row NAME FOLDER... (the first is the baseline)")
    runs = {row[0]: [read_run(Path(folder)) for folder in row[1:]] for row in args.row}
    log = RunLog("memory.md", "quality over seeds", "benchmarks.quality_curves", argv) if args.log else None
    print(hardware_line())  # the machine the runs are read on: run them there
    lines = compare(runs)
    print("\n".join(lines))
    if args.plot:
        plot(runs, args.plot)
        print(f"plot: {args.plot}")
    if log:
        log.finish()
    return lines


if __name__ == "__main__":
    main()
