"""Trace one training step of a benchmark row at any size, without its memory: the
roofline's op counts.

A row (``benchmarks.rows``: the same builder and optimizer the timing benchmarks use) is
built and stepped on fake tensors (``FakeTensorMode``: shapes and dtypes, no storage) as
rank 0 of a fake process group of ``world`` ranks (``torch.distributed``'s ``"fake"``
backend: collectives return at once), under :class:`benchmarks._op_trace.OpCounter`. The
first step runs uncounted (FSDP2's lazy init, the optimizer's states); the second is the
count, ``benchmarks.timing.train_step`` as the benchmarks time it.

The library picks some paths by device type (it reads an update's finite verdict at once
on the CPU, where that costs nothing, and defers it on accelerators; it sizes the
optimizer's chunks per device). ``accelerator=True`` traces its accelerator paths on the
CPU's fake tensors, as its own tests switch them on, for a GPU's estimate.

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
import functools
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
def _accelerator_policy() -> Iterator[None]:
    """fsdp_int8's choices for an accelerator, on the CPU's fake tensors: update verdicts
    deferred to the step's one check (as its tests switch it on) and the optimizer's
    chunks of accelerator size."""
    from fsdp_int8._weight import update_checks
    from fsdp_int8.optim import _base

    with mock.patch.object(update_checks, "defers", lambda device: True), \
            mock.patch.object(_base, "_CHUNK_ELEMENTS_CPU", _base._CHUNK_ELEMENTS), \
            mock.patch.object(_base, "_PIECE_ELEMENTS_CPU", _base._PIECE_ELEMENTS):
        yield


def _step_counters(optimizer: torch.optim.Optimizer) -> set[int]:
    """ids of the optimizer's ``step`` counters: tensors that live on the host on GPUs too
    (``torch.optim``'s ``capturable=False``), so reading one waits for no device."""
    return {id(state["step"]) for state in optimizer.state.values()
            if isinstance(state.get("step"), torch.Tensor)}


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


def trace_row(name: str, args: ModelArgs, *, batch: int, seq: int, world: int,
              accelerator: bool = False) -> dict[str, OpCost]:
    """One counted training step of row ``name`` at shape ``args``, ``batch`` sequences of
    ``seq`` tokens on this rank of ``world`` (module doc). ``accelerator``: with fsdp_int8's
    accelerator policy (:func:`_accelerator_policy`), and the optimizer's host-side step
    counters' reads not counted as syncs."""
    counter = OpCounter(answer_reads=True)
    policy = _accelerator_policy() if accelerator else contextlib.nullcontext()
    with warnings.catch_warnings(), fake_world(world), FakeTensorMode(allow_non_fake_inputs=True), counter, \
            _tracing_patches(counter), policy:
        warnings.simplefilter("ignore")  # fake tensors' data pointers, the slow-kernel notes
        row = registry.row(name)
        with counter.paused():
            model, optimizer = registry.build(row, args)
            tokens = torch.randint(0, args.vocab_size, (batch, seq + 1))
            inputs, targets = tokens[:, :-1], tokens[:, 1:]
            train_step(model, optimizer, inputs, targets, clip=row.clip)  # lazy init, optimizer states
        if accelerator:
            counter.host_tensors = _step_counters(optimizer)
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


def trace_row_blocks(name: str, args: ModelArgs, *, batch: int, seq: int, world: int, whole: bool = False,
                     accelerator: bool = False) -> Trace:
    """Row ``name``'s step at ``args.n_layers`` blocks: traced whole (``whole``), or at 1 and
    2 blocks of the real width and extrapolated block by block; ``accelerator`` as
    :func:`trace_row`'s."""
    trace = functools.partial(trace_row, name, batch=batch, seq=seq, world=world, accelerator=accelerator)
    policy = "fsdp_int8's accelerator policy" if accelerator else "fsdp_int8's CPU policy"
    if whole or args.n_layers <= 2:
        return Trace(trace(args), f"{policy}; traced whole ({args.n_layers} blocks)")
    one = trace(dataclasses.replace(args, n_layers=1))
    two = trace(dataclasses.replace(args, n_layers=2))
    how = (f"{policy}; traced at 1 and 2 blocks of real size, extrapolated to {args.n_layers}: "
           f"trace(1) + {args.n_layers - 1} x (trace(2) - trace(1))")
    return Trace(_combine(one, two, args.n_layers), how)
