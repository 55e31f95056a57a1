"""int8 training in torchtitan, switched on through torchtitan's own extension points.

Install with ``pip install "fsdp_int8[torchtitan]"``; this module imports torchtitan, so
``import fsdp_int8`` never imports it. Verified against torchtitan 0.3.0.
:func:`enable_int8_training` switches a ``Trainer.Config`` to int8 with all the pieces
here; :func:`export_hf_state_dict` exports the trained model in Hugging Face's keys. What
works, and how: docs/integrations.md.
"""

from __future__ import annotations

import logging
import warnings
from dataclasses import dataclass, field, fields, replace
from typing import Any, Callable

import torch
import torch.nn as nn
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType
from torch.distributed.checkpoint.stateful import Stateful
from torchtitan.components.checkpointer import AsyncMode, CheckpointManager
from torchtitan.components.checkpointer.base import MODEL, ModelWrapper
from torchtitan.components.quantization import QuantizationConverter
from torchtitan.models.common.embedding import Embedding
from torchtitan.models.common.linear import Linear
from torchtitan.models.common.moe import GroupedExperts

from fsdp_int8 import _dist
from fsdp_int8._dist import local_shard
from fsdp_int8._quant.generators import seed_weight_rounding
from fsdp_int8._weight.census import int8_census
from fsdp_int8._weight.tensor import Int8Weight
from fsdp_int8.checkpoint import (
    CpuCopyStager, capture_generators, check_int8_entries, export_full_state_dict, restore_generators,
)
from fsdp_int8.config import Int8TrainingConfig, counts_experts
from fsdp_int8.gradients import enable_quantized_reduce_scatter
from fsdp_int8.integrations._torchtitan_modules import int8_class, is_int8_config
from fsdp_int8.integrations._torchtitan_optim import Int8OptimizersContainer, int8_optimizers_config

__all__ = [
    "Int8LinearConverter",
    "Int8CheckpointManager",
    "Int8OptimizersContainer",
    "int8_post_optimizer_build",
    "enable_int8_training",
    "export_hf_state_dict",
]

logger = logging.getLogger("fsdp_int8")


