"""Collectives on ``Int8Weight`` besides DTensor's int8 gathers carry values of the outer
dtype (2 gloo ranks, one spawn): a scatter from an int8 source into plain and int8
receivers (accelerate's ``cpu_ram_efficient_loading``), an all-reduce, and a rank that
fails to put its values on the wire: it still takes part, so its peer raises within
seconds instead of waiting for gloo's timeout.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist
import torch.nn as nn

import fsdp_int8
from fsdp_int8 import Int8Weight
from fsdp_int8.testing import run_distributed

from _cases import case

ROWS, COLS = 12, 40


def _weight(seed: int) -> Int8Weight:
    return Int8Weight.from_float(torch.randn(ROWS, COLS, generator=torch.Generator().manual_seed(seed)))


def _scatter(rank: int, world: int) -> None:
    source = _weight(0)  # what rank 0 holds; every rank builds it to compare
    pieces = list(source.chunk(world))
    for receiver in ("plain", "int8"):
        with case(f"scatter from an Int8Weight into {receiver} receivers"):
            if receiver == "plain" and rank != 0:
                out = torch.zeros(ROWS // world, COLS)
            else:
                out = torch.empty_like(pieces[0])  # an Int8Weight
            dist.scatter(out, pieces if rank == 0 else None, src=0)
            mine = pieces[rank]
            if isinstance(out, Int8Weight):  # rounded back to nearest: exact for fp32 as quantized
                assert torch.equal(out.int_data, mine.int_data) and torch.equal(out.scale, mine.scale)
            else:
                assert torch.equal(out, mine.dequantize())


def _all_reduce(rank: int, world: int) -> None:
    with case("all_reduce of Int8Weights: the sum of the values, rounded to nearest"):
        weight = _weight(rank)
        expected = sum(_weight(r).dequantize() for r in range(world))
        dist.all_reduce(weight)
        assert isinstance(weight, Int8Weight)
        reference = Int8Weight.from_float(expected)
        assert torch.equal(weight.int_data, reference.int_data)
        torch.testing.assert_close(weight.scale, reference.scale, rtol=0, atol=0)


def _fails_on_one_rank(rank: int, world: int) -> None:
    """Rank 0 cannot dequantize what it broadcasts. It sends NaN and raises; the peer's int8
    weight refuses the NaN, and so does a quantized layer a plain receiver loads it into."""
    def broken(*args, **kwargs):
        raise RuntimeError("simulated failure on rank 0")

    for receiver in ("int8", "plain, then load_state_dict(assign=True)"):
        with case(f"a broadcast that fails on rank 0, {receiver} receiver"):
            start = time.monotonic()
            weight = _weight(rank)
            if rank == 0:
                weight.dequantize = broken
                try:
                    dist.broadcast(weight, src=0)
                except RuntimeError as error:
                    assert "simulated failure" in str(error.__cause__) and "sent NaN" in str(error)
                else:
                    raise AssertionError("rank 0 did not raise")
            else:
                layer = fsdp_int8.quantize_(nn.Sequential(nn.Linear(COLS, ROWS)), fsdp_int8.Int8TrainingConfig(min_features=1))
                try:
                    if receiver == "int8":
                        dist.broadcast(weight, src=0)
                    else:
                        plain = torch.zeros(ROWS, COLS)
                        dist.broadcast(plain, src=0)
                        layer.load_state_dict({"0.weight": plain, "0.bias": torch.zeros(ROWS)}, assign=True)
                except ValueError as error:
                    assert "non-finite" in str(error)
                else:
                    raise AssertionError(f"the peer did not raise (receiver: {receiver})")
            elapsed = time.monotonic() - start
            assert elapsed < 10, f"took {elapsed:.1f} s: a rank waited for its peer"
            dist.barrier()  # both ranks are still in step


def _body(rank: int, world: int) -> None:
    _scatter(rank, world)
    _all_reduce(rank, world)
    _fails_on_one_rank(rank, world)


def test_collectives_carry_values_and_never_leave_a_peer_waiting():
    run_distributed(_body, 2, timeout=120)
