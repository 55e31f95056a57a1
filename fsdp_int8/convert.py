"""``quantize_``: swap a model's eligible ``nn.Linear`` (and GPT-2 ``Conv1D``) weights and
mixture-of-experts weights for ``Int8Weight`` parameters."""

from __future__ import annotations

import logging
from typing import Any, Callable, NamedTuple

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

from fsdp_int8._dist import is_sharded, local_shard
from fsdp_int8._quant.generators import seed_weight_rounding
from fsdp_int8._quant.kernels import warn_on_failure
from fsdp_int8._weight.census import int8_census, warn_about_left_in_full_precision, warn_if_mostly_full_precision
from fsdp_int8._weight.conv1d import int8_conv1d_, why_not_convertible
from fsdp_int8._weight.embedding import why_not_quantizable as why_not_int8_embedding
from fsdp_int8._weight.load_checks import add_check_hook
from fsdp_int8._weight.pickle_layout import recorded_int8_matmul
from fsdp_int8._weight.tensor import Int8Weight
from fsdp_int8._weight.dbrx_experts import int8_dbrx_experts_
from fsdp_int8._weight.grouped_experts import int8_experts_, why_not_int8_experts
from fsdp_int8._weight.transposed_experts import transposed_value
from fsdp_int8.config import (
    OFF, ON, Int8TrainingConfig, expert_weight_names, is_conv1d, router_modules, training_config,
    transposed_expert_weights,
)
from fsdp_int8.guard import refuse_steps_on_replaced

__all__ = ["quantize_", "init_int8_weights_"]

# Called as hook(model, config) after quantize_ swapped weights of a model. The framework
# adapters sit above this module, so they register here instead of being imported:
# fsdp_int8.integrations adds the one that gives transformers models their quantizer (so
# save_pretrained writes int8 rows and scales), at `import fsdp_int8`.
AFTER_QUANTIZE: list[Callable[[nn.Module, Int8TrainingConfig], None]] = []


logger = logging.getLogger("fsdp_int8")


def parameter_owners(model: nn.Module) -> dict[int, list[str]]:
    """Every module name that registers each parameter, by ``id(parameter)``; a parameter
    with two owners is tied (``tie_word_embeddings``: the embedding and the output head)."""
    owners: dict[int, list[str]] = {}
    for name, module in model.named_modules(remove_duplicate=False):
        for param in module._parameters.values():
            if param is not None:
                owners.setdefault(id(param), []).append(name)
    return owners


def _adapter_layers(model: nn.Module) -> set[int]:
    """Ids of the modules of PEFT adapters (LoRA's ``lora_A`` / ``lora_B``, ...), as each
    peft tuner layer names them in ``adapter_layer_names`` (no peft import). They are the
    part that trains: never quantized, whatever their size or name."""
    found: set[int] = set()
    for module in model.modules():
        for attr in getattr(module, "adapter_layer_names", ()):
            holder = getattr(module, attr, None)
            if isinstance(holder, nn.Module):
                found.update(id(m) for m in holder.modules())
    return found


class _Targets(NamedTuple):
    """What :func:`_targets` found: the layers to quantize and those left alone, named."""

    layers: list[tuple[nn.Module, bool]]  # (module, is a Conv1D: its weight is transposed)
    experts: list[nn.Module]  # mixture-of-experts modules: their 3-D weights become int8
    tied: list[str]
    unsupported: list[str]


def _targets(model: nn.Module, config: Int8TrainingConfig) -> _Targets:
    """The modules to quantize, and the candidates left alone with the reason.

    A weight shared with a module that keeps it in full precision is left alone:
    quantizing it for one owner would untie it or give the other an int8 weight it cannot
    use. A selected embedding takes its tied ``nn.Linear`` heads along. A Conv1D's weight
    is left alone if anything else holds it: its int8 weight is the transpose.
    """
    selected: list[tuple[str, nn.Module, bool]] = []
    adapters = _adapter_layers(model)
    found = _Targets([], [], [], [])
    seen: set[int] = set()
    routers = router_modules(model)
    for name, module in model.named_modules(remove_duplicate=False):
        if id(module) in adapters:
            continue
        if not config.should_quantize(module, name, router=id(module) in routers):
            continue
        if expert_weight_names(module):
            problem = why_not_int8_experts(module)
            if problem is not None:
                found.unsupported.append(f"{name} ({problem})")
            elif id(module) not in seen:
                seen.add(id(module))
                found.experts.append(module)
            continue
        selected.append((name, module, is_conv1d(module)))
    target_names = {name for name, _, _ in selected}
    owners = parameter_owners(model)
    for name, module, transposed in selected:
        if id(module) in seen:  # one module under two names
            continue
        seen.add(id(module))
        holders = owners.get(id(module.weight), [])
        if transposed:
            others = [o for o in holders if model.get_submodule(o) is not module]
            problem = why_not_convertible(module)
        else:
            others = [o for o in holders if o not in target_names]
            problem = why_not_int8_embedding(module) if isinstance(module, nn.Embedding) else None
        if problem is not None:
            found.unsupported.append(f"{name} ({problem})")
            continue
        heads = [model.get_submodule(o) for o in others]
        if isinstance(module, nn.Embedding) and all(isinstance(h, nn.Linear) for h in heads):
            # an output head tied to the embedding follows it onto the int8 weight
            found.layers.extend((head, False) for head in heads if id(head) not in seen)
            seen.update(id(head) for head in heads)
            others = []
        if others and not isinstance(module.weight, Int8Weight):
            found.tied.append(f"{name} (tied to {', '.join(others)})")
        else:
            found.layers.append((module, transposed))
    return found


