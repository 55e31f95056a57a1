"""The torchrun launcher end to end: a real run, a rank killed and restarted, bad input,
who may write into an --out that already holds checkpoints, and the precisions it and the
benchmarks build (launch.precisions, launch.build) and its compile flags (launch.compile_policy)."""

from __future__ import annotations

import argparse
import math
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
import torch.nn as nn
from torch.distributed.fsdp import FSDPModule

import fsdp_int8
from benchmarks.timing import train_step
from fsdp_int8 import hardware
from fsdp_int8.testing import run_distributed
from launch import build, compile_policy, hardware_choice, parallel, precisions, run_dir, train
from launch.metrics import read_metrics
from launch.model import PRESETS, Transformer, next_token_loss

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
        (["--tp", "4"], "--tp 4 does not divide the world size 2"),
        (["--tp", "2", "--n-heads", "1"], "--tp 2 does not divide the model's 1 attention heads"),
        (["--pp", "3"], "--pp 3 does not divide the model's 2 blocks"),
        (["--pp", "2", "--tp", "2"], "--pp 2 x --tp 2 = 4 does not divide the world size 2"),
        (["--pp", "2", "--batch-size", "3"], "--batch-size 3 does not divide into --microbatches 2"),
        (["--pp", "2", "--microbatches", "1"], "--pp-schedule 1f1b needs at least --pp 2 microbatches"),
        (["--microbatches", "2"], "--microbatches is for pipeline parallelism"),
        (["--compile-blocks", "--tp", "2"], "--compile-blocks is not tested with --tp or --pp"),
        # one word per choice: compiling whole blocks is its own flag, the kernels take auto / on / off
        (["--compile", "blocks"], "its own flag: --compile-blocks instead of --compile blocks"),
        (["--compile", "true"], "--compile takes auto, on, off, not 'true'"),
        (["--preset", "tiny-moe", "--tp", "2"], "a mixture-of-experts preset has none"),
        (["--preset", "tiny-moe", "--pp", "2"], "also trains on its routers' load-balancing loss"),
        (["--preset", "tiny-moe", "--compile-blocks", "--compute-dtype", "fp32"],
         "mixture-of-experts preset needs bf16 compute"),
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
    # written in the background: published before the run ends
    assert one_process(*SHORT, "--out", out, "--checkpoint-async") == 0
    assert (tmp_path / "out" / "checkpoints" / "step_00000002" / "manifest.json").is_file()

    assert one_process(*SHORT, "--out", out, "--resume") == 0  # at --steps already
    assert "is complete: its checkpoint is at step 2 and --steps is 2" in capsys.readouterr().out

    assert one_process(*SHORT, "--out", out) == 2  # a new run: refused before any process group
    assert "already holds checkpoints of another run (newest: step_00000002): pass --resume" in capsys.readouterr().err
    assert not torch.distributed.is_initialized()
    assert (tmp_path / "out" / "checkpoints" / "step_00000002").is_dir()

    assert one_process(*SHORT, "--out", out, "--overwrite", "--steps", "1") == 0
    assert [p.name for p in (tmp_path / "out" / "checkpoints").glob("step_*")] == ["step_00000001"]


def test_an_error_during_a_background_save_finishes_it_before_the_run_ends(one_process, monkeypatch, capsys, tmp_path):
    """The save of step 1 is in flight (its write held) when step 2 raises: the run waits
    for it, says it was published, and only then lets the error end the run (and its
    process group)."""
    from fsdp_int8.checkpoint import _files

    real_write, release = _files.write_manifest, threading.Event()

    def held_write(*args, **kwargs):  # the writer thread waits until step 2 has raised
        assert release.wait(timeout=60)
        return real_write(*args, **kwargs)

    def failing_rate(step, args):
        if step == 1:
            release.set()
            raise RuntimeError("injected at step 2")
        return args.lr

    monkeypatch.setattr(_files, "write_manifest", held_write)
    monkeypatch.setattr(train, "learning_rate", failing_rate)
    out = tmp_path / "out"
    with pytest.raises(RuntimeError, match="injected at step 2"):
        one_process(*SHORT, "--out", str(out), "--checkpoint-async", "--checkpoint-every", "1")
    assert f"the checkpoint in flight was published: {out / 'checkpoints' / 'step_00000001'}" in capsys.readouterr().err
    assert (out / "checkpoints" / "step_00000001" / "manifest.json").is_file()
    assert not torch.distributed.is_initialized()


