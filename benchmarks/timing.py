"""The one timing loop of the benchmarks: rows interleaved step by step, paired medians.

Every benchmark that compares step times (``ratios``, ``compare``, ``scaling --measure``,
``speed_memory``, ``optimizer_step``) times its rows here, so they all mean the same thing:

* **Interleaved rows.** Each measured step runs every row once, one after the other (step
  ``i`` of every row before step ``i + 1`` of any), and the order rotates from one step to
  the next so that no row always runs first or last. A machine shared with other jobs
  slows the rows of one step alike.
* **Paired medians.** A row's ratio to a baseline is the median, over the steps, of the
  row's time over the baseline's time *in the same step*: load that drifts over seconds
  cancels within each pair. The ratio of the two medians is printed beside it.

A row is a callable ``step(i) -> object`` (``i`` counts from 0, warm-up steps included);
:func:`train_step` is the training step of the model rows.
"""

from __future__ import annotations

import statistics
import time
from typing import Callable

import torch
import torch.distributed as dist

Times = dict[str, list[float]]  # {row: seconds of each timed step, in step order}


def interleave(rows: dict[str, Callable[[int], object]], *, steps: int, warmup: int = 0,
               on_step: Callable[[str, int], None] | None = None) -> Times:
    """Run ``warmup + steps`` steps of every row, interleaved; time the last ``steps``.

    Args:
        rows: ``{name: step}``; ``step(i)`` runs step ``i`` of that row.
        steps: Timed steps per row.
        warmup: Untimed steps per row first (compilation, allocator, caches).
        on_step: Called as ``on_step(name, i)`` after each row's step ``i``, outside the timing.

    Returns:
        ``{name: [seconds of each timed step]}``, in the order of ``rows``.
    """
    if steps < 1 or warmup < 0:
        raise ValueError(f"need steps >= 1 and warmup >= 0, got steps={steps}, warmup={warmup}")
    if not rows:
        raise ValueError("no rows to time")
    names = list(rows)
    times: Times = {name: [] for name in names}
    for step in range(warmup + steps):
        turn = step % len(names)  # rotate the order: no row always runs first (or last)
        for name in names[turn:] + names[:turn]:
            began = time.perf_counter()
            rows[name](step)
            elapsed = time.perf_counter() - began
            if step >= warmup:
                times[name].append(elapsed)
            if on_step is not None:
                on_step(name, step)
    return times


def paired_ratio(times: Times, row: str, baseline: str) -> float:
    """The median over steps of ``row``'s time over ``baseline``'s in the same step."""
    if len(times[row]) != len(times[baseline]):
        raise ValueError(f"{row!r} and {baseline!r} were not timed in the same steps "
                         f"({len(times[row])} and {len(times[baseline])} times)")
    return statistics.median(t / b for t, b in zip(times[row], times[baseline]))


def ratio_lines(times: Times, baseline: str, labels: dict[str, str] | None = None) -> list[str]:
    """The table every timing benchmark prints: per row its median, the ratio of medians,
    the median of paired ratios (lower is faster), min, max and the number of steps."""
    labels = {row: (labels or {}).get(row, row) for row in times}
    base = statistics.median(times[baseline])
    width = max(15, *map(len, labels.values()))
    lines = [f"{'row':<{width}} {'median ms':>10} {'ratio of medians':>17} {'median of ratios':>17} "
             f"{'min ms':>8} {'max ms':>8} {'steps':>6}"]
    for row, values in times.items():
        median = statistics.median(values)
        lines.append(f"{labels[row]:<{width}} {median * 1e3:10.1f} {median / base:16.3f}x "
                     f"{paired_ratio(times, row, baseline):16.3f}x {min(values) * 1e3:8.1f} "
                     f"{max(values) * 1e3:8.1f} {len(values):6d}")
    return lines


def train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, inputs: torch.Tensor,
               targets: torch.Tensor, clip: bool = True) -> float:
    """One training step as the launcher runs it: forward, next-token loss, backward,
    gradient clipping at 1.0 (``clip``; an optimizer that clips inside backward takes
    ``clip=False``), the optimizer step, ``zero_grad``, then a barrier (so that a step's
    time includes the slowest rank's). Returns the loss."""
    from launch.model import next_token_loss

    loss = next_token_loss(model, inputs, targets)
    loss.backward()
    if clip:
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    optimizer.zero_grad()
    if dist.is_initialized():
        dist.barrier()
    return loss.item()
