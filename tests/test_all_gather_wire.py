"""The FSDP2 all-gather wire format and hooks, in one process (the gather simulated by cat).

The distributed tests run the hooks under real FSDP2; these pin the byte layout itself:
what each rank packs (values, scale bytes, zeroed padding rows) and that unpacking the
gathered buffer gives back every row and scale exactly.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

import fsdp_int8
from fsdp_int8 import Int8Weight
from fsdp_int8._weight.all_gather import (
    SCALE_BYTES,
    flagged_shards,
    layout_flag,
    pack_rows,
    padded_rows,
    shard_rows,
    unpack_rows,
)


def _shards(weight: Int8Weight, world: int) -> list[Int8Weight]:
    return list(torch.chunk(weight, world, dim=0))


def test_pack_rows_layout_and_zero_padding():
    garbage = torch.full((4, 5 + SCALE_BYTES), 7, dtype=torch.int8)
    q = torch.randint(-127, 128, (3, 5), dtype=torch.int8)
    scale = torch.rand(3) + 0.5
    del garbage  # freed just before: the allocator likely hands its bytes out again
    wire = pack_rows(q, scale, rows=4)
    assert wire.shape == (4, 5 + SCALE_BYTES) and wire.dtype == torch.int8
    assert torch.equal(wire[:3, :5], q)
    assert torch.equal(wire[:3, 5:].contiguous().view(torch.float32).flatten(), scale)
    assert torch.count_nonzero(wire[3:]) == 0  # padding rows are zeros, not leftover memory


def test_pack_rows_accepts_strided_rows():
    q = torch.randint(-127, 128, (6, 4), dtype=torch.int8).t()  # [4, 6], not contiguous
    scale = torch.rand(4)
    wire = pack_rows(q, scale, rows=4)
    assert torch.equal(wire[:, :6], q)


@pytest.mark.parametrize("unsharded_rows,world", [(8, 2), (7, 2), (5, 4), (3, 4)])
def test_gathered_shards_unpack_to_the_whole_weight(unsharded_rows, world):
    weight = Int8Weight.from_float(torch.randn(unsharded_rows, 6))
    rows = padded_rows(unsharded_rows, world)
    packed = [pack_rows(s.int_rows(), s.scale, rows) for s in _shards(weight, world)]
    packed += [torch.zeros(rows, 6 + SCALE_BYTES, dtype=torch.int8)] * (world - len(packed))  # empty shards
    data, scale = unpack_rows(torch.cat(packed), unsharded_rows, 6)
    assert torch.equal(data, weight.int_data) and torch.equal(scale, weight.scale)


def _shard_mesh(world: int, coordinate: int) -> SimpleNamespace:
    """What the hooks read of the shard mesh FSDP2 passes: its size and this rank's place on it."""
    return SimpleNamespace(size=lambda: world, ndim=1, get_local_rank=lambda dim=None: coordinate)


def _gather(shards: list[Int8Weight], world: int) -> tuple[torch.Tensor, tuple]:
    """Every rank's pre-all-gather buffer, concatenated as FSDP2's all-gather does."""
    outputs = [s.fsdp_pre_all_gather(_shard_mesh(world, c)) for c, s in enumerate(shards)]
    assert len({meta for _, meta in outputs}) == 1  # every rank describes the same weight
    return torch.cat([inputs[0] for inputs, _ in outputs]), outputs[0][1]


@pytest.mark.parametrize("unsharded_rows,world", [(8, 2), (7, 2), (5, 4), (3, 4), (1, 3)])
def test_shard_rows_is_torch_chunks_split(unsharded_rows, world):
    chunks = torch.chunk(torch.empty(unsharded_rows), world)
    expected = [len(c) for c in chunks] + [0] * (world - len(chunks))
    assert [shard_rows(unsharded_rows, world, c) for c in range(world)] == expected


def test_layout_flag_is_found_and_real_shards_are_not():
    weight = Int8Weight.from_float(torch.randn(5, 6))
    rows = padded_rows(5, 4)
    real = [pack_rows(s.int_rows(), s.scale, rows) for s in _shards(weight, 4)]
    real.append(torch.zeros(rows, 6 + SCALE_BYTES, dtype=torch.int8))  # an empty shard: all padding
    assert flagged_shards(torch.cat(real), rows, 6) == []
    real[1] = layout_flag(rows, 6, torch.device("cpu"))
    assert flagged_shards(torch.cat(real), rows, 6) == [1]


@pytest.mark.parametrize("int8_matmul", [None, fsdp_int8.Int8MatmulConfig()], ids=["weight-only", "int8-mm"])
def test_shards_cut_before_fsdp_raise_on_every_rank(int8_matmul):
    # What torch's ColwiseParallel leaves FSDP2 on a (dp=2, tp=2) mesh: tp rank 0's rows 0..3
    # of an 8-row weight, cut again in two on dp, each piece still saying the weight has 8.
    weight = Int8Weight.from_float(torch.randn(8, 6), int8_matmul=int8_matmul)
    tp_local = torch.chunk(weight, 2)[0]
    assert tp_local.unsharded_rows == 8
    gathered, metadata = _gather(_shards(tp_local, 2), 2)
    for rank_view in _shards(tp_local, 2):  # each dp rank reads the same gathered bytes
        with pytest.raises(NotImplementedError, match=r"shard\(s\) \[0, 1\] of the 2-way.*tensor parallelism"):
            rank_view.fsdp_post_all_gather((gathered,), metadata, torch.float32)


def test_one_misplaced_shard_is_enough_for_every_rank_to_raise():
    # 3 rows on 2 ranks: shards of 2 and 1. A rank holding 1 row where 2 belong flags itself;
    # its peer holds what it should and still raises, from the gathered flag.
    weight = Int8Weight.from_float(torch.randn(3, 6))
    pieces = [torch.chunk(weight, 3)[0], torch.chunk(weight, 2)[1]]  # 1 row at shard 0, 1 at shard 1
    gathered, metadata = _gather(pieces, 2)
    assert flagged_shards(gathered, metadata[1], 6) == [0]
    with pytest.raises(NotImplementedError, match=r"shard\(s\) \[0\]"):
        pieces[1].fsdp_post_all_gather((gathered,), metadata, torch.float32)


@pytest.mark.parametrize("int8_matmul", [None, fsdp_int8.Int8MatmulConfig()], ids=["weight-only", "int8-mm"])
def test_hooks_round_trip(int8_matmul):
    weight = Int8Weight.from_float(torch.randn(7, 6), int8_matmul=int8_matmul)
    gathered, metadata = _gather(_shards(weight, 2), 2)
    assert metadata == (7, 4)  # the whole weight's rows, the rows every rank sends
    unsharded, inner = weight.fsdp_post_all_gather((gathered,), metadata, torch.bfloat16)
    if int8_matmul is None:  # weight-only: a plain bf16 tensor, dequantized once
        assert type(unsharded) is torch.Tensor and unsharded.dtype == torch.bfloat16
        assert torch.equal(unsharded, weight.dequantize(torch.bfloat16))
    else:  # int8 matmuls: an Int8Weight over the gathered rows
        assert isinstance(unsharded, Int8Weight)
        assert torch.equal(unsharded.int_data, weight.int_data) and torch.equal(unsharded.scale, weight.scale)
