"""Trace one training step of a benchmark row at any size, without its memory: the
roofline's op counts.

A row (``benchmarks.rows``: the same builder and optimizer the timing benchmarks use) is
built and stepped on fake tensors (``FakeTensorMode``: shapes and dtypes, no storage) as
rank 0 of a fake process group of ``world`` ranks (``torch.distributed``'s ``"fake"``
backend: collectives return at once), under :class:`benchmarks._op_trace.OpCounter`. The
first step runs uncounted (FSDP2's lazy init, the optimizer's states); the second is the
count, ``benchmarks.timing.train_step`` as the benchmarks time it.

What fake tensors cannot do is arranged around, for the trace only:

* a device mesh is made of real tensors (it is built outside fake mode);
* fsdp_int8's first-unshard layout check reads the gathered flag bytes, which fake
  collectives never fill (the check is skipped; it runs at the first step only);
* fsdp_int8's compiled quantization kernels (``Int8TrainingConfig.compile``) run their
  Python body as one :meth:`~benchmarks._op_trace.OpCounter.fused` region: one kernel
  reading its arguments and writing its results, as inductor's fused kernel does (under a
  dispatch mode the library would take its eager path instead).

:func:`trace_row_blocks` traces 1 and 2 blocks at the real width and extrapolates to
``n_layers`` (each block after the first costs what the second added), or traces the
whole model.
"""

from __future__ import annotations

import contextlib
import dataclasses
import warnings
from collections import defaultdict
from typing import Iterator
from unittest import mock

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensorMode, unset_fake_temporarily

from benchmarks import rows as registry
from benchmarks._op_trace import OpCost, OpCounter
from benchmarks.timing import train_step
from launch.model import ModelArgs

__all__ = ["Trace", "fake_world", "trace_row", "trace_row_blocks"]


@dataclasses.dataclass(frozen=True)
class Trace:
    """One step's costs by op name, and how they were obtained (for the output)."""

    costs: dict[str, OpCost]
    how: str


@contextlib.contextmanager
def fake_world(world: int) -> Iterator[None]:
    """A fake process group of ``world`` ranks, this process rank 0, for the block."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise RuntimeError("a process group is already initialized: trace in a process without one")
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _real_mesh(make):
    def made_outside_fake_mode(*args, **kwargs):
        with unset_fake_temporarily():
            return make(*args, **kwargs)

    return made_outside_fake_mode


def _kernel_name(function) -> str:
    """The name of a compiled kernel's body (a wrapper's first callable closure cell)."""
    for cell in getattr(function, "__closure__", None) or ():
        if callable(cell.cell_contents):
            return _kernel_name(cell.cell_contents)
    return getattr(function, "__name__", "kernel")


@contextlib.contextmanager
def _tracing_patches(counter: OpCounter) -> Iterator[None]:
    import fsdp_int8.sharding
    import launch.parallel
    from fsdp_int8._quant import kernels
    from fsdp_int8._weight import all_gather

    def fused_kernel(function):
        def run(*args):
            with counter.fused(_kernel_name(function), args) as region:
                result = function(*args)
                region.done(result)
            return result

        return run

    with contextlib.ExitStack() as stack:
        for module in (launch.parallel, fsdp_int8.sharding):
            stack.enter_context(mock.patch.object(module, "init_device_mesh", _real_mesh(module.init_device_mesh)))
        stack.enter_context(mock.patch.object(all_gather, "flagged_shards", lambda *args, **kwargs: []))
        stack.enter_context(mock.patch.object(kernels, "_compiler_runs_eagerly", lambda: False))
        stack.enter_context(mock.patch.object(kernels, "compiled", fused_kernel))
        yield


def trace_row(name: str, args: ModelArgs, *, batch: int, seq: int, world: int) -> dict[str, OpCost]:
    """One counted training step of row ``name`` at shape ``args``, ``batch`` sequences of
    ``seq`` tokens on this rank of ``world`` (module doc)."""
    counter = OpCounter(answer_reads=True)
    with warnings.catch_warnings(), fake_world(world), FakeTensorMode(allow_non_fake_inputs=True), counter, \
            _tracing_patches(counter):
        warnings.simplefilter("ignore")  # fake tensors' data pointers, the slow-kernel notes
        row = registry.row(name)
        with counter.paused():
            model, optimizer = registry.build(row, args)
            tokens = torch.randint(0, args.vocab_size, (batch, seq + 1))
            inputs, targets = tokens[:, :-1], tokens[:, 1:]
            train_step(model, optimizer, inputs, targets, clip=row.clip)  # lazy init, optimizer states
        train_step(model, optimizer, inputs, targets, clip=row.clip)
    return dict(counter.costs)


def _combine(one: dict[str, OpCost], two: dict[str, OpCost], blocks: int) -> dict[str, OpCost]:
    """``one + (blocks - 1) * (two - one)``, op by op."""
    out: dict[str, OpCost] = defaultdict(OpCost)
    for name in set(one) | set(two):
        cost = out[name]
        cost.add(one.get(name, OpCost()), 2 - blocks)
        cost.add(two.get(name, OpCost()), blocks - 1)
    return dict(out)


def trace_row_blocks(name: str, args: ModelArgs, *, batch: int, seq: int, world: int, whole: bool = False) -> Trace:
    """Row ``name``'s step at ``args.n_layers`` blocks: traced whole (``whole``), or at 1 and
    2 blocks of the real width and extrapolated block by block."""
    if whole or args.n_layers <= 2:
        costs = trace_row(name, args, batch=batch, seq=seq, world=world)
        return Trace(costs, f"traced whole ({args.n_layers} blocks)")
    one = trace_row(name, dataclasses.replace(args, n_layers=1), batch=batch, seq=seq, world=world)
    two = trace_row(name, dataclasses.replace(args, n_layers=2), batch=batch, seq=seq, world=world)
    how = (f"traced at 1 and 2 blocks of real size, extrapolated to {args.n_layers}: "
           f"trace(1) + {args.n_layers - 1} x (trace(2) - trace(1))")
    return Trace(_combine(one, two, args.n_layers), how)
