"""Rank side of the conformance suite: what every spawned rank runs.

:func:`rank_main` runs a spawn's steps one after another, journaling each (see
:mod:`._journal`), with a barrier between steps; :func:`run_step` runs one scenario
function and turns whatever it raises into ``failed`` outcomes.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist

from fsdp_int8.testing._harness import Ctx, Failure, describe
from fsdp_int8.testing._journal import Journal, Watchdog, abort_marker
from fsdp_int8.testing._plan import Step
from fsdp_int8.testing._scenarios_checkpoint import dcp_reshard
from fsdp_int8.testing._scenarios_collectives import asymmetric_failure, wire_bytes
from fsdp_int8.testing._scenarios_ops import ops
from fsdp_int8.testing._scenarios_training import bf16_mixed_precision, meta_init, parity
from fsdp_int8.testing._spec import FAILED, SubclassSpec
from fsdp_int8.testing.processes import device_type_for

# Step.function -> the scenario function; each returns {report key: (status, detail)}.
FUNCTIONS: dict[str, Callable[..., dict[str, tuple[str, str]]]] = {
    "ops": ops,
    "parity": parity,
    "bf16_mixed_precision": bf16_mixed_precision,
    "meta_init": meta_init,
    "wire_bytes": wire_bytes,
    "dcp": dcp_reshard,
    "asymmetric_failure": asymmetric_failure,
}


def run_step(spec: SubclassSpec, function: str, keys: tuple[str, ...], kwargs: dict,
             agreement: Any) -> dict[str, list[str]]:
    """Run one scenario function in this rank: ``{key: [status, detail]}``, never raises.

    ``agreement`` is a gloo group used for nothing but :meth:`~._harness.Ctx.agree`; the
    scenario's own collectives go through a fresh group, so that a scenario that failed
    half-way leaves nothing unmatched for the next one.
    """
    world, rank = dist.get_world_size(), dist.get_rank()
    device = torch.device(device_type_for(world))
    if device.type == "cuda":  # run_distributed set this rank's GPU
        device = torch.device("cuda", torch.cuda.current_device())
    ctx = Ctx(spec, rank, world, device, dist.new_group(), agreement)
    torch.manual_seed(1234 + rank)  # for subclasses that round with the global generator
    try:
        results = FUNCTIONS[function](ctx, **kwargs)
    except Failure as failure:
        results = {key: (FAILED, str(failure)) for key in keys}
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as error:  # noqa: BLE001 - dcp raises CheckpointException(BaseException)
        results = {key: (FAILED, describe(error)) for key in keys}
    return {key: list(results[key]) for key in keys}


def rank_main(
    rank: int, world_size: int, spec: SubclassSpec, steps: list[Step], directory: str,
    scenario_timeout: float, grace: float,
) -> None:
    """Runs in every spawned rank: each step, then a barrier, journaling as it goes."""
    directory_path = Path(directory)
    journal = Journal(directory_path, rank)
    # Gloo groups of our own (they work next to NCCL too) keep the barriers between
    # scenarios and the agreements inside them apart from every collective a scenario
    # issues, and from each other: a rank that failed early waits at the barrier while
    # the others may still be in an agreement.
    control = dist.new_group(backend="gloo")
    agreement = dist.new_group(backend="gloo")
    watchdog = Watchdog(journal, directory_path, scenario_timeout, grace)
    for index, step in enumerate(steps):
        journal.write(ev="start", step=index, function=step.function)
        watchdog.enter(index)
        outcomes = run_step(spec, step.function, step.keys, step.kwargs, agreement)
        if any(status == FAILED for status, _ in outcomes.values()):
            abort_marker(directory_path, index).touch()
        journal.write(ev="end", step=index, outcomes=outcomes)
        dist.barrier(group=control)
        watchdog.leave()
    journal.write(ev="done")
