"""No partial checkpoint, ever, on 2 ranks: every fault before, during and after the write
fails on every rank promptly and publishes nothing (or says what was published).

One spawn for the faults that leave the process group usable:
- one rank's generator serialization, CPU copy (``async_``) or state collection raising;
- the pruning (``keep=``) raising ``PermissionError`` on rank 0, synchronous and in the background;
- replacing ``latest`` failing on rank 0 (no ``step_N``, no ``.latest.*.tmp`` left);
- a short write inside dcp's writer (the file-size limit, as a full disk): the error names
  the ``OSError``, not torch's ``unexpected pos``;
- a checkpoint whose manifest lists one rank's files only (what a writer that took a
  destroyed process group for a single process published): the load refuses it, naming
  the missing files;
- the background group's timeout is the training group's;
- a NaN gradient on one rank with plain ``torch.optim.AdamW`` (batched or not, clipped or
  not): every rank refuses the step, nothing is written, states stay finite, the next step runs.

A second spawn for the race that destroys a process group: rank 1's background writer
starts only after rank 1 called ``destroy_process_group()``; it publishes nothing, warns
and fails its handle, and rank 0's handle fails too.
"""

from __future__ import annotations

import datetime
import errno
import json
import os
import re
import resource
import shutil
import signal
import tempfile
import threading
import time
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import fsdp_int8
from fsdp_int8 import _dist
from fsdp_int8.checkpoint import CheckpointError, latest_checkpoint
from fsdp_int8.checkpoint import _dcp, _files, save as save_module
from fsdp_int8.guard import NonFiniteGradientError
from fsdp_int8.testing import run_distributed

from _cases import assert_identical, case, sharded_mlp, snapshot, train_step_batches

PROMPT_S = 20  # a refusal must be far quicker than any process-group timeout


def _patched(owner, name: str, replacement):
    """Set ``owner.name`` to ``replacement``; returns a function that puts it back."""
    real = getattr(owner, name)
    setattr(owner, name, replacement)
    return lambda: setattr(owner, name, real)


def _on_rank(rank: int, error: BaseException, real):
    """A stand-in for ``real`` that raises ``error`` on ``rank`` and calls ``real`` elsewhere."""
    def stand_in(*args, **kwargs):
        if dist.get_rank() == rank:
            raise error
        return real(*args, **kwargs)
    return stand_in


def _refused_on_every_rank(call, *, match: str) -> str:
    """``call()`` raises a ``CheckpointError`` matching ``match``, promptly; its message."""
    start = time.monotonic()
    with pytest.raises(CheckpointError) as refused:
        result = call()
        if hasattr(result, "result"):
            result.result(timeout=PROMPT_S)
    assert time.monotonic() - start < PROMPT_S, "the refusal was not prompt"
    message = str(refused.value)
    assert re.search(match, message, re.S), message
    everyone = _dist.all_gather(message)
    assert everyone[0] == everyone[1], f"the ranks disagree: {everyone}"
    return message


def _faults(rank: int, world: int, root: str, names: tuple[str, ...] = ()) -> dict:
    """Every case of :data:`FAULTS` (or those ``names``), in order, on one checkpoint root."""
    root = Path(root)
    model, opt = sharded_mlp()
    train_step_batches(model, opt, 0, 1)
    fsdp_int8.save_checkpoint(root, model, opt, step=1)
    outcomes = {}
    for name, fault in FAULTS.items():
        if not names or name in names:
            outcomes.update(fault(rank, root, model, opt))
    return outcomes


def _one_rank_fails_before_the_write(rank: int, root: Path, model, opt) -> dict:
    outcomes = {}
    for where, owner, name, asynchronous in [
        ("serializing its generator states", save_module, "_serialized", False),
        ("serializing its generator states", save_module, "_serialized", True),
        ("copying its state to CPU memory", _dcp, "cpu_copy", True),
        ("collecting its model and optimizer state", _dcp, "training_state", False),
    ]:
        label = f"rank 1 fails {where} ({'async_' if asynchronous else 'synchronous'})"
        with case(label):
            restore = _patched(owner, name, _on_rank(1, RuntimeError("injected"), getattr(owner, name)))
            try:
                message = _refused_on_every_rank(
                    lambda: fsdp_int8.save_checkpoint(root, model, opt, step=2, async_=asynchronous),
                    match=rf"rank 1: {where}: RuntimeError: injected")
            finally:
                restore()
            assert "rank 0:" not in message and not (root / "step_00000002").exists()
            assert not list(root.glob(".tmp-*")), "the partial save was left behind"
            outcomes[label] = message
    return outcomes


