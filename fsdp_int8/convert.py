"""``quantize_``: swap a model's eligible ``nn.Linear`` weights for ``Int8Weight`` parameters."""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

from fsdp_int8._generators import seed_weight_rounding
from fsdp_int8.config import Int8TrainingConfig
from fsdp_int8.weight import Int8Weight, local_shard

__all__ = ["quantize_", "init_int8_weights_", "is_sharded"]


def is_sharded(model: nn.Module) -> bool:
    """Whether ``fully_shard`` (FSDP2) or another DTensor API has touched ``model``."""
    from torch.distributed.fsdp import FSDPModule

    return any(isinstance(m, FSDPModule) for m in model.modules()) or any(
        isinstance(p, DTensor) for p in model.parameters()
    )


def quantize_(model: nn.Module, config: Int8TrainingConfig | None = None) -> nn.Module:
    """Swap eligible ``nn.Linear`` weights of ``model`` for int8 weights, in place.

    Quantization rounds to nearest; later optimizer updates use the config's rounding.
    Idempotent (already quantized weights are left alone), keeps tied weights tied, and
    works on a model on the meta device (``to_empty`` then allocates int8 storage). When it
    quantizes anything it also seeds the stochastic-rounding generator from
    ``config.seed`` and this process's rank.

    Args:
        model: The model, before any ``fully_shard``.
        config: Which layers and how; defaults to :class:`Int8TrainingConfig()`.

    Returns:
        ``model`` itself.

    Raises:
        RuntimeError: if the model is already sharded (quantize first, then shard).
    """
    config = config or Int8TrainingConfig()
    if is_sharded(model):
        raise RuntimeError(
            "quantize_ got a model that is already sharded (fully_shard or DTensor parameters). "
            "Quantize first, then shard: use fsdp_int8.shard_model(model), which does both."
        )
    # Build every int8 weight first, then swap: a layer that cannot be quantized raises
    # before the model has changed.
    swapped: dict[int, nn.Parameter] = {}  # tied weights stay tied
    targets: list[tuple[nn.Module, int]] = []
    for name, module in model.named_modules(remove_duplicate=False):
        if not config.should_quantize(module, name):
            continue
        weight = module.weight
        if isinstance(weight, Int8Weight):
            continue
        if id(weight) not in swapped:
            with torch.no_grad():
                int8_weight = Int8Weight.from_float(
                    weight, stochastic_rounding=config.stochastic_rounding,
                    int8_matmul=config.int8_matmul,
                )
            swapped[id(weight)] = nn.Parameter(int8_weight, requires_grad=weight.requires_grad)
        targets.append((module, id(weight)))
    for module, key in targets:
        module.weight = swapped[key]
    if swapped:  # a repeated call changes nothing, not even the generator
        # Not sharded yet: every process holds every row, one shard (mesh=None).
        seed_weight_rounding(config.seed)
    return model


def init_int8_weights_(
    model: nn.Module, init_fn: Callable[[str, torch.Tensor], object]
) -> nn.Module:
    """Initialise every int8 weight of ``model`` through a float tensor, rounding to nearest.

    Single-op initialisers (``uniform_``, ``normal_``, ``kaiming_uniform_``, a module's
    ``reset_parameters``) work on int8 weights directly. Multi-step ones such as
    ``nn.init.trunc_normal_`` would requantize between their steps; run them here instead.
    Works before and after sharding (the float tensor has the parameter's sharding).

    Args:
        model: A quantized (possibly sharded) model.
        init_fn: ``init_fn(name, values)`` fills the fp32 tensor ``values`` in place.

    Returns:
        ``model``.
    """
    for name, param in model.named_parameters():
        if not isinstance(local_shard(param), Int8Weight):
            continue
        values = torch.zeros_like(param, dtype=torch.float32)  # plain (sharded like param)
        with torch.no_grad():
            init_fn(name, values)
            param.copy_(values)
    return model
