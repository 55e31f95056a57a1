"""Argument checks of the fused optimizers: parameters and hyperparameters."""

from __future__ import annotations

from typing import Any, Iterable

import torch


def check_floating(params: Iterable[torch.Tensor], owner: str) -> None:
    """Raise unless every parameter is a real floating tensor (``owner`` names the optimizer)."""
    for param in params:
        if not isinstance(param, torch.Tensor):
            raise TypeError(f"{owner} optimizes tensors, got {type(param).__name__}")
        if param.is_complex():
            raise ValueError(
                f"{owner} does not support complex parameters (got one of dtype {param.dtype}): "
                "view it as real (torch.view_as_real) or use torch.optim"
            )
        if not param.is_floating_point():
            raise ValueError(f"{owner} optimizes floating parameters, got one of dtype {param.dtype}")


def check_number(name: str, value: Any, low: float, high: float | None = None) -> None:
    """Raise unless ``value``, a number or a one-element tensor (never a bool), lies in
    ``[low, high)``, or is ``>= low`` without ``high``."""
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ValueError(f"{name} must be a number or a one-element tensor, got shape {tuple(value.shape)}")
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number, got {value!r}")
    if not (value >= low and (high is None or value < high)):  # NaN fails too
        bound = f">= {low}" if high is None else f"[{low}, {high})"
        raise ValueError(f"{name} must be in {bound}, got {value}")
