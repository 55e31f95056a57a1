"""Checkpoints across tensor-parallel layouts (4 ranks, one spawn), and the column windows
of int8 weights that DCP reshards them with (one process).

Layouts (dp, tp) on 4 ranks: (2, 2) is saved; it loads bit-exactly at (4, 1) (plain 1-D
FSDP, no tp), at (1, 4) (tp alone: every rowwise weight split 4 ways by its columns, FSDP
over one rank; the only other layout that 4 ranks and these widths allow) and back at
(2, 2) from (1, 4); a (4, 1) checkpoint, as 1-D runs wrote them before tp existed, loads
at (2, 2). Exact resume at (2, 2) with stochastic rounding restores every rank's
tensor-parallel rounding streams. torch AdamW's states reshard with the weights, and so do
Int8AdamW's 8-bit states when each rank's part of a row is whole blocks (refused otherwise).
"""

from __future__ import annotations

import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from _cases import assert_identical, case, snapshot
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

import fsdp_int8
from fsdp_int8 import Int8AdamW, Int8TrainingConfig, Int8Weight
from fsdp_int8._quant.generators import WEIGHT_ROUNDING, GeneratorBank
from fsdp_int8.testing import run_distributed

BATCH = 8  # global batch: divides dp = 1, 2 and 4
PLAN = {"w1": ColwiseParallel(), "w2": RowwiseParallel()}
SEED = 7


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w1 = nn.Linear(32, 64)
        self.w2 = nn.Linear(64, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.w2(torch.relu(self.w1(x)))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Block() for _ in range(2))
        self.head = nn.Linear(32, 4)  # full precision (a skip name), on the dp mesh alone

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def _model(layout, optimizer=torch.optim.AdamW, init: int = 0, **options):
    """``layout``: ``(dp, tp)``, or ``"hsdp"`` (2 x 2 replicate x shard, no tp)."""
    torch.manual_seed(init)
    config = Int8TrainingConfig(min_features=1, seed=SEED)  # stochastic rounding (default)
    if layout == "hsdp":
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
        model = fsdp_int8.shard_model(Net(), mesh=mesh, config=config)
    elif layout[1] == 1:
        model = fsdp_int8.shard_model(Net(), config=config)  # today's 1-D FSDP
    else:
        mesh = init_device_mesh("cpu", layout, mesh_dim_names=("dp", "tp"))
        model = fsdp_int8.shard_model(Net(), mesh=mesh, config=config, tp_plan=PLAN)
    return model, optimizer(model.parameters(), lr=1e-2, weight_decay=0.1, **options)


def _train(model, opt, layout, first_step: int, steps: int) -> list[float]:
    """``steps`` steps; the sum over ranks of each step's loss (the same on every rank)."""
    dp, tp = (2, 1) if layout == "hsdp" else layout
    coordinate = dist.get_rank() // tp  # tp peers see the same batch
    per_rank = BATCH // (4 // tp)
    losses = []
    for step in range(first_step, first_step + steps):
        data = torch.Generator().manual_seed(step)  # the batch depends on the step only
        x, y = torch.randn(BATCH, 32, generator=data), torch.randn(BATCH, 4, generator=data)
        mine = slice(coordinate * per_rank, (coordinate + 1) * per_rank)
        loss = F.mse_loss(model(x[mine]), y[mine])
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
    total = torch.stack(losses)
    dist.all_reduce(total)
    return total.tolist()


def _same(a: dict, b: dict) -> bool:
    try:
        assert_identical(a, b, "")
    except AssertionError:
        return False
    return True


def _tp_shard(model):
    """This rank's ``TensorParallelShard`` (of the first rowwise int8 weight)."""
    return model.layers[0].w2.weight._local_tensor.tensor_parallel