def recorded_compile(value: Any) -> Any:
    """``Int8TrainingConfig.compile`` as a file recorded it: 0.1.0's bool (a pickled load
    hook, a ``config.json``) reads as ``"on"`` / ``"off"``, anything else as it is. Only
    files go through this: a bool given in code is refused."""
    if isinstance(value, bool):
        return ON if value else OFF
    return value


class _RequantizeAssigned:
    """``load_state_dict`` post-hook of a quantized layer: keeps its weight int8.

    A plain floating weight that ``load_state_dict(..., assign=True)`` assigns (accelerate's
    ``cpu_ram_efficient_loading`` on every rank but the first) is rounded to nearest into a
    new ``Int8Weight``, sharded like it. A picklable object, not a closure: modules holding
    it still ``torch.save`` whole and ``copy.deepcopy``.
    """

    def __init__(
        self, stochastic_rounding: bool, int8_matmul, compiled: str = OFF, names: tuple[str, ...] = ("weight",),
        int8_gathered_weights: bool = False,
    ) -> None:
        self.stochastic_rounding = stochastic_rounding
        self.int8_matmul = int8_matmul
        self.int8_gathered_weights = int8_gathered_weights
        self.compiled = compiled  # Int8TrainingConfig.compile: "auto", "on" or "off"
        self.names = names  # the module's int8 parameters: "weight", or an experts module's

    def __setstate__(self, state: dict[str, Any]) -> None:
        # pickle layout 1 of this hook has no ``compiled`` field (its kernels ran eagerly),
        # layouts 1 and 2 no ``names`` (a layer's weight); 0.1.0's layouts hold a bool
        self.__dict__.update({"compiled": OFF, "names": ("weight",), "int8_gathered_weights": False, **state})
        self.compiled = recorded_compile(self.compiled)
        self.int8_matmul, gathered = recorded_int8_matmul(self.int8_matmul)
        self.int8_gathered_weights = self.int8_gathered_weights or gathered

    def __call__(self, module: nn.Module, incompatible_keys) -> None:
        for name in self.names:
            self._requantize(module, name)

    def _requantize(self, module: nn.Module, name: str) -> None:
        weight = module._parameters.get(name)
        if weight is None:
            return
        local = local_shard(weight)
        if isinstance(local, Int8Weight) or local.is_meta or not local.is_floating_point() or local.dim() not in (2, 3):
            return
        with torch.no_grad():
            int8 = Int8Weight.from_float(
                local.detach(), stochastic_rounding=self.stochastic_rounding,
                int8_matmul=self.int8_matmul, int8_gathered_weights=self.int8_gathered_weights,
                compiled=Int8TrainingConfig(compile=self.compiled).compiles(local.shape[-1]),
            )
            if isinstance(weight, DTensor):  # FSDP2 pads every shard to the whole weight's rows
                int8 = int8.with_tensors(int8.int_data, int8.scale, unsharded_rows=weight.shape[:-1].numel())
                int8 = DTensor.from_local(
                    int8, weight.device_mesh, weight.placements, run_check=False,
                    shape=weight.shape, stride=weight.stride(),
                )
        setattr(module, name, nn.Parameter(int8, requires_grad=weight.requires_grad))


# A whole quantized model pickles this hook with its layers: torch.load(weights_only=True)
# needs it allow-listed (building it runs nothing; it acts only inside load_state_dict).
torch.serialization.add_safe_globals([_RequantizeAssigned])


