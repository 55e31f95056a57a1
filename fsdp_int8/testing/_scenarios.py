"""The scenarios of the FSDP2 conformance suite (see ``fsdp_int8.testing.conformance``); they run in every rank.

Each scenario builds a tiny model whose linear weights are the subclass under test
(``spec.from_float``), shards it with ``fully_shard`` and checks what FSDP2 does with it.
Checks are gathered per rank and agreed on by all ranks at fixed points (``_Ctx.agree``),
so that a mismatch on one rank's shard fails the scenario on every rank at the same
place, instead of leaving the other ranks blocked in the next collective.

What the parity scenarios compare, and why the tolerances are what they are:

* The reference is an unsharded copy of the model holding the SAME subclass values
  (``from_float`` of the same floats; after the first step, ``from_float`` of the sharded
  model's values), run on each rank's own batch, with gradients all-reduced (averaged)
  by hand: what FSDP2 computes, without FSDP2.
* Forward and backward then run the same subclass code on the same values; only the
  order in which the ranks' gradients are summed differs (reduce-scatter against
  all-reduce), a few fp32 ulps. Losses must agree to 1e-5 relative, gradients to 1e-5 of
  their largest magnitude: 100x the noise, orders of magnitude below any real bug
  (wrong rows, stale weights from an ignored ``out=``, lost padding).
* After the optimizer step (plain SGD: each side moved by ``LR`` times its own gradient,
  whose difference the gradient check has just bounded) each side has rounded its update
  into the format; the two may differ by ``LR`` times the row's largest gradient
  difference (a row-scaled format rescales the row with its largest element), plus one
  rounding step (``spec.rounding_step`` of the row's largest magnitude: stochastic
  rounding draws differ between a shard and the whole weight, round-to-nearest can flip
  on a tie), plus 1e-5 of the row's magnitude for fp32. The bf16 scenario uses the same
  bound; its gradients differ by bf16 rounding, and the bound follows them.
* The reference is rebuilt from the sharded model's values before every step, so such
  one-step differences never accumulate and each step is checked from equal weights.
"""

from __future__ import annotations

import dataclasses
import functools
import traceback
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

import fsdp_int8
from fsdp_int8.testing.conformance import _INJECTED, FAILED, NOT_APPLICABLE, PASSED, SubclassSpec
from fsdp_int8.testing.processes import device_type_for
from fsdp_int8.weight import local_shard

DIM = 16            # features in and out of every block
BATCH_PER_RANK = 4
LR = 0.1            # SGD: updates of several int8 steps, so stale weights show at once
FP32_RTOL = 1e-5    # see the module docstring
# bf16 compute against the fp32 reference (bf16 keeps 8 significant bits, 0.4% per
# rounding; a forward and backward through two blocks round a few dozen times). Seen on
# Int8Weight, the bf16 reference subclass and torchao's weight at 2 and 4 ranks: losses
# within 0.25%, gradients within 0.9% (of the whole gradient's norm). Limits at 4-5x
# that; real bugs give errors of order 1. Weights after a step need no limit of their
# own (see _compare_weights).
BF16_LOSS_RTOL = 1e-2
BF16_GRAD_RTOL = 5e-2


class _Failure(AssertionError):
    """A scenario failed on purpose (already agreed by all ranks): no traceback needed."""


class _Wrong(AssertionError):
    """An op returned a wrong result."""


# ---------------------------------------------------------------------------- context
@dataclasses.dataclass
class _Shard:
    """The dimension FSDP2 shards over: its group, this rank's index in it, its size."""

    group: Any
    rank: int
    size: int


@dataclasses.dataclass
class _Ctx:
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
            raise _Wrong(f"to_float returned {type(out).__name__}, not a plain tensor")
        if out.shape != tensor.shape:
            raise _Wrong(f"to_float of a {tuple(tensor.shape)} tensor has shape {tuple(out.shape)}")
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
            raise _Failure(f"{where}: " + "; ".join(lines[:4]) + more)


