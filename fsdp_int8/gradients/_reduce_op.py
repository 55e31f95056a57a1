"""What FSDP2's reduce ``op`` does to the sum of the ranks' slices."""

from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["op_multiplier"]


def _op_type(op: object) -> object:
    # ReduceOp.SUM is a RedOpType; ReduceOp.PREMUL_SUM(f) is a ReduceOp carrying .op, .factor
    # (and isinstance(RedOpType, ReduceOp) holds too, so test the narrower type first).
    return op if isinstance(op, dist.ReduceOp.RedOpType) else getattr(op, "op", op)


def op_multiplier(op: object, world_size: int) -> float | torch.Tensor | None:
    """What the sum of the ranks' slices is multiplied by for FSDP2's ``op``.

    ``SUM`` -> ``None`` (nothing), ``AVG`` -> ``1 / world_size``, ``PREMUL_SUM(f)`` -> ``f``
    (``sum(f * x_i) = f * sum(x_i)``; ``f`` may be a float or a 0-d tensor).

    Raises:
        ValueError: for any other op (FSDP2 only issues these three).
    """
    kind = _op_type(op)
    if kind == dist.ReduceOp.SUM:
        return None
    if kind == dist.ReduceOp.AVG:
        return None if world_size == 1 else 1.0 / world_size
    if kind == dist.ReduceOp.PREMUL_SUM:
        if isinstance(op, dist.ReduceOp.RedOpType):
            raise ValueError("PREMUL_SUM needs its factor: pass ReduceOp.PREMUL_SUM(factor)")
        return op.factor
    raise ValueError(
        f"the quantized reduce-scatter supports SUM, AVG and PREMUL_SUM (what FSDP2 issues), "
        f"got {kind}"
    )