def test_the_lean_recipe_trains_and_resumes(one_process, tmp_path):
    out = str(tmp_path / "lean")
    # with 4-bit states (8-bit ones, the default, train in the next test), with FSDP2's CPU
    # offload (on this CPU mesh a host-to-host no-op, so the run is the plain one's), then
    # resumed without it: where the shards live is no part of a checkpoint
    four_bit = ("--lean", "--optimizer", "int8-adamw-4bit")
    assert one_process(*SHORT, *four_bit, "--cpu-offload", "--out", out) == 0
    assert one_process(*SHORT, *four_bit, "--out", out, "--resume", "--steps", "3") == 0
    records = read_metrics(tmp_path / "lean" / "metrics.jsonl")
    assert records[-1]["step"] == 3
    # each step logs the gradient norm its in-backward clipping measured
    steps = [r for r in records if "loss" in r]
    assert len(steps) == 3 and all(r["grad_norm"] > 0 and math.isfinite(r["grad_norm"]) for r in steps), steps


def test_a_resume_with_other_recipe_flags_is_refused_naming_each_one(one_process, capsys, tmp_path):
    import json

    lean, plain = str(tmp_path / "lean"), str(tmp_path / "plain")
    assert one_process(*SHORT, "--lean", "--grad-clip", "0", "--out", lean) == 0
    assert one_process(*SHORT, "--optimizer", "int8-adamw-8bit", "--grad-clip", "0", "--out", plain) == 0
    capsys.readouterr()

    def refused(out: str, *argv: str) -> str:
        assert one_process(*SHORT, *argv, "--grad-clip", "0", "--out", out, "--resume", "--steps", "3") == 2
        error = capsys.readouterr().err
        assert "Rerun with the checkpoint's flags" in error and "--overwrite" in error, error
        assert len(error) < 1500 and "CheckpointError" not in error, error  # one short message
        return error

    # the lean run's checkpoint, resumed with its optimizer alone (the embedding would go
    # float), or with none of the recipe (the optimizer's state would not fit)
    error = refused(lean, "--optimizer", "int8-adamw-8bit")
    for line in ("--lean: checkpoint True, this run False", "--quantize-embeddings: checkpoint True, this run False",
                 "--step-in-backward: checkpoint True, this run False",
                 "--int8-gathered-weights: checkpoint True, this run False"):
        assert line in error, error
    assert "--optimizer:" not in error and "--precision:" not in error, error  # only what differs
    error = refused(lean)
    assert "--lean: checkpoint True, this run False" in error
    assert "--optimizer: checkpoint int8-adamw-8bit, this run adamw" in error, error
    # the other direction: a checkpoint with a float embedding resumed with --lean
    error = refused(plain, "--lean")
    assert "--lean: checkpoint False, this run True" in error, error
    assert "--quantize-embeddings: checkpoint False, this run True" in error, error
    # a checkpoint recording only its command line is compared through it
    manifest = next((tmp_path / "plain" / "checkpoints").glob("step_*")) / "manifest.json"
    record = json.loads(manifest.read_text())
    assert record["extra"]["argv"][-2:] == ["--out", plain]
    del record["extra"]["recipe"]
    manifest.write_text(json.dumps(record))
    assert "--lean: checkpoint False, this run True" in refused(plain, "--lean")
    # nothing of the refused resumes was trained or written
    assert [p.name for p in (tmp_path / "lean" / "checkpoints").glob("step_*")] == ["step_00000002"]
    assert max(r["step"] for r in read_metrics(tmp_path / "lean" / "metrics.jsonl")) == 2

    # the same recipe resumes; other flags (steps, learning rate, seed) may change
    assert one_process(*SHORT, "--lean", "--grad-clip", "0", "--out", lean, "--resume", "--steps", "3",
                       "--lr", "1e-3", "--seed", "1") == 0
    assert read_metrics(tmp_path / "lean" / "metrics.jsonl")[-1]["step"] == 3


