"""What every conformance scenario uses inside a rank: the context, the models, the data.

Each scenario builds a tiny model whose linear weights are the subclass under test
(``spec.from_float``), shards it with ``fully_shard`` and checks what FSDP2 does with it.
Checks are gathered per rank and agreed on by all ranks at fixed points
(:meth:`Ctx.agree`), so that a mismatch on one rank's shard fails the scenario on every
rank at the same place, instead of leaving the other ranks blocked in the next collective.
"""

from __future__ import annotations

import dataclasses
import traceback
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from fsdp_int8._dist import local_shard
from fsdp_int8.testing._spec import SubclassSpec

DIM = 16            # features in and out of every block
BATCH_PER_RANK = 4


class Failure(AssertionError):
    """A scenario failed on purpose (already agreed by all ranks): no traceback needed."""


class Wrong(AssertionError):
    """An op returned a wrong result."""


# ---------------------------------------------------------------------------- context
@dataclasses.dataclass
class Shard:
    """The dimension FSDP2 shards over: its group, this rank's index in it, its size."""

    group: Any
    rank: int
    size: int


@dataclasses.dataclass
class Ctx:
    """One rank's view of one scenario: the spec, where it runs, the problems found so far."""

    spec: SubclassSpec
    rank: int
    world: int
    device: torch.device
    group: Any          # a fresh group of all ranks for this scenario
    agreement: Any      # a gloo group for agree() only
    problems: list[str] = dataclasses.field(default_factory=list)

    def values(self, tensor: torch.Tensor) -> torch.Tensor:
        """``spec.to_float(tensor)`` as fp32, checked to be a plain tensor of its shape."""
        out = self.spec.to_float(tensor)
        if not isinstance(out, torch.Tensor) or type(out) not in (torch.Tensor, nn.Parameter):
            raise Wrong(f"to_float returned {type(out).__name__}, not a plain tensor")
        if out.shape != tensor.shape:
            raise Wrong(f"to_float of a {tuple(tensor.shape)} tensor has shape {tuple(out.shape)}")
        return out.detach().float()

    def floats(self, tensor: torch.Tensor, subclass: bool) -> torch.Tensor:
        """fp32 values of a parameter: :meth:`values` for the subclass under test, else a copy."""
        return self.values(tensor) if subclass else tensor.detach().float()

    def expect(self, ok: bool, message: str) -> None:
        if not ok:
            self.problems.append(message)

    def agree(self, where: str) -> None:
        """Every rank learns every rank's problems; all raise if there is any."""
        everyone: list[list[str]] = [[] for _ in range(self.world)]
        dist.all_gather_object(everyone, self.problems, group=self.agreement)
        self.problems = []
        by_text: dict[str, list[int]] = {}
        for r, problems in enumerate(everyone):
            for text in problems:
                by_text.setdefault(text, []).append(r)
        if by_text:
            lines = [f"rank{'s' if len(rs) > 1 else ''} {','.join(map(str, rs))}: {t}"
                     for t, rs in by_text.items()]
            more = f" (+{len(lines) - 4} more)" if len(lines) > 4 else ""
            raise Failure(f"{where}: " + "; ".join(lines[:4]) + more)


def describe(error: BaseException) -> str:
    """``Type: message (at file:line in function)``, short enough for a report."""
    failures = getattr(error, "failures", None)  # dcp's CheckpointException: rank -> error
    if isinstance(failures, dict) and failures:
        first = next(iter(failures.values()))
        first = first[0] if isinstance(first, tuple) and first else first  # (error, traceback)
        if isinstance(first, BaseException):
            return f"{type(error).__name__} from {describe(first)}"
    message = " ".join(str(error).split())
    if len(message) > 400:
        message = message[:400] + " ..."
    frames = traceback.extract_tb(error.__traceback__)
    where = ""
    if frames:
        where = f" (at {Path(frames[-1].filename).name}:{frames[-1].lineno} in {frames[-1].name})"
    return f"{type(error).__name__}: {message}{where}"


# ---------------------------------------------------------------------------- models
class _Block(nn.Module):
    def __init__(self, rows: int) -> None:
        super().__init__()
        self.up = nn.Linear(DIM, rows, bias=False)   # [rows, DIM]: the sharded rows vary
        self.down = nn.Linear(rows, DIM)             # a plain bias next to the subclass

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # tanh, not relu: smooth, so bf16 rounding cannot flip a unit on or off and the
        # bf16 scenario's differences stay rounding-sized.
        return x + self.down(torch.tanh(self.up(x)))


