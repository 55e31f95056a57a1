"""One optimizer step over int8 weights: fsdp_int8's optimizers against torch AdamW's forms.

    python -m benchmarks.optimizer_step                 # 4 weights [1024, 1024], 20 steps
    python -m benchmarks.optimizer_step --weights 8 --rows 768 --cols 512
    python -m benchmarks.optimizer_step --log           # + a dated section in benchmarks/results/performance.md

One process, one thread, no FSDP2: each optimizer (built by the registry,
``benchmarks.rows.OPTIMIZERS``) owns its own int8 weights (the same initial values and
gradients) and the steps of all of them are interleaved in the benchmarks' one loop
(``benchmarks.timing``: every optimizer steps once per round, the order rotating), once
with weights whose quantization kernels run eagerly and once with weights made with
compiled ones (``compiled=True``, what ``Int8TrainingConfig(compile="on")`` gives every
weight). Prints the median milliseconds per step (lower is faster) and the median over
rounds of each one's step time over ``Int8AdamW``'s in the same round.
"""

from __future__ import annotations

import argparse
import statistics
import sys

import torch

from benchmarks.report import log_run
from benchmarks.rows import OPTIMIZERS as FACTORIES
from benchmarks.timing import interleave, paired_ratio
from fsdp_int8 import Int8Weight, hardware

# the registry's names: fsdp_int8's optimizers (8-bit states in blocks of 128), torch AdamW's three forms
OPTIMIZERS = ("Int8AdamW", "8-bit AdamW", "AdamW for-loop", "AdamW foreach", "fused AdamW")
BASELINE = "Int8AdamW"


def _weights(count: int, rows: int, cols: int, compiled: bool) -> list[torch.nn.Parameter]:
    generator = torch.Generator().manual_seed(0)
    params = []
    for _ in range(count):
        values = torch.randn(rows, cols, generator=generator) * 0.02
        param = torch.nn.Parameter(Int8Weight.from_float(values, compiled=compiled))
        param.grad = torch.randn(rows, cols, generator=generator) * 1e-3
        params.append(param)
    return params


def measure(count: int, rows: int, cols: int, steps: int, warmup: int = 3) -> dict[str, dict[str, list[float]]]:
    """``{mode: {optimizer: [seconds of each timed step]}}``, modes ``eager`` and ``compiled``."""
    results = {}
    for mode in ("eager", "compiled"):
        optimizers = {name: FACTORIES[name](_weights(count, rows, cols, mode == "compiled"), 1e-3, 0.1)
                      for name in OPTIMIZERS}
        results[mode] = interleave({name: (lambda i, o=o: o.step()) for name, o in optimizers.items()},
                                   steps=steps, warmup=warmup)
    return results


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--weights", type=int, default=4)
    parser.add_argument("--rows", type=int, default=1024)
    parser.add_argument("--cols", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=20, help="timed steps per optimizer and mode")
    parser.add_argument("--log", action="store_true",
                        help="also append a dated section (command, hardware line, table) to "
                        "benchmarks/results/performance.md")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    lines: list[str] = []

    def say(text: str) -> None:
        print(text, flush=True)
        lines.append(text)

    say(f"{args.weights} int8 weights [{args.rows}, {args.cols}], stochastic rounding, weight decay 0.1, "
        f"1 thread; median of {args.steps} interleaved steps; ratio: median over steps of the step time over "
        f"{BASELINE}'s in the same step")
    say(hardware.hardware_line())
    results = measure(args.weights, args.rows, args.cols, args.steps)
    say(f"{'kernels':<10}" + "".join(f"{name:>17}" for name in OPTIMIZERS))
    for mode, times in results.items():
        say(f"{mode:<10}" + "".join(f"{statistics.median(times[n]) * 1e3:9.1f} ms {paired_ratio(times, n, BASELINE):4.2f}x"
                                    for n in OPTIMIZERS))
    if args.log:
        command = "python -m benchmarks.optimizer_step " + " ".join(sys.argv[1:] if argv is None else argv)
        print(f"logged: {log_run('performance.md', 'One optimizer step', command, lines)}")


if __name__ == "__main__":
    main()