@pytest.mark.parametrize("recipe", [["--precision", "int8-mm"], ["--lean"]])
def test_the_moe_preset_trains_and_resumes(one_process, recipe, tmp_path):
    out = str(tmp_path / "moe")
    assert one_process(*SHORT, "--preset", "tiny-moe", *recipe, "--out", out) == 0
    assert one_process(*SHORT, "--preset", "tiny-moe", *recipe, "--out", out, "--resume", "--steps", "3") == 0
    steps = [r for r in read_metrics(tmp_path / "moe" / "metrics.jsonl") if "loss" in r]
    assert [r["step"] for r in steps] == [0, 1, 2] and all(math.isfinite(r["loss"]) for r in steps), steps
    # each step logs how evenly the routers spread the tokens (1.0 when balanced; the
    # busiest expert holds at least the mean)
    assert all(r["balance_loss"] > 0 and r["expert_load_max"] >= 1.0 for r in steps), steps


def test_every_step_logs_its_gradient_norm(one_process, tmp_path):
    out = tmp_path / "norms"
    assert one_process(*SHORT, "--out", str(out)) == 0  # clip_grad_norm_ after backward (--grad-clip 1.0)
    assert one_process(*SHORT, "--out", str(tmp_path / "none"), "--grad-clip", "0") == 0
    assert all(r["grad_norm"] > 0 for r in read_metrics(out / "metrics.jsonl") if "loss" in r)
    assert not any("grad_norm" in r for r in read_metrics(tmp_path / "none" / "metrics.jsonl"))


def test_bf16_gradients_train(one_process, tmp_path):
    out = tmp_path / "bf16-grads"
    assert one_process(*SHORT, "--optimizer", "int8-adamw-8bit", "--bf16-grads", "--out", str(out)) == 0
    last = read_metrics(out / "metrics.jsonl")[-1]
    assert last["step"] == 2 and math.isfinite(last["val_loss"])


def test_block_activation_checkpointing_gives_the_same_gradients():
    torch.manual_seed(0)
    model = Transformer(PRESETS["tiny"])
    model.init_weights()
    tokens = torch.randint(0, 256, (2, 17), generator=torch.Generator().manual_seed(1))
    grads = []
    for checkpointing in (False, True):
        model.checkpoint_blocks = checkpointing
        next_token_loss(model, tokens[:, :-1], tokens[:, 1:]).backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
        model.zero_grad()
    # the recomputed forward runs the same fp32 kernels on the same inputs: bit for bit
    assert all(torch.equal(grads[0][n], grads[1][n]) for n in grads[0])


def test_a_torchrun_restart_resumes_only_its_own_jobs_checkpoints(monkeypatch, tmp_path):
    out = tmp_path / "out"
    fsdp_int8.save_checkpoint(out / "checkpoints", nn.Linear(2, 2), step=5)  # an earlier job's

    def start_mode(*argv: str) -> str:  # as main() decides it
        args = train.parse_args(["--out", str(out), *argv])
        return run_dir.start_mode(Path(args.out), resume=args.resume, overwrite=args.overwrite)

    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job-b")
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    with pytest.raises(ValueError, match="already holds checkpoints of another run"):
        start_mode()  # job b's first attempt
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")  # torchrun restarts the refused job
    with pytest.raises(ValueError, match="this torchrun restart found checkpoints of another run"):
        start_mode()
    assert start_mode("--resume") == "resume"

    run_dir.claim_output(out, "fresh")  # what job b's first attempt does when it may start
    assert start_mode() == "resume"  # its restarts resume its own checkpoints
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job-c")
    with pytest.raises(ValueError, match="this torchrun restart found checkpoints of another run"):
        start_mode()
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "none")  # no id to tell jobs apart: as before
    assert start_mode() == "resume"

    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT")
    assert start_mode("--overwrite") == "overwrite"
    with pytest.raises(SystemExit):
        train.parse_args(["--out", str(out), "--resume", "--overwrite"])


