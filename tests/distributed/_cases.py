"""Building blocks of the multi-process tests: each runs inside every rank."""

from __future__ import annotations

import contextlib
import copy
from typing import Iterator

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.tensor import DTensor

import fsdp_int8
from fsdp_int8 import Int8TrainingConfig, Int8Weight

from _matrix import FULL_MATRIX  # noqa: F401  (the cases' modules read it from here)
from _nets import MLPNet

BF16_POLICY = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


@contextlib.contextmanager
def case(name: str) -> Iterator[None]:
    """Prefix a failure with the case it belongs to (many cases share one spawn)."""
    try:
        yield
    except AssertionError as error:
        raise AssertionError(f"[{name}] {error}") from error


def local_of(param: torch.Tensor) -> torch.Tensor:
    return param._local_tensor if isinstance(param, DTensor) else param


def int8_params(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    return [(n, p) for n, p in model.named_parameters() if isinstance(local_of(p), Int8Weight)]


def mean_over_ranks(value: torch.Tensor) -> float:
    value = value.detach().float().clone()
    dist.all_reduce(value)
    return value.item() / dist.get_world_size()


def reference_step(reference: nn.Module, optimizer: torch.optim.Optimizer, x: torch.Tensor,
                   y: torch.Tensor) -> float:
    """One step of the single-process reference on the whole batch; its loss."""
    loss = F.mse_loss(reference(x), y)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss.item()


def compare_shards(model: nn.Module, reference: nn.Module, shard_rank: int, shard_world: int):
    """Max |int8 difference|, fraction of differing int8 values, max relative scale error
    between each rank's int8 shard and the same rows of the single-process reference."""
    ref_params = dict(reference.named_parameters())
    max_diff, differing, total, scale_err = 0, 0, 0, 0.0
    err_sq, ref_sq = 0.0, 0.0
    weights = int8_params(model)
    assert len(weights) == len(int8_params(reference)) > 0, "no int8 weights to compare"
    for name, param in weights:
        shard = local_of(param)
        ref = ref_params[name]
        # FSDP2 chunks dim 0: rows, or whole experts of a MoE weight [experts, out, in]
        rows = list(torch.chunk(ref.int_data, shard_world))
        ref_rows = rows[shard_rank] if shard_rank < len(rows) else ref.int_data[:0]
        ref_scale = torch.chunk(ref.scale, shard_world)
        ref_scale = ref_scale[shard_rank] if shard_rank < len(ref_scale) else ref.scale[:0]
        ref_rows, ref_scale = ref_rows.reshape(-1, ref.row_len), ref_scale.reshape(-1)
        shard_rows, shard_scale = shard.read_rows()
        assert shard_rows.shape == ref_rows.shape, (name, shard.shape, ref_rows.shape)
        diff = (shard_rows.int() - ref_rows.int()).abs()
        if diff.numel():
            max_diff = max(max_diff, int(diff.max()))
            scale_err = max(
                scale_err, float(((shard_scale - ref_scale).abs() / ref_scale.clamp_min(1e-12)).max())
            )
        differing += int((diff > 0).sum())
        total += diff.numel()
        ref_values = ref_rows.float() * ref_scale.unsqueeze(1)
        err_sq += float((shard.dequantize(torch.float32).view_as(ref_values) - ref_values).pow(2).sum())
        ref_sq += float(ref_values.pow(2).sum())
    counts = torch.tensor([differing, total, err_sq, ref_sq], dtype=torch.float64)
    dist.all_reduce(counts)  # over all shards: one rank's few rows are noisy
    return dict(
        max_diff=max_diff,
        frac=(counts[0] / counts[1].clamp_min(1)).item(),
        scale_err=scale_err,
        rel_err=(counts[2].sqrt() / counts[3].sqrt().clamp_min(1e-30)).item(),
    )


def train_parity(
    rank: int,
    world: int,
    *,
    hidden: int,
    mp_policy: MixedPrecisionPolicy | None,
    reshard_after_forward: bool,
    steps: int,
    mesh=None,
    int8_matmul=None,
) -> dict:
    """Train an FSDP2 int8 model and a single-process int8 model (round-to-nearest) on the
    same data: each rank sees its slice of the batch, the reference the whole batch."""
    torch.manual_seed(0)
    reference = MLPNet(hidden=hidden)
    model = copy.deepcopy(reference)
    config = Int8TrainingConfig(  # tiny rows too
        stochastic_rounding=False, min_features=1, int8_matmul=int8_matmul
    )
    fsdp_int8.quantize_(reference, config)
    fsdp_int8.shard_model(
        model, config=config, mp_policy=mp_policy, mesh=mesh,
        reshard_after_forward=reshard_after_forward,
    )
    # AdamW divides by sqrt(v): where a gradient is near zero, the bf16 run's rounding
    # noise can flip the update's sign, a full 2 * lr apart. SGD's update is proportional
    # to the gradient, so the bf16 runs are compared with SGD, the fp32 runs with AdamW.
    if mp_policy is not None and mp_policy.param_dtype == torch.bfloat16:
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        ref_opt = torch.optim.SGD(reference.parameters(), lr=0.05, momentum=0.9)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
        ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2, weight_decay=0.01)
    data = torch.Generator().manual_seed(1)
    per_rank = 4
    losses = []
    for _ in range(steps):
        x = torch.randn(per_rank * world, 32, generator=data)
        y = torch.randn(per_rank * world, 4, generator=data)
        mine = slice(rank * per_rank, (rank + 1) * per_rank)
        loss = F.mse_loss(model(x[mine]), y[mine])
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append((mean_over_ranks(loss), reference_step(reference, ref_opt, x, y)))
    shard_rank = mesh.get_local_rank(mesh.ndim - 1) if mesh is not None else rank
    shard_world = mesh.size(mesh.ndim - 1) if mesh is not None else world
    return dict(losses=losses, **compare_shards(model, reference, shard_rank, shard_world))


