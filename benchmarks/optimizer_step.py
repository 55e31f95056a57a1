"""One optimizer step over int8 weights: fsdp_int8's optimizers against torch AdamW's forms.

    python -m benchmarks.optimizer_step                 # 4 weights [1024, 1024], 20 steps
    python -m benchmarks.optimizer_step --weights 8 --rows 768 --cols 512

One process, one thread, no FSDP2: each optimizer owns its own int8 weights (the same
initial values and gradients) and the steps of all of them are interleaved (step 1 of
every optimizer, then step 2, ...), once with weights whose quantization kernels run
eagerly and once with weights made with compiled ones (``Int8TrainingConfig(compile=True)``). Prints the median milliseconds per step (lower is faster) and each
one's ratio to ``Int8AdamW``'s in the same mode.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Callable

import torch

import fsdp_int8
from fsdp_int8 import Int8Weight, hardware

OPTIMIZERS: dict[str, Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer]] = {
    "Int8AdamW": lambda p: fsdp_int8.Int8AdamW(p, lr=1e-3, weight_decay=0.1),
    "Int8AdamW 8-bit": lambda p: fsdp_int8.Int8AdamW(p, lr=1e-3, weight_decay=0.1, state_bits=8),
    "AdamW for-loop": lambda p: torch.optim.AdamW(p, lr=1e-3, weight_decay=0.1, foreach=False),
    "AdamW foreach": lambda p: torch.optim.AdamW(p, lr=1e-3, weight_decay=0.1, foreach=True),
    "AdamW fused": lambda p: torch.optim.AdamW(p, lr=1e-3, weight_decay=0.1, fused=True),
}


def _weights(count: int, rows: int, cols: int, compiled: bool) -> list[torch.nn.Parameter]:
    generator = torch.Generator().manual_seed(0)
    params = []
    for _ in range(count):
        values = torch.randn(rows, cols, generator=generator) * 0.02
        param = torch.nn.Parameter(Int8Weight.from_float(values, compiled=compiled))
        param.grad = torch.randn(rows, cols, generator=generator) * 1e-3
        params.append(param)
    return params


def measure(count: int, rows: int, cols: int, steps: int, warmup: int = 3) -> dict[str, dict[str, float]]:
    """``{mode: {optimizer: median seconds per step}}``, modes ``eager`` and ``compiled``."""
    results = {}
    for mode in ("eager", "compiled"):
        optimizers = {name: make(_weights(count, rows, cols, mode == "compiled")) for name, make in OPTIMIZERS.items()}
        times: dict[str, list[float]] = {name: [] for name in optimizers}
        for step in range(warmup + steps):
            for name, optimizer in optimizers.items():
                began = time.perf_counter()
                optimizer.step()
                if step >= warmup:
                    times[name].append(time.perf_counter() - began)
        results[mode] = {name: statistics.median(values) for name, values in times.items()}
    return results


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--weights", type=int, default=4)
    parser.add_argument("--rows", type=int, default=1024)
    parser.add_argument("--cols", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=20, help="timed steps per optimizer and mode")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    print(f"{args.weights} int8 weights [{args.rows}, {args.cols}], stochastic rounding, weight decay 0.1, "
          f"1 thread; median of {args.steps} interleaved steps")
    print(hardware.hardware_line())
    results = measure(args.weights, args.rows, args.cols, args.steps)
    print(f"{'kernels':<10}" + "".join(f"{name:>17}" for name in OPTIMIZERS))
    for mode, row in results.items():
        base = row["Int8AdamW"]
        print(f"{mode:<10}" + "".join(f"{row[n] * 1e3:9.1f} ms {row[n] / base:4.2f}x" for n in OPTIMIZERS))


if __name__ == "__main__":
    main()
