"""The torchrun launcher end to end: a real run, a rank killed and restarted, bad input."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import fsdp_int8
from launch import train
from launch.metrics import read_metrics
from launch.model import Transformer

ROOT = Path(__file__).resolve().parents[2]
# A small, fast run: 2 MB of text, 40 steps of 4 x 64 bytes on the tiny preset.
RUN = ["--preset", "tiny", "--steps", "40", "--batch-size", "4", "--seq-len", "64",
       "--max-bytes", "2000000", "--checkpoint-every", "10", "--eval-every", "20",
       "--eval-batches", "2", "--keep", "10"]


def _torchrun(out: Path, *extra: str) -> subprocess.Popen:
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
               *extra, "-m", "launch.train", *RUN, "--out", str(out)]
    return subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _worker_with_rank(parent: int, rank: int) -> int | None:
    """The pid of torchrun's worker process whose RANK is ``rank``."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            environ = (entry / "environ").read_bytes().split(b"\0")
        except (OSError, IndexError, ValueError):
            continue
        if ppid == parent and f"RANK={rank}".encode() in environ:
            return int(entry.name)
    return None


def _final_weights(out: Path) -> dict[str, torch.Tensor]:
    """The final checkpoint loaded into one unsharded process (a 2 -> 1 load)."""
    args = train.parse_args(RUN)
    model = fsdp_int8.quantize_(Transformer(args.model))
    fsdp_int8.load_checkpoint(out / "checkpoints", model)
    weights = {}
    for name, param in model.named_parameters():
        if isinstance(param, fsdp_int8.Int8Weight):
            weights[name + ".int_data"], weights[name + ".scale"] = param.int_data, param.scale
        else:
            weights[name] = param.detach()
    return weights


def test_a_killed_rank_restarts_and_the_run_ends_as_if_uninterrupted(tmp_path):
    interrupted, clean = tmp_path / "interrupted", tmp_path / "clean"
    proc = _torchrun(interrupted, "--max-restarts", "1")
    killed_at = None
    try:
        deadline = time.monotonic() + 240
        metrics = interrupted / "metrics.jsonl"
        while killed_at is None:
            assert proc.poll() is None and time.monotonic() < deadline, "run ended before the kill"
            steps = [r["step"] for r in read_metrics(metrics) if "loss" in r] if metrics.exists() else []
            if steps and max(steps) >= 25:  # past the checkpoints of steps 10 and 20
                pid = _worker_with_rank(proc.pid, 1)
                if pid is not None:
                    os.kill(pid, signal.SIGKILL)
                    killed_at = max(steps)
            time.sleep(0.01)
        output, _ = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, output[-3000:]
    assert killed_at < 40, "killed too late to matter"
    starts = [r for r in read_metrics(interrupted / "metrics.jsonl") if r.get("event") == "start"]
    assert [r["step"] for r in starts][0] == 0 and starts[-1]["step"] in (20, 30), starts

    clean_run = _torchrun(clean)
    clean_output, _ = clean_run.communicate(timeout=300)
    assert clean_run.returncode == 0, clean_output[-3000:]
    assert "done: 40 steps" in clean_output and (clean / "loss.png").stat().st_size > 10_000

    records = read_metrics(clean / "metrics.jsonl")
    losses = [r["loss"] for r in records if "loss" in r]
    assert len(losses) == 40 and losses[-1] < losses[0] - 1.0, losses  # ln(256) = 5.5 at start
    assert all(r["all_gather_bytes"] > 0 for r in records if "loss" in r)

    a, b = _final_weights(interrupted), _final_weights(clean)
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), f"{name} differs after the restart"


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--data", "/nonexistent/corpus"], "data path /nonexistent/corpus does not exist"),
        (["--preset", "huge"], "invalid choice: 'huge'"),
        (["--replicas", "3"], "--replicas 3 does not divide the world size 2"),
        (["--n-heads", "5"], "dim=64 is not divisible by n_heads=5"),
        (["--steps", "0"], "--steps must be at least 1"),
    ],
)
def test_bad_input_fails_before_any_process_group(argv, message, monkeypatch, capsys, tmp_path):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    try:
        code = train.main(argv + ["--out", str(tmp_path)])
    except SystemExit as exit_:  # argparse
        code = exit_.code
    assert code == 2
    assert message in capsys.readouterr().err
    assert not torch.distributed.is_initialized()


def test_empty_data_directory_is_refused(monkeypatch, capsys, tmp_path):
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "image.png").write_bytes(b"\x89PNG")
    monkeypatch.setenv("RANK", "0")
    assert train.main(["--data", str(tmp_path / "data")]) == 2
    assert "no text files" in capsys.readouterr().err


def test_bad_data_path_under_torchrun_exits_without_hanging(tmp_path):
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
               "-m", "launch.train", "--data", str(tmp_path / "missing"), "--out", str(tmp_path)]
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode != 0
    assert "does not exist" in result.stdout + result.stderr
