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
from fsdp_int8._all_gather import SCALE_BYTES, pack_rows, padded_rows, unpack_rows


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


@pytest.mark.parametrize("full_rows,world", [(8, 2), (7, 2), (5, 4), (3, 4)])
def test_gathered_shards_unpack_to_the_whole_weight(full_rows, world):
    weight = Int8Weight.from_float(torch.randn(full_rows, 6))
    rows = padded_rows(full_rows, world)
    packed = [pack_rows(s.int_rows(), s.scale, rows) for s in _shards(weight, world)]
    packed += [torch.zeros(rows, 6 + SCALE_BYTES, dtype=torch.int8)] * (world - len(packed))  # empty shards
    data, scale = unpack_rows(torch.cat(packed), full_rows, 6)
    assert torch.equal(data, weight.int_data) and torch.equal(scale, weight.scale)


@pytest.mark.parametrize("int8_matmul", [None, fsdp_int8.Int8MatmulConfig()], ids=["weight-only", "int8-mm"])
def test_hooks_round_trip(int8_matmul):
    weight = Int8Weight.from_float(torch.randn(7, 6), int8_matmul=int8_matmul)
    # what the hooks read of the shard mesh FSDP2 passes: its size and this rank's place on it
    mesh = SimpleNamespace(size=lambda: 2, ndim=1, get_local_rank=lambda dim=None: 0)
    outputs = [s.fsdp_pre_all_gather(mesh) for s in _shards(weight, 2)]
    assert all(meta == 7 for _, meta in outputs)
    gathered = torch.cat([inputs[0] for inputs, _ in outputs])
    unsharded, inner = weight.fsdp_post_all_gather((gathered,), 7, torch.bfloat16)
    if int8_matmul is None:  # weight-only: a plain bf16 tensor, dequantized once
        assert type(unsharded) is torch.Tensor and unsharded.dtype == torch.bfloat16
        assert torch.equal(unsharded, weight.dequantize(torch.bfloat16))
    else:  # int8 matmuls: an Int8Weight over the gathered rows
        assert isinstance(unsharded, Int8Weight)
        assert torch.equal(unsharded.int_data, weight.int_data) and torch.equal(unsharded.scale, weight.scale)