def int8_parameter(weight: torch.Tensor, config: Int8TrainingConfig) -> nn.Parameter:
    """``weight`` quantized (round to nearest) into a new parameter with ``config``'s
    rounding, matmuls and kernels, keeping ``requires_grad``."""
    if config.compile == ON:
        warn_on_failure()
    with torch.no_grad():
        int8 = Int8Weight.from_float(
            weight, stochastic_rounding=config.stochastic_rounding, int8_matmul=config.int8_matmul,
            int8_gathered_weights=config.int8_gathered_weights,
            compiled=config.compiles(weight.shape[-1]),
        )
    return nn.Parameter(int8, requires_grad=weight.requires_grad)


def _int8_parameter_over(weight: torch.Tensor, config: Int8TrainingConfig, blocks: int | None) -> nn.Parameter:
    """``weight`` as an int8 parameter, over its :func:`transposed_value` with ``blocks``
    (a Conv1D's ``[in, out]``, experts' ``[E, in, out]``, DBRX's ``w2``: one scale per
    output feature, rows FSDP2 can shard) or, with ``blocks`` ``None``, as it is."""
    if blocks is None:
        return int8_parameter(weight, config)
    with torch.no_grad():
        values = transposed_value(weight.detach(), blocks).contiguous()
    return int8_parameter(values, config).requires_grad_(weight.requires_grad)


def _keep_int8_on_load(module: nn.Module, config: Int8TrainingConfig, names: tuple[str, ...]) -> None:
    """The load hooks of a module whose parameters ``names`` became int8: entries are
    checked before ``load_state_dict`` copies them, and plain weights it assigns are
    rounded back to int8."""
    module.register_load_state_dict_post_hook(
        _RequantizeAssigned(config.stochastic_rounding, config.int8_matmul, config.compile, names,
                            config.int8_gathered_weights)
    )
    add_check_hook(module)