class Int8LinearConverter(QuantizationConverter):
    """torchtitan model-config converter: selected layers get int8 weights.

    Each selected ``Linear.Config`` (MoE ``GroupedExperts.Config``: 3-D weights, one scale
    per expert and output feature; with ``quantize_embeddings``, ``Embedding.Config``)
    becomes the config of an int8 subclass of the same module class, whose weight is an
    :class:`~fsdp_int8.Int8Weight` from construction on. torchtitan's ``parallelize_fn``
    then shards the int8 weights (FSDP2 all-gathers int8 rows and scales), and ``to_empty``
    plus torchtitan's ``init_states`` fill them. Layers are selected as
    :func:`fsdp_int8.quantize_` selects them (``training``'s ``module_filter``,
    ``skip_names`` and ``min_features``, given each layer's FQN), minus those whose FQN
    contains one of ``filter_fqns``; MoE routers and another converter's layers (float8)
    are left alone. Converting twice changes nothing; selecting nothing warns.

    Use it as torchtitan uses its float8 converter, with :func:`int8_post_optimizer_build`
    as the model spec's ``post_optimizer_build_fn`` (or call :func:`enable_int8_training`,
    which does both)::

        model_registry("debugmodel", converters=[Int8LinearConverter.Config(quantize_gradients=True)])

    Args:
        config: The converter's :class:`Int8LinearConverter.Config`.
    """

    @dataclass(kw_only=True, slots=True)
    class Config(QuantizationConverter.Config):
        """The converter's settings; ``build()`` gives the converter.

        Attributes:
            training: The :class:`fsdp_int8.Int8TrainingConfig` of the int8 layers: which
                layers, rounding, seed, matmuls, ``compile``.
            filter_fqns: Layers whose FQN contains any of these stay in full precision (as float8's).
            quantize_gradients: Replace FSDP2's gradient reduce-scatter with the int8 one
                (:func:`fsdp_int8.gradients.enable_quantized_reduce_scatter`), installed by
                :func:`int8_post_optimizer_build` once the model is sharded.
            lean: The lean-memory recipe as far as torchtitan's Trainer takes it: ``training``
                gets ``Int8TrainingConfig.lean()``'s int8 embeddings and int8 gathered
                weights (its other fields kept), and :func:`enable_int8_training` makes the
                optimizer's ``AdamW`` groups ``"Int8AdamW.lean"`` ones (8-bit states;
                :class:`Int8OptimizersContainer`). Not applied: the compute dtype
                (torchtitan's ``training.mixed_precision_param``, bf16 by default, decides)
                and ``Int8AdamW.lean``'s step inside backward with its ``max_grad_norm``
                (torchtitan's Trainer clips every gradient after backward: ``training.max_norm``).
            model_compile_enabled: torchtitan's own field, set by torchtitan.
        """

        training: Int8TrainingConfig = field(default_factory=Int8TrainingConfig)
        filter_fqns: list[str] = field(default_factory=list)
        quantize_gradients: bool = False
        lean: bool = False

    def _training(self) -> Int8TrainingConfig:
        """``training``, with the lean recipe's embeddings and gathered weights under ``lean``."""
        if not self.config.lean:
            return self.config.training
        lean = Int8TrainingConfig.lean()
        return replace(self.config.training, quantize_embeddings=lean.quantize_embeddings,
                       int8_gathered_weights=lean.int8_gathered_weights)

    def __init__(self, config: Config) -> None:
        self.config = config

    def _selects(self, fqn: str, module_config: Any, parent: Any) -> bool:
        if not issubclass(module_config._owner, (Linear, GroupedExperts, Embedding)):
            return False  # another converter's layer (float8): not ours to change
        if any(part in fqn for part in self.config.filter_fqns):
            return False
        with torch.device("meta"):  # the filter looks at a module: a free one
            probe = module_config.build()
        # a MoE router's gate (TokenChoiceTopKRouter.Config has num_experts) stays as it is
        return self._training().should_quantize(probe, fqn, router=counts_experts(parent))

    def convert(self, model_config: Any) -> Any:
        """Return ``model_config`` with every selected layer config made int8."""
        converted = []
        found = [found for kind in (Linear.Config, GroupedExperts.Config, Embedding.Config)
                 for found in model_config.traverse(kind)]
        for fqn, linear_config, parent, attr in found:
            if is_int8_config(linear_config) or not self._selects(fqn, linear_config, parent):
                continue
            int8_config = int8_class(linear_config._owner).Config(
                **{f.name: getattr(linear_config, f.name) for f in fields(linear_config) if f.init},
                _int8=self._training(),
                _quantize_gradients=self.config.quantize_gradients,
            )
            if parent is None:
                model_config = int8_config
            elif isinstance(parent, list):
                parent[attr] = int8_config
            else:
                setattr(parent, attr, int8_config)
            converted.append(fqn)
        if converted:
            logger.info("Int8LinearConverter: %d linear and experts layers get int8 weights", len(converted))
        elif not any(is_int8_config(c) for _, c, _, _ in model_config.traverse(Linear.Config)):
            warnings.warn(
                "Int8LinearConverter selected no linear layer: the model trains in full "
                "precision. Check Int8TrainingConfig's module_filter, skip_names and "
                "min_features, and filter_fqns.",
                stacklevel=2,
            )
        return model_config


def _trainings(model: nn.Module) -> list[Int8TrainingConfig]:
    return [m._fsdp_int8_training for m in model.modules() if hasattr(m, "_fsdp_int8_training")]


