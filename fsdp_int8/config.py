"""Every switch of int8 training in one dataclass."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch.nn as nn

__all__ = ["Int8TrainingConfig", "ModuleFilter"]

# ``filter(module, fully_qualified_name) -> bool``: True quantizes that ``nn.Linear``.
ModuleFilter = Callable[[nn.Module, str], bool]


@dataclass
class Int8TrainingConfig:
    """How :func:`fsdp_int8.quantize_` and :func:`fsdp_int8.shard_model` treat a model.

    Attributes:
        stochastic_rounding: Write optimizer updates back with stochastic rounding
            (unbiased, so updates smaller than one int8 step survive on average).
            ``False`` rounds to nearest: deterministic, for debugging and exact parity tests.
        seed: Seed of the stochastic-rounding generator. Each shard rank mixes in its
            rank, so shards draw different noise while replicas (HSDP) draw the same.
        module_filter: Decides which ``nn.Linear`` layers are quantized. ``None`` uses
            the default: every ``nn.Linear`` whose name is not in ``skip_names`` and
            whose in and out features are both at least ``min_features``.
        skip_names: Last name components that stay in full precision (output heads,
            whose error is the most visible in the loss).
        min_features: Smaller layers stay in full precision: a row of K weights
            carries a 4-byte scale, so tiny rows save little and lose precision.
    """

    stochastic_rounding: bool = True
    seed: int = 0
    module_filter: ModuleFilter | None = None
    skip_names: tuple[str, ...] = ("lm_head", "output", "head")
    min_features: int = 16

    def __post_init__(self) -> None:
        if self.min_features < 1:
            raise ValueError(f"min_features must be >= 1, got {self.min_features}")
        if not isinstance(self.seed, int):
            raise TypeError(f"seed must be an int, got {type(self.seed).__name__}")

    def should_quantize(self, module: nn.Module, name: str) -> bool:
        """Whether ``module`` (found at ``name`` in the model) gets an int8 weight."""
        if not isinstance(module, nn.Linear):
            return False
        if self.module_filter is not None:
            return bool(self.module_filter(module, name))
        if name.rsplit(".", 1)[-1] in self.skip_names:
            return False
        return min(module.in_features, module.out_features) >= self.min_features
