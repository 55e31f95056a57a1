"""Testing helpers that downstream projects reuse; how to use them: docs/testing.md.

* Run a test body in N real processes (CPU + gloo, or one GPU per rank + NCCL where there
  are enough GPUs): :func:`run_distributed`, :class:`DistributedTestCase`.
* The FSDP2 conformance suite for any tensor-subclass weight under ``fully_shard``
  (training parity, uneven shards, world size 1, HSDP, meta-device init, bf16 mixed
  precision, all-gather bytes, DCP resharding, the ops FSDP2 and DCP send):
  :class:`SubclassSpec`, :func:`check_fsdp2_conformance` / :func:`assert_fsdp2_conformance`.
* :func:`count_host_syncs`: the host reads of tensor values (device syncs on a GPU) a block
  of code makes, counted on any device; :func:`count_kernels`: the kernels it launches.
"""

from typing import Any

from fsdp_int8.testing import processes
from fsdp_int8.testing._host_syncs import HostSyncs, count_host_syncs
from fsdp_int8.testing._kernels import KernelCounts, count_kernels
from fsdp_int8.testing.conformance import (
    SCENARIOS,
    ConformanceReport,
    ScenarioResult,
    SubclassSpec,
    assert_fsdp2_conformance,
    check_fsdp2_conformance,
)
from fsdp_int8.testing.processes import device_type_for, run_distributed

__all__ = [
    "run_distributed",
    "DistributedTestCase",
    "device_type_for",
    "SubclassSpec",
    "check_fsdp2_conformance",
    "assert_fsdp2_conformance",
    "ConformanceReport",
    "ScenarioResult",
    "SCENARIOS",
    "count_host_syncs",
    "HostSyncs",
    "count_kernels",
    "KernelCounts",
]


def __getattr__(name: str) -> Any:
    # DistributedTestCase is built on first use (see processes): importing torch's test
    # utilities would cost every spawned rank about a second.
    if name == "DistributedTestCase":
        return processes.DistributedTestCase
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
