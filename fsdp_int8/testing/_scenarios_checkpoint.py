"""The checkpoint scenario: ``torch.distributed.checkpoint`` save at one world size, load
at the next (the runner passes each spawn the previous one's directory)."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

from fsdp_int8._dist import local_shard
from fsdp_int8.testing._harness import (
    Ctx, build, chunk, flat_mesh, gather_full, shard_model, subclass_names,
)
from fsdp_int8.testing._spec import NOT_APPLICABLE, PASSED


def dcp_reshard(ctx: Ctx, load_from: str | None, save_to: str) -> dict[str, tuple[str, str]]:
    """Load ``load_from`` (if any) and check it bit-exactly; save this world size's model
    to ``save_to`` with its full values in ``expected.pt`` for the next world size."""
    rows = (8, 12)  # the same model at every world size
    mesh, shard = flat_mesh(ctx)
    names = subclass_names(rows)
    result = (NOT_APPLICABLE, "saved a checkpoint for the next world size")
    if load_from is not None:
        model = shard_model(build(ctx, rows, seed=99), mesh, True)  # other values than saved
        state = get_model_state_dict(model)
        dcp.load(state, checkpoint_id=load_from, process_group=ctx.group)
        set_model_state_dict(model, state)
        expected = torch.load(Path(load_from) / "expected.pt")
        for name, param in model.named_parameters():
            local = local_shard(param)
            mine = ctx.floats(local, name in names).cpu()
            want = expected["values"][name][chunk(param.shape[0], shard)]
            ctx.expect(mine.shape == want.shape and torch.equal(mine, want),
                       f"{name}: loaded values differ from the saved ones")
        ctx.agree(f"loading the world-size-{expected['world_size']} checkpoint")
        result = (PASSED, f"saved at world size {expected['world_size']}, loaded bit-exactly")
    model = shard_model(build(ctx, rows, seed=1000 + ctx.world), mesh, True)
    dcp.save(get_model_state_dict(model), checkpoint_id=save_to, process_group=ctx.group)
    values = {k: v.cpu() for k, v in gather_full(ctx, model, shard, names).items()}
    if ctx.rank == 0:
        torch.save({"world_size": ctx.world, "values": values}, Path(save_to) / "expected.pt")
    dist.barrier(group=ctx.group)
    return {"dcp_reshard": result}
