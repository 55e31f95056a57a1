"""Count what a piece of PyTorch code asks of a device, op by op: the roofline's inputs.

:class:`OpCounter` is a ``TorchDispatchMode`` that records, for every aten op it sees
(grouped by op name, see :class:`OpCost`):

* **FLOPs by dtype**, for the ops that multiply matrices: torch's own formulas
  (``torch.utils.flop_counter.flop_registry``: ``mm``, ``addmm``, ``bmm``, the CUDA
  attention kernels, ...) plus the ones it lacks: ``torch._int_mm`` (int8 FLOPs),
  ``torch._grouped_mm``, the CPU's flash attention, forward and backward, and fsdp_int8's
  grouped int8 GEMMs of experts (custom ops, counted whole: their per-expert kernels are
  not seen). A causal attention counts half of torch's full-square figure (the kernels
  skip the masked blocks). The dtype is the first operand's. 2-D GEMMs also keep their
  shape and layout (``gemm_shape``), for a device whose rate depends on them.
* **Bytes read and written**: every tensor argument read once, every output written once,
  counted as ``torch.utils._runtime_estimation.get_num_bytes`` does (a broadcast dim
  counts once). An argument an op only overwrites (``copy_``'s destination, ``out=``,
  ``zero_``, ``fill_``) is written, not read.
* **Launches**: one per op that runs a kernel; views, allocations without a fill and
  metadata queries launch nothing.
* **Host syncs**: reads of a tensor's value by the host (``aten._local_scalar_dense``:
  ``.item()``, ``bool(t)``, ``.tolist()``), each a wait for the device's queue on a GPU.
* **Collectives**: the buffers of ``c10d`` all-gathers and reduce-scatters (output and
  input respectively: all ranks' shares), which the roofline times over the interconnect.

Composite ops that reach the mode (below autograd, inside a tensor subclass's dispatch)
are decomposed under it, so their parts are counted and they are not counted twice. An
op on a tensor subclass is left to the subclass (``NotImplemented``), whose own aten ops
on plain tensors come back here.

``fused(name, inputs)`` models a ``torch.compile``d function: the matmuls inside it stay
kernels of their own (inductor calls them as extern kernels), and the other ops between
two matmuls form one fused kernel, which reads the tensors it did not make itself and
writes the tensors something after it reads (a later part of the region, or the
region's results), once each.

Traced on fake tensors (``answer_reads=True``) a host read has no value: the mode
answers ``True`` for a bool, 1 for an integer and 1.0 for a float, values that keep the
code on its common path (finite checks and agreement flags pass, nothing is skipped),
and a ``bincount`` with ``minlength`` (a router's tokens per expert) is that long. Reads
of ``host_tensors`` (ids) are not syncs.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections import defaultdict
from typing import Any, Iterator

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from benchmarks._flops import flops_of, gemm_shape, op_name

__all__ = ["OpCost", "OpCounter", "tensor_bytes"]

aten = torch.ops.aten

HOST_READS = (aten._local_scalar_dense.default,)
COLLECTIVE_KINDS = {  # c10d op -> (kind, index of the buffer the collective's bytes are counted on)
    "c10d._allgather_base_": ("all_gather", 0),  # (output, input): the gathered output
    "c10d.allgather_into_tensor_coalesced_": ("all_gather", 0),
    "c10d._reduce_scatter_base_": ("reduce_scatter", 1),  # (output, input): the whole input
    "c10d.reduce_scatter_tensor_coalesced_": ("reduce_scatter", 1),
    "_c10d_functional.all_gather_into_tensor": ("all_gather", None),  # the returned output
    "_c10d_functional.reduce_scatter_tensor": ("reduce_scatter", 0),
    "_c10d_functional.all_reduce": ("all_reduce", 0),
    "c10d.allreduce_": ("all_reduce", 0),
}
# ops that run no kernel: allocations without a fill, metadata, bookkeeping
NO_KERNEL = {
    "aten.empty", "aten.empty_strided", "aten.empty_like", "aten.new_empty", "aten.new_empty_strided",
    "aten.detach", "aten.lift_fresh", "aten._unsafe_view", "aten.alias", "aten.set_", "aten.resize_", "aten.record_stream",
    "aten._has_compatible_shallow_copy_type", "aten.is_same_size", "aten.sym_size", "aten.sym_stride",
    "aten.sym_numel", "aten.sym_storage_offset", "aten.is_coalesced", "aten._local_scalar_dense",
    "c10d.barrier", "_c10d_functional.wait_tensor",
}
NO_KERNEL_NAMESPACES = ("prim", "profiler")
OVERWRITES = {  # in-place ops whose first argument's old values are not read
    "aten.copy_", "aten.zero_", "aten.fill_", "aten.uniform_", "aten.normal_", "aten.random_",
    "aten.bernoulli_", "aten.exponential_",
}


@dataclasses.dataclass
class OpCost:
    """What the calls of one op (or one fused region) asked of the device, summed."""

    calls: int = 0
    flops: dict[str, float] = dataclasses.field(default_factory=lambda: defaultdict(float))  # dtype -> FLOPs
    bytes_read: float = 0.0
    bytes_written: float = 0.0
    launches: int = 0
    host_syncs: int = 0
    collective: str | None = None  # "all_gather" / "reduce_scatter" / "all_reduce"
    collective_bytes: float = 0.0  # all ranks' shares of the buffers
    # 2-D GEMMs by (dtype, m, k, n, a transposed, b transposed) -> calls: for a device whose
    # GEMM rate depends on the shape and layout
    gemms: dict[tuple, float] = dataclasses.field(default_factory=lambda: defaultdict(float))

    @property
    def bytes(self) -> float:
        return self.bytes_read + self.bytes_written

    def add(self, other: "OpCost", times: float = 1.0) -> None:
        """Add ``times`` x ``other`` into this cost (``times`` may be negative or fractional)."""
        self.calls += other.calls * times
        for dtype, flops in other.flops.items():
            self.flops[dtype] += flops * times
        self.bytes_read += other.bytes_read * times
        self.bytes_written += other.bytes_written * times
        self.launches += other.launches * times
        self.host_syncs += other.host_syncs * times
        self.collective = self.collective or other.collective
        self.collective_bytes += other.collective_bytes * times
        for key, calls in other.gemms.items():
            self.gemms[key] += calls * times


def tensor_bytes(t: torch.Tensor) -> int:
    """Bytes an op touches of ``t``: its elements (a dim of stride 0 counts once) times
    the element size, as torch's runtime estimator counts them."""
    numel = 1
    for size, stride in zip(t.shape, t.stride()):
        if stride != 0:
            numel *= int(size)
    return numel * t.element_size()