# ---------------------------------------------------------------- --precision auto
@pytest.mark.parametrize(
    ("int8_fast", "bf16_fast", "precision", "compute"),
    [(False, False, "int8", "fp32"), (True, True, "int8-mm", "bf16"), (True, False, "int8-mm", "fp32")],
)
def test_auto_precision_follows_the_hardware(monkeypatch, int8_fast, bf16_fast, precision, compute):
    found = hardware.Capability("cpu", "a CPU", (), int8_fast, bf16_fast, "int8 evidence", "bf16 evidence")
    monkeypatch.setattr(hardware, "capability", lambda device: found)
    args = train.parse_args([])
    assert (args.precision, args.compute_dtype) == ("auto", "auto")  # the defaults
    chosen, dtype, line = hardware_choice.resolve_auto(args.precision, args.compute_dtype, torch.device("cpu"))
    assert (chosen, dtype) == (precision, compute)
    assert line.startswith("auto on a CPU:") and "int8 evidence" in line and "bf16 evidence" in line


def test_explicit_precision_wins_over_auto(monkeypatch):
    monkeypatch.setattr(hardware, "capability", lambda device: pytest.fail("asked the hardware"))
    cpu = torch.device("cpu")
    assert hardware_choice.resolve_auto("int8-mm", "bf16", cpu) == ("int8-mm", "bf16", None)
    # a baseline: no compute dtype to choose
    assert hardware_choice.resolve_auto("fp32", "auto", cpu) == ("fp32", "auto", None)
    with pytest.raises(SystemExit):  # the old alias of int8-mm is gone
        train.parse_args(["--precision", "int8-mm-all"])


def test_step_in_backward_flags(capsys):
    args = train.parse_args(["--optimizer", "int8-adamw-8bit", "--step-in-backward"])
    assert args.step_in_backward and args.grad_clip == 1.0  # by the previous step's norm inside backward
    assert train.parse_args([]).grad_clip == 1.0
    plain = train.parse_args([])
    assert plain.optimizer == "adamw" and not (plain.quantize_embeddings or plain.activation_checkpointing
                                               or plain.int8_gathered_weights)
    lean = train.parse_args(["--lean"])  # one word for the whole lean-memory recipe
    assert lean.optimizer == "int8-adamw-8bit" and lean.step_in_backward and lean.grad_clip == 1.0
    assert lean.quantize_embeddings and lean.activation_checkpointing and lean.int8_gathered_weights
    assert train.parse_args(["--lean", "--optimizer", "int8-adamw"]).optimizer == "int8-adamw"
    assert train.parse_args(["--optimizer", "int8-adamw-8bit", "--bf16-grads"]).bf16_grads
    refused = {
        ("--bf16-grads",): "--optimizer int8-adamw",
        ("--lean", "--bf16-grads"): "drop one",
        ("--step-in-backward",): "--optimizer int8-adamw",
        ("--optimizer", "int8-adamw", "--step-in-backward", "--pp", "2"): "--pp",
        ("--lean", "--optimizer", "adamw"): "drop --optimizer adamw",
        ("--quantize-embeddings", "--precision", "bf16"): "needs an int8 precision",
        ("--int8-gathered-weights", "--precision", "bf16"): "--int8-gathered-weights needs an int8 precision",
    }
    for argv, message in refused.items():
        with pytest.raises(SystemExit):
            train.parse_args(list(argv))
        assert message in capsys.readouterr().err, argv


# ---------------------------------------------------------------- launch.precisions, launch.compile_policy
def test_a_row_spells_a_precision_and_its_options():
    parse, recipe = precisions.parse_row, precisions.Recipe
    assert parse("int8-mm") == recipe(precisions.PRECISIONS["int8-mm"], "bf16", "on")  # compile=on: the rows' default
    assert parse("int8:fp32:compile=off") == recipe.of("int8", "fp32", "off")
    assert parse("int8:compile=on", compile="off").compile == "on" and parse("int8:compile=auto").compile == "auto"
    assert parse("bf16") == recipe.of("bf16", "fp32", "on")  # options dropped
    for name in ("int8-mm", "int8:fp32:compile=off", "int8:compile=auto", "int8:bf16-model", "int8-grads:compile=off",
                 "all-bf16", "torchao"):
        assert parse(name).name == name  # the spelling of a recipe reads back as it
    assert parse("int8:fp32:compile=on", compile="off").name == "int8:fp32"
    assert parse("int8-mm-wgrad-bf16:compile=off").label == "int8 matmuls, float wgrad (compile=off)"
    for bad, message in (("int8-mm-all", "unknown precision"), ("int8:fp16", "unknown option"),
                         ("int8:compile=yes", "compile=auto / compile=on / compile=off"),
                         ("fp32:compile=off", "takes no options")):
        with pytest.raises(ValueError, match=message):
            parse(bad)
    assert set(precisions.LAUNCHER_PRECISIONS) <= set(precisions.PRECISIONS)
    # the launcher's --compile auto and the benchmarks' rows: the library's rule, for the model's width
    assert precisions.resolve_compile("auto", 511) == "off" and precisions.resolve_compile("auto", 512) == "on"
    assert precisions.resolve_compile("on", 16) == "on" and precisions.resolve_compile("off", 4096) == "off"