def int8_post_optimizer_build(optimizers: Any, model_parts: list[nn.Module], parallel_dims: Any) -> None:
    """torchtitan ``post_optimizer_build_fn``: finish what needs the sharded model.

    Set it on the model spec, or let :func:`enable_int8_training` do it. Seeds the weights'
    stochastic rounding from the converter's seed and this rank's shard coordinate (shards
    must draw different noise, replicas the same), installs the int8 gradient
    reduce-scatter when the converter's ``quantize_gradients`` is set, and logs how much of
    each model part is int8.

    Args:
        optimizers: torchtitan's optimizers (unused).
        model_parts: The sharded model parts.
        parallel_dims: torchtitan's ``ParallelDims`` (unused).

    Raises:
        RuntimeError: no model part has a layer built by :class:`Int8LinearConverter`.
        ValueError: the int8 layers were converted with different seeds.
    """
    trainings = [t for model in model_parts for t in _trainings(model)]
    if not trainings:
        raise RuntimeError(
            "int8_post_optimizer_build found no layer built by Int8LinearConverter: add "
            "Int8LinearConverter.Config() to the model's converters, e.g. "
            "model_registry(flavor, converters=[Int8LinearConverter.Config()]), or call "
            "fsdp_int8.integrations.torchtitan.enable_int8_training(trainer_config)."
        )
    seed = trainings[0].seed
    if any(t.seed != seed for t in trainings):
        raise ValueError("the int8 layers were converted with different seeds; use one converter")
    # One bank for the process: any part's mesh gives this rank's shard coordinate.
    seed_weight_rounding(seed, next(filter(None, map(_dist.mesh_of, model_parts)), None))
    for model in model_parts:
        if any(getattr(m, "_fsdp_int8_quantize_gradients", False) for m in model.modules()):
            enable_quantized_reduce_scatter(model, seed=seed)
        logger.info("torchtitan: %s", int8_census(model))


def _storage_address(tensor: torch.Tensor) -> int:
    local = local_shard(tensor)
    return (local.int_data if isinstance(local, Int8Weight) else local).untyped_storage().data_ptr()


class _Int8ModelWrapper(ModelWrapper):
    """torchtitan's ``ModelWrapper`` (a cached state dict), recognising an int8 weight by its int8 storage."""

    def state_dict(self) -> dict[str, Any]:
        for key, value in self._get_state_dict().items():
            cached = self.cached_state_dict.get(key)
            if cached is None or (cached.shape, cached.dtype) != (value.shape, value.dtype):
                self.cached_state_dict[key] = value
            elif _storage_address(cached) != _storage_address(value):
                # made by a state-dict hook (a fused QKV split): refresh the cached copy
                cached.copy_(value)
        return self.cached_state_dict


ROUNDING_STATES = "fsdp_int8_rounding"  # the checkpoint's key of the rounding generators


class _RoundingStreams(Stateful):
    """This rank's generator states under a key naming the layout and the rank: dcp keeps every
    rank's, and a run in another layout (its rows moved between ranks) finds none of its own."""

    def __init__(self, model_parts: list[nn.Module]) -> None:
        self._model = model_parts[0] if len(model_parts) == 1 else nn.ModuleList(model_parts)

    def state_dict(self) -> dict[str, Any]:
        state = capture_generators(self._model)
        return {f"{state['layout']}_rank{_dist.rank()}": state}

    def key(self) -> str:
        (key,) = self.state_dict()
        return key

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        restore_generators(state_dict[self.key()], self._model)