def assert_parity(result: dict, *, bf16: bool) -> None:
    """Tolerances.

    fp32: FSDP sums the ranks' gradients in another order than one process does, so
    values differ by a few fp32 ulps (~1e-7 relative); round-to-nearest then flips only
    the int8 values within that distance of a .5 boundary: losses agree to 1e-5 relative,
    at most 1% of int8 values differ, by at most one step, scales by 1e-5.
    bf16 policy (SGD, see train_parity): the FSDP run computes in bf16 (8-bit mantissa,
    0.4% per rounding) against an fp32 reference, so the two trajectories drift apart
    value by value (a differently rounded int8 value feeds the next step). What must
    hold is closeness in aggregate: losses within 3% and the dequantized weights within
    2% of the reference's norm (one int8 step is ~1% of a row's typical magnitude; seen:
    at most 0.62% after 8 steps, FSDP_INT8_PRINT_PARITY=1 prints them).
    """
    for step, (loss, ref) in enumerate(result["losses"]):
        rel = abs(loss - ref) / abs(ref)
        limit = 3e-2 if bf16 else 1e-5
        assert rel <= limit, f"step {step}: loss {loss} vs reference {ref} ({rel:.2e} > {limit})"
    if bf16:
        assert result["rel_err"] <= 2e-2, result
    else:
        assert result["max_diff"] <= 1, result
        assert result["frac"] <= 0.01, result
        assert result["scale_err"] <= 1e-5, result
        assert result["rel_err"] <= 1e-3, result


def snapshot(model: nn.Module, opt: torch.optim.Optimizer) -> dict:
    """Full int8 bytes, scales and optimizer states (gathered: comparable at any world size)."""
    weights = {}
    for name, param in model.named_parameters():
        full = param.full_tensor() if isinstance(param, DTensor) else param
        weights[name] = (
            (full.int_data.clone(), full.scale.clone()) if isinstance(full, Int8Weight)
            else full.detach().clone()
        )
    states = get_optimizer_state_dict(model, opt, options=StateDictOptions(full_state_dict=True))
    moments = {
        f"{fqn}.{key}": value.detach().clone()
        for fqn, state in states["state"].items() for key, value in state.items()
    }
    return {"weights": weights, "optimizer": moments}


