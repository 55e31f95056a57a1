"""The torchrun launcher end to end: a real run, a rank killed and restarted, bad input, and
who may write into an --out that already holds checkpoints."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.nn as nn

import fsdp_int8
from fsdp_int8 import _hardware
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
    assert train.main(["--data", str(tmp_path / "data"), "--out", str(tmp_path / "out")]) == 2
    assert "no text files" in capsys.readouterr().err


def test_bad_data_path_under_torchrun_exits_without_hanging(tmp_path):
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
               "-m", "launch.train", "--data", str(tmp_path / "missing"), "--out", str(tmp_path)]
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode != 0
    assert "does not exist" in result.stdout + result.stderr


# ---------------------------------------------------------------- an --out with checkpoints
# One process, in this one (no torchrun): 2 steps of a small run take about a second.
SHORT = ["--preset", "tiny", "--steps", "2", "--batch-size", "2", "--seq-len", "32",
         "--max-bytes", "300000", "--checkpoint-every", "2", "--eval-every", "2", "--eval-batches", "1"]


@pytest.fixture
def one_process(monkeypatch):
    """torchrun's environment for a world of one process; ``main`` runs in this one."""
    for name, value in {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0",
                        "LOCAL_WORLD_SIZE": str(os.cpu_count() or 1),  # one thread, as now
                        "MASTER_ADDR": "127.0.0.1"}.items():
        monkeypatch.setenv(name, value)
    for name in ("TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_RUN_ID"):
        monkeypatch.delenv(name, raising=False)
    threads = torch.get_num_threads()

    def main(*argv: str) -> int:
        with socket.socket() as probe:  # a free port for this process group's store
            probe.bind(("127.0.0.1", 0))
            monkeypatch.setenv("MASTER_PORT", str(probe.getsockname()[1]))
        return train.main(list(argv))

    yield main
    torch.set_num_threads(threads)


def test_a_new_run_refuses_another_runs_checkpoints_and_a_finished_run_is_complete(one_process, capsys, tmp_path):
    out = str(tmp_path / "out")
    assert one_process(*SHORT, "--out", out) == 0
    assert (tmp_path / "out" / "checkpoints" / "step_00000002").is_dir()

    assert one_process(*SHORT, "--out", out, "--resume") == 0  # at --steps already
    assert "is complete: its checkpoint is at step 2 and --steps is 2" in capsys.readouterr().out

    assert one_process(*SHORT, "--out", out) == 2  # a new run: refused before any process group
    assert "already holds checkpoints of another run (newest: step_00000002): pass --resume" in capsys.readouterr().err
    assert not torch.distributed.is_initialized()
    assert (tmp_path / "out" / "checkpoints" / "step_00000002").is_dir()

    assert one_process(*SHORT, "--out", out, "--overwrite", "--steps", "1") == 0
    assert [p.name for p in (tmp_path / "out" / "checkpoints").glob("step_*")] == ["step_00000001"]


def test_a_torchrun_restart_resumes_only_its_own_jobs_checkpoints(monkeypatch, tmp_path):
    out = tmp_path / "out"
    fsdp_int8.save_checkpoint(out / "checkpoints", nn.Linear(2, 2), step=5)  # an earlier job's
    args = train.parse_args(["--out", str(out)])
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job-b")
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    with pytest.raises(ValueError, match="already holds checkpoints of another run"):
        train.start_mode(args)  # job b's first attempt
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")  # torchrun restarts the refused job
    with pytest.raises(ValueError, match="this torchrun restart found checkpoints of another run"):
        train.start_mode(args)
    assert train.start_mode(train.parse_args(["--out", str(out), "--resume"])) == "resume"

    train.claim_output(out, "fresh")  # what job b's first attempt does when it may start
    assert train.start_mode(args) == "resume"  # its restarts resume its own checkpoints
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job-c")
    with pytest.raises(ValueError, match="this torchrun restart found checkpoints of another run"):
        train.start_mode(args)
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "none")  # no id to tell jobs apart: as before
    assert train.start_mode(args) == "resume"

    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT")
    assert train.start_mode(train.parse_args(["--out", str(out), "--overwrite"])) == "overwrite"
    with pytest.raises(SystemExit):
        train.parse_args(["--out", str(out), "--resume", "--overwrite"])


# ---------------------------------------------------------------- --precision auto
@pytest.mark.parametrize(
    ("int8_fast", "bf16_fast", "precision", "compute"),
    [(False, False, "int8", "fp32"), (True, True, "int8-mm", "bf16"), (True, False, "int8-mm", "fp32")],
)
def test_auto_precision_follows_the_hardware(monkeypatch, int8_fast, bf16_fast, precision, compute):
    found = _hardware.Capability("cpu", "a CPU", (), int8_fast, bf16_fast, "int8 evidence", "bf16 evidence")
    monkeypatch.setattr(_hardware, "capability", lambda device: found)
    args = train.parse_args([])
    assert (args.precision, args.compute_dtype) == ("auto", "auto")  # the defaults
    line = train.choose_for_hardware(args, torch.device("cpu"))
    assert (args.precision, args.compute_dtype) == (precision, compute)
    assert line.startswith("auto on a CPU:") and "int8 evidence" in line and "bf16 evidence" in line


def test_explicit_precision_wins_over_auto(monkeypatch):
    monkeypatch.setattr(_hardware, "capability", lambda device: pytest.fail("asked the hardware"))
    args = train.parse_args(["--precision", "int8-mm", "--compute-dtype", "bf16"])
    assert train.choose_for_hardware(args, torch.device("cpu")) is None
    assert (args.precision, args.compute_dtype) == ("int8-mm", "bf16")
    args = train.parse_args(["--precision", "fp32"])  # a baseline: no compute dtype to choose
    assert train.choose_for_hardware(args, torch.device("cpu")) is None
