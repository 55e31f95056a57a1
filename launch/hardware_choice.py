"""What ``--precision auto`` and ``--compute-dtype auto`` resolve to on this hardware, one
answer for every rank (rank 0 decides and broadcasts it)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from fsdp_int8 import hardware
from fsdp_int8.config import AUTO
from launch.precisions import PRECISIONS


def resolve_auto(precision: str, compute_dtype: str, device: torch.device) -> tuple[str, str, str | None]:
    """Resolve ``auto`` in ``--precision`` and ``--compute-dtype`` from what ``device`` runs fast.

    ``auto`` precision: ``int8-mm`` with a fast int8 GEMM, else ``int8``; ``auto`` compute
    dtype (of an int8 precision): ``bf16`` with fast bf16 matmuls, else ``fp32``. Under a
    process group rank 0 decides (its check may time a kernel) and every rank takes its
    answer, so all ranks build the same model. Returns the two choices and the line that
    says what was chosen and why (``None`` if nothing was ``auto``).
    """
    needs_compute = compute_dtype == AUTO and (precision == AUTO or PRECISIONS[precision].int8)
    if precision != AUTO and not needs_compute:
        return precision, compute_dtype, None
    found = [hardware.capability(device) if not dist.is_initialized() or dist.get_rank() == 0 else None]
    if dist.is_initialized():
        dist.broadcast_object_list(found, src=0)
    found = found[0]
    reasons = []
    if precision == AUTO:
        precision = "int8-mm" if found.int8_gemm_fast else "int8"
        kind = "a fast" if found.int8_gemm_fast else "no fast"
        reasons.append(f"--precision {precision} ({kind} int8 GEMM: {found.int8_evidence})")
    if needs_compute:
        compute_dtype = "bf16" if found.bf16_matmul_fast else "fp32"
        kind = "a fast" if found.bf16_matmul_fast else "no fast"
        reasons.append(f"--compute-dtype {compute_dtype} ({kind} bf16 matmul: {found.bf16_evidence})")
    return precision, compute_dtype, f"auto on {found.name}: " + "; ".join(reasons)