class Net(nn.Module):
    """Residual blocks whose two linear weights become the subclass, and a plain head."""

    def __init__(self, rows: tuple[int, ...]) -> None:
        super().__init__()
        self.layers = nn.ModuleList(_Block(r) for r in rows)
        self.head = nn.Linear(DIM, 4)  # stays plain, in the root's group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def subclass_names(rows: tuple[int, ...]) -> list[str]:
    """The parameters of a :class:`Net` that hold the subclass under test."""
    return [f"layers.{i}.{lin}.weight" for i in range(len(rows)) for lin in ("up", "down")]


def _set_param(net: nn.Module, name: str, value: torch.Tensor) -> None:
    owner, _, attr = name.rpartition(".")
    setattr(net.get_submodule(owner), attr, nn.Parameter(value, requires_grad=True))


def quantize(spec: SubclassSpec, net: Net, rows: tuple[int, ...]) -> Net:
    """``net`` with its subclass weights replaced by ``spec.from_float`` of their values."""
    for name in subclass_names(rows):
        _set_param(net, name, spec.from_float(net.get_parameter(name).detach()))
    return net


def build(ctx: Ctx, rows: tuple[int, ...], seed: int = 0) -> Net:
    """The float model of ``seed`` (made on the CPU: the same on every device), quantized."""
    torch.manual_seed(seed)
    return quantize(ctx.spec, Net(rows).to(ctx.device), rows)


def reference_from(ctx: Ctx, rows: tuple[int, ...], full: dict[str, torch.Tensor]) -> Net:
    """An unsharded model holding ``full`` values: ``from_float`` for the subclass weights."""
    net = Net(rows).to(ctx.device)
    subclass = set(subclass_names(rows))
    for name, value in full.items():
        _set_param(net, name, ctx.spec.from_float(value) if name in subclass else value.clone())
    return net


def shard_model(net: Net, mesh: DeviceMesh, reshard: bool,
                mp: MixedPrecisionPolicy | None = None) -> Net:
    """``fully_shard`` each block, then the root."""
    mp = mp or MixedPrecisionPolicy()
    for block in net.layers:
        fully_shard(block, mesh=mesh, reshard_after_forward=reshard, mp_policy=mp)
    fully_shard(net, mesh=mesh, reshard_after_forward=reshard, mp_policy=mp)
    return net


# ---------------------------------------------------------------------------- shards and data
def flat_mesh(ctx: Ctx) -> tuple[DeviceMesh, Shard]:
    """A 1-D mesh over the scenario's group, and the shard dimension it makes."""
    mesh = DeviceMesh.from_group(ctx.group, ctx.device.type)
    return mesh, Shard(ctx.group, ctx.rank, ctx.world)


def chunk(rows: int, shard: Shard) -> slice:
    """This rank's rows as ``torch.chunk`` (FSDP2) splits them: the last ranks may get none."""
    size = -(-rows // shard.size)
    return slice(min(shard.rank * size, rows), min((shard.rank + 1) * size, rows))


def row_scale(values: torch.Tensor) -> torch.Tensor:
    """Each row's largest magnitude (the whole tensor's for 1-D), broadcastable to it."""
    if values.dim() < 2:
        return values.abs().amax().expand_as(values) if values.numel() else values
    return values.abs().amax(dim=-1, keepdim=True).expand_as(values)


def gather_full(ctx: Ctx, model: nn.Module, shard: Shard,
                names: list[str]) -> dict[str, torch.Tensor]:
    """Every parameter's full values, gathered with plain all-gathers (not the subclass's)."""
    subclass = set(names)
    full = {}
    for name, param in model.named_parameters():
        local = local_shard(param)
        values = ctx.floats(local, name in subclass)
        rows = param.shape[0]
        padded_rows = -(-rows // shard.size)
        padded = values.new_zeros(padded_rows, *values.shape[1:])
        padded[: values.shape[0]] = values
        pieces = [torch.empty_like(padded) for _ in range(shard.size)]
        dist.all_gather(pieces, padded, group=shard.group)
        full[name] = torch.cat(pieces)[:rows]
    return full


def batch(ctx: Ctx, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's slice of the step's global batch (every rank, replicas too, differs)."""
    data = torch.Generator().manual_seed(100 + step)
    x = torch.randn(ctx.world * BATCH_PER_RANK, DIM, generator=data)
    y = torch.randn(ctx.world * BATCH_PER_RANK, 4, generator=data)
    mine = slice(ctx.rank * BATCH_PER_RANK, (ctx.rank + 1) * BATCH_PER_RANK)
    return x[mine].to(ctx.device), y[mine].to(ctx.device)
