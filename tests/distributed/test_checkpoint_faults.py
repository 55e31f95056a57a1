"""Checkpoints that go wrong on one rank, on 2 ranks, one spawn.

A full disk (``OSError`` ENOSPC, raised by ``os.fsync`` on one rank for one file: where a
disk or quota that runs out during a write shows up at the latest) while rank 1 writes its
dcp shards, while rank 1 writes its generator states and while rank 0 writes the
manifest: every rank raises the same ``CheckpointError`` at once, naming the rank, the
file and the cause; nothing is published, no temporary folder is left, and a later save
and collectives work.

Generator files on load: a damaged one is refused on every rank, naming the rank and the
file (without torch's advice to load with ``weights_only=False``); one deleted together
with its manifest entry is refused, naming it; without a manifest (``allow_unverified``)
no rank's streams are restored (not rank 0's alone), with a warning.

Saves in the background, with int8 weights and ``Int8AdamW(state_bits=8)``'s states:
``save_checkpoint(..., async_=True)`` while training goes on (the write held in flight),
and torchtitan's ``async`` and ``async_with_pinned_mem`` modes through
``Int8CheckpointManager``; each reloads bit-exactly.
"""

from __future__ import annotations

import contextlib
import errno
import fnmatch
import json
import os
import re
import shutil
import tempfile
import threading
import time
import warnings
from pathlib import Path
from typing import Iterator

import pytest
import torch
import torch.distributed as dist

import fsdp_int8
from fsdp_int8.checkpoint import CheckpointError
from fsdp_int8.testing import run_distributed

from _cases import assert_identical, case, sharded_mlp, snapshot, train_step_batches
from _nets import MLPNet

# Each rank gives up on a peer that never reaches a collective after this long (the
# process group's own timeout is 30 min); a refused save must be far quicker.
PROMPT_S = 20


@contextlib.contextmanager
def _disk_full(rank: int, pattern: str) -> Iterator[None]:
    """On ``rank``, ``os.fsync`` of a file whose path matches ``pattern`` fails as a full disk does."""
    real = os.fsync

    def fsync(fd: int) -> None:
        if dist.get_rank() == rank and fnmatch.fnmatch(os.readlink(f"/proc/self/fd/{fd}"), pattern):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        real(fd)

    os.fsync = fsync
    try:
        yield
    finally:
        os.fsync = real


def _faults(rank: int, world: int, root: str) -> dict:
    root = Path(root)
    model, opt = sharded_mlp()
    train_step_batches(model, opt, 0, 1)
    fsdp_int8.save_checkpoint(root, model, opt, step=1)
    at_one = snapshot(model, opt)
    train_step_batches(model, opt, 1, 1)
    messages = {}
    for where, failing, pattern, names in [
        ("dcp shards", 1, "*/__1_*.distcp", r"__1_\*\.distcp"),
        ("generator states", 1, "*/rng/rank_00001.pt", r"rng/rank_00001\.pt"),
        ("manifest", 0, "*/.manifest.json.*.tmp", r"manifest\.json"),
    ]:
        with case(f"disk full on rank {failing} while it writes the {where}"):
            start = time.monotonic()
            with _disk_full(failing, pattern), pytest.raises(CheckpointError) as refused:
                fsdp_int8.save_checkpoint(root, model, opt, step=2)
            assert time.monotonic() - start < PROMPT_S, "the refusal was not prompt"
            message = str(refused.value)
            assert f"rank {failing}: writing " in message and f"rank {1 - failing}:" not in message, message
            assert "No space left on device" in message and "OSError" in message, message
            assert re.search(names, message), message
            messages[where] = message
            dist.barrier()
            assert not list(root.glob(".tmp-*")), "the partial save was left behind"
            assert not (root / "step_00000002").exists()
            assert fsdp_int8.checkpoint.latest_checkpoint(root).name == "step_00000001"

    with case("after the refusals: collectives, a save and a load work"):
        total = torch.tensor([rank + 1.0])
        dist.all_reduce(total)
        assert total.item() == 3.0
        fsdp_int8.save_checkpoint(root, model, opt, step=2)
        at_two = snapshot(model, opt)
        fresh, fresh_opt = sharded_mlp()
        assert fsdp_int8.load_checkpoint(root, fresh, fresh_opt).step == 2
        assert_identical(at_two, snapshot(fresh, fresh_opt), "the save after the refusals")
        assert fsdp_int8.load_checkpoint(root, fresh, fresh_opt, step=1).step == 1
        assert_identical(at_one, snapshot(fresh, fresh_opt), "the checkpoint before the refusals")
    messages.update(_generator_files(rank, root))
    _async_saves(rank, root)
    _torchtitan_async_modes(rank, root)
    return messages