class Int8CheckpointManager(CheckpointManager):
    """torchtitan's ``CheckpointManager`` for models with int8 weights.

    Select it as the trainer's checkpoint component (``Trainer.Config.checkpoint =
    Int8CheckpointManager.Config(...)``); :func:`enable_int8_training` does it for you.
    Saves and loads through dcp as ``CheckpointManager`` does, int8 bytes and scales
    included, with a model wrapper that tells weights apart by their int8 storage
    (torchtitan's compares ``untyped_storage()``, which an ``Int8Weight`` refuses), plus
    each rank's stochastic-rounding generators (key ``fsdp_int8_rounding``): a run resumed
    in the same layout rounds exactly as the uninterrupted run. A checkpoint without them
    for this run's layout (another world size or mesh, or written by ``CheckpointManager``)
    loads the rest, and the rounding keeps the stream seeded at start-up.

    Args:
        config: Its :class:`Int8CheckpointManager.Config`.
        model_parts: The model parts; torchtitan's other keywords pass through.
    """

    @dataclass(kw_only=True, slots=True)
    class Config(CheckpointManager.Config):
        """torchtitan's ``CheckpointManager.Config``, with the same fields."""

    def __init__(self, config: Config, *, model_parts: list[nn.Module], **kwargs: Any) -> None:
        super().__init__(config, model_parts=model_parts, **kwargs)
        if self.enable:
            self.states[MODEL] = _Int8ModelWrapper(model_parts)
            self.states[ROUNDING_STATES] = _RoundingStreams(model_parts)

    def dcp_save(self, state_dict: dict[str, Any], checkpoint_id: str, async_mode: AsyncMode,
                 enable_garbage_collection: bool = False, to_hf: bool = False) -> Any:
        """torchtitan's save; its ``async`` and ``async_with_pinned_mem`` modes stage with
        :class:`fsdp_int8.checkpoint.CpuCopyStager` (dcp's default stager cannot copy an int8
        weight), then a thread or a checkpoint process writes, as torchtitan's would."""
        if async_mode == AsyncMode.DISABLED or to_hf:
            return super().dcp_save(state_dict, checkpoint_id, async_mode, enable_garbage_collection, to_hf)
        in_process = async_mode == AsyncMode.ASYNC_WITH_PINNED_MEM
        return dcp.async_save(
            state_dict, checkpoint_id=checkpoint_id, process_group=self.pg,
            async_checkpointer_type=AsyncCheckpointerType.PROCESS if in_process else AsyncCheckpointerType.THREAD,
            async_stager=CpuCopyStager(as_future=in_process),
        )

    def dcp_load(self, state_dict: dict[str, Any], checkpoint_id: str, from_hf: bool, from_quantized: bool) -> None:
        """torchtitan's load, after the checkpoint's int8 weights are read into copies and
        checked (dcp writes into the model's and optimizer's own tensors, so a refusal after
        it would come too late), and without the rounding generators where the checkpoint
        has none for this rank (dcp would refuse the missing key).

        Raises:
            Int8LoadError: on every rank, when any rank's shard of an int8 weight holds a
                NaN, infinite or negative scale or a value of -128; nothing is loaded.
        """
        if not from_hf:
            check_int8_entries(checkpoint_id, state_dict)
        streams = state_dict.get(ROUNDING_STATES)
        if streams is not None and not _holds_rounding_states(checkpoint_id, from_hf, streams.key()):
            logger.info("fsdp_int8: %s holds no rounding generators for %s; the rounding keeps "
                        "its start-up stream", checkpoint_id, streams.key())
            state_dict = {k: v for k, v in state_dict.items() if k != ROUNDING_STATES}
        super().dcp_load(state_dict, checkpoint_id, from_hf, from_quantized)


def _holds_rounding_states(checkpoint_id: str, from_hf: bool, key: str) -> bool:
    if from_hf:
        return False
    prefix = f"{ROUNDING_STATES}.{key}."
    saved = FileSystemReader(checkpoint_id).read_metadata().state_dict_metadata
    return any(key.startswith(prefix) for key in saved)


def _chain(first: Callable | None, then: Callable) -> Callable:
    if first is None or first is then:
        return then

    def both(optimizers: Any, model_parts: list[nn.Module], parallel_dims: Any) -> None:
        first(optimizers, model_parts, parallel_dims)
        then(optimizers, model_parts, parallel_dims)

    return both


def _int8_checkpoint_config(config: Any) -> Int8CheckpointManager.Config:
    if isinstance(config, Int8CheckpointManager.Config):
        return config
    if type(config) is not CheckpointManager.Config:
        raise TypeError(
            f"enable_int8_training cannot adapt a {type(config).__qualname__} checkpoint "
            "component: it replaces torchtitan's CheckpointManager.Config by "
            "Int8CheckpointManager.Config. Give your manager the int8-aware model wrapper "
            "(see Int8CheckpointManager) and leave the checkpoint config as it is."
        )
    values = {f.name: getattr(config, f.name) for f in fields(config) if f.init}
    return Int8CheckpointManager.Config(**values)


