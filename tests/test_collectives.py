"""count_collectives in one process (a world-size-1 gloo group): nested blocks each count
what ran inside them, and leave as they came."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from fsdp_int8.collectives import count_collectives


@pytest.fixture
def single_rank_group():
    if dist.is_initialized():
        pytest.fail("a process group is already initialised in this worker")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_nested_counters_count_their_own_blocks_and_exit_in_order(single_rank_group):
    # the inner block opens first thing: the two counters hold equal records when it closes,
    # which must not make it remove the outer one (counters are compared by identity)
    with count_collectives() as outer:
        with count_collectives() as inner:
            dist.all_reduce(torch.ones(2, dtype=torch.int8))
        dist.broadcast(torch.ones(3), src=0)
    assert [r.name for r in inner.records] == ["all_reduce"]
    assert inner.records[0].dtype == torch.int8
    assert [r.name for r in outer.records] == ["all_reduce", "broadcast"]
    with count_collectives() as after:  # the wrappers were removed and installed again cleanly
        dist.all_reduce(torch.ones(1))
    assert len(after.records) == 1
