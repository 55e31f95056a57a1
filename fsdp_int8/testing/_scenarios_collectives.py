"""Scenarios about FSDP2's all-gather of the weight: the bytes it moves, and what happens
when one rank's ``fsdp_pre_all_gather`` fails while the others enter the collective."""

from __future__ import annotations

import functools
from typing import Any, Callable

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.fsdp import fully_shard

from fsdp_int8._dist import local_shard
from fsdp_int8.collectives import count_collectives
from fsdp_int8.testing._harness import Ctx, batch, build, flat_mesh, shard_model
from fsdp_int8.testing._spec import INJECTED, PASSED


class _OneWeight(nn.Module):
    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(F.linear(x, self.weight))  # not a view: FSDP2 would warn


def wire_bytes(ctx: Ctx) -> dict[str, tuple[str, str]]:
    """The all-gather's bytes, counted at the collective, against ``wire_bytes_per_element``."""
    cols, rows = 64, 4 * ctx.world  # even rows: no padding in the count
    mesh, _ = flat_mesh(ctx)
    torch.manual_seed(0)
    model = _OneWeight(ctx.spec.from_float(torch.randn(rows, cols, device=ctx.device)))
    fully_shard(model, mesh=mesh)  # one group, one parameter: one all-gather
    x = torch.randn(2, cols, device=ctx.device)
    with count_collectives() as counter:
        model(x)
    gathers = [r for r in counter.records if r.name.startswith("all_gather")]
    measured = sum(r.bytes for r in gathers)
    per_element = ctx.spec.wire_bytes_for(torch.Size([rows, cols]))
    declared = per_element * rows * cols
    seen = ", ".join(f"{r.name} {r.dtype} x {r.numel}" for r in gathers) or "no all-gather"
    ctx.expect(abs(measured - declared) <= 1e-6 * declared,
               f"the all-gather moved {measured} bytes ({measured / (rows * cols):.4f} per element; "
               f"{seen}), declared {per_element:.4f} per element = {declared:.0f} bytes")
    ctx.agree(f"all-gather bytes of a {rows} x {cols} weight")
    per_element = measured / (rows * cols)
    return {"wire_bytes": (PASSED, f"{per_element:.4f} bytes per element as declared ({seen})")}


def asymmetric_failure(ctx: Ctx) -> dict[str, tuple[str, str]]:
    """One training step on every rank, then the last rank's hook raises: the others
    block in the all-gather; the watchdogs must end the run (judged by the parent)."""
    rows = (2 * ctx.world, 3 * ctx.world)
    mesh, _ = flat_mesh(ctx)
    model = shard_model(build(ctx, rows), mesh, True)
    x, _ = batch(ctx, 0)
    model(x).sum().backward()
    message = f"{INJECTED} on rank {ctx.rank} (raised by the conformance suite on purpose)"
    if ctx.rank == ctx.world - 1:
        local = local_shard(model.layers[0].up.weight)
        hook = getattr(local, "fsdp_pre_all_gather", None)
        if hook is None:
            raise RuntimeError(message + "; the weight has no fsdp_pre_all_gather")
        local.fsdp_pre_all_gather = functools.wraps(hook)(_raiser(message))
    model(x).sum().backward()
    return {"asymmetric_failure": (PASSED, "no rank blocked")}


def _raiser(message: str) -> Callable[..., Any]:
    def raise_(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(message)

    return raise_
