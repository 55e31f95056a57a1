"""The reusable multi-process test base, used the way a downstream project would use it.

Six spawns in all (each costs a few seconds of ``import torch`` per rank):

* one ``DistributedTestCase`` subclass with ONE test method (every method spawns its ranks);
* ``run_distributed`` returning per-rank values;
* ``run_distributed`` with a failing rank: AssertionError with its traceback, no hang;
* ``run_distributed`` with ranks that die before reporting: a prompt error, not a hang;
* ``run_distributed`` with a rank that aborts in native code: its stderr quoted;
* ``run_distributed`` with a rank that hangs: where it waits, quoted.

Bodies and models are module-level: the spawned ranks unpickle them by name.
"""

from __future__ import annotations

import importlib
import os
import signal
import time

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from fsdp_int8.sharding import shard_model
from fsdp_int8.testing import DistributedTestCase, device_type_for, run_distributed
from fsdp_int8.weight import Int8Weight

_BACKEND = {"cpu": "gloo", "cuda": "nccl"}


class _Block(nn.Module):
    def __init__(self, dim: int = 32, hidden: int = 48) -> None:
        super().__init__()
        self.up = nn.Linear(dim, hidden)
        self.down = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(x)))


class _TinyNet(nn.Module):
    """Two blocks in ``self.layers`` (found by ``find_blocks``) and a small full-precision head."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([_Block(), _Block()])
        self.head = nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def _local(param: torch.Tensor) -> torch.Tensor:
    return param._local_tensor if isinstance(param, DTensor) else param


# ---------------------------------------------------------------- unittest style
class TwoRankTestCase(DistributedTestCase):
    @property
    def world_size(self) -> int:
        return 2

    def test_process_group_and_one_training_step(self) -> None:
        # This body runs inside each spawned rank, with the default group already up.
        self.assertTrue(dist.is_initialized())
        self.assertEqual(dist.get_world_size(), 2)
        self.assertNotEqual(self.rank, self.MAIN_PROCESS_RANK)
        self.assertEqual(self.rank, dist.get_rank())
        self.assertEqual(self.device_type, device_type_for(self.world_size))
        self.assertEqual(dist.get_backend(), _BACKEND[self.device_type])
        if not torch.cuda.is_available():
            self.assertEqual((self.device_type, dist.get_backend()), ("cpu", "gloo"))

        torch.manual_seed(0)  # the same initial weights on every rank
        model = shard_model(_TinyNet().to(self.device_type))
        self.assertIsInstance(model, FSDPModule)
        int8 = [n for n, p in model.named_parameters() if isinstance(_local(p), Int8Weight)]
        self.assertEqual(
            sorted(int8),
            sorted(f"layers.{i}.{lin}.weight" for i in range(2) for lin in ("up", "down")),
        )

        # The same batch on every rank: the losses must agree exactly.
        x = torch.randn(4, 32, generator=torch.Generator().manual_seed(0)).to(self.device_type)
        loss = model(x).pow(2).mean()
        loss.backward()
        self.assertTrue(torch.isfinite(loss).item(), loss)
        for name, param in model.named_parameters():
            self.assertIsNotNone(param.grad, name)
            self.assertTrue(torch.isfinite(_local(param.grad)).all().item(), name)

        summed = loss.detach().clone()
        dist.all_reduce(summed)
        everyone = [torch.empty_like(summed) for _ in range(self.world_size)]
        dist.all_gather(everyone, summed)
        self.assertTrue(torch.isfinite(summed).item(), summed)
        self.assertTrue(all(torch.equal(v, everyone[0]) for v in everyone), everyone)
        # each rank contributed the same loss
        torch.testing.assert_close(summed, loss.detach() * self.world_size, rtol=0, atol=0)


# ---------------------------------------------------------------- pytest-function style
def _values_body(rank: int, world_size: int, tag: str) -> dict:
    reduced = torch.full((3,), float(rank + 1))
    dist.all_reduce(reduced)  # 1 + 2 on two ranks
    weight = Int8Weight.from_float(
        torch.randn(8, 16, generator=torch.Generator().manual_seed(rank)),
        stochastic_rounding=False,
    )
    return {
        "rank": rank,
        "dist_rank": dist.get_rank(),
        "world_size": world_size,
        "tag": tag,
        "pid": os.getpid(),
        "mine": torch.full((2, 3), float(rank)),
        "big": torch.arange(200_000, dtype=torch.float32) + rank,  # well past any inline size
        "view": torch.arange(10, dtype=torch.int64)[rank::2],  # a non-contiguous view
        "reduced": reduced,
        "weight": weight,
    }


def test_run_distributed_returns_values_indexed_by_rank():
    results = run_distributed(_values_body, 2, "hello", timeout=60)
    assert isinstance(results, list) and len(results) == 2
    for rank, value in enumerate(results):
        assert value["rank"] == rank and value["dist_rank"] == rank
        assert value["world_size"] == 2 and value["tag"] == "hello"
        assert value["pid"] != os.getpid()
        torch.testing.assert_close(value["mine"], torch.full((2, 3), float(rank)), rtol=0, atol=0)
        big = value["big"]
        assert big.dtype == torch.float32 and big.shape == (200_000,)
        assert big[0].item() == rank and big[-1].item() == 199_999 + rank
        assert torch.equal(value["view"], torch.arange(rank, 10, 2))
        assert torch.equal(value["reduced"], torch.full((3,), 3.0))
        weight = value["weight"]
        expected = Int8Weight.from_float(
            torch.randn(8, 16, generator=torch.Generator().manual_seed(rank)),
            stochastic_rounding=False,
        )
        assert isinstance(weight, Int8Weight) and weight.shape == (8, 16)
        assert torch.equal(weight.int_data, expected.int_data)
        assert torch.equal(weight.scale, expected.scale)
    assert results[0]["pid"] != results[1]["pid"]


def _rank1_fails_body(rank: int, world_size: int) -> int:
    dist.barrier()  # both ranks are up
    if rank == 1:
        assert rank == 0, "rank 1 failed on purpose (marker 7f3a)"
    # Rank 0 now waits for a rank that is gone: run_distributed must not wait with it.
    dist.barrier()
    return rank


def test_run_distributed_reports_failing_rank_and_does_not_hang():
    start = time.monotonic()
    with pytest.raises(AssertionError) as info:
        run_distributed(_rank1_fails_body, 2, timeout=60)
    elapsed = time.monotonic() - start
    message = str(info.value)
    assert "ranks failed" in message and "--- rank 1 ---" in message, message
    rank1 = message[message.index("--- rank 1 ---"):]
    # the failing rank's own traceback text, not a summary
    assert "Traceback (most recent call last)" in rank1, message
    assert "_rank1_fails_body" in rank1 and "AssertionError" in rank1, message
    assert "rank 1 failed on purpose (marker 7f3a)" in rank1, message
    assert elapsed < 60, f"run_distributed took {elapsed:.0f} s: it waited for the blocked rank"


class _FailsToUnpickle:
    """Unpickling it in a spawned rank raises, as when a rank cannot import the module that
    defines the body (e.g. two test files with one basename: ``Can't get attribute ...``)."""

    def __reduce__(self):
        return (importlib.import_module, ("fsdp_int8_no_such_module_7f3a",))


def test_run_distributed_notices_ranks_that_die_before_reporting():
    # Both ranks exit with code 1 within seconds (ModuleNotFoundError while unpickling
    # their arguments); a prompt AssertionError naming them is expected, not a TimeoutError.
    started = time.monotonic()
    with pytest.raises(AssertionError, match=r"exited with code 1 before reporting"):
        run_distributed(_values_body, 2, _FailsToUnpickle(), timeout=120)
    assert time.monotonic() - started < 60


def _rank1_aborts_body(rank: int, world_size: int) -> int:
    dist.barrier()  # both ranks are up
    if rank == 1:
        os.abort()  # a native crash: no Python exception, no report, exit code -SIGABRT
    dist.barrier()  # rank 0 waits here until gloo notices the peer is gone
    return rank


def test_run_distributed_quotes_the_stderr_of_a_rank_that_crashed():
    # A rank killed by a signal leaves no traceback of its own; what it printed to stderr
    # (a native "terminate called ..." line, faulthandler's stacks) is all there is.
    with pytest.raises(AssertionError) as info:
        run_distributed(_rank1_aborts_body, 2, timeout=120)
    message = str(info.value)
    assert "--- rank 1 ---" in message, message
    rank1 = message[message.index("--- rank 1 ---"):]
    assert f"exited with code {-signal.SIGABRT}" in rank1, message
    assert "Fatal Python error: Aborted" in rank1, message
    assert "_rank1_aborts_body" in rank1, message  # faulthandler's stack names the body


def _rank1_hangs_body(rank: int, world_size: int) -> int:
    if rank == 1:
        time.sleep(600)  # a rank stuck outside any collective
    return rank


def test_run_distributed_quotes_where_a_hung_rank_waits():
    started = time.monotonic()
    with pytest.raises(TimeoutError) as info:
        run_distributed(_rank1_hangs_body, 2, timeout=20)
    message = str(info.value)
    assert "did not finish in 20 s" in message and "--- rank 1, where it waits ---" in message, message
    rank1 = message[message.index("--- rank 1, where it waits ---"):]
    assert "_rank1_hangs_body" in rank1, message  # faulthandler's stack, asked for by SIGUSR1
    assert time.monotonic() - started < 60