def test_the_compile_choice_has_one_spelling_and_the_others_name_it():
    """Rows, recipes and the launcher spell the kernels' choice as Int8TrainingConfig.compile
    does (auto / on / off); the row options compiled and eager, a bool and --compile blocks
    are refused, each naming the spelling to use."""
    for old, new in (("int8:fp32:eager", "int8:fp32:compile=off"), ("int8-mm:compiled:blocks", "int8-mm:compile=on:blocks")):
        with pytest.raises(ValueError, match=f"is spelled compile=o[nf]+ .*: {new} instead of {old}"):
            precisions.parse_row(old)
        with pytest.raises(argparse.ArgumentTypeError, match=new):
            precisions.row_argument(old)
    with pytest.raises(TypeError, match="use compile='off' instead of compile=False"):
        precisions.Recipe(precisions.PRECISIONS["int8"], "bf16", False)
    assert train.parse_args([]).compile == "auto" and train.parse_args(["--compile", "off"]).compile == "off"
    with pytest.raises(argparse.ArgumentTypeError, match="--compile-blocks instead of --compile blocks"):
        compile_policy.compile_choice("blocks")


def test_compiled_blocks_are_a_row_option_of_every_precision_and_a_launcher_flag():
    parse, recipe = precisions.parse_row, precisions.Recipe
    assert parse("bf16:blocks") == recipe(precisions.PRECISIONS["bf16"], None, "off", True)
    # compiled blocks keep the compiled kernels for what runs outside them (the weights' updates)
    assert parse("int8-mm:blocks") == recipe(precisions.PRECISIONS["int8-mm"], "bf16", "on", True)
    assert parse("int8-mm:compile=off:blocks").compile == "off"
    for name in ("bf16:blocks", "int8-mm:blocks", "int8:fp32:blocks", "int8-mm:compile=off:blocks"):
        assert parse(name).name == name
    assert parse("int8:compile=on:blocks", compile="off").name == "int8:blocks"
    with pytest.raises(ValueError, match="takes no options but blocks"):
        parse("fp32:compile=off:blocks")
    flagged = train.parse_args(["--compile-blocks", "--compile", "off"])  # two choices, one flag each
    assert flagged.compile_blocks and flagged.compile == "off" and not train.parse_args([]).compile_blocks
    # torch compiles torch._grouped_mm for bf16 operands only: fp32 MoE blocks are refused
    # (--precision / --compute-dtype auto: once the hardware has resolved them)
    moe = train.parse_args(["--preset", "tiny-moe", "--compile-blocks"])
    compile_policy.check_blocks(moe, fp32=False)
    with pytest.raises(ValueError, match="mixture-of-experts preset needs bf16 compute"):
        compile_policy.check_blocks(moe, fp32=True)
    assert recipe.of("fp32").computes_in_fp32 and recipe.of("int8", "fp32").computes_in_fp32
    assert not recipe.of("bf16").computes_in_fp32 and not recipe.of("int8-mm").computes_in_fp32