def _generator_files(rank: int, root: Path) -> dict:
    model, opt = sharded_mlp()
    before = snapshot(model, opt)
    messages = {}
    for damage in ("zeroed header", "truncated", "foreign content"):
        with case(f"rank 1's generator file {damage}"):
            copy = root / f"damaged_{damage.replace(' ', '_')}"
            if rank == 0:
                shutil.copytree(root / "step_00000002", copy)
                rng = copy / "rng" / "rank_00001.pt"
                data = rng.read_bytes()
                if damage == "foreign content":
                    torch.save([1, 2, 3], rng)
                else:
                    rng.write_bytes(bytes(64) + data[64:] if damage == "zeroed header" else data[: len(data) // 2])
            dist.barrier()
            with pytest.raises(CheckpointError) as refused:
                fsdp_int8.load_checkpoint(copy, model, opt, verify=False)  # verify would catch it first
            message = str(refused.value)
            assert f"rank 1: the generator states in {copy}/rng/rank_00001.pt cannot be read" in message, message
            assert "weights_only" not in message and "rank 0:" not in message, message
            assert_identical(before, snapshot(model, opt), "after the refused load")
            messages[damage] = message

    with case("rank 1's generator file deleted with its manifest entry: the load refuses, naming it"):
        copy = root / "one_generator_file"
        if rank == 0:
            shutil.copytree(root / "step_00000002", copy)
            (copy / "rng" / "rank_00001.pt").unlink()
            manifest = json.loads((copy / "manifest.json").read_text())
            del manifest["files"]["rng/rank_00001.pt"]
            (copy / "manifest.json").write_text(json.dumps(manifest))
        dist.barrier()
        with pytest.raises(CheckpointError, match=r"incomplete \(saved by 2 ranks\): rng/rank_00001\.pt: not in the manifest"):
            fsdp_int8.load_checkpoint(copy, model, opt)
    with case("the same without a manifest (allow_unverified): no rank restores, with a warning"):
        if rank == 0:
            (copy / "manifest.json").unlink()
        dist.barrier()
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*loaded without verification")
            with pytest.warns(UserWarning, match=r"rank 1 has no generator states, so no rank restores"):
                info = fsdp_int8.load_checkpoint(copy, model, opt, allow_unverified=True)
        assert not info.rng_restored, "rank 0 restored its streams while rank 1 reseeded"
        with case("the control: the intact checkpoint restores on every rank"):
            assert fsdp_int8.load_checkpoint(root / "step_00000002", model, opt).rng_restored
    return messages


@contextlib.contextmanager
def _writes_held(pattern: str) -> Iterator[threading.Event]:
    """``os.fsync`` of a file matching ``pattern`` waits (on the writer's thread) until the
    event it yields is set: a write that is provably still in flight meanwhile."""
    real, release = os.fsync, threading.Event()

    def fsync(fd: int) -> None:
        if fnmatch.fnmatch(os.readlink(f"/proc/self/fd/{fd}"), pattern):
            assert release.wait(timeout=PROMPT_S), "the training loop was blocked by the save"
        real(fd)

    os.fsync = fsync
    try:
        yield release
    finally:
        release.set()
        os.fsync = real


def _int8_adamw_model():
    torch.manual_seed(0)
    model = fsdp_int8.shard_model(MLPNet(hidden=33), config=fsdp_int8.Int8TrainingConfig(seed=7))
    return model, fsdp_int8.Int8AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, state_bits=8, block_size=16)


def _async_saves(rank: int, root: Path) -> None:
    root = root / "async"
    model, opt = _int8_adamw_model()
    train_step_batches(model, opt, 0, 2)
    assert any("exp_avg_int8" in state for state in opt.state.values()), "no 8-bit optimizer state"
    at_save = snapshot(model, opt)
    with case("async_: training goes on while the write is in flight; the reload is bit-exact"):
        with _writes_held("*/__*_0.distcp") as release:
            handle = fsdp_int8.save_checkpoint(root, model, opt, step=2, async_=True)
            train_step_batches(model, opt, 2, 2)  # collectives on the default group meanwhile
            assert not handle.done() and not (root / "step_00000002").exists()
            release.set()
            assert handle.result(timeout=PROMPT_S) == root / "step_00000002"
        uninterrupted = snapshot(model, opt)
        fresh, fresh_opt = _int8_adamw_model()
        info = fsdp_int8.load_checkpoint(root, fresh, fresh_opt)
        assert info.step == 2 and info.rng_restored
        assert_identical(at_save, snapshot(fresh, fresh_opt), "async save, reload")
        train_step_batches(fresh, fresh_opt, 2, 2)  # the generators were taken at the save
        assert_identical(uninterrupted, snapshot(fresh, fresh_opt), "async save at 2, resume, 2 more")
    with case("async_: a save in flight is published before the next save, which may re-save its step"):
        first = fsdp_int8.save_checkpoint(root, model, opt, step=4, async_=True)
        fsdp_int8.save_checkpoint(root, model, opt, step=4, keep=1)
        assert first.done() and first.result() == root / "step_00000004"
        assert sorted(p.name for p in root.iterdir()) == ["latest", "step_00000004"]
    with case("async_: a full disk on rank 1 fails the handle on every rank; the group stays usable"):
        with _disk_full(1, "*/rng/rank_00001.pt"):
            handle = fsdp_int8.save_checkpoint(root, model, opt, step=5, async_=True)
            with pytest.raises(CheckpointError, match=r"rank 1: writing .*rng/rank_00001\.pt: OSError"):
                handle.result(timeout=PROMPT_S)
        assert fsdp_int8.checkpoint.latest_checkpoint(root).name == "step_00000004"
        total = torch.tensor([1.0])
        dist.all_reduce(total)
        assert total.item() == 2.0


def _torchtitan_async_modes(rank: int, root: Path) -> None:
    """torchtitan's ``async`` (a writer thread) and ``async_with_pinned_mem`` (a checkpoint
    process) modes through ``Int8CheckpointManager.dcp_save``, as its ``_save`` calls it."""
    from torchtitan.components.checkpointer import AsyncMode

    from fsdp_int8.checkpoint._dcp import training_state
    from fsdp_int8.integrations.torchtitan import Int8CheckpointManager

    manager = object.__new__(Int8CheckpointManager)  # what dcp_save reads of the manager
    manager.pg, manager.sd_adapter = dist.new_group(backend="gloo"), None
    model, opt = _int8_adamw_model()
    train_step_batches(model, opt, 0, 2)
    for mode in (AsyncMode.ASYNC, AsyncMode.ASYNC_WITH_PINNED_MEM):
        with case(f"torchtitan's {mode.value}: int8 weights and 8-bit states staged whole, reloaded bit-exactly"):
            at_save = snapshot(model, opt)
            folder = root / f"titan_{mode.value}"
            saving = manager.dcp_save(training_state(model, opt), str(folder), mode)
            if mode == AsyncMode.ASYNC_WITH_PINNED_MEM:
                saving.staging_completion.result(timeout=PROMPT_S)
                saving = saving.upload_completion
            train_step_batches(model, opt, 2, 1)  # changes the model while the write goes on
            saving.result(timeout=120)  # the first checkpoint process starts a Python
            fresh, fresh_opt = _int8_adamw_model()
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # no manifest: "loaded without verification"
                fsdp_int8.load_checkpoint(folder, fresh, fresh_opt, allow_unverified=True)
            assert_identical(at_save, snapshot(fresh, fresh_opt), f"torchtitan {mode.value} save, reload")


def test_a_save_that_fails_on_one_rank_fails_on_every_rank_with_the_same_error():
    with tempfile.TemporaryDirectory() as root:
        messages = run_distributed(_faults, 2, root, timeout=180)
    assert messages[0] == messages[1]  # the same errors on every rank
