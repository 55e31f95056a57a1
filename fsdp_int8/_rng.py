"""The stochastic-rounding generator: one per process and device, seedable, restorable.

Seeds mix the configured seed with the *shard* rank: FSDP shards must draw different
noise, but HSDP replicas of one shard must draw the same, or they would drift apart.
"""

from __future__ import annotations

import torch

_GOLDEN = 0x9E3779B97F4A7C15  # odd 64-bit constant: spreads consecutive ranks apart
_MASK63 = (1 << 63) - 1

_base_seed: int = 0
_generators: dict[str, torch.Generator] = {}


def _device_key(device: torch.device | str) -> str:
    device = torch.device(device)
    if device.type != "cpu" and device.index is None:
        device = torch.device(device.type, torch.get_device_module(device.type).current_device())
    return str(device)


def seed_for(seed: int, shard_rank: int) -> int:
    """The generator seed used by ``shard_rank`` for the configured ``seed``."""
    return (seed * _GOLDEN + shard_rank * (_GOLDEN >> 1) + shard_rank) & _MASK63


def manual_seed(seed: int, shard_rank: int = 0) -> None:
    """Reset every device's generator to the stream of ``(seed, shard_rank)``."""
    global _base_seed
    _base_seed = seed_for(seed, shard_rank)
    for key, gen in _generators.items():
        gen.manual_seed(_base_seed)


def generator(device: torch.device | str) -> torch.Generator | None:
    """The generator for ``device``, created on first use (``None`` on meta)."""
    if torch.device(device).type == "meta":
        return None
    key = _device_key(device)
    gen = _generators.get(key)
    if gen is None:
        gen = torch.Generator(device=key)
        gen.manual_seed(_base_seed)
        _generators[key] = gen
    return gen


def get_state() -> dict[str, torch.Tensor]:
    """A copy of every device generator's state, keyed by device."""
    return {key: gen.get_state().clone() for key, gen in _generators.items()}


def set_state(state: dict[str, torch.Tensor]) -> None:
    """Restore states saved by :func:`get_state`."""
    for key, value in state.items():
        generator(key).set_state(value.clone())