def _describe(error: BaseException) -> str:
    """``Type: message (at file:line in function)``, short enough for a report."""
    failures = getattr(error, "failures", None)  # dcp's CheckpointException: rank -> error
    if isinstance(failures, dict) and failures:
        first = next(iter(failures.values()))
        first = first[0] if isinstance(first, tuple) and first else first  # (error, traceback)
        if isinstance(first, BaseException):
            return f"{type(error).__name__} from {_describe(first)}"
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


class _Net(nn.Module):
    def __init__(self, rows: tuple[int, ...]) -> None:
        super().__init__()
        self.layers = nn.ModuleList(_Block(r) for r in rows)
        self.head = nn.Linear(DIM, 4)  # stays plain, in the root's group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def _subclass_names(rows: tuple[int, ...]) -> list[str]:
    return [f"layers.{i}.{lin}.weight" for i in range(len(rows)) for lin in ("up", "down")]


def _set_param(net: nn.Module, name: str, value: torch.Tensor) -> None:
    owner, _, attr = name.rpartition(".")
    setattr(net.get_submodule(owner), attr, nn.Parameter(value, requires_grad=True))


def _quantize(spec: SubclassSpec, net: _Net, rows: tuple[int, ...]) -> _Net:
    for name in _subclass_names(rows):
        _set_param(net, name, spec.from_float(net.get_parameter(name).detach()))
    return net


def _build(ctx: _Ctx, rows: tuple[int, ...], seed: int = 0) -> _Net:
    """The float model of ``seed`` (made on the CPU: the same on every device), quantized."""
    torch.manual_seed(seed)
    return _quantize(ctx.spec, _Net(rows).to(ctx.device), rows)


def _reference_from(ctx: _Ctx, rows: tuple[int, ...], full: dict[str, torch.Tensor]) -> _Net:
    """An unsharded model holding ``full`` values: ``from_float`` for the subclass weights."""
    net = _Net(rows).to(ctx.device)
    subclass = set(_subclass_names(rows))
    for name, value in full.items():
        _set_param(net, name, ctx.spec.from_float(value) if name in subclass else value.clone())
    return net


def _shard_model(net: _Net, mesh: DeviceMesh, reshard: bool,
                 mp: MixedPrecisionPolicy | None = None) -> _Net:
    mp = mp or MixedPrecisionPolicy()
    for block in net.layers:
        fully_shard(block, mesh=mesh, reshard_after_forward=reshard, mp_policy=mp)
    fully_shard(net, mesh=mesh, reshard_after_forward=reshard, mp_policy=mp)
    return net


def _flat_mesh(ctx: _Ctx) -> tuple[DeviceMesh, _Shard]:
    mesh = DeviceMesh.from_group(ctx.group, ctx.device.type)
    return mesh, _Shard(ctx.group, ctx.rank, ctx.world)


