"""Count the host reads of tensor values a piece of code makes: each a device sync on a GPU.

On an accelerator each read waits for the device's queue to drain, so a training step
that makes one per parameter stalls once per parameter. A CPU cannot feel that cost, so
tests count the reads instead (:func:`count_host_syncs`). Counting goes through a kernel
of ``aten::_local_scalar_dense`` of this module's, not a ``TorchDispatchMode``, because a
mode does not see the reads made inside a tensor subclass's ``__torch_dispatch__`` or
inside other aten kernels.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import threading
import traceback
import warnings
from typing import Any, Callable, Iterator

import torch

__all__ = ["HostSyncs", "count_host_syncs"]

# Functions whose reads are of host-resident step counters (function name, path part).
_STEP_COUNTER_READERS = (("_get_value", "torch/optim/"), ("_step_counts", "fsdp_int8/optim/"))
# Fused optimizer kernels, whose CPU versions read their scalars on the host.
_FUSED_KERNELS = ("_fused_adamw_", "_fused_adam_", "_fused_sgd_", "_fused_adagrad_")
_LOCK = threading.Lock()  # one counting region at a time: the kernel registration is process-wide


@dataclasses.dataclass
class HostSyncs:
    """What :func:`count_host_syncs` found: the value reads of one counted region.

    Attributes:
        sites: For each read, the innermost Python frame outside torch that made it
            (``"path:line in function"``).
    """

    sites: list[str] = dataclasses.field(default_factory=list)

    @property
    def count(self) -> int:
        """How many reads the region made."""
        return len(self.sites)

    def summary(self, limit: int = 10) -> str:
        """The most frequent call sites, one a line, with their counts."""
        common = collections.Counter(self.sites).most_common(limit)
        return "\n".join(f"{n:5d}  {site}" for site, n in common) or "no value reads"


def _is_torch(frame: traceback.FrameSummary) -> bool:
    return "/torch/" in frame.filename.replace("\\", "/")


def _site(stack: list[traceback.FrameSummary]) -> str:
    """The innermost frame of ``stack`` (outermost first) that is not torch's or this module's."""
    for frame in reversed(stack):
        if not _is_torch(frame) and frame.filename != __file__:
            return f"{frame.filename}:{frame.lineno} in {frame.name}"
    return "<unknown>"


def _reads_a_step_counter(stack: list[traceback.FrameSummary]) -> bool:
    return any(
        frame.name == name and path in frame.filename.replace("\\", "/")
        for frame in stack for name, path in _STEP_COUNTER_READERS
    )


def _value(tensor: torch.Tensor) -> Any:
    """``tensor``'s one value as a Python number, without ``_local_scalar_dense``."""
    host = tensor.detach().cpu()
    if host.dtype in (torch.bfloat16, torch.float16) or host.dtype.is_floating_point and host.dtype.itemsize == 1:
        host = host.to(torch.float64)
    return host.reshape(()).numpy().item()


@contextlib.contextmanager
def count_host_syncs() -> Iterator[HostSyncs]:
    """Count the host reads of tensor values (device syncs on an accelerator) made inside the block.

    Counted: every ``aten::_local_scalar_dense`` (``.item()``, ``bool(t)``, ``float(t)``,
    ``int(t)``, a tensor as an index), also inside tensor subclasses and other kernels, and
    every ``Tensor.tolist()``. Left out: reads of values that live on the host by design on
    every device, the CPU ``step`` counters of ``torch.optim``'s and fsdp_int8's optimizers
    and the fused optimizer kernels' (``torch._fused_adamw_`` and kin) reads of their step
    and learning rate (host-side on the CPU only). While it runs ``_local_scalar_dense`` has
    a kernel of its own for the CPU (and CUDA), registered with ``torch.library``: count,
    do not time, under it. One counting region at a time per process.

    Yields:
        A :class:`HostSyncs`, which fills in as the block runs.

    Example::

        with count_host_syncs() as reads:
            loss.backward(); optimizer.step()
        assert reads.count <= 2, reads.summary()
    """
    result = HostSyncs()
    inside_fused = [0]

    def record() -> None:
        if inside_fused[0]:
            return
        stack = traceback.extract_stack()[:-2]
        if not _reads_a_step_counter(stack):
            result.sites.append(_site(stack))

    def local_scalar_dense(tensor: torch.Tensor) -> Any:
        record()
        return _value(tensor)

    original_tolist = torch.Tensor.tolist

    def tolist(self: torch.Tensor) -> Any:
        record()
        return original_tolist(self)

    def host_reading(kernel: Callable) -> Callable:
        def run(*args: Any, **kwargs: Any) -> Any:
            inside_fused[0] += 1
            try:
                return kernel(*args, **kwargs)
            finally:
                inside_fused[0] -= 1
        return run

    fused = {name: getattr(torch, name) for name in _FUSED_KERNELS if hasattr(torch, name)}
    with _LOCK:
        library = torch.library.Library("aten", "IMPL")
        try:
            with warnings.catch_warnings():  # "overriding a previously registered kernel": on purpose
                warnings.simplefilter("ignore")
                for key in ("CPU", "CUDA") if torch.cuda.is_available() else ("CPU",):
                    library.impl("_local_scalar_dense", local_scalar_dense, key)
            torch.Tensor.tolist = tolist
            for name, kernel in fused.items():
                setattr(torch, name, host_reading(kernel))
            yield result
        finally:
            torch.Tensor.tolist = original_tolist
            for name, kernel in fused.items():
                setattr(torch, name, kernel)
            library._destroy()  # the aten kernels come back (as torch.library._scoped_library does)
