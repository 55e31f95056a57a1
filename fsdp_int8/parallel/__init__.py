"""Tensor parallelism for int8 weights: styles for ``parallelize_module``, and a plan converter.

``shard_model(model, mesh=mesh, tp_plan=plan)`` applies a plan for you (tensor
parallelism first, then FSDP2 on the data-parallel dims). Calling ``parallelize_module``
yourself, use :class:`Int8ColwiseParallel` / :class:`Int8RowwiseParallel` (or
:func:`int8_tp_plan` of a stock plan) on a quantized model: torch's stock styles refuse
int8 weights (docs/parallelism.md says why).
"""

from fsdp_int8.parallel._styles import Int8ColwiseParallel, Int8RowwiseParallel, int8_tp_plan

__all__ = ["Int8ColwiseParallel", "Int8RowwiseParallel", "int8_tp_plan"]