def _pruning_fails(rank: int, root: Path, model, opt) -> dict:
    outcomes = {}
    for asynchronous in (False, True):
        label = f"pruning raises PermissionError on rank 0 ({'async_' if asynchronous else 'synchronous'})"
        with case(label):
            fsdp_int8.save_checkpoint(root, model, opt, step=3)
            denied = PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(root / "step_00000001"))
            restore = _patched(_files, "prune", _on_rank(0, denied, _files.prune))
            try:
                message = _refused_on_every_rank(
                    lambda: fsdp_int8.save_checkpoint(root, model, opt, step=4, keep=1, async_=asynchronous),
                    match=r"step_00000004 was saved and published .*rank 0: removing the checkpoints .*"
                          r"keep=1: PermissionError")
            finally:
                restore()
            assert latest_checkpoint(root).name == "step_00000004"
            total = torch.tensor([1.0])
            dist.all_reduce(total)  # the collectives are still in line
            assert total.item() == 2.0
            outcomes[label] = message
    return outcomes


def _publishing_fails(rank: int, root: Path, model, opt) -> dict:
    with case("replacing latest fails on rank 0: nothing published, nothing left"):
        fsdp_int8.save_checkpoint(root, model, opt, step=5)
        dist.barrier()
        if rank == 0:
            (root / "latest").unlink()
            (root / "latest").mkdir()  # os.replace cannot put a file over a directory
        dist.barrier()
        message = _refused_on_every_rank(lambda: fsdp_int8.save_checkpoint(root, model, opt, step=6),
                                         match=r"step_00000006 was not saved: rank 0: publishing")
        assert not (root / "step_00000006").exists(), "a checkpoint was published by the failed save"
        assert not list(root.glob(".latest.*.tmp")) and not list(root.glob(".tmp-*")), sorted(os.listdir(root))
        assert latest_checkpoint(root).name == "step_00000005"  # the newest complete one
        dist.barrier()
        if rank == 0:
            (root / "latest").rmdir()
        dist.barrier()
    return {"latest": message}


def _short_write(rank: int, root: Path, model, opt) -> dict:
    # 4096 hidden rows: each optimizer state of a rank's shard is one write larger than a
    # file's buffer, which goes to the disk inside torch's archive writer (not at a flush).
    model, opt = sharded_mlp(hidden=4096)
    train_step_batches(model, opt, 0, 1)
    with case("a short write inside dcp's writer names the OSError, not 'unexpected pos'"):
        limit = resource.getrlimit(resource.RLIMIT_FSIZE)
        handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG
        if rank == 1:
            resource.setrlimit(resource.RLIMIT_FSIZE, (1024, limit[1]))
        try:
            message = _refused_on_every_rank(lambda: fsdp_int8.save_checkpoint(root, model, opt, step=7),
                                             match=r"rank 1: writing .*__\{rank\}|rank 1: writing .*distcp")
        finally:
            resource.setrlimit(resource.RLIMIT_FSIZE, limit)
            signal.signal(signal.SIGXFSZ, handler)
        assert f"[Errno {errno.EFBIG}]" in message and "OSError" in message, message
        assert "__1_0.distcp" in message and "unexpected pos" not in message, message
    return {"short write": message}


def _partial_manifest(rank: int, root: Path, model, opt) -> dict:
    with case("a manifest that lists one rank's files is refused by the load, naming the missing"):
        source = fsdp_int8.save_checkpoint(root / "source", model, opt, step=5)
        partial = root / "partial"
        if rank == 0:
            shutil.copytree(source, partial)
            manifest = json.loads((partial / "manifest.json").read_text())
            manifest["files"] = {k: v for k, v in manifest["files"].items() if "_1" not in k and "00001" not in k}
            (partial / "manifest.json").write_text(json.dumps(manifest))
            for name in ("__1_0.distcp", "rng/rank_00001.pt"):
                (partial / name).unlink()
        dist.barrier()
        fresh, fresh_opt = sharded_mlp()
        before = snapshot(fresh, fresh_opt)
        with pytest.raises(CheckpointError) as refused:
            fsdp_int8.load_checkpoint(partial, fresh, fresh_opt)
        message = str(refused.value)
        assert "is incomplete (saved by 2 ranks)" in message, message
        assert "rng/rank_00001.pt: not in the manifest" in message and "__1_0.distcp" in message, message
        assert_identical(before, snapshot(fresh, fresh_opt), "after the refused load")
    return {"partial": message}


