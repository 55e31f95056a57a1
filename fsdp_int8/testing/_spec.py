"""The conformance suite's shared vocabulary: the spec, the scenario keys, the results.

Both halves of the suite import this module and nothing else of each other: the
scenarios (``_scenarios_*``, run inside the ranks) report ``(status, detail)`` pairs
with the statuses below, and the runner (:mod:`fsdp_int8.testing.conformance`, in the
parent) turns them into :class:`ScenarioResult` and :class:`ConformanceReport`.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import torch

PASSED, FAILED, NOT_APPLICABLE = "passed", "failed", "not applicable"

INJECTED = "injected rank-asymmetric failure"
"""Marks the error the ``asymmetric_failure`` scenario raises on purpose, so that the
parent can tell it from a real failure."""

OP_SCENARIOS = {
    "op:view(-1)": "view(-1) keeps the subclass, has the flat shape and the same values",
    "op:as_strided": "as_strided(t, t.shape, contiguous strides, 0), as FSDP2 calls it on the "
                     "unsharded weight",
    "op:split/chunk": "torch.split and torch.chunk on dim 0: subclass pieces with the right rows",
    "op:new_zeros": "new_zeros([rows, cols]): a zero subclass tensor (FSDP2's padded shard)",
    "op:copy_": "copy_ from the subclass (exact) and from a float tensor (within one rounding step)",
    "op:pin_memory": "pin_memory keeps type and values (needs an accelerator)",
    "op:slice": "slices on dim 0, empty ones too, that alias the base (FSDP2 writes shards "
                "through them)",
    "op:cat": "torch.cat on dim 0 of two subclass tensors",
    "op:broadcast": "dist.broadcast of a subclass tensor (full state dicts broadcast from rank 0)",
}

#: Every scenario the suite knows, by report key, with what it checks, in report order:
#: ``parity_reshard``, ``parity_no_reshard``, ``world_size_1``, ``uneven_shards``,
#: ``empty_shards``, ``hsdp``, ``meta_init``, ``bf16_mixed_precision``, ``wire_bytes``,
#: ``dcp_reshard``, ``op:view(-1)``, ``op:as_strided``, ``op:split/chunk``, ``op:new_zeros``,
#: ``op:copy_``, ``op:pin_memory``, ``op:slice``, ``op:cat``, ``op:broadcast``,
#: ``asymmetric_failure``. Which world sizes run each: docs/testing.md.
SCENARIOS: dict[str, str] = {
    "parity_reshard": "training parity, reshard_after_forward=True: losses, sharded gradients "
                      "and weights before and after each optimizer step against an unsharded "
                      "reference with all-reduced gradients",
    "parity_no_reshard": "the same with reshard_after_forward=False",
    "world_size_1": "the same on one rank (FSDP2's single-rank path skips the collective)",
    "uneven_shards": "rows not divisible by the world size: the last rank holds fewer rows",
    "empty_shards": "fewer rows than ranks: some ranks hold empty shards",
    "hsdp": "HSDP on a 2 x (world/2) mesh: the hooks must work with the shard mesh only",
    "meta_init": "build on the meta device, fully_shard, to_empty, initialise with copy_, train",
    "bf16_mixed_precision": "MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32): the "
                            "unsharded weight is bf16, training tracks the fp32 reference",
    "wire_bytes": "bytes of FSDP2's all-gather, counted at the collective, against "
                  "wire_bytes_per_element",
    "dcp_reshard": "torch.distributed.checkpoint save at one world size, load at the next, bit-exact",
    **OP_SCENARIOS,
    "asymmetric_failure": "a failure injected on one rank only (its fsdp_pre_all_gather raises) "
                          "ends the run within a bounded time instead of hanging",
}


@dataclasses.dataclass(frozen=True)
class SubclassSpec:
    """How to build, read and measure a tensor-subclass weight.

    Every callable must be picklable (a module-level function, or a class method such
    as ``MyWeight.from_float``): the ranks run in spawned processes.

    Attributes:
        name: Shown in reports.
        from_float: ``from_float(t) -> weight``: the subclass holding the float tensor
            ``t`` (2-D, fp32, possibly on the meta device). The suite wraps the result in
            ``nn.Parameter``.
        to_float: ``to_float(weight) -> tensor``: the values a weight (or a shard, empty
            ones too, a slice, a flat view of one) stands for, as a plain floating tensor
            of its shape.
        wire_bytes_per_element: Bytes per weight element that FSDP2's all-gather moves
            (all ranks' shares together, no mixed precision, rows divisible by the world
            size): a number, or ``f(full_shape) -> float`` when it depends on the shape
            (an int8 weight with one fp32 scale per row of K elements: ``1 + 4 / K``).
        rounding_step: The largest change one rounding of an update can make, relative
            to the largest magnitude in its row: ``1 / 127`` for int8 rows scaled by
            their absmax, ``2 ** -7`` for bf16 storage, 0 for a format that stores fp32.
            Two runs that round the same update may land one step apart (stochastic
            rounding draws differ between a shard and the whole weight); the comparisons
            after optimizer steps allow this much and no more.
    """

    name: str
    from_float: Callable[[torch.Tensor], torch.Tensor]
    to_float: Callable[[torch.Tensor], torch.Tensor]
    wire_bytes_per_element: float | Callable[[torch.Size], float]
    rounding_step: float = 0.0

    def wire_bytes_for(self, shape: torch.Size) -> float:
        """Declared all-gather bytes per element for a weight of ``shape``."""
        per_element = self.wire_bytes_per_element
        return float(per_element(shape) if callable(per_element) else per_element)


@dataclasses.dataclass(frozen=True)
class ScenarioResult:
    """The outcome of one scenario.

    Attributes:
        status: ``"passed"``, ``"failed"`` or ``"not applicable"``.
        detail: Why (the failure, or why it does not apply).
    """

    status: str
    detail: str = ""

    @property
    def failed(self) -> bool:
        """``status == "failed"``."""
        return self.status == FAILED


@dataclasses.dataclass
class ConformanceReport:
    """What :func:`~fsdp_int8.testing.check_fsdp2_conformance` found, scenario by scenario.

    A scenario run at several world sizes is merged: failed if it failed at any, passed if
    it passed at any (and failed at none), else not applicable; the detail names the world
    sizes. ``str(report)`` is :meth:`table`.

    Attributes:
        spec_name: ``SubclassSpec.name``.
        world_sizes: The world sizes that ran.
        results: Report key (see :data:`SCENARIOS`) -> :class:`ScenarioResult`.
        seconds: Wall time of the whole check.
        spawns: Process groups spawned (one per world size, plus one more after each
            scenario that ended a spawn).
    """

    spec_name: str
    world_sizes: tuple[int, ...]
    results: dict[str, ScenarioResult]
    seconds: float = 0.0
    spawns: int = 0

    @property
    def failures(self) -> dict[str, ScenarioResult]:
        """The failed scenarios."""
        return {k: r for k, r in self.results.items() if r.failed}

    @property
    def ok(self) -> bool:
        """No scenario failed (``not applicable`` ones do not count)."""
        return not self.failures

    def status(self, key: str) -> str:
        """The status of scenario ``key``."""
        return self.results[key].status

    def table(self) -> str:
        """The report as a markdown table (scenario | result | detail), under a line with
        :meth:`summary`, the world sizes and the wall time."""
        lines = [f"{self.spec_name}: {self.summary()} (world sizes {self.world_sizes}, "
                 f"{self.seconds:.0f} s)", "", "| scenario | result | detail |", "|---|---|---|"]
        for key, result in self.results.items():
            detail = result.detail.replace("|", "\\|").replace("\n", " ")
            lines.append(f"| {key} | {result.status} | {detail} |")
        return "\n".join(lines)

    def summary(self) -> str:
        """How many scenarios passed, failed and did not apply, in one line."""
        statuses = [r.status for r in self.results.values()]
        return ", ".join(f"{statuses.count(s)} {s}" for s in (PASSED, FAILED, NOT_APPLICABLE))

    def __str__(self) -> str:
        return self.table()
