"""Tensor-parallel pieces that need no process group: the plan converter, the quantizer's
shared-``amax`` path, and the rounding streams of tensor-parallel shards."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
)

from fsdp_int8._quant.generators import GeneratorBank
from fsdp_int8.parallel import Int8ColwiseParallel, Int8RowwiseParallel, int8_tp_plan
from fsdp_int8.quant import absmax_quantize, signed_row_absmax


def test_plan_converter_swaps_stock_linear_styles_and_keeps_their_settings():
    prepare = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
    plan = {
        "attn.q": ColwiseParallel(use_local_output=False),
        "attn.o": RowwiseParallel(output_layouts=Shard(1)),
        "norm": SequenceParallel(),
        "attn": prepare,
    }
    converted = int8_tp_plan(plan)
    assert type(converted["attn.q"]) is Int8ColwiseParallel and not converted["attn.q"].use_local_output
    assert type(converted["attn.o"]) is Int8RowwiseParallel
    assert converted["attn.o"].output_layouts == (Shard(1),)
    assert converted["norm"] is plan["norm"] and converted["attn"] is prepare
    assert type(plan["attn.q"]) is ColwiseParallel  # the caller's plan is left alone


@pytest.mark.parametrize("bad", [[ColwiseParallel()], {"w": "colwise"}])
def test_plan_converter_refuses_what_is_not_a_plan(bad):
    with pytest.raises(TypeError, match="ParallelStyle|dict of module names"):
        int8_tp_plan(bad)


def test_shared_amax_equal_to_the_rows_own_gives_the_same_bits():
    values = torch.randn(6, 10, generator=torch.Generator().manual_seed(0))
    own = absmax_quantize(values)
    shared = absmax_quantize(values, amax=signed_row_absmax(values))
    assert torch.equal(own[0], shared[0]) and torch.equal(own[1], shared[1])


def test_a_larger_shared_amax_scales_every_row_by_it_and_clips_nothing():
    """A tp peer's columns hold this row's maximum: the local columns round on its scale."""
    values = torch.randn(4, 8, generator=torch.Generator().manual_seed(1))
    amax = signed_row_absmax(values) * 3
    for rounding in ("nearest", "stochastic"):
        q, scale = absmax_quantize(values, amax=amax, rounding=rounding, generator=torch.Generator().manual_seed(2))
        assert torch.equal(scale, amax / 127)
        assert q.abs().max() <= 127 // 3 + 1  # a third of the range, nothing at the clamp
        # per element, the error is below one step of the shared scale
        assert ((q.float() * scale[:, None] - values).abs() <= scale[:, None] * (1 + 1e-6)).all()


def test_shared_amax_is_for_whole_rows_only():
    with pytest.raises(ValueError, match="whole rows"):
        absmax_quantize(torch.ones(2, 4), amax=torch.ones(2), block_size=2)


def _shard(coordinate: int, size: int = 2) -> SimpleNamespace:
    return SimpleNamespace(coordinate=coordinate, size=size)


def test_tensor_parallel_shards_draw_their_own_streams_and_restore_them():
    bank = GeneratorBank()
    bank.manual_seed(7, 1)
    draws = {
        key: torch.rand(4, generator=bank.generator("cpu", shard))
        for key, shard in (("dp", None), ("tp0", _shard(0)), ("tp1", _shard(1)))
    }
    assert len({tuple(d.tolist()) for d in draws.values()}) == 3  # no two share a stream
    state = bank.get_state()
    assert set(state) == {"cpu", "cpu/tp0of2", "cpu/tp1of2"}
    after = torch.rand(4, generator=bank.generator("cpu", _shard(1)))
    fresh = GeneratorBank()
    fresh.set_state(state)
    assert torch.equal(torch.rand(4, generator=fresh.generator("cpu", _shard(1))), after)
    bank.manual_seed(7, 1)  # reseeding rewinds the tp streams too
    assert torch.equal(torch.rand(4, generator=bank.generator("cpu", _shard(1))), draws["tp1"])


@pytest.mark.parametrize("write", ["mul_", "div_", "zero_", "add_", "copy_ from floats"])
def test_a_column_window_refuses_writes_that_would_change_other_columns(write):
    """A slice along dim 1 shares the whole rows' scales: rescaling or requantizing it
    would change the columns outside it, so every such write raises and changes nothing."""
    from fsdp_int8 import Int8Weight

    weight = Int8Weight.from_float(torch.randn(4, 8, generator=torch.Generator().manual_seed(3)))
    before = weight.int_data.clone(), weight.scale.clone()
    window = weight[:, 2:6]
    ops = {
        "mul_": lambda w: w.mul_(0.5), "div_": lambda w: w.div_(2.0), "zero_": lambda w: w.zero_(),
        "add_": lambda w: w.add_(torch.ones(4, 4)), "copy_ from floats": lambda w: w.copy_(torch.ones(4, 4)),
    }
    with pytest.raises(NotImplementedError, match="window of columns"):
        ops[write](window)
    assert torch.equal(weight.int_data, before[0]) and torch.equal(weight.scale, before[1])