def _background_timeout(rank: int, root: Path, model, opt) -> dict:
    with case("the background writer's group takes the training group's timeout"):
        handle = fsdp_int8.save_checkpoint(root / "timeout", model, opt, step=1, async_=True)
        handle.result(timeout=PROMPT_S)
        timeout = save_module._background["group"]._get_backend(torch.device("cpu")).options._timeout
        assert timeout == PG_TIMEOUT, timeout
    return {}


def _nan_on_one_rank(rank: int, root: Path, model, opt) -> dict:
    outcomes = {}
    for batched in (False, True):
        for clip in (False, True):
            label = f"NaN on rank 1, torch AdamW{', batched' if batched else ''}{', clipped' if clip else ''}"
            with case(label):
                model, opt = sharded_mlp()
                handle = fsdp_int8.optim.batch_int8_updates(opt) if batched else None
                train_step_batches(model, opt, 0, 2)
                before = snapshot(model, opt)
                x = torch.randn(4, 32)
                F.mse_loss(model(x), torch.zeros(4, 4)).backward()
                if rank == 1:
                    next(p for p in model.parameters() if p.grad is not None).grad._local_tensor.view(-1)[0] = float("nan")
                if clip:
                    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                start = time.monotonic()
                with pytest.raises(NonFiniteGradientError) as refused:
                    opt.step()
                assert time.monotonic() - start < PROMPT_S
                opt.zero_grad()
                assert_identical(before, snapshot(model, opt), "after the refused step")
                steps = [int(state["step"]) for state in opt.state.values()]
                assert _dist.all_gather(steps)[0] == _dist.all_gather(steps)[1] == [2] * len(steps)
                train_step_batches(model, opt, 2, 1)  # the next step runs, on every rank
                assert all(torch.isfinite(_dist.local_shard(v)).all() for s in opt.state.values()
                           for v in s.values() if torch.is_tensor(v) and v.is_floating_point())
                if handle is not None:
                    handle.remove()
                outcomes[label] = str(refused.value)
    return outcomes


FAULTS = {
    "before the write": _one_rank_fails_before_the_write,
    "pruning": _pruning_fails,
    "publishing": _publishing_fails,
    "short write": _short_write,
    "partial manifest": _partial_manifest,
    "background timeout": _background_timeout,
    "NaN": _nan_on_one_rank,
}
PG_TIMEOUT = datetime.timedelta(seconds=300)  # not torch's default (30 min): the writer's group must follow it


def test_every_fault_before_during_and_after_the_write_fails_every_rank_and_publishes_nothing():
    with tempfile.TemporaryDirectory() as root:
        outcomes = run_distributed(_faults, 2, root, timeout=240, pg_timeout=PG_TIMEOUT)
    assert outcomes[0] == outcomes[1]


def _destroyed_in_flight(rank: int, world: int, root: str) -> dict:
    root = Path(root)
    model, opt = sharded_mlp()
    train_step_batches(model, opt, 0, 1)
    release = threading.Event()
    real_write = save_module._write

    def held(*args, **kwargs):  # rank 1's writer starts only once its group is destroyed
        if rank == 1:
            assert release.wait(timeout=PROMPT_S)
        return real_write(*args, **kwargs)

    save_module._write = held
    try:
        handle = fsdp_int8.save_checkpoint(root, model, opt, step=1, async_=True)
        if rank == 1:
            dist.destroy_process_group()
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                release.set()
                with pytest.raises(CheckpointError) as refused:
                    handle.result(timeout=PROMPT_S)
            assert any("process group was destroyed" in str(w.message) for w in caught), [str(w.message) for w in caught]
        else:
            with pytest.raises(CheckpointError) as refused:
                handle.result(timeout=PROMPT_S)
            dist.destroy_process_group()
    finally:
        save_module._write = real_write
    return {"message": str(refused.value), "published": sorted(p.name for p in root.glob("step_*"))}


def test_a_writer_whose_process_group_is_destroyed_publishes_nothing():
    with tempfile.TemporaryDirectory() as root:
        outcomes = run_distributed(_destroyed_in_flight, 2, root, timeout=120)
        assert not list(Path(root).glob("step_*")) and not (Path(root) / "latest").exists()
    assert "rank 1's process group was destroyed while the save was in flight" in outcomes[1]["message"]
    assert "nothing was published" in outcomes[1]["message"]
    assert "another rank ended or destroyed its process group" in outcomes[0]["message"], outcomes[0]["message"]
    assert outcomes[0]["published"] == outcomes[1]["published"] == []