def _assert_reseeded(step: int, dp_coordinate: int) -> None:
    """The weights' rounding stream is the one of (step, this rank's dp shard)."""
    expected = GeneratorBank()
    expected.manual_seed(step, dp_coordinate)
    assert torch.equal(WEIGHT_ROUNDING.get_state()["cpu"], expected.generator("cpu").get_state()), (
        f"rank {dist.get_rank()}: not reseeded for dp shard {dp_coordinate}"
    )


def _body(rank, world, root):
    with case("(2, 2): train 2 steps, save, 2 more"):
        model, opt = _model((2, 2))
        _train(model, opt, (2, 2), 0, 2)
        path = fsdp_int8.save_checkpoint(f"{root}/a", model, opt, step=2)
        at_save = snapshot(model, opt)
        losses = _train(model, opt, (2, 2), 2, 2)
        uninterrupted = snapshot(model, opt)
        saved = torch.load(path / "rng" / f"rank_{rank:05d}.pt", weights_only=True)["rounding"]
        assert f"cpu/tp{rank % 2}of2" in saved, sorted(saved)
        assert "layers.0.w2.weight" in at_save["weights"] and not _same(at_save, uninterrupted)
    with case("(2, 2) -> (2, 2): exact resume"):
        model, opt = _model((2, 2), init=1)
        assert not _same(at_save, snapshot(model, opt))  # the load has work to do
        info = fsdp_int8.load_checkpoint(f"{root}/a", model, opt)
        assert info.rng_restored
        assert_identical(at_save, snapshot(model, opt), "(2, 2) load")
        resumed = _train(model, opt, (2, 2), 2, 2)
        assert resumed == losses, (resumed, losses)
        assert_identical(uninterrupted, snapshot(model, opt), "(2, 2) save at 2, resume, 2 more")
    with case("(2, 2) -> (2, 2) with another tp rounding stream: not the same run"):
        model, opt = _model((2, 2), init=1)
        fsdp_int8.load_checkpoint(f"{root}/a", model, opt)
        WEIGHT_ROUNDING.generator("cpu", _tp_shard(model)).manual_seed(12345)
        _train(model, opt, (2, 2), 2, 2)
        assert not _same(uninterrupted, snapshot(model, opt))  # so the resume above needed it
    with case("(2, 2) -> (4, 1)"):
        model, opt = _model((4, 1), init=1)
        info = fsdp_int8.load_checkpoint(f"{root}/a", model, opt)
        assert not info.rng_restored
        _assert_reseeded(2, dp_coordinate=rank)
        assert_identical(at_save, snapshot(model, opt), "(2, 2) -> (4, 1)")
        _train(model, opt, (4, 1), 2, 1)
        fsdp_int8.save_checkpoint(f"{root}/b", model, opt, step=3)
        at_four = snapshot(model, opt)
    with case("(4, 1) (a 1-D checkpoint) -> (2, 2)"):
        model, opt = _model((2, 2), init=1)
        info = fsdp_int8.load_checkpoint(f"{root}/b", model, opt)
        assert not info.rng_restored
        _assert_reseeded(3, dp_coordinate=rank // 2)  # the dp shard's, not the tp shard's
        assert_identical(at_four, snapshot(model, opt), "(4, 1) -> (2, 2)")
        assert all(l == l for l in _train(model, opt, (2, 2), 3, 1))  # and it trains on
    with case("(2, 2) -> (1, 4) -> (2, 2)"):
        model, opt = _model((1, 4), init=1)
        assert not fsdp_int8.load_checkpoint(f"{root}/a", model, opt).rng_restored
        assert_identical(at_save, snapshot(model, opt), "(2, 2) -> (1, 4)")
        fsdp_int8.save_checkpoint(f"{root}/c", model, opt, step=2)
        model, opt = _model((2, 2), init=1)
        assert not fsdp_int8.load_checkpoint(f"{root}/c", model, opt).rng_restored
        assert_identical(at_save, snapshot(model, opt), "(1, 4) -> (2, 2)")
    with case("HSDP 2 x 2 -> (dp, tp) = (2, 2): same mesh shape, other layout"):
        model, opt = _model("hsdp")
        _train(model, opt, "hsdp", 0, 1)
        fsdp_int8.save_checkpoint(f"{root}/d", model, opt, step=1)
        at_hsdp = snapshot(model, opt)
        model, opt = _model((2, 2), init=1)
        assert not fsdp_int8.load_checkpoint(f"{root}/d", model, opt).rng_restored
        _assert_reseeded(1, dp_coordinate=rank // 2)
        assert_identical(at_hsdp, snapshot(model, opt), "HSDP -> (2, 2)")
    with case("Int8AdamW, 8-bit states: (2, 2) -> (4, 1)"):
        eight_bit = dict(optimizer=Int8AdamW, state_bits=8, block_size=16)  # 64 / tp = 32: 2 blocks
        model, opt = _model((2, 2), **eight_bit)
        _train(model, opt, (2, 2), 0, 2)
        fsdp_int8.save_checkpoint(f"{root}/e", model, opt, step=2)
        at_save = snapshot(model, opt)
        assert at_save["optimizer"]["layers.0.w2.weight.exp_avg_int8"].shape == (32, 64)
        assert at_save["optimizer"]["layers.0.w2.weight.exp_avg_scale"].shape == (32, 4)
        model, opt = _model((4, 1), init=1, **eight_bit)
        fsdp_int8.load_checkpoint(f"{root}/e", model, opt)
        assert_identical(at_save, snapshot(model, opt), "Int8AdamW 8-bit (2, 2) -> (4, 1)")
    with case("Int8AdamW, 8-bit blocks across tp shards: refused at the first step"):
        model, opt = _model((2, 2), optimizer=Int8AdamW, state_bits=8, block_size=64)
        with pytest.raises(ValueError, match="block_size=64"):
            _train(model, opt, (2, 2), 0, 1)


def test_checkpoints_across_tensor_parallel_layouts():
    with tempfile.TemporaryDirectory() as tmp:
        run_distributed(_body, 4, tmp)


def test_column_windows_read_and_copy_exactly():
    """What DCP does to a weight split by columns: column slices (views sharing the
    whole rows' scales) read right and take ``copy_`` from Int8Weights byte for byte."""
    torch.manual_seed(0)
    weight = Int8Weight.from_float(torch.randn(4, 8))
    window = weight[:, 2:6]
    assert isinstance(window, Int8Weight) and window.row_len == 4 and window.shape == (4, 4)
    assert window.scale.data_ptr() == weight.scale.data_ptr()  # shared, not copied
    assert torch.equal(window.dequantize(), weight.dequantize()[:, 2:6])
    assert torch.equal(weight.narrow(1, 2, 4).int_data, weight.int_data[:, 2:6])
    assert torch.equal(window[:, 1:3].dequantize(), weight.dequantize()[:, 3:5])  # a window's window
    assert torch.equal(window[1:3].dequantize(), weight.dequantize()[1:3, 2:6])

    target = Int8Weight.from_float(torch.zeros(4, 8))
    for start, stop in ((0, 3), (3, 8)):  # two pieces, as two checkpoint shards
        target.narrow(1, start, stop - start).copy_(weight[:, start:stop])
    assert torch.equal(target.int_data, weight.int_data) and torch.equal(target.scale, weight.scale)

    with pytest.raises(NotImplementedError, match="window of columns"):
        window.copy_(torch.randn(4, 4))  # a requantizing write would rescale other columns
    with pytest.raises(NotImplementedError, match="window of columns"):
        window.assign_(torch.randn(4, 4), stochastic=True)
    for split in (lambda w: torch.split(w, 4, dim=1), lambda w: torch.chunk(w, 2, dim=1)):
        with pytest.raises(NotImplementedError, match="dim 0 only"):
            split(weight)  # what torch's stock RowwiseParallel does: still refused
