"""``quantize_``: swap a model's eligible ``nn.Linear`` weights for ``Int8Weight`` parameters."""

from __future__ import annotations

import logging
import warnings
from typing import Any, Callable, NamedTuple

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor
from torch.utils._pytree import tree_map_only

from fsdp_int8._dist import local_shard
from fsdp_int8._generators import seed_weight_rounding
from fsdp_int8.config import Int8TrainingConfig
from fsdp_int8.weight import Int8Weight

__all__ = ["quantize_", "init_int8_weights_", "is_sharded", "dequantize_all"]


def dequantize_all(tree: Any, dtype: torch.dtype | None = None) -> Any:
    """Replace every ``Int8Weight`` in a pytree by its dequantized plain tensor."""
    return tree_map_only(Int8Weight, lambda w: w.dequantize(dtype), tree)

logger = logging.getLogger("fsdp_int8")

_NAMES_SHOWN = 6  # a warning names this many modules, then counts the rest


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


def parameter_owners(model: nn.Module) -> dict[int, list[str]]:
    """Every module name that registers each parameter, by ``id(parameter)``.

    A parameter with two owners is tied (``tie_word_embeddings``: the embedding and the
    output head).
    """
    owners: dict[int, list[str]] = {}
    for name, module in model.named_modules(remove_duplicate=False):
        for param in module._parameters.values():
            if param is not None:
                owners.setdefault(id(param), []).append(name)
    return owners


def _named_list(names: list[str]) -> str:
    shown = ", ".join(names[:_NAMES_SHOWN])
    more = len(names) - _NAMES_SHOWN
    return shown + (f" and {more} more" if more > 0 else "")


def _untied_targets(
    model: nn.Module, config: Int8TrainingConfig
) -> tuple[list[tuple[str, nn.Module]], list[str]]:
    """The modules to quantize, and warnings for weights tied to full-precision modules.

    A weight shared with a module that keeps it in full precision (an ``nn.Embedding``
    tied to the output head) is left alone: quantizing it for one owner would untie it
    (the other would keep a plain weight) or give the other an int8 weight it cannot use.
    """
    targets = [
        (name, module) for name, module in model.named_modules(remove_duplicate=False)
        if config.should_quantize(module, name)
    ]
    target_names = {name for name, _ in targets}
    owners = parameter_owners(model)
    kept, tied = [], []
    for name, module in targets:
        others = [o for o in owners.get(id(module.weight), []) if o not in target_names]
        if others and not isinstance(module.weight, Int8Weight):
            tied.append(f"{name} (tied to {', '.join(others)})")
        else:
            kept.append((name, module))
    return kept, tied


def _is_transposed_linear(module: nn.Module) -> bool:
    """A ``transformers.pytorch_utils.Conv1D`` (GPT-2's linears: weight ``[in, out]``)."""
    return type(module).__name__ == "Conv1D" and hasattr(module, "nf") and hasattr(module, "nx")


def _warn_about_full_precision(model: nn.Module, tied: list[str]) -> None:
    """One warning per kind of layer that ``quantize_`` cannot quantize, naming the layers."""
    if tied:
        warnings.warn(
            f"quantize_ left {len(tied)} weight(s) in full precision because they are tied "
            f"to a module that is not quantized: {_named_list(tied)}. Untie them (e.g. "
            "tie_word_embeddings=False) to quantize them.",
            stacklevel=3,
        )
    transposed = [n for n, m in model.named_modules() if _is_transposed_linear(m)]
    if transposed:
        warnings.warn(
            f"quantize_ left {len(transposed)} Conv1D layer(s) in full precision: "
            f"{_named_list(transposed)}. transformers' Conv1D (GPT-2 style) stores its weight "
            "as [in, out] and multiplies with addmm, not F.linear; only nn.Linear weights "
            "are quantized.",
            stacklevel=3,
        )


