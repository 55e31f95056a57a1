"""Training scenarios: parity on each mesh and row layout, bf16 mixed precision, meta init.

Each trains the tiny model sharded and compares it with the unsharded reference
(:func:`~._parity.train_compare`); they differ in how the model is built and sharded.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy

from fsdp_int8._dist import local_shard
from fsdp_int8.testing._harness import (
    Ctx, Net, Shard, build, chunk, flat_mesh, quantize, row_scale, shard_model, subclass_names,
)
from fsdp_int8.testing._parity import FP32_RTOL, train_compare
from fsdp_int8.testing._spec import PASSED

_PARITY_KEYS = {"reshard": "parity_reshard", "no_reshard": "parity_no_reshard",
                "world_size_1": "world_size_1", "uneven": "uneven_shards", "empty": "empty_shards",
                "hsdp": "hsdp"}


def parity(ctx: Ctx, kind: str) -> dict[str, tuple[str, str]]:
    """reshard / no_reshard / world_size_1 / uneven / empty / hsdp: build, shard, train, compare."""
    w = ctx.world
    if kind == "hsdp":
        mesh = init_device_mesh(ctx.device.type, (2, w // 2), mesh_dim_names=("replicate", "shard"))
        shard = Shard(mesh.get_group("shard"), mesh.get_local_rank("shard"), w // 2)
        rows = (2 * shard.size, 3 * shard.size)
    else:
        mesh, shard = flat_mesh(ctx)
        rows = {
            "uneven": (2 * w - 1, 3 * w - 1),  # the last rank holds fewer rows, none holds zero
            "empty": (w - 1, 1),                # fewer rows than ranks: empty shards
        }.get(kind, (2 * w, 3 * w))
    reshards = {"no_reshard": (False,), "world_size_1": (True, False)}.get(kind, (True,))
    steps = 3 if kind in ("reshard", "no_reshard", "world_size_1") else 2
    details = []
    for reshard in reshards:
        model = shard_model(build(ctx, rows), mesh, reshard)
        details.append(train_compare(ctx, model, build(ctx, rows), rows, shard, steps=steps))
    what = {"world_size_1": "reshard_after_forward True and False",
            "hsdp": f"mesh 2 x {w // 2}, rows {rows}"}.get(kind, f"rows {rows} on {w} ranks")
    return {_PARITY_KEYS[kind]: (PASSED, f"{what}; " + "; ".join(details))}


def bf16_mixed_precision(ctx: Ctx) -> dict[str, tuple[str, str]]:
    """bf16 unsharded weights under ``param_dtype=bf16``, fp32 shards, parity within bf16 limits."""
    rows = (2 * ctx.world, 3 * ctx.world)
    mesh, shard = flat_mesh(ctx)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    model = shard_model(build(ctx, rows), mesh, True, policy)
    seen: dict[str, torch.dtype] = {}
    for i, block in enumerate(model.layers):
        for lin in ("up", "down"):
            getattr(block, lin).register_forward_pre_hook(
                functools.partial(_record_weight_dtype, seen, f"layers.{i}.{lin}.weight"))
    detail = train_compare(ctx, model, build(ctx, rows), rows, shard, steps=2, mp=True)
    for name, dtype in seen.items():
        ctx.expect(dtype == torch.bfloat16, f"{name}: the unsharded weight is {dtype} under "
                   "param_dtype=bfloat16 (does fsdp_post_all_gather honour param_dtype?)")
    for name, param in model.named_parameters():
        ctx.expect(param.dtype == torch.float32, f"{name}: the sharded parameter became {param.dtype}")
    ctx.agree("dtypes under the bf16 policy")
    return {"bf16_mixed_precision": (PASSED, f"unsharded weights bf16; {detail}")}


def _record_weight_dtype(seen: dict, name: str, module: nn.Module, args: Any) -> None:
    seen[name] = module.weight.dtype


def meta_init(ctx: Ctx) -> dict[str, tuple[str, str]]:
    """``from_float`` on meta, ``fully_shard``, ``to_empty``, ``copy_`` of initial values, train."""
    rows = (2 * ctx.world, 3 * ctx.world)
    mesh, shard = flat_mesh(ctx)
    with torch.device("meta"):
        model = quantize(ctx.spec, Net(rows), rows)
    shard_model(model, mesh, True)
    model.to_empty(device=ctx.device)
    init = torch.Generator().manual_seed(7)  # the same full values on every rank
    names = set(subclass_names(rows))
    for name, param in model.named_parameters():
        full = (torch.randn(param.shape, generator=init) * 0.2).to(ctx.device)
        mine = full[chunk(param.shape[0], shard)]
        with torch.no_grad():
            local_shard(param).copy_(mine)
        if name in names:
            got = ctx.values(local_shard(param))
            allowed = (ctx.spec.rounding_step * 1.001 + FP32_RTOL) * row_scale(mine)
            ctx.expect(got.shape == mine.shape and bool(((got - mine).abs() <= allowed).all()),
                       f"{name}: after to_empty and copy_ the shard does not hold the initial values "
                       "within one rounding step")
    ctx.agree("after to_empty and initialisation")
    detail = train_compare(ctx, model, None, rows, shard, steps=2)
    return {"meta_init": (PASSED, f"from_float on meta, to_empty, copy_ init; {detail}")}
