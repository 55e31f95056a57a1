"""How much of a model is int8: the count ``quantize_`` logs, and its warnings about what
stays in full precision."""

from __future__ import annotations

import warnings
from typing import NamedTuple

import torch.nn as nn

from fsdp_int8._dist import local_shard
from fsdp_int8._weight.tensor import Int8Weight

__all__ = ["Int8Census", "int8_census", "warn_if_mostly_full_precision", "warn_about_left_in_full_precision"]

_NAMES_SHOWN = 6  # a warning names this many parameters or modules


class Int8Census(NamedTuple):
    """How much of a model is int8 (see :func:`int8_census`)."""

    int8_weights: int
    int8_elements: int
    total_elements: int

    def __str__(self) -> str:
        share = self.int8_elements / self.total_elements if self.total_elements else 0.0
        return (
            f"{self.int8_weights} int8 weights, {self.int8_elements:,} of "
            f"{self.total_elements:,} parameter elements ({share:.0%}) int8"
        )


def int8_census(model: nn.Module) -> Int8Census:
    """Count ``model``'s int8 weights and parameter elements (sharded or not: global sizes)."""
    weights = elements = total = 0
    for param in model.parameters():
        total += param.numel()
        if isinstance(local_shard(param), Int8Weight):
            weights += 1
            elements += param.numel()
    return Int8Census(weights, elements, total)


def warn_if_mostly_full_precision(model: nn.Module, census: Int8Census) -> None:
    """Warn when less than half of ``model``'s parameter elements are int8, naming the
    largest full-precision parameters: a model whose big weights were not recognised (a
    MoE's experts in a layout fsdp_int8 does not know) must not train as "int8" silently."""
    if not census.total_elements or 2 * census.int8_elements >= census.total_elements:
        return
    plain = sorted(
        ((param.numel(), name) for name, param in model.named_parameters()
         if not isinstance(local_shard(param), Int8Weight)),
        reverse=True,
    )
    largest = [f"{name} {tuple(model.get_parameter(name).shape)}" for _, name in plain[:_NAMES_SHOWN]]
    warnings.warn(
        f"quantize_: only {census}; the largest full-precision parameters are "
        f"{', '.join(largest)}. If they should be int8, select them with "
        "Int8TrainingConfig(module_filter=..., min_features=..., skip_names=...); "
        "nn.Linear layers and mixture-of-experts modules (num_experts and 3-D "
        "[experts, out, in] weights, or DBRX's) can be int8.",
        stacklevel=3,
    )


def _named_list(names: list[str]) -> str:
    shown = ", ".join(names[:_NAMES_SHOWN])
    more = len(names) - _NAMES_SHOWN
    return shown + (f" and {more} more" if more > 0 else "")


def warn_about_left_in_full_precision(tied: list[str], unsupported: list[str]) -> None:
    """One warning per kind of layer that ``quantize_`` cannot quantize, naming the layers."""
    if tied:
        warnings.warn(
            f"quantize_ left {len(tied)} weight(s) in full precision because they are tied "
            f"to a module that is not quantized: {_named_list(tied)}. Untie them (e.g. "
            "tie_word_embeddings=False) to quantize them.",
            stacklevel=3,
        )
    if unsupported:
        warnings.warn(
            f"quantize_ left {len(unsupported)} layer(s) in full precision that it cannot "
            f"convert: {_named_list(unsupported)}.",
            stacklevel=3,
        )
