"""fsdp_int8's optimizers in torchtitan: :class:`Int8OptimizersContainer`, torchtitan's
``OptimizersContainer`` whose parameter groups may name ``"Int8AdamW"`` or
``"Int8AdamW.lean"`` besides torchtitan's own optimizers.

torchtitan builds its optimizers from names (``ParamGroupConfig.optimizer_name``) that
its container resolves from a fixed table; the container here adds fsdp_int8's. The lean
name is ``Int8AdamW.lean`` (8-bit states, bounded update blocks) without the step inside
backward and its ``max_grad_norm``: torchtitan's ``Trainer`` clips every gradient after
backward (``training.max_norm``), which a gradient applied inside backward cannot take.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Any, Callable

from torch.optim import Optimizer
from torchtitan.components.optimizer import OptimizersContainer

from fsdp_int8.optim import Int8AdamW

INT8_ADAMW, INT8_ADAMW_LEAN = "Int8AdamW", "Int8AdamW.lean"


def _lean_adamw(params: Any, **kwargs: Any) -> Int8AdamW:
    """``Int8AdamW.lean`` stepping after backward, where torchtitan's Trainer clips."""
    return Int8AdamW.lean(params, **{"step_in_backward": False, "max_grad_norm": None, **kwargs})


class Int8OptimizersContainer(OptimizersContainer):
    """torchtitan's ``OptimizersContainer`` whose parameter groups may also name fsdp_int8's optimizers.

    Its ``Config`` fields, flat FQN-keyed state dict and steps are torchtitan's. A group's
    ``optimizer_name`` may also be ``"Int8AdamW"`` (:class:`fsdp_int8.Int8AdamW`, the
    group's ``optimizer_kwargs`` its per-group keywords: ``lr``, ``betas``, ``eps``,
    ``weight_decay``, ``state_bits``, ``block_size``, ``fused``) or ``"Int8AdamW.lean"``
    (:meth:`fsdp_int8.Int8AdamW.lean` stepping after backward: 8-bit states and
    ``step_elements=LEAN_STEP_ELEMENTS``); optimizer-wide keywords (``step_elements``) go in
    ``optimizer_factory_kwargs_by_name``. :func:`enable_int8_training` makes torchtitan's
    ``OptimizersContainer.Config`` this one, with the same fields.

    Example::

        config.optimizer.param_groups = [ParamGroupConfig(pattern=".*", optimizer_name="Int8AdamW",
                                                          optimizer_kwargs={"lr": 3e-4, "state_bits": 8})]
    """

    @dataclass(kw_only=True, slots=True)
    class Config(OptimizersContainer.Config):
        """torchtitan's ``OptimizersContainer.Config``, with the same fields."""

    @staticmethod
    def _resolve_optimizer_factory(name: str) -> Callable[..., Optimizer]:
        ours: dict[str, Callable[..., Optimizer]] = {INT8_ADAMW: Int8AdamW, INT8_ADAMW_LEAN: _lean_adamw}
        return ours[name] if name in ours else OptimizersContainer._resolve_optimizer_factory(name)


def int8_optimizers_config(config: Any, *, lean: bool) -> Any:
    """``config`` (torchtitan's ``OptimizersContainer.Config``) as an
    :class:`Int8OptimizersContainer.Config`; with ``lean`` its ``"AdamW"`` groups name
    ``"Int8AdamW.lean"`` (their ``lr``, ``betas``, ``eps`` and ``weight_decay`` kept). Any
    other optimizer config is returned as it is, or refused with ``lean``."""
    if isinstance(config, Int8OptimizersContainer.Config) or type(config) is OptimizersContainer.Config:
        values = {f.name: getattr(config, f.name) for f in fields(config) if f.init}
    elif lean:
        raise TypeError(
            f"Int8LinearConverter.Config(lean=True) cannot adapt a {type(config).__qualname__} optimizer "
            "component: it makes torchtitan's OptimizersContainer.Config an Int8OptimizersContainer.Config "
            "whose AdamW groups are Int8AdamW.lean's. Name 'Int8AdamW.lean' in your optimizer's groups "
            "(Int8OptimizersContainer resolves it), or leave lean off"
        )
    else:
        return config
    if lean:
        values["param_groups"] = [
            replace(group, optimizer_name=INT8_ADAMW_LEAN) if group.optimizer_name == "AdamW" else group
            for group in values["param_groups"]
        ]
    return Int8OptimizersContainer.Config(**values)