def _every_precision_trains(rank: int, world: int) -> dict:
    out = {}
    shape = PRESETS["tiny"]
    tokens = torch.randint(0, 256, (2, 33), generator=torch.Generator().manual_seed(0))
    for row in ("fp32", "bf16", "all-bf16", "int8", "int8-mm", "int8-mm-wgrad-bf16", "int8-grads",
                "int8-mm-grads", "int8:fp32:compile=off", "int8-mm:bf16-model", "bf16:blocks", "int8-mm:blocks"):
        recipe = precisions.parse_row(row, compile="off")
        # full_init is one code path for every recipe: one baseline, one int8 and the bf16 model suffice
        for full_init in (False, True) if row in ("bf16", "int8", "int8-mm:bf16-model") else (False,):
            model = build.build_model(recipe, shape, "cpu", full_init=full_init)
            optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
            losses = [train_step(model, optimizer, tokens[:, :-1], tokens[:, 1:], clip=False)
                      for _ in range(3)]
            locals_ = [p.to_local() for p in model.parameters()]
            out[row, full_init] = dict(
                losses=losses, int8=sum(isinstance(p, fsdp_int8.Int8Weight) for p in locals_),
                compiled=[block._compiled_call_impl is not None for block in model.blocks()],
                dtypes={p.dtype for p in locals_ if not isinstance(p, fsdp_int8.Int8Weight)},
                groups=[name for name, m in model.named_modules() if isinstance(m, FSDPModule)],
            )
    return out


def test_every_precision_builds_shards_and_trains():
    """Each precision of launch.precisions, built by launch.build both ways (on meta then initialised by
    shard, and initialised whole then sharded), trains: its loss falls over 3 steps. With
    ``blocks`` (a bf16 baseline and int8 matmuls) every block is compiled whole, by inductor."""
    results = run_distributed(_every_precision_trains, 1)[0]
    for (row, full_init), found in results.items():
        recipe = precisions.parse_row(row, compile="off")
        assert found["losses"][-1] < found["losses"][0], (row, full_init, found["losses"])
        assert found["compiled"] == [recipe.blocks] * PRESETS["tiny"].n_layers, (row, found["compiled"])
        assert (found["int8"] == 7 * PRESETS["tiny"].n_layers) == recipe.precision.int8, (row, found)
        stored = torch.bfloat16 if recipe.compute_dtype == "bf16-model" else torch.float32
        assert found["dtypes"] == {stored}, (row, found)
    # every baseline is grouped as shard_model groups the int8 rows: the embedding, each block, the root
    groups = {row: found["groups"] for (row, _), found in results.items()}
    assert groups["bf16"] == groups["int8"] == ["", "tok_embeddings", *(f"layers.{i}" for i in range(PRESETS["tiny"].n_layers))]
    assert all(found == groups["int8"] for found in groups.values()), groups


# ---------------------------------------------------------------- --tp: tensor parallelism
def _tensor_parallel_against_data_parallel(rank: int, world: int) -> dict:
    shape = PRESETS["tiny"]
    tokens = torch.randint(0, 256, (2, 33), generator=torch.Generator().manual_seed(0))  # every rank's batch
    meshes = {"dp": parallel.device_mesh("cpu"), "tp": parallel.device_mesh("cpu", tp=2),
              "hsdp+tp": parallel.device_mesh("cpu", tp=2, replicas=2), "pp": parallel.device_mesh("cpu", pp=2),
              "pp+tp": parallel.device_mesh("cpu", pp=2, tp=2)}
    out = {"data_rank": {name: parallel.data_rank(mesh) for name, mesh in meshes.items()}}
    for layout, mesh in meshes.items():  # the launcher's meta-device build: each rank initialises its piece
        model = build.build_model(precisions.parse_row("int8:fp32:compile=off"), shape, "cpu",
                                       mesh=parallel.stage_mesh(mesh), stage=parallel.pipeline_stage(mesh))
        out["init", layout] = _gathered_values(model)
    for row in ("fp32", "int8:fp32:compile=off"):
        for layout in ("dp", "tp"):
            # full_init: the same initial weights whatever the layout (on meta, each shard draws its own)
            model = build.build_model(precisions.parse_row(row), shape, "cpu", full_init=True,
                                           mesh=meshes[layout])
            optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
            losses, norms = [], []
            for _ in range(3):
                loss = next_token_loss(model, tokens[:, :-1], tokens[:, 1:])
                loss.backward()
                norms.append(parallel.clip_grad_norm_(model.parameters(), 1.0).item())
                optimizer.step()
                optimizer.zero_grad()
                losses.append(loss.item())
            out[row, layout] = dict(losses=losses, norms=norms)
    return out