def _launches_kernel(func, name: str) -> bool:
    if func.namespace in NO_KERNEL_NAMESPACES or name in NO_KERNEL:
        return False
    return not func.is_view


def _overwritten(func, name: str, args: tuple, kwargs: dict) -> set[int]:
    """ids of the tensor arguments ``func`` writes without reading."""
    ids = {id(v) for k, v in kwargs.items() if k == "out" or k.startswith("out")}
    for argument, value in zip(func._schema.arguments, args):
        if argument.is_out:
            ids.add(id(value))
    if name in OVERWRITES and args and isinstance(args[0], torch.Tensor):
        ids.add(id(args[0]))
    return ids


def _tensors(tree: Any) -> list[torch.Tensor]:
    flat, _ = tree_flatten(tree)
    seen, out = set(), []
    for t in flat:
        if isinstance(t, torch.Tensor) and id(t) not in seen:
            seen.add(id(t))
            out.append(t)
    return out


def _plain(t: torch.Tensor) -> bool:
    return type(t) in (torch.Tensor, torch.nn.Parameter, FakeTensor)


def _has_composite_kernel(func) -> bool:
    return func.namespace == "aten" and func.has_kernel_for_dispatch_key(torch._C.DispatchKey.CompositeImplicitAutograd)


class OpCounter(TorchDispatchMode):
    """Record the cost of every aten op run under it, by op name (see the module doc).

    Args:
        answer_reads: Answer host reads of tensor values instead of running them (tracing
            on fake tensors, which hold no values).
    """

    def __init__(self, answer_reads: bool = False) -> None:
        super().__init__()
        self.answer_reads = answer_reads
        self.costs: dict[str, OpCost] = defaultdict(OpCost)
        self.counting = True
        self.host_tensors: set[int] = set()  # ids of tensors whose reads wait for no device
        self._region: FusedRegion | None = None

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Run ops (answering host reads as usual) without recording them."""
        counting, self.counting = self.counting, False
        try:
            yield
        finally:
            self.counting = counting

    def fused(self, name: str, inputs: Any) -> "FusedRegion":
        """A compiled function's region named ``name``, called on ``inputs`` (see
        :class:`FusedRegion`)."""
        return FusedRegion(self, name, inputs)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        tensors = _tensors((args, kwargs))
        if any(not _plain(t) for t in tensors):
            return NotImplemented  # the subclass's own ops on its plain tensors come back here
        name = op_name(func)
        if func in HOST_READS:
            if id(args[0]) not in self.host_tensors:
                self._record_sync(name)
            if self.answer_reads:
                dtype = args[0].dtype
                return True if dtype == torch.bool else (1.0 if dtype.is_floating_point else 1)
            return func(*args, **kwargs)
        if self.answer_reads and func is aten.bincount.default:
            # a histogram's length depends on its values; with minlength (a router's counts per
            # expert) it is minlength
            minlength = kwargs.get("minlength", args[2] if len(args) > 2 else 0)
            out = torch.zeros(minlength, dtype=torch.long, device=args[0].device)
            self._record(func, name, args, kwargs, out, tensors)
            return out
        if not func.is_view and _has_composite_kernel(func):
            with self:
                decomposed = func.decompose(*args, **kwargs)
            if decomposed is not NotImplemented:
                return decomposed
        out = func(*args, **kwargs)
        if self.counting:
            self._record(func, name, args, kwargs, out, tensors)
        return out

    def _record_sync(self, name: str) -> None:
        if self.counting:
            cost = self.costs[name]  # a sync is never fused away
            cost.calls += 1
            cost.host_syncs += 1

    def _record(self, func, name: str, args, kwargs, out, inputs: list[torch.Tensor]) -> None:
        launches = _launches_kernel(func, name)
        flops = flops_of(func, args, kwargs, out)
        shape = gemm_shape(func, args)
        if self._region is not None and name not in COLLECTIVE_KINDS:
            self._region.ops.append(_RegionOp(
                name, flops, launches, shape,
                view=func.is_view or name in NO_KERNEL, overwritten=_overwritten(func, name, args, kwargs),
                inputs=inputs, outputs=_tensors(out)))
            return
        cost = self.costs[name]
        for dtype, count in flops.items():
            cost.flops[dtype] += count
        if shape is not None:
            cost.gemms[shape] += 1
        cost.calls += 1
        if name in COLLECTIVE_KINDS:
            kind, index = COLLECTIVE_KINDS[name]
            buffers = _tensors(out if index is None else args[index])
            cost.collective = kind
            cost.collective_bytes += sum(t.numel() * t.element_size() for t in buffers)
            return  # its time is the interconnect's, not the memory's
        if not launches:
            return
        cost.launches += 1
        if name == "fsdp.all_gather_copy_in":  # copies the shards into this rank's slice of the buffer
            shards = sum(tensor_bytes(t) for t in _tensors(args[0]))
            cost.bytes_read += shards
            cost.bytes_written += shards
            return
        overwritten = _overwritten(func, name, args, kwargs)
        cost.bytes_read += sum(tensor_bytes(t) for t in inputs if id(t) not in overwritten)
        cost.bytes_written += sum(tensor_bytes(t) for t in _tensors(out))


@dataclasses.dataclass
class _RegionOp:
    name: str
    flops: dict[str, float]
    launches: bool
    gemm: tuple | None
    view: bool
    overwritten: set[int]
    inputs: list[torch.Tensor]
    outputs: list[torch.Tensor]


class FusedRegion:
    """The ops run inside count as a compiled function's kernels (see
    :meth:`OpCounter.fused`): each matmul its own kernel; the other ops between two matmuls
    one fused kernel. Call :meth:`done` with the results before leaving."""

    def __init__(self, counter: OpCounter, name: str, inputs: Any) -> None:
        self.counter, self.name, self.inputs = counter, name, inputs
        self.ops: list[_RegionOp] = []  # holds the tensors: their ids stay unique
        self.results: Any = None

    def __enter__(self) -> "FusedRegion":
        self._outer = self.counter._region
        if self._outer is None:
            self.counter._region = self
        return self

    def done(self, results: Any) -> None:
        """The region's results (written by the region's last kernels)."""
        self.results = results

    def __exit__(self, *exc) -> None:
        if self._outer is not None:
            return  # a region inside a region is part of it
        self.counter._region = None
        if exc[0] is None and self.counter.counting:
            for name, cost in self.kernels().items():
                self.counter.costs[name].add(cost)

    def kernels(self) -> dict[str, OpCost]:
        """The region's costs by kernel name: its matmuls by op name, its fused parts as
        ``fused <name>``."""
        base: dict[int, int] = {}  # a view's id -> the id of the tensor it views

        def root(t: torch.Tensor) -> int:
            key = id(t)
            while key in base:
                key = base[key]
            return key

        arguments = {id(t) for t in _tensors(self.inputs)}
        segment_of_op, segment, producer = [], 0, {}
        for op in self.ops:
            if op.view:
                for out in op.outputs:
                    if op.inputs and root(op.inputs[0]) != id(out):  # an in-place view returns its input
                        base[id(out)] = root(op.inputs[0])
                segment_of_op.append(None)
                continue
            is_matmul = bool(op.flops)
            if is_matmul:
                segment += 1
            segment_of_op.append(segment)
            for out in op.outputs:
                if root(out) not in arguments:  # an argument written in place is still read from outside
                    producer.setdefault(root(out), segment)
            if is_matmul:
                segment += 1
        last_read: dict[int, int] = {}
        for op, seg in zip(self.ops, segment_of_op):
            if seg is None:
                continue
            for t in op.inputs:
                if id(t) not in op.overwritten:
                    last_read[root(t)] = max(last_read.get(root(t), -1), seg)
        results = {root(t) for t in _tensors(self.results)} | {root(t) for t in _tensors(self.inputs)}
        costs: dict[str, OpCost] = defaultdict(OpCost)
        fused_reads: dict[int, set[int]] = defaultdict(set)
        fused_writes: dict[int, set[int]] = defaultdict(set)
        sizes: dict[int, int] = {}
        for op, seg in zip(self.ops, segment_of_op):
            if seg is None:
                continue
            if op.flops:  # a matmul: an extern kernel with its own operands and result
                cost = costs[op.name]
                cost.calls += 1
                cost.launches += 1
                for dtype, flops in op.flops.items():
                    cost.flops[dtype] += flops
                if op.gemm is not None:
                    cost.gemms[op.gemm] += 1
                cost.bytes_read += sum(tensor_bytes(t) for t in op.inputs if id(t) not in op.overwritten)
                cost.bytes_written += sum(tensor_bytes(t) for t in op.outputs)
                continue
            if not op.launches:
                continue
            for t in op.inputs:
                if id(t) not in op.overwritten and producer.get(root(t), -1) != seg:
                    fused_reads[seg].add(root(t))
                    sizes[root(t)] = max(sizes.get(root(t), 0), tensor_bytes(t))
            for t in op.outputs:
                key = root(t)
                if last_read.get(key, -1) > seg or key in results:
                    fused_writes[seg].add(key)
                    sizes[key] = max(sizes.get(key, 0), tensor_bytes(t))
        fused = costs[f"fused {self.name}"]
        for seg in sorted(set(fused_reads) | set(fused_writes)):
            fused.calls += 1
            fused.launches += 1
            fused.bytes_read += sum(sizes[key] for key in fused_reads[seg])
            fused.bytes_written += sum(sizes[key] for key in fused_writes[seg])
        return {name: cost for name, cost in costs.items() if cost.calls}
