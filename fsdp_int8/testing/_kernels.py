"""Count the kernels a block of code launches: aten ops and fsdp_int8's Triton launches."""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Iterator

from torch._library.custom_ops import _maybe_get_opdef
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

from fsdp_int8._quant import grouped_gemm

# aten ops that launch no kernel: views, allocations without a fill, host reads
_NO_KERNEL = frozenset({
    "view", "_unsafe_view", "t", "transpose", "permute", "expand", "slice", "select", "unsqueeze", "squeeze",
    "alias", "detach", "empty", "empty_strided", "as_strided", "split", "chunk", "split_with_sizes", "unbind",
    "reshape", "_reshape_alias", "lift_fresh", "_local_scalar_dense",
})


@dataclasses.dataclass
class KernelCounts:
    """What :func:`count_kernels` saw.

    Attributes:
        aten: aten ops that launched a kernel.
        triton: launches of fsdp_int8's Triton kernels (the grouped int8 GEMMs of experts).
    """

    aten: int = 0
    triton: int = 0


class _Counting(TorchDispatchMode):
    def __init__(self, counts: KernelCounts) -> None:
        super().__init__()
        self.counts = counts

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        opdef = _maybe_get_opdef(func) if func.namespace == "fsdp_int8" else None
        if opdef is not None:  # an fsdp_int8 custom op: count what its body runs
            with self:
                return opdef._init_fn(*args, **kwargs)
        if func.__name__.split(".")[0] not in _NO_KERNEL:
            self.counts.aten += 1
        return func(*args, **kwargs)


@contextlib.contextmanager
def count_kernels() -> Iterator[KernelCounts]:
    """Count the kernels launched inside the block, on any device.

    Counted: every aten op that runs a kernel (views, metadata and allocations without a
    fill excluded), also inside fsdp_int8's custom ops, and every launch of fsdp_int8's
    Triton kernels (Triton's interpreter's own tensor copies are not counted: a GPU makes
    none). Ops inside a compiled graph count as the graph runs them. One counting region
    at a time per process.

    Example::

        with count_kernels() as kernels:
            loss.backward()
        print(kernels.aten, kernels.triton)
    """
    counts = KernelCounts()
    launchers = {"_launch_rows": grouped_gemm._launch_rows, "_launch_sums": grouped_gemm._launch_sums}

    def counted(launch):
        def launch_counted(*args, **kwargs):
            counts.triton += 1
            with _disable_current_modes():
                return launch(*args, **kwargs)
        return launch_counted

    for name, launch in launchers.items():
        setattr(grouped_gemm, name, counted(launch))
    try:
        with _Counting(counts):
            yield counts
    finally:
        for name, launch in launchers.items():
            setattr(grouped_gemm, name, launch)