def enable_int8_training(trainer_config: Any, converter: Int8LinearConverter.Config | None = None) -> Any:
    """Switch a torchtitan ``Trainer.Config`` to int8 training, in place; returns it.

    Converts ``trainer_config.model_spec.model`` with :class:`Int8LinearConverter`, adds
    :func:`int8_post_optimizer_build` to the model spec's ``post_optimizer_build_fn``
    (after any it had), makes the checkpoint component an :class:`Int8CheckpointManager`
    and torchtitan's optimizer component an :class:`Int8OptimizersContainer` with the same
    settings (with the converter's ``lean``, its ``AdamW`` groups ``"Int8AdamW.lean"``,
    their ``lr``, ``betas``, ``eps`` and ``weight_decay`` kept).

    Args:
        trainer_config: torchtitan's ``Trainer.Config``, with its ``model_spec`` set.
        converter: The converter's settings; default ``Int8LinearConverter.Config()``.

    Raises:
        ValueError: the config has no ``model_spec`` yet.
        TypeError: its checkpoint component is neither torchtitan's ``CheckpointManager``
            nor :class:`Int8CheckpointManager`, or ``lean`` meets an optimizer component
            other than torchtitan's ``OptimizersContainer`` (checked before anything changes).

    Example::

        enable_int8_training(config, Int8LinearConverter.Config(training=Int8TrainingConfig(seed=1)))
    """
    spec = trainer_config.model_spec
    if spec is None:
        raise ValueError(
            "enable_int8_training needs trainer_config.model_spec (set by torchtitan's model "
            "registry, e.g. config.model_spec = model_registry('debugmodel'))"
        )
    converter = converter or Int8LinearConverter.Config()
    checkpoint = _int8_checkpoint_config(trainer_config.checkpoint)  # refuse before changing
    optimizer = int8_optimizers_config(trainer_config.optimizer, lean=converter.lean)
    spec.model = converter.build().convert(spec.model)
    spec.post_optimizer_build_fn = _chain(spec.post_optimizer_build_fn, int8_post_optimizer_build)
    trainer_config.checkpoint, trainer_config.optimizer = checkpoint, optimizer
    return trainer_config


def export_hf_state_dict(model: nn.Module, sd_adapter: Any, dtype: torch.dtype = torch.bfloat16) -> dict[str, Any]:
    """A torchtitan model's plain, full, dequantized state dict in Hugging Face's keys and
    layout, for ``save_pretrained`` or safetensors. Call on every rank.

    It is ``sd_adapter.to_hf`` of :func:`fsdp_int8.export_full_state_dict` (which gives
    torchtitan's own keys, the fused ``wqkv`` split into ``wq`` / ``wk`` / ``wv`` by
    torchtitan's state-dict hook).

    Args:
        model: A torchtitan model with int8 weights (:class:`Int8LinearConverter`, or
            ``quantize_`` / ``shard_model``), sharded or not.
        sd_adapter: torchtitan's state-dict adapter (``to_hf(state_dict)``), e.g.
            ``Llama3StateDictAdapter(model_config, None)`` or the trainer's ``sd_adapter``.
        dtype: Floating dtype of every floating entry.

    Returns:
        The state dict, on CPU, on rank 0; ``{}`` on the others.

    Example::

        state = export_hf_state_dict(model, Llama3StateDictAdapter(model_config, None))  # every rank
        if dist.get_rank() == 0:
            hf_model.load_state_dict(state)  # LlamaForCausalLM; or safetensors.torch.save_file
    """
    plain = export_full_state_dict(model, dtype)
    return sd_adapter.to_hf(plain) if _dist.rank() == 0 else {}