def _gathered_values(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter of ``model`` (this rank's pipeline stage) whole: int8 weights dequantized."""
    out = {}
    for name, param in model.named_parameters():
        whole = param.full_tensor()
        out[name] = whole.dequantize() if isinstance(whole, fsdp_int8.Int8Weight) else whole.detach().clone()
    return out


def _single_process_init() -> dict[str, torch.Tensor]:
    """The launcher's tiny model initialised whole in this process, quantized as build_model does."""
    model = Transformer(PRESETS["tiny"])
    model.init_weights(0)
    fsdp_int8.quantize_(model, fsdp_int8.Int8TrainingConfig())
    return {name: p.dequantize() if isinstance(p, fsdp_int8.Int8Weight) else p.detach()
            for name, p in model.named_parameters()}


def test_tensor_parallel_builds_what_data_parallel_builds():
    """--tp's mesh, data split and gradient clipping, and build_model on a (dp, tp) mesh: from
    the same weights and data, the fp32 baseline (torch's styles) and weight-only int8
    (fsdp_int8's) train as on the all-FSDP mesh."""
    results = run_distributed(_tensor_parallel_against_data_parallel, 4)
    for rank, found in enumerate(results):
        # tp peers are neighbouring ranks and share a data index; HSDP's replicas come first;
        # pipeline stages are the outermost dim, and a stage's ranks i and a later one's i share an index
        assert found["data_rank"] == {"dp": (rank, 4), "tp": (rank // 2, 2), "hsdp+tp": (rank // 2, 2),
                                      "pp": (rank % 2, 2), "pp+tp": (0, 1)}
        whole = _single_process_init()
        for layout in found["data_rank"]:  # a meta-device init equals a single process's, bit for bit
            init = found["init", layout]
            assert init and all(torch.equal(value, whole[name]) for name, value in init.items()), (rank, layout)
        for row in ("fp32", "int8:fp32:compile=off"):
            dp, tp = found[row, "dp"], found[row, "tp"]
            # Same weights and data: the layouts differ only in the order of fp32 sums (tp partial
            # sums, the clip's norm over two meshes), ~1e-6 relative; a wrong split or a norm that
            # missed a mesh's shards is off by percents.
            assert tp["losses"][0] == pytest.approx(dp["losses"][0], rel=1e-5), (row, dp, tp)
            assert tp["norms"][0] == pytest.approx(dp["norms"][0], rel=1e-4), (row, dp, tp)
            # fp32 keeps agreeing; int8's stochastic rounding draws per layout (its streams are
            # keyed by dp and tp coordinates): its updates agree to a few roundings of ~1/127 of
            # a row's absmax, which moves this loss by well under 1e-2 (measured below 1e-3)
            rel = 1e-4 if row == "fp32" else 1e-2
            assert tp["losses"] == pytest.approx(dp["losses"], rel=rel), (row, dp, tp)
            assert tp["losses"][-1] < tp["losses"][0] - 0.05, (row, tp)


@pytest.mark.exhaustive  # the pp 2 x tp 2 run below launches --tp under torchrun in CI
def test_a_tensor_parallel_run_trains_under_torchrun(tmp_path):
    """The 4-process CPU demo of --tp 2: two tp pairs, FSDP2 over the pairs."""
    out = tmp_path / "tp"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "4",
               "-m", "launch.train", "--preset", "tiny", "--steps", "6", "--batch-size", "4", "--seq-len", "64",
               "--max-bytes", "300000", "--eval-every", "3", "--eval-batches", "2", "--checkpoint-every", "6",
               "--precision", "int8", "--compute-dtype", "fp32", "--tp", "2", "--out", str(out)]
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-3000:]
    assert "on 4 x cpu (tp 2 x dp 2)" in output and "done: 6 steps" in output, output[-3000:]
    records = read_metrics(out / "metrics.jsonl")
    assert [r["tp"] for r in records if r.get("event") == "start"] == [2]
    losses = [r["loss"] for r in records if "loss" in r]
    val = [r["val_loss"] for r in records if "val_loss" in r]
    # Step 0: weights of std 0.02 give near-zero logits, so the loss is ln(256) = 5.545 up to
    # the batch's luck (every layout starts from the single-process weights: see the test above).
    assert len(losses) == 6 and abs(losses[0] - math.log(256)) < 0.05, losses
    assert len(val) >= 2 and val[-1] < val[0] - 0.1, val  # fixed batches: measured 5.42 -> 5.18
    assert all(r["all_gather_bytes"] > 0 for r in records if "loss" in r)
    assert (out / "checkpoints" / "step_00000006").is_dir()


# ---------------------------------------------------------------- --pp: pipeline parallelism
@pytest.mark.parametrize(
    ("layout", "extra"),
    [pytest.param("pp 2 x dp 2, 1f1b over 2 microbatches", ["--pp", "2"], marks=pytest.mark.exhaustive),
     ("pp 2 x tp 2 x dp 1, gpipe over 4 microbatches", ["--pp", "2", "--tp", "2", "--microbatches", "4",
                                                     "--pp-schedule", "gpipe"])],
    ids=["pp2-dp2", "pp2-tp2"],
)
def test_a_pipeline_parallel_run_trains_under_torchrun(layout, extra, tmp_path):
    """The 4-process CPU demo of --pp 2: two stages of one block each (the first with the
    embedding, the second with the norm and head), each FSDP-sharded over its two ranks (or
    split by --tp 2); the loss comes from the last stage, validation runs forward only."""
    out = tmp_path / "pp"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "4",
               "-m", "launch.train", "--preset", "tiny", "--steps", "6", "--batch-size", "4", "--seq-len", "64",
               "--max-bytes", "300000", "--eval-every", "3", "--eval-batches", "2", "--checkpoint-every", "6",
               "--precision", "int8", "--compute-dtype", "fp32", *extra, "--out", str(out)]
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-3000:]
    # the stages' parameters counted together: the whole tiny model's 0.13M
    assert f"0.13M parameters on 4 x cpu ({layout})" in output and "done: 6 steps" in output, output[-3000:]
    records = read_metrics(out / "metrics.jsonl")
    assert [r["pp"] for r in records if r.get("event") == "start"] == [2]
    losses = [r["loss"] for r in records if "loss" in r]
    val = [r["val_loss"] for r in records if "val_loss" in r]
    # Step 0's loss is ln(256) up to the batch's luck, as in the --tp run (measured 5.557 at
    # pp 2 x dp 2, 5.571 at pp 2 x tp 2): it is the last stage's, sent back to rank 0
    assert len(losses) == 6 and abs(losses[0] - math.log(256)) < 0.05, losses
    assert len(val) >= 2 and val[-1] < val[0] - 0.1, val  # measured 5.43 -> 5.20 (both layouts)
    assert (out / "checkpoints" / "step_00000006").is_dir()


def test_a_compiling_run_says_so_and_keeps_its_first_step_out_of_the_eta(one_process, tmp_path, capsys):
    """--compile on: rank 0 says what compiles before the first step, then how long the
    first step and the first evaluation took, and restarts the progress bar's clock (a
    compiling step would make the ETA of the rest many times too long)."""
    assert one_process(*SHORT, "--compile", "on", "--out", str(tmp_path / "compiled")) == 0
    out = capsys.readouterr().out
    assert "compiling the quantization kernels: the first step and the first evaluation take longer" in out
    assert "step 0 took" in out and "the first evaluation took" in out and "the ETA counts from here" in out


def test_the_progress_bar_restarts_its_clock_keeping_its_count():
    from launch.metrics import Progress

    progress = Progress(total=10, initial=2, enabled=True)
    assert progress.bar is not None  # tqdm is installed with the launcher's extra
    progress.update(2, 1.0, 100.0, 0)
    started = progress.bar.start_t
    time.sleep(0.01)
    progress.restart_clock()
    assert progress.bar.n == progress.bar.initial == 3 and progress.bar.start_t > started
    progress.update(3, 1.0, 100.0, 0)
    assert progress.bar.n == 4
    progress.close()
