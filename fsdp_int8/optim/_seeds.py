"""The rounding seeds of one optimizer's step: one per stochastically rounded int8 weight.

Once per step each such weight (of the groups with ``lr != 0``) gets a seed, drawn in
parameter order from the weight's rounding stream, and is then rounded from a generator
seeded with it. The noise a weight gets thus does not depend on the order of the updates
(after backward or inside it) or on which other weights got gradients. After backward the
seeds are read back in the same host sync as the finite-gradient verdict; inside backward,
at the first hook.
"""

from __future__ import annotations

from typing import Any

import torch

from fsdp_int8._dist import local_shard
from fsdp_int8._quant.generators import draw_update_seed_values, draw_update_seeds, update_seeds_from
from fsdp_int8._weight.tensor import Int8Weight
from fsdp_int8._weight.tensor_parallel import rounding_generator
from fsdp_int8.guard import NonFiniteGradientError, check_finite_gradients


def _seeded_weights(param_groups: list[dict[str, Any]]) -> tuple[list[torch.Tensor], list[torch.Generator]]:
    """The stochastically rounded int8 weights of the groups with ``lr != 0`` that have a
    rounding generator, in parameter order, and their generators."""
    weights, generators = [], []
    for group in param_groups:
        if float(group["lr"]) == 0.0:
            continue
        for param in group["params"]:
            local = local_shard(param)
            if isinstance(local, Int8Weight) and local.stochastic_rounding:
                generator = rounding_generator(local, local.device)
                if generator is not None:
                    weights.append(param)
                    generators.append(generator)
    return weights, generators


class StepSeeds:
    """The seeds of the step in progress and the generators made from them."""

    def __init__(self) -> None:
        self._seeds: dict[int, int] | None = None  # id(param) -> its update's rounding seed
        self._streams: dict[int, torch.Generator] = {}  # id(param) -> its seeded generator

    def draw(self, optimizer: torch.optim.Optimizer) -> None:
        """Draw the step's seeds, unless this step has them (one host read)."""
        if self._seeds is None:
            weights, generators = _seeded_weights(optimizer.param_groups)
            self._seeds = {id(p): seed for p, seed in zip(weights, draw_update_seeds(generators))}

    def draw_checked(self, optimizer: torch.optim.Optimizer) -> None:
        """Draw the step's seeds and read them back with the finite-gradient verdict of
        :func:`~fsdp_int8.guard.check_finite_gradients`: one device sync for both. A
        refused step puts the generators back (it changes nothing) and raises."""
        weights, generators = _seeded_weights(optimizer.param_groups)
        states = [(g, g.get_state()) for g in {id(g): g for g in generators}.values()]  # host-side state
        draws = draw_update_seed_values(generators)
        try:
            values = check_finite_gradients(optimizer, read_with=draws)
        except NonFiniteGradientError:
            for generator, state in states:
                generator.set_state(state)
            raise
        self._seeds = {id(p): seed for p, seed in zip(weights, update_seeds_from(generators, values))}

    def stream(self, param: torch.Tensor, device: torch.device) -> torch.Generator | None:
        """The generator of ``param``'s rounding this step (one per parameter, shared by its
        pieces in row order), ``None`` if it has no seed (round to nearest)."""
        stream = self._streams.get(id(param))
        if stream is None:
            seed = (self._seeds or {}).get(id(param))
            if seed is None:
                return None
            stream = self._streams[id(param)] = torch.Generator(device=device).manual_seed(seed)
        return stream

    def forget(self) -> None:
        """End the step: the next update draws new seeds."""
        self._seeds = None
        self._streams.clear()