class _RequantizeAssigned:
    """``load_state_dict`` post-hook of a quantized layer: keeps its weight int8.

    ``load_state_dict(state_dict, assign=True)`` replaces parameters by the state dict's
    tensors instead of copying into them. A plain floating weight assigned that way (as
    accelerate's ``cpu_ram_efficient_loading`` does on every rank but the first, with the
    shards it scattered) is rounded to nearest into a new ``Int8Weight``, sharded like it;
    an ``Int8Weight`` is kept as it is. A picklable object, not a closure: modules holding
    it are still saved whole by ``torch.save`` and copied by ``copy.deepcopy``.
    """

    def __init__(self, stochastic_rounding: bool, int8_matmul, compiled: bool = False) -> None:
        self.stochastic_rounding = stochastic_rounding
        self.int8_matmul = int8_matmul
        self.compiled = compiled

    def __call__(self, module: nn.Module, incompatible_keys) -> None:
        weight = module._parameters.get("weight")
        if weight is None:
            return
        local = local_shard(weight)
        if isinstance(local, Int8Weight) or local.is_meta or not local.is_floating_point() or local.dim() != 2:
            return
        with torch.no_grad():
            int8 = Int8Weight.from_float(
                local.detach(), stochastic_rounding=self.stochastic_rounding,
                # modules pickled before weights carried `compiled` have no such attribute
                int8_matmul=self.int8_matmul, compiled=getattr(self, "compiled", False),
            )
            if isinstance(weight, DTensor):
                int8.full_rows = weight.shape[0]  # FSDP2 pads every shard to the same rows
                int8 = DTensor.from_local(
                    int8, weight.device_mesh, weight.placements, run_check=False,
                    shape=weight.shape, stride=weight.stride(),
                )
        module.weight = nn.Parameter(int8, requires_grad=weight.requires_grad)


def int8_parameter(weight: torch.Tensor, config: Int8TrainingConfig) -> nn.Parameter:
    """``weight`` quantized (round to nearest) into a new parameter with ``config``'s
    rounding, matmuls and kernels, keeping ``requires_grad``."""
    with torch.no_grad():
        int8 = Int8Weight.from_float(
            weight, stochastic_rounding=config.stochastic_rounding, int8_matmul=config.int8_matmul,
            compiled=config.compile,
        )
    return nn.Parameter(int8, requires_grad=weight.requires_grad)


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
    works on a model on the meta device (``to_empty`` then allocates int8 storage). A
    quantized layer stays quantized when ``load_state_dict(..., assign=True)`` assigns it
    a plain floating weight (accelerate's ``cpu_ram_efficient_loading`` does): the values
    are rounded to nearest into a new int8 weight. When it
    quantizes anything it also seeds the stochastic-rounding generator from
    ``config.seed`` and shard coordinate 0 (the same on every process: replicas of an
    unsharded model, as under DDP, round alike).

    It warns once, naming them, about layers it leaves in full precision that look like
    candidates: weights tied to a module that is not quantized (an ``nn.Embedding`` tied
    to the output head) and transformers' ``Conv1D`` layers (GPT-2). It logs the
    count of int8 weights and elements on the ``fsdp_int8`` logger at INFO.

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
    modules, tied = _untied_targets(model, config)
    for name, module in modules:
        weight = module.weight
        if isinstance(weight, Int8Weight):
            continue
        if id(weight) not in swapped:
            swapped[id(weight)] = int8_parameter(weight, config)
        targets.append((module, id(weight)))
    for module, key in targets:
        module.weight = swapped[key]
        module.register_load_state_dict_post_hook(
            _RequantizeAssigned(config.stochastic_rounding, config.int8_matmul, config.compile)
        )
    if swapped:  # a repeated call changes nothing, not even the generator
        # Not sharded yet: every process holds every row, one shard (mesh=None).
        seed_weight_rounding(config.seed)
    _warn_about_full_precision(model, tied)
    logger.info("quantize_: %s", int8_census(model))
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
