"""Shared by the Hugging Face examples: run accelerate's FSDP2 on CPU processes too.

accelerate enables FSDP only when each process has an accelerator; on CPU it silently
falls back to DDP. FSDP2 itself runs on CPU with gloo, so :func:`fsdp2_accelerator`
switches accelerate's (process-wide) state to FSDP where it chose multi-CPU. On GPUs it
changes nothing. :func:`accelerate_session` leaves the process as it found it: the
process group (destroyed only if accelerate created it here), accelerate's state and the
environment variables accelerate writes.
"""

from __future__ import annotations

import contextlib
import os
from typing import Iterator

import torch
import torch.distributed as dist

_ENV = (
    "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
    "ACCELERATE_USE_FSDP", "FSDP_CPU_RAM_EFFICIENT_LOADING",
)


def on_cpu() -> bool:
    return not torch.accelerator.is_available()


@contextlib.contextmanager
def accelerate_session() -> Iterator[None]:
    from accelerate.state import AcceleratorState, GradientState

    had_group = dist.is_initialized()
    saved = {key: os.environ.get(key) for key in _ENV}
    if had_group:  # accelerate reads the layout from the environment: say what it is
        os.environ.setdefault("LOCAL_RANK", str(dist.get_rank()))
        os.environ.setdefault("LOCAL_WORLD_SIZE", str(dist.get_world_size()))
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    try:
        yield
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)
        GradientState._reset_state()
        if not had_group and dist.is_initialized():
            dist.destroy_process_group()
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def fsdp2_accelerator(plugin):
    """An ``Accelerator`` running ``plugin`` (FSDP2), on CPU processes too."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, PartialState
    from accelerate.utils import DistributedType

    accelerator = Accelerator(cpu=on_cpu(), fsdp_plugin=plugin)
    if accelerator.distributed_type == DistributedType.MULTI_CPU:
        # AcceleratorState copies PartialState's fields each time it is built: set both.
        PartialState().distributed_type = DistributedType.FSDP
        state = AcceleratorState()
        state.distributed_type = DistributedType.FSDP
        state.fsdp_plugin = plugin
    return accelerator