def _chunk(rows: int, shard: _Shard) -> slice:
    """This rank's rows as ``torch.chunk`` (FSDP2) splits them: the last ranks may get none."""
    size = -(-rows // shard.size)
    return slice(min(shard.rank * size, rows), min((shard.rank + 1) * size, rows))


def _row_scale(values: torch.Tensor) -> torch.Tensor:
    """Each row's largest magnitude (the whole tensor's for 1-D), broadcastable to it."""
    if values.dim() < 2:
        return values.abs().amax().expand_as(values) if values.numel() else values
    return values.abs().amax(dim=-1, keepdim=True).expand_as(values)


def _gather_full(ctx: _Ctx, model: nn.Module, shard: _Shard,
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


# ---------------------------------------------------------------------------- parity
@dataclasses.dataclass
class _Worst:
    """The largest discrepancies seen, relative to their tolerance scales (for the report)."""

    mp: bool = False
    loss: float = 0.0
    grad: float = 0.0
    weight: float = 0.0  # in rounding steps, beyond the update's gradient difference

    def text(self, steps: int) -> str:
        grads = "of their norm" if self.mp else "of their max"
        against = " against the fp32 reference" if self.mp else ""
        return (f"{steps} steps{against}: losses within {self.loss:.1e} (rel), gradients within "
                f"{self.grad:.1e} {grads}, weights after steps within {self.weight:.2f} "
                "rounding steps (beyond LR x the gradient difference)")


def _batch(ctx: _Ctx, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's slice of the step's global batch (every rank, replicas too, differs)."""
    data = torch.Generator().manual_seed(100 + step)
    x = torch.randn(ctx.world * BATCH_PER_RANK, DIM, generator=data)
    y = torch.randn(ctx.world * BATCH_PER_RANK, 4, generator=data)
    mine = slice(ctx.rank * BATCH_PER_RANK, (ctx.rank + 1) * BATCH_PER_RANK)
    return x[mine].to(ctx.device), y[mine].to(ctx.device)


def _compare_start(ctx: _Ctx, model: nn.Module, reference: nn.Module, shard: _Shard,
                   names: list[str]) -> None:
    """Before any step: the shards hold exactly the reference's rows (same from_float)."""
    ref = dict(reference.named_parameters())
    subclass = set(names)
    for name, param in model.named_parameters():
        local, expected, chunk = local_shard(param), ref[name], _chunk(param.shape[0], shard)
        mine = ctx.floats(local, name in subclass)
        rows = ctx.floats(expected, name in subclass)[chunk]
        ctx.expect(mine.shape == rows.shape and torch.equal(mine, rows),
                   f"{name}: the shard after fully_shard is not the weight's rows "
                   f"{chunk.start}:{chunk.stop} (shapes {tuple(mine.shape)} vs {tuple(rows.shape)})")


def _compare_grads(ctx: _Ctx, model: nn.Module, reference: nn.Module, shard: _Shard,
                   worst: _Worst, mp: bool) -> None:
    ref = dict(reference.named_parameters())
    for name, param in model.named_parameters():
        if param.grad is None:
            ctx.problems.append(f"{name}: no gradient")
            continue
        grad = local_shard(param.grad).detach().float()
        expected = ref[name].grad[_chunk(param.shape[0], shard)].float()
        if grad.shape != expected.shape:
            ctx.problems.append(
                f"{name}: gradient shard {tuple(grad.shape)}, expected {tuple(expected.shape)}")
            continue
        if not expected.numel():
            continue
        if mp:
            # Against the whole gradient's norm: the shards' errors add up (in squares) to
            # the whole tensor's, and a small shard whose gradient sums cancel is not
            # judged alone.
            err = float((grad - expected).norm() / ref[name].grad.float().norm().clamp_min(1e-30))
            worst.grad = max(worst.grad, err)
            ctx.expect(err <= BF16_GRAD_RTOL, f"{name}: gradient shard off by {err:.2e} of the "
                       f"whole gradient's norm > {BF16_GRAD_RTOL}")
            continue
        scale = float(ref[name].grad.abs().max())
        err = float((grad - expected).abs().max()) / max(scale, 1e-30)
        worst.grad = max(worst.grad, err)
        ctx.expect(err <= FP32_RTOL,
                   f"{name}: gradient off by {err:.2e} of its max |grad| > {FP32_RTOL}")


def _compare_weights(ctx: _Ctx, model: nn.Module, reference: nn.Module, shard: _Shard,
                     names: list[str], worst: _Worst) -> None:
    """After the step. Plain SGD moved each side by exactly ``LR * its gradient``, so the
    two may differ by ``LR`` times the largest gradient difference in the row (bounded by
    the gradient check; the row's largest, because a row-scaled format rescales the whole
    row when its largest element moves), plus one rounding step of the format, plus fp32
    noise (1e-5 of the row's max)."""
    ref = dict(reference.named_parameters())
    subclass = set(names)
    for name, param in model.named_parameters():
        is_subclass = name in subclass
        rows = _chunk(param.shape[0], shard)
        local = local_shard(param)
        mine = ctx.floats(local, is_subclass)
        full = ctx.floats(ref[name], is_subclass)
        expected = full[rows]
        if mine.shape != expected.shape:
            ctx.problems.append(
                f"{name}: shard {tuple(mine.shape)} after the step, expected {tuple(expected.shape)}")
            continue
        if not expected.numel() or param.grad is None:
            continue
        update_gap = LR * _row_scale(local_shard(param.grad).float() - ref[name].grad[rows].float())
        scale = _row_scale(expected)
        step = ctx.spec.rounding_step if is_subclass else 0.0
        beyond_update = ((mine - expected).abs() - update_gap).clamp_min(0)
        allowed = (step * 1.001 + FP32_RTOL) * scale + 1e-12
        if is_subclass and step > 0:
            worst.weight = max(worst.weight, float((beyond_update / (step * scale + 1e-30)).max()))
        if not bool((beyond_update <= allowed).all()):
            index = tuple(int(i) for i in torch.nonzero(beyond_update > allowed)[0])
            ctx.problems.append(
                f"{name}: after the optimizer step, element {index} is {float(mine[index]):.6g}, the "
                f"reference {float(expected[index]):.6g} (allowed: {float(update_gap[index]):.3g} from "
                f"the gradients, {step:g} rounding step and {FP32_RTOL:g} of the row's max "
                f"{float(scale[index]):.4g})"
            )


def _train_compare(ctx: _Ctx, model: nn.Module, reference: nn.Module | None, rows: tuple[int, ...],
                   shard: _Shard, *, steps: int, mp: bool = False) -> str:
    """Train ``model`` (sharded) and the reference side by side; compare at every step."""
    names = _subclass_names(rows)
    opt = torch.optim.SGD(model.parameters(), lr=LR, foreach=False)  # add_ only, on every subclass
    worst = _Worst(mp=mp)
    if reference is not None:
        _compare_start(ctx, model, reference, shard, names)
        ctx.agree("after fully_shard, before training")
    for step in range(steps):
        if reference is None or step > 0:
            reference = _reference_from(ctx, rows, _gather_full(ctx, model, shard, names))
        ref_opt = torch.optim.SGD(reference.parameters(), lr=LR, foreach=False)
        x, y = _batch(ctx, step)
        loss = F.mse_loss(model(x).float(), y)
        loss.backward()
        ref_loss = F.mse_loss(reference(x).float(), y)
        ref_loss.backward()
        for param in reference.parameters():  # the reference's data parallelism, by hand
            dist.all_reduce(param.grad, op=dist.ReduceOp.SUM, group=ctx.group)
            param.grad /= ctx.world
        err = abs(loss.item() - ref_loss.item()) / max(abs(ref_loss.item()), 1e-30)
        worst.loss = max(worst.loss, err)
        limit = BF16_LOSS_RTOL if mp else FP32_RTOL
        ctx.expect(err <= limit, f"loss {loss.item():.6g} vs reference {ref_loss.item():.6g} "
                                 f"({err:.1e} > {limit:g})")
        _compare_grads(ctx, model, reference, shard, worst, mp)
        ctx.agree(f"step {step}, before the optimizer step")
        opt.step()
        ref_opt.step()
        _compare_weights(ctx, model, reference, shard, names, worst)
        opt.zero_grad()
        ctx.agree(f"step {step}, after the optimizer step")
    return worst.text(steps)


def _parity(ctx: _Ctx, kind: str) -> dict[str, tuple[str, str]]:
    """reshard / no_reshard / world_size_1 / uneven / empty / hsdp: build, shard, train, compare."""
    w = ctx.world
    if kind == "hsdp":
        mesh = init_device_mesh(ctx.device.type, (2, w // 2), mesh_dim_names=("replicate", "shard"))
        shard = _Shard(mesh.get_group("shard"), mesh.get_local_rank("shard"), w // 2)
        rows = (2 * shard.size, 3 * shard.size)
    else:
        mesh, shard = _flat_mesh(ctx)
        rows = {
            "uneven": (2 * w - 1, 3 * w - 1),  # the last rank holds fewer rows, none holds zero
            "empty": (w - 1, 1),                # fewer rows than ranks: empty shards
        }.get(kind, (2 * w, 3 * w))
    reshards = {"no_reshard": (False,), "world_size_1": (True, False)}.get(kind, (True,))
    steps = 3 if kind in ("reshard", "no_reshard", "world_size_1") else 2
    details = []
    for reshard in reshards:
        model = _shard_model(_build(ctx, rows), mesh, reshard)
        details.append(_train_compare(ctx, model, _build(ctx, rows), rows, shard, steps=steps))
    what = {"world_size_1": "reshard_after_forward True and False",
            "hsdp": f"mesh 2 x {w // 2}, rows {rows}"}.get(kind, f"rows {rows} on {w} ranks")
    return {_PARITY_KEYS[kind]: (PASSED, f"{what}; " + "; ".join(details))}


_PARITY_KEYS = {"reshard": "parity_reshard", "no_reshard": "parity_no_reshard",
                "world_size_1": "world_size_1", "uneven": "uneven_shards", "empty": "empty_shards",
                "hsdp": "hsdp"}


# ---------------------------------------------------------------------------- other scenarios
def _bf16_mixed_precision(ctx: _Ctx) -> dict[str, tuple[str, str]]:
    rows = (2 * ctx.world, 3 * ctx.world)
    mesh, shard = _flat_mesh(ctx)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    model = _shard_model(_build(ctx, rows), mesh, True, policy)
    seen: dict[str, torch.dtype] = {}
    for i, block in enumerate(model.layers):
        for lin in ("up", "down"):
            getattr(block, lin).register_forward_pre_hook(
                functools.partial(_record_weight_dtype, seen, f"layers.{i}.{lin}.weight"))
    detail = _train_compare(ctx, model, _build(ctx, rows), rows, shard, steps=2, mp=True)
    for name, dtype in seen.items():
        ctx.expect(dtype == torch.bfloat16, f"{name}: the unsharded weight is {dtype} under "
                   "param_dtype=bfloat16 (does fsdp_post_all_gather honour param_dtype?)")
    for name, param in model.named_parameters():
        ctx.expect(param.dtype == torch.float32, f"{name}: the sharded parameter became {param.dtype}")
    ctx.agree("dtypes under the bf16 policy")
    return {"bf16_mixed_precision": (PASSED, f"unsharded weights bf16; {detail}")}


def _record_weight_dtype(seen: dict, name: str, module: nn.Module, args: Any) -> None:
    seen[name] = module.weight.dtype


def _meta_init(ctx: _Ctx) -> dict[str, tuple[str, str]]:
    rows = (2 * ctx.world, 3 * ctx.world)
    mesh, shard = _flat_mesh(ctx)
    with torch.device("meta"):
        model = _quantize(ctx.spec, _Net(rows), rows)
    _shard_model(model, mesh, True)
    model.to_empty(device=ctx.device)
    init = torch.Generator().manual_seed(7)  # the same full values on every rank
    names = set(_subclass_names(rows))
    for name, param in model.named_parameters():
        full = (torch.randn(param.shape, generator=init) * 0.2).to(ctx.device)
        mine = full[_chunk(param.shape[0], shard)]
        with torch.no_grad():
            local_shard(param).copy_(mine)
        if name in names:
            got = ctx.values(local_shard(param))
            allowed = (ctx.spec.rounding_step * 1.001 + FP32_RTOL) * _row_scale(mine)
            ctx.expect(got.shape == mine.shape and bool(((got - mine).abs() <= allowed).all()),
                       f"{name}: after to_empty and copy_ the shard does not hold the initial values "
                       "within one rounding step")
    ctx.agree("after to_empty and initialisation")
    detail = _train_compare(ctx, model, None, rows, shard, steps=2)
    return {"meta_init": (PASSED, f"from_float on meta, to_empty, copy_ init; {detail}")}


class _OneWeight(nn.Module):
    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(F.linear(x, self.weight))  # not a view: FSDP2 would warn


def _wire_bytes(ctx: _Ctx) -> dict[str, tuple[str, str]]:
    cols, rows = 64, 4 * ctx.world  # even rows: no padding in the count
    mesh, _ = _flat_mesh(ctx)
    torch.manual_seed(0)
    model = _OneWeight(ctx.spec.from_float(torch.randn(rows, cols, device=ctx.device)))
    fully_shard(model, mesh=mesh)  # one group, one parameter: one all-gather
    x = torch.randn(2, cols, device=ctx.device)
    with fsdp_int8.count_collectives() as counter:
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


def _dcp(ctx: _Ctx, load_from: str | None, save_to: str) -> dict[str, tuple[str, str]]:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

    rows = (8, 12)  # the same model at every world size
    mesh, shard = _flat_mesh(ctx)
    names = _subclass_names(rows)
    result = (NOT_APPLICABLE, "saved a checkpoint for the next world size")
    if load_from is not None:
        model = _shard_model(_build(ctx, rows, seed=99), mesh, True)  # other values than saved
        state = get_model_state_dict(model)
        dcp.load(state, checkpoint_id=load_from, process_group=ctx.group)
        set_model_state_dict(model, state)
        expected = torch.load(Path(load_from) / "expected.pt")
        for name, param in model.named_parameters():
            local = local_shard(param)
            mine = ctx.floats(local, name in names).cpu()
            want = expected["values"][name][_chunk(param.shape[0], shard)]
            ctx.expect(mine.shape == want.shape and torch.equal(mine, want),
                       f"{name}: loaded values differ from the saved ones")
        ctx.agree(f"loading the world-size-{expected['world_size']} checkpoint")
        result = (PASSED, f"saved at world size {expected['world_size']}, loaded bit-exactly")
    model = _shard_model(_build(ctx, rows, seed=1000 + ctx.world), mesh, True)
    dcp.save(get_model_state_dict(model), checkpoint_id=save_to, process_group=ctx.group)
    values = {k: v.cpu() for k, v in _gather_full(ctx, model, shard, names).items()}
    if ctx.rank == 0:
        torch.save({"world_size": ctx.world, "values": values}, Path(save_to) / "expected.pt")
    dist.barrier(group=ctx.group)
    return {"dcp_reshard": result}


def _asymmetric_failure(ctx: _Ctx) -> dict[str, tuple[str, str]]:
    """One training step on every rank, then the last rank's hook raises: the others
    block in the all-gather; the watchdogs must end the run (judged by the parent)."""
    rows = (2 * ctx.world, 3 * ctx.world)
    mesh, _ = _flat_mesh(ctx)
    model = _shard_model(_build(ctx, rows), mesh, True)
    x, _ = _batch(ctx, 0)
    model(x).sum().backward()
    message = f"{_INJECTED} on rank {ctx.rank} (raised by the conformance suite on purpose)"
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


# ---------------------------------------------------------------------------- ops
def _same_type(result: Any, weight: torch.Tensor, what: str) -> None:
    if not isinstance(result, type(weight)):
        raise _Wrong(f"{what} returned {type(result).__name__}, not {type(weight).__name__}")


def _same_values(ctx: _Ctx, result: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    if tuple(result.shape) != tuple(expected.shape):
        raise _Wrong(f"{what} has shape {tuple(result.shape)}, expected {tuple(expected.shape)}")
    if not torch.equal(ctx.values(result), expected):
        raise _Wrong(f"{what} holds other values")


def _within_rounding(ctx: _Ctx, result: torch.Tensor, target: torch.Tensor, what: str) -> None:
    got = ctx.values(result)
    allowed = (ctx.spec.rounding_step * 1.001 + 1e-6) * _row_scale(target)
    if got.shape != target.shape or not bool(((got - target).abs() <= allowed).all()):
        raise _Wrong(f"{what} is more than one rounding step from the float values")


def _op_view(ctx: _Ctx, w: torch.Tensor, v: torch.Tensor) -> None:
    flat = w.view(-1)
    _same_type(flat, w, "view(-1)")
    _same_values(ctx, flat, v.view(-1), "view(-1)")


def _op_as_strided(ctx: _Ctx, w: torch.Tensor, v: torch.Tensor) -> None:
    out = torch.as_strided(w, w.shape, (w.shape[1], 1), 0)
    _same_type(out, w, "as_strided")
    _same_values(ctx, out, v, "as_strided")


def _op_split(ctx: _Ctx, w: torch.Tensor, v: torch.Tensor) -> None:
    for what, pieces, sizes in (("split(4)", torch.split(w, 4), (4, 2)),
                                ("chunk(4)", torch.chunk(w, 4), (2, 2, 2))):
        if [p.shape[0] for p in pieces] != list(sizes):
            raise _Wrong(f"{what} gave pieces of {[tuple(p.shape) for p in pieces]} rows")
        start = 0
        for piece in pieces:
            _same_type(piece, w, what)
            _same_values(ctx, piece, v[start: start + piece.shape[0]], f"a piece of {what}")
            start += piece.shape[0]


def _op_new_zeros(ctx: _Ctx, w: torch.Tensor, v: torch.Tensor) -> None:
    zeros = w.new_zeros((8, w.shape[1]))
    _same_type(zeros, w, "new_zeros")
    _same_values(ctx, zeros, torch.zeros(8, w.shape[1], device=w.device), "new_zeros")


def _op_copy(ctx: _Ctx, w: torch.Tensor, v: torch.Tensor) -> None:
    target = ctx.spec.from_float(torch.zeros(w.shape, device=w.device))
    target.copy_(w)
    _same_values(ctx, target, v, "copy_ from the subclass")
    floats = torch.randn(w.shape, generator=torch.Generator().manual_seed(4)).to(w.device)
    target.copy_(floats)
    _within_rounding(ctx, target, floats, "copy_ from a float tensor")


def _op_slice(ctx: _Ctx, w: torch.Tensor, v: torch.Tensor) -> None:
    part = w[2:5]
    _same_type(part, w, "slice")
    _same_values(ctx, part, v[2:5], "w[2:5]")
    empty = w[6:6]
    _same_type(empty, w, "an empty slice")
    _same_values(ctx, empty, v[6:6], "w[6:6]")
    padded = ctx.spec.from_float(torch.zeros(8, w.shape[1], device=w.device))
    padded[0:6].copy_(w)  # FSDP2 writes each shard into its padded buffer this way
    expected = torch.cat([v, torch.zeros(2, w.shape[1], device=w.device)])
    _same_values(ctx, padded, expected, "a buffer written through its slice [0:6] (not a view?)")


def _op_pin_memory(ctx: _Ctx, w: torch.Tensor, v: torch.Tensor) -> tuple[str, str] | None:
    if not (hasattr(torch, "accelerator") and torch.accelerator.is_available()):
        return (NOT_APPLICABLE, "pin_memory needs an accelerator; there is none")
    cpu = ctx.spec.from_float(torch.randn(6, 8, generator=torch.Generator().manual_seed(3)))
    pinned = cpu.pin_memory()
    _same_type(pinned, cpu, "pin_memory")
    if not pinned.is_pinned():
        raise _Wrong("pin_memory returned a tensor that is not pinned")
    _same_values(ctx, pinned, ctx.values(cpu), "pin_memory")
    return None


def _op_cat(ctx: _Ctx, w: torch.Tensor, v: torch.Tensor) -> None:
    base = torch.randn(6, 8, generator=torch.Generator().manual_seed(3)).to(w.device)
    top, bottom = ctx.spec.from_float(base[:2]), ctx.spec.from_float(base[2:])
    joined = torch.cat([top, bottom])
    _same_values(ctx, joined, torch.cat([ctx.values(top), ctx.values(bottom)]), "cat")


def _op_broadcast(ctx: _Ctx, w: torch.Tensor, v: torch.Tensor) -> None:
    def floats(seed: int) -> torch.Tensor:
        return torch.randn(6, 8, generator=torch.Generator().manual_seed(seed)).to(w.device)

    mine = ctx.spec.from_float(floats(50 + ctx.rank))
    root = ctx.values(ctx.spec.from_float(floats(50)))  # what rank 0 holds
    dist.broadcast(mine, group=ctx.group, group_src=0)
    _within_rounding(ctx, mine, root, "the broadcast tensor")


_OPS: dict[str, tuple[tuple[str, ...], Callable[..., Any]]] = {
    "op:view(-1)": (("view",), _op_view),
    "op:as_strided": (("as_strided",), _op_as_strided),
    "op:split/chunk": (("split", "chunk"), _op_split),
    "op:new_zeros": (("new_zeros",), _op_new_zeros),
    "op:copy_": (("copy_",), _op_copy),
    "op:pin_memory": (("pin_memory",), _op_pin_memory),
    "op:slice": (("slice", "narrow"), _op_slice),
    "op:cat": (("cat",), _op_cat),
    "op:broadcast": (("broadcast",), _op_broadcast),
}


def _ops(ctx: _Ctx, only: tuple[str, ...]) -> dict[str, tuple[str, str]]:
    """Each op: correct, or an error that names it (both pass); anything else fails."""
    base = torch.randn(6, 8, generator=torch.Generator().manual_seed(3)).to(ctx.device)
    weight = ctx.spec.from_float(base)
    values = ctx.values(weight)
    results = {}
    for key in only:
        names, check = _OPS[key]
        try:
            outcome = check(ctx, weight, values)
            results[key] = outcome or (PASSED, "correct")
        except _Wrong as wrong:
            results[key] = (FAILED, f"wrong result: {wrong}")
        except Exception as error:  # noqa: BLE001 - judging the error is the point
            text = str(error)
            if any(name in text for name in names):
                results[key] = (PASSED, f"unsupported, with a clear error: {_describe(error)}")
            else:
                results[key] = (FAILED, f"an error that does not name the op: {_describe(error)}")
    return results


# ---------------------------------------------------------------------------- entry point
_FUNCTIONS: dict[str, Callable[..., dict[str, tuple[str, str]]]] = {
    "ops": _ops,
    "parity": _parity,
    "bf16_mixed_precision": _bf16_mixed_precision,
    "meta_init": _meta_init,
    "wire_bytes": _wire_bytes,
    "dcp": _dcp,
    "asymmetric_failure": _asymmetric_failure,
}

def run_step(spec: SubclassSpec, function: str, keys: tuple[str, ...], kwargs: dict,
             agreement: Any) -> dict[str, list[str]]:
    """Run one scenario function in this rank: ``{key: [status, detail]}``, never raises.

    ``agreement`` is a gloo group used for nothing but :meth:`_Ctx.agree`; the scenario's
    own collectives go through a fresh group, so that a scenario that failed half-way
    leaves nothing unmatched for the next one.
    """
    world, rank = dist.get_world_size(), dist.get_rank()
    device = torch.device(device_type_for(world))
    if device.type == "cuda":  # run_distributed set this rank's GPU
        device = torch.device("cuda", torch.cuda.current_device())
    ctx = _Ctx(spec, rank, world, device, dist.new_group(), agreement)
    torch.manual_seed(1234 + rank)  # for subclasses that round with the global generator
    try:
        results = _FUNCTIONS[function](ctx, **kwargs)
    except _Failure as failure:
        results = {key: (FAILED, str(failure)) for key in keys}
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as error:  # noqa: BLE001 - dcp raises CheckpointException(BaseException)
        results = {key: (FAILED, _describe(error)) for key in keys}
    return {key: list(results[key]) for key in keys}