def quantize_(model: nn.Module, config: Int8TrainingConfig | None = None) -> nn.Module:
    """Swap the weights of ``model`` that ``config`` selects for int8 weights, in place.

    For one process or DDP; with FSDP2 use :func:`fsdp_int8.shard_model`, which calls it.
    Each ``nn.Linear`` (and mixture-of-experts weight) that
    :meth:`Int8TrainingConfig.should_quantize` accepts gets an ``nn.Parameter`` holding an
    ``Int8Weight``, rounded to nearest from its current values, with the same outer dtype
    and ``requires_grad`` and ``config``'s rounding, ``int8_matmul`` and ``compile``.
    Transformers' ``Conv1D`` layers (GPT-2; weight ``[in, out]``) become ``Int8Conv1D``
    modules in place: ``nn.Linear``s over the ``[out, in]`` int8 transpose with GPT-2's
    state-dict keys, so ``load_state_dict`` of a GPT-2 state dict works and
    ``export_full_state_dict`` writes one. Expert weights become 3-D int8 weights, one
    scale per expert and output feature; routers stay in full precision. PEFT adapter
    layers (the modules a peft tuner layer names in ``adapter_layer_names``, such as
    LoRA's ``lora_A`` / ``lora_B``) are never quantized.

    Idempotent (``Int8Weight``s are left alone), keeps tied weights tied, and works on the
    meta device (``to_empty`` then allocates int8 storage). A quantized layer stays
    quantized when ``load_state_dict(..., assign=True)`` assigns it a plain floating weight
    (accelerate's ``cpu_ram_efficient_loading`` does): it is rounded to nearest into a new
    int8 weight. A ``transformers.PreTrainedModel`` also gets fsdp_int8's transformers
    quantizer (:func:`fsdp_int8.integrations.hf_quantizer.attach_hf_quantizer`), so that
    ``save_pretrained``, ``Trainer`` checkpoints and ``from_pretrained`` keep its int8 rows
    and scales. Build the optimizer afterwards: an optimizer holding a replaced parameter
    raises ``RuntimeError`` at its first ``step()``.

    When it quantizes anything it seeds the stochastic-rounding generator from
    ``config.seed`` and shard coordinate 0 on every process, so DDP replicas round alike
    (a model sharded afterwards by ``fully_shard`` by hand reseeds at its first all-gather:
    docs/design.md); a call that changes nothing does not reseed. It warns once, naming
    them, about candidate layers it leaves in full precision (weights tied to a module that
    is not quantized, ``Conv1D`` layers whose weight another module shares or whose
    ``forward`` was replaced on the instance, embeddings with ``max_norm`` or sparse
    gradients, experts stored transposed), logs the count of int8 weights (``fsdp_int8``
    logger, INFO), and warns when less than half of the parameter elements are int8,
    naming the largest full-precision parameters.

    Args:
        model: The model, before any ``fully_shard``.
        config: Which layers and how; default ``Int8TrainingConfig()``.

    Returns:
        ``model`` itself.

    Raises:
        RuntimeError: when the model is already sharded (FSDP2 or DTensor parameters).
        TypeError: when ``config`` is not an ``Int8TrainingConfig``.
        ValueError: when a weight to quantize holds NaN or Inf or has 0 input features
            (nothing is swapped then: every int8 weight is built before the first swap).

    Example:
        ::

            model = fsdp_int8.quantize_(MyModel(), fsdp_int8.Int8TrainingConfig(compile="on"))
            model = torch.nn.parallel.DistributedDataParallel(model)  # replicas stay bit-identical
    """
    config = training_config(config)
    if is_sharded(model):
        raise RuntimeError(
            "quantize_ got a model that is already sharded (fully_shard or DTensor parameters). "
            "Quantize first, then shard: use fsdp_int8.shard_model(model), which does both."
        )
    # Build every int8 weight first, then swap: a layer that cannot be quantized raises
    # before the model has changed.
    original = list(model.parameters())  # an optimizer holding one of these is refused once replaced
    swapped: dict[int, nn.Parameter] = {}  # tied weights stay tied
    targets: list[tuple[nn.Module, int, bool]] = []
    found = _targets(model, config)
    for module, transposed in found.layers:
        weight = module.weight
        if isinstance(weight, Int8Weight):
            continue
        if id(weight) not in swapped:
            swapped[id(weight)] = _int8_parameter_over(weight, config, 1 if transposed else None)
        targets.append((module, id(weight), transposed))
    experts: list[tuple[nn.Module, dict[str, nn.Parameter], dict[str, int]]] = []
    for module in found.experts:
        blocks = transposed_expert_weights(module)
        weights = {
            name: _int8_parameter_over(param, config, blocks.get(name)) for name in expert_weight_names(module)
            if not isinstance(param := module._parameters[name], Int8Weight)
        }
        if weights:
            experts.append((module, weights, blocks))
    for module, key, transposed in targets:
        if transposed:  # GPT-2's Conv1D becomes an nn.Linear over the transpose, in place
            int8_conv1d_(module, swapped[key])
        else:
            module.weight = swapped[key]
        _keep_int8_on_load(module, config, ("weight",))
    for module, weights, blocks in experts:
        # [E, in, out] experts (DBRX's w2) hold their transpose; the class computes through int8_grouped_mm
        int8_experts_(module, {n: w for n, w in weights.items() if n in blocks}, blocks)
        for name, weight in weights.items():
            if name not in blocks:
                setattr(module, name, weight)
            swapped[id(weight)] = weight
        _keep_int8_on_load(module, config, tuple(weights))
    int8_dbrx_experts_(model)
    if swapped:  # a repeated call changes nothing, not even the generator
        add_check_hook(model)  # ... and all of the model's at once: a refused load changes nothing
        # Not sharded yet: every process holds every row, one shard (mesh=None).
        seed_weight_rounding(config.seed)
        refuse_steps_on_replaced(original, model, "quantize_")
        for hook in AFTER_QUANTIZE:
            hook(model, config)
    warn_about_left_in_full_precision(found.tied, found.unsupported)
    census = int8_census(model)
    logger.info("quantize_: %s", census)
    warn_if_mostly_full_precision(model, census)
    return model


def init_int8_weights_(
    model: nn.Module, init_fn: Callable[[str, torch.Tensor], object]
) -> nn.Module:
    """Initialise every int8 weight of ``model`` through a float tensor, rounding to nearest.

    For each parameter whose (local) tensor is an ``Int8Weight`` it makes an fp32 zero
    tensor like the parameter (a DTensor with the same sharding on a sharded model), has
    ``init_fn`` fill it and copies it into the weight; other parameters are not touched.
    Single-op initialisers (``uniform_``, ``normal_``, ``kaiming_uniform_``, a module's
    ``reset_parameters``) work on int8 weights directly; multi-step ones such as
    ``nn.init.trunc_normal_`` would requantize between their steps: run them here. Works
    before and after sharding.

    Args:
        model: A quantized (possibly sharded) model.
        init_fn: ``init_fn(name, values)`` fills the fp32 tensor ``values`` in place; its
            return value is ignored.

    Returns:
        ``model``.

    Example:
        ::

            fsdp_int8.init_int8_weights_(model, lambda name, w: torch.nn.init.trunc_normal_(w, std=0.02))
    """
    for name, param in model.named_parameters():
        if not isinstance(local_shard(param), Int8Weight):
            continue
        values = torch.zeros_like(param, dtype=torch.float32)  # plain (sharded like param)
        with torch.no_grad():
            init_fn(name, values)
            param.copy_(values)
    return model
