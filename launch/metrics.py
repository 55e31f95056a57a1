"""What a training run leaves behind: a JSONL log of every step, a progress bar, a PNG."""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch


class MetricsLog:
    """Appends one JSON object per line; a resumed run drops the records it will redo."""

    def __init__(self, path: Path, resume_step: int | None) -> None:
        self.path = path
        records = read_metrics(path) if resume_step is not None and path.exists() else []
        kept = [r for r in records if r.get("step", 0) < (resume_step or 0) or r.get("event")]
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in kept)
        self._file = open(path, "a")

    def write(self, **record: Any) -> None:
        self._file.write(json.dumps({**record, "time": time.time()}) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


def read_metrics(path: str | os.PathLike) -> list[dict]:
    """The records of a metrics file (a torn last line from a killed run is skipped)."""
    records = []
    for line in Path(path).read_text().splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return records


class Progress:
    """A tqdm bar on rank 0; plain lines when tqdm is missing or output is not a terminal."""

    def __init__(self, total: int, initial: int, enabled: bool) -> None:
        self.enabled = enabled
        self.bar = None
        if enabled:
            try:
                from tqdm import tqdm

                self.bar = tqdm(total=total, initial=initial, unit="step", dynamic_ncols=True,
                                mininterval=1.0)
            except ImportError:
                pass

    def update(self, step: int, loss: float, tokens_per_s: float, gathered_bytes: int) -> None:
        if not self.enabled:
            return
        text = f"loss {loss:.3f} | {tokens_per_s:,.0f} tok/s | all-gather {gathered_bytes / 1e6:.2f} MB/step"
        if self.bar is not None:
            self.bar.set_postfix_str(text, refresh=False)
            self.bar.update(1)
        elif step % 25 == 0:
            print(f"step {step}: {text}", flush=True)

    def restart_clock(self) -> None:
        """Count the rate and the ETA from here on: the steps so far (one that compiled)
        would make the ETA of the rest many times too long."""
        if self.bar is not None:
            done = self.bar.n
            self.bar.reset()
            self.bar.n = self.bar.last_print_n = self.bar.initial = done

    def write(self, message: str) -> None:
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.write(message)
        else:
            print(message, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


class RunLog:
    """Rank 0's record of a run: the progress bar and ``metrics.jsonl`` (nothing on the other
    ranks, which only train)."""

    def __init__(self, path: Path, *, total: int, start: int, resumed: bool, enabled: bool) -> None:
        self.enabled = enabled
        self.metrics = MetricsLog(path, resume_step=start if resumed else None) if enabled else None
        self.progress = Progress(total=total, initial=start, enabled=enabled)

    def note(self, line: str) -> None:
        """Say ``line`` (rank 0)."""
        if self.enabled:
            self.progress.write(line)

    def start(self, line: str, **record: Any) -> None:
        """Say ``line`` and record the start event."""
        if self.enabled:
            self.progress.write(line)
            self.metrics.write(event="start", **record)

    def step(self, step: int, loss: "torch.Tensor", lr: float, seconds: float, tokens: int, counter: Any,
             grad_norm: "torch.Tensor | float | None" = None, routing: dict[str, float] | None = None) -> None:
        """One training step: its loss, learning rate, time, tokens (all ranks), the bytes
        its collectives moved (``counter``: a ``CollectiveCounter``), the global gradient
        norm before clipping (``None``: not measured, no clipping) and, for a
        mixture-of-experts model, how evenly its routers spread the tokens (``routing``)."""
        if not self.enabled:  # the loss stays on the device: no sync on the other ranks
            return
        loss, gathered = loss.item(), counter.total_bytes("all_gather_single")
        self.progress.update(step, loss, tokens / seconds, gathered)
        norm = {} if grad_norm is None else {"grad_norm": float(grad_norm)}
        self.metrics.write(step=step, loss=loss, lr=lr, seconds=seconds, tokens_per_s=tokens / seconds,
                           all_gather_bytes=gathered, collective_bytes=counter.total_bytes(), **norm,
                           **(routing or {}))

    def compiled(self, what: str, seconds: float) -> None:
        """``what`` (a step or an evaluation that compiled) took ``seconds``: say so and
        keep it out of the ETA."""
        if self.enabled:
            self.progress.write(f"{what} took {seconds:.0f} s with compilation; the ETA counts from here")
            self.progress.restart_clock()

    def validation(self, step: int, val: float) -> None:
        if self.enabled:
            self.metrics.write(step=step, val_loss=val)
            self.progress.write(f"step {step}: validation loss {val:.4f} ({bits_per_byte(val):.3f} bits/byte)")

    def close(self, step: int, val: float | None) -> None:
        """Record the end event and close the file and the bar."""
        self.progress.close()
        if self.enabled:
            self.metrics.write(event="end", step=step, val_loss=val)
            self.metrics.close()


def plot_losses(records: list[dict], path: Path, title: str) -> Path | None:
    """Train loss (a running mean) and validation loss against the step, as a PNG."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    train = {r["step"]: r["loss"] for r in records if "loss" in r}
    val = {r["step"]: r["val_loss"] for r in records if "val_loss" in r}
    steps = sorted(train)
    window = max(1, len(steps) // 50)
    smoothed = [
        sum(train[s] for s in steps[max(0, i - window + 1): i + 1]) / len(steps[max(0, i - window + 1): i + 1])
        for i in range(len(steps))
    ]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(steps, smoothed, label=f"train (mean of {window})")
    if val:
        ax.plot(sorted(val), [val[s] for s in sorted(val)], "o-", label="validation")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats/byte)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def bits_per_byte(loss: float) -> float:
    return loss / math.log(2)