def assert_identical(a: dict, b: dict, what: str) -> None:
    """Two :func:`snapshot` results hold the same bytes (and dtypes) everywhere."""
    assert a["weights"].keys() == b["weights"].keys(), what
    assert a["optimizer"].keys() == b["optimizer"].keys(), what
    for name, x in a["weights"].items():
        y = b["weights"][name]
        same = all(map(torch.equal, x, y)) if isinstance(x, tuple) else torch.equal(x, y)
        assert same, f"{what}: weight {name} differs"
    for name, x in a["optimizer"].items():
        y = b["optimizer"][name]
        assert x.dtype == y.dtype and torch.equal(x, y), f"{what}: optimizer state {name} differs"


def train_repeating_pattern(model: nn.Module, rank: int, world: int, steps: int) -> list[float]:
    """Train ``tiny_transformer`` to continue a 16-token cycle; the mean loss of each step.

    ln(64) = 4.16 at the start; the cycle is learnable to well below 1 nat. The losses are
    all-reduced once at the end, not per step: each collective costs on 2 shared cores.
    """
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    pattern = torch.arange(16) * 5 % 64
    losses = []
    for step in range(steps):
        offsets = torch.randint(0, 16, (4,), generator=torch.Generator().manual_seed(step * world + rank))
        batch = torch.stack([pattern.roll(-int(o)).repeat(2) for o in offsets])
        loss = F.cross_entropy(model(batch[:, :-1]).flatten(0, 1), batch[:, 1:].flatten())
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
    total = torch.stack(losses)
    dist.all_reduce(total)
    return (total / world).tolist()


STEP_BATCH = 8  # global batch of train_step_batches: divides 1, 2 and 4 ranks


def sharded_mlp(mesh=None, hidden: int = 33) -> tuple[nn.Module, torch.optim.Optimizer]:
    """``MLPNet`` (seed 0) through ``shard_model`` over ``mesh`` (all ranks by default), with
    stochastic rounding seeded 7, and an AdamW with weight decay."""
    torch.manual_seed(0)
    model = fsdp_int8.shard_model(MLPNet(hidden=hidden), mesh=mesh, config=Int8TrainingConfig(seed=7))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


def train_step_batches(model: nn.Module, opt: torch.optim.Optimizer, first_step: int, steps: int) -> None:
    """Steps ``first_step ..``: each on a global batch that depends on the step only, split
    over the ranks (so a resumed run sees the data an uninterrupted one would)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    per_rank = STEP_BATCH // world
    for step in range(first_step, first_step + steps):
        data = torch.Generator().manual_seed(step)
        x, y = torch.randn(STEP_BATCH, 32, generator=data), torch.randn(STEP_BATCH, 4, generator=data)
        mine = slice(rank * per_rank, (rank + 1) * per_rank)
        F.mse_loss(model(x[mine]), y[mine]).backward()
        opt.step()
        opt.zero_grad()


def replicas_differ(model: nn.Module, mesh, replicate_dim: str) -> list[str]:
    """Names of the int8 weights whose shard (bytes and scales) is not the same on every
    replica of it along ``mesh``'s dim ``replicate_dim`` (HSDP)."""
    group, size = mesh.get_group(replicate_dim), mesh.size(mesh.mesh_dim_names.index(replicate_dim))
    differ = []
    for name, param in model.named_parameters():
        local = local_of(param)
        if isinstance(local, Int8Weight):
            mine = (local.int_rows().cpu(), local.scale.cpu())
            replicas = [None] * size
            dist.all_gather_object(replicas, mine, group=group)
            if not all(all(map(torch.equal, mine, other)) for other in replicas):
                differ.append(name)
    return differ
