"""fsdp_int8 as a transformers quantization method: int8 weights in safetensors.

Importing this module registers the method ``"fsdp_int8"`` with transformers (in a new
process ``import fsdp_int8`` suffices for transformers to find it):
``from_pretrained(path, quantization_config=Int8TrainingHfConfig())`` quantizes while
loading, ``save_pretrained`` writes int8 rows with fp32 scales
(:func:`int8_safetensors_state_dict`; experts one pair per expert and projection, in the
model family's keys) and records the method in ``config.json``, and ``from_pretrained`` of
the folder restores them exactly. :func:`fsdp_int8.quantize_` and
``shard_model`` give every transformers model they quantize this quantizer
(:func:`attach_hf_quantizer`), so it saves int8 with no call of its own;
``model.state_dict()`` keeps ``Int8Weight`` values. Verified with transformers 5.23.0 (its
``HfQuantizer`` protocol changed within 5.x); the layout and what works: docs/integrations.md.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.nn as nn
from transformers import PreTrainedModel
from transformers.core_model_loading import ConversionOps
from transformers.quantizers import HfQuantizer, register_quantization_config, register_quantizer
from transformers.quantizers.auto import AUTO_QUANTIZATION_CONFIG_MAPPING, AUTO_QUANTIZER_MAPPING
from transformers.quantizers.quantizers_utils import get_module_from_name, should_convert_module
from transformers.utils.quantization_config import QuantizationConfigMixin

from fsdp_int8._weight.pickle_layout import recorded_int8_matmul
from fsdp_int8._weight.tensor import Int8Weight
from fsdp_int8.config import Int8MatmulConfig, Int8TrainingConfig, expert_weight_names, training_config
from fsdp_int8.convert import parameter_owners, quantize_, recorded_compile
from fsdp_int8.integrations._hf_conversions import (
    QuantizeOnLoad as _QuantizeOnLoad, add_scale_conversions, check_tied_copy, checked_rows, int8_conversions,
    int8_layers_in_checkpoint,
)
from fsdp_int8.integrations._hf_layout import (
    QUANT_METHOD, SCALE_SUFFIX, add_load_hooks, int8_parameter_names, int8_safetensors_state_dict, is_int8,
    save_pretrained_argument, state_dict_from_int8_safetensors, tied_and_fp32_modules, without_tied_copies,
)

__all__ = [
    "QUANT_METHOD", "SCALE_SUFFIX", "Int8TrainingHfConfig", "Int8TrainingHfQuantizer", "attach_hf_quantizer",
    "int8_safetensors_state_dict", "state_dict_from_int8_safetensors",
]

_FORMAT_VERSION = 2  # written; 1 ([out, in] int8 rows) is still read
_READ_VERSIONS = (1, 2)
_loading = False  # True while the quantizer runs quantize_ on a model transformers is loading


class Int8TrainingHfConfig(QuantizationConfigMixin):
    """The ``quantization_config`` of fsdp_int8 for transformers: what ``config.json`` records.

    Every field is JSON (``quant_method`` is ``"fsdp_int8"``). Loading an int8 folder needs no
    config; ``from_pretrained(name, quantization_config=Int8TrainingHfConfig(seed=1))`` quantizes.

    Args:
        stochastic_rounding: As in :class:`fsdp_int8.Int8TrainingConfig`.
        seed: As in :class:`fsdp_int8.Int8TrainingConfig`.
        skip_names: As in :class:`fsdp_int8.Int8TrainingConfig`.
        min_features: As in :class:`fsdp_int8.Int8TrainingConfig`.
        modules_to_not_convert: More linear layers to keep in full precision, matched as
            transformers' quantizers match them (a name, a prefix up to a ``.``, a suffix such
            as ``"lm_head"``, or a regex); :meth:`from_training_config` lists a ``module_filter``'s here.
        int8_matmul: The fields of :class:`fsdp_int8.Int8MatmulConfig` as a dict
            (``{"output": True, ...}``), or ``None`` for weight-only int8.
        int8_gathered_weights: As in :class:`fsdp_int8.Int8TrainingConfig`.
        compile: As in :class:`fsdp_int8.Int8TrainingConfig`.
        quantize_embeddings: As in :class:`fsdp_int8.Int8TrainingConfig`.
        format_version: The file layout: ``2`` (written) has ``weight`` int8 ``[out * in]``, the
            rows flat so that loaders without this method refuse them; ``1`` (read) has
            ``[out, in]``; both have ``weight_scale`` fp32 ``[out]``.

    Raises:
        TypeError: an unknown field.
        ValueError: another ``format_version``, or a value ``Int8TrainingConfig`` refuses.
    """

    def __init__(
        self,
        stochastic_rounding: bool = True,
        seed: int = 0,
        skip_names: list[str] | tuple[str, ...] = Int8TrainingConfig.skip_names,
        min_features: int = Int8TrainingConfig.min_features,
        modules_to_not_convert: list[str] | None = None,
        int8_matmul: dict[str, bool] | None = None,
        int8_gathered_weights: bool = False,
        compile: str = Int8TrainingConfig.compile,
        quantize_embeddings: bool = False,
        format_version: int = _FORMAT_VERSION,
        **kwargs: Any,
    ) -> None:
        kwargs.pop("quant_method", None)  # from_dict of a config.json passes it back in
        if kwargs:
            raise TypeError(f"Int8TrainingHfConfig got unknown fields {sorted(kwargs)}")
        if format_version not in _READ_VERSIONS:
            raise ValueError(
                f"this fsdp_int8 reads format_version {' and '.join(map(str, _READ_VERSIONS))} of int8 "
                f"checkpoints, the checkpoint has {format_version}: upgrade fsdp_int8"
            )
        self.quant_method = QUANT_METHOD
        self.format_version = format_version
        self.stochastic_rounding = bool(stochastic_rounding)
        self.seed = int(seed)
        self.skip_names = list(skip_names)
        self.min_features = int(min_features)
        self.modules_to_not_convert = None if modules_to_not_convert is None else list(modules_to_not_convert)
        matmul, gathered = recorded_int8_matmul(int8_matmul)
        self.int8_matmul = None if matmul is None else dataclasses.asdict(matmul)
        self.int8_gathered_weights = bool(int8_gathered_weights) or gathered
        self.compile = compile  # "auto", "on" or "off": to_training_config checks it
        self.quantize_embeddings = bool(quantize_embeddings)
        self.to_training_config()  # validates the fields now, not at load time

    @classmethod
    def from_dict(cls, config_dict: dict[str, Any], return_unused_kwargs: bool = False, **kwargs: Any) -> Any:
        """transformers' reader of ``config.json`` (0.1.0's bool ``compile`` reads as ``"on"`` / ``"off"``)."""
        compile = recorded_compile(config_dict.get("compile", Int8TrainingConfig.compile))
        return super().from_dict({**config_dict, "compile": compile}, return_unused_kwargs, **kwargs)

    @classmethod
    def from_training_config(
        cls, config: Int8TrainingConfig | None = None, model: nn.Module | None = None
    ) -> "Int8TrainingHfConfig":
        """The JSON form of ``config`` (default ``Int8TrainingConfig()``). A ``module_filter``
        has none: ``model`` (already quantized) must then be given (else ``ValueError``), and
        the layers it left in full precision are listed in ``modules_to_not_convert``."""
        config = training_config(config)
        kept = None
        if config.module_filter is not None:
            if model is None:
                raise ValueError("a module_filter has no JSON form: pass the quantized model to list what it kept")
            candidates = (nn.Linear, nn.Embedding) if config.quantize_embeddings else nn.Linear
            kept = [n for n, m in model.named_modules()
                    if not is_int8(m) and (isinstance(m, candidates) or expert_weight_names(m))]
        return cls(
            stochastic_rounding=config.stochastic_rounding, seed=config.seed,
            skip_names=config.skip_names, min_features=config.min_features, modules_to_not_convert=kept,
            int8_matmul=None if config.int8_matmul is None else dataclasses.asdict(config.int8_matmul),
            int8_gathered_weights=config.int8_gathered_weights,
            compile=config.compile, quantize_embeddings=config.quantize_embeddings,
        )

    def to_training_config(self, more_to_not_convert: list[str] | tuple[str, ...] = ()) -> Int8TrainingConfig:
        """The :class:`fsdp_int8.Int8TrainingConfig` of these fields; ``more_to_not_convert`` adds modules to keep."""
        excluded = [*(self.modules_to_not_convert or ()), *more_to_not_convert]
        return Int8TrainingConfig(
            stochastic_rounding=self.stochastic_rounding, seed=self.seed,
            module_filter=(
                _NotConverted(excluded, tuple(self.skip_names), self.min_features, self.quantize_embeddings)
                if excluded else None
            ),
            skip_names=tuple(self.skip_names), min_features=self.min_features,
            int8_matmul=None if self.int8_matmul is None else Int8MatmulConfig(**self.int8_matmul),
            int8_gathered_weights=self.int8_gathered_weights,
            compile=self.compile, quantize_embeddings=self.quantize_embeddings,
        )


class _NotConverted:
    """``module_filter``: the default rule minus the modules ``patterns`` name (picklable)."""

    def __init__(self, patterns: list[str], skip_names: tuple[str, ...], min_features: int,
                 quantize_embeddings: bool = False) -> None:
        self.patterns = patterns
        self.default = Int8TrainingConfig(skip_names=skip_names, min_features=min_features,
                                          quantize_embeddings=quantize_embeddings)

    def __call__(self, module: nn.Module, name: str) -> bool:
        return should_convert_module(name, self.patterns) and self.default.selects_by_default(module, name)


class _OnlyThese:
    """``module_filter`` of an int8 checkpoint: exactly the layers it holds scales for."""

    def __init__(self, names: set[str]) -> None:
        self.names = names

    def __call__(self, module: nn.Module, name: str) -> bool:
        return name in self.names


class Int8TrainingHfQuantizer(HfQuantizer):
    """The ``HfQuantizer`` of ``"fsdp_int8"``: loads, quantizes and saves int8 weights.

    Not built by hand: it is ``model.hf_quantizer`` after loading, ``quantize_`` or
    :func:`attach_hf_quantizer`. Before the weights load it runs ``quantize_`` on the meta
    model (the config's rule, or exactly the layers the files hold scales for; none: the
    plain model). It rounds a full-precision checkpoint to nearest one weight at a time as
    read, and puts an int8 one's rows and scales into ``Int8Weight`` parameters. ``Trainer``
    trains the model as it is (no adapters needed).

    Args:
        quantization_config: The model's :class:`Int8TrainingHfConfig`.
    """

    requires_calibration = False
    # a model's own weight converters (fused projections) carry the scales along
    serialized_names = {"weight": ["weight", "weight" + SCALE_SUFFIX]}

    def __init__(self, quantization_config: Int8TrainingHfConfig, **kwargs: Any) -> None:
        super().__init__(quantization_config, **kwargs)
        self._placeholders: dict[tuple[str, str], Int8Weight] = {}  # (module, int8 param) -> meta weight
        self._files: dict[str, str] = {}  # module with int8 parameters -> a file holding them, while loading
        self._checkpoint_files: list[str] = []
        self._plain_checkpoint = False

    @property
    def quantized_element_size(self) -> float:
        return 1.0

    @property
    def is_trainable(self) -> bool:
        return True

    @property
    def is_qat_trainable(self) -> bool:
        return True

    def is_serializable(self) -> bool:
        return True

    def get_quantize_ops(self) -> ConversionOps:
        return _QuantizeOnLoad(self)

    def update_weight_conversions(self, weight_conversions: list, model: PreTrainedModel) -> list:
        """The model's conversions, made to carry an int8 folder's scales with its rows (:func:`int8_conversions`)."""
        if not self._placeholders or self.quantization_config.format_version < 2:
            return super().update_weight_conversions(weight_conversions, model)
        int8 = {f"{module}.{name}": tuple(w.shape) for (module, name), w in self._placeholders.items()}
        converted = int8_conversions(weight_conversions, int8, model_name=type(model).__name__, loading=True)
        return converted + self.get_weight_conversions()

    def param_needs_quantization(self, model: PreTrainedModel, param_name: str, **kwargs: Any) -> bool:
        """Whether ``param_name`` is int8 and read from a full-precision checkpoint."""
        module, name = get_module_from_name(model, param_name)
        return not self.pre_quantized and name in int8_parameter_names(module)

    def _process_model_before_weight_loading(
        self, model: PreTrainedModel, checkpoint_files: list[str] | None = None, **kwargs: Any
    ) -> None:
        keep_embeddings = self.quantization_config.quantize_embeddings
        config = self.quantization_config.to_training_config(tied_and_fp32_modules(model, keep_embeddings))
        names = None
        if self.pre_quantized:
            names = int8_layers_in_checkpoint(model, checkpoint_files)
            self._files, self._checkpoint_files = dict(names or {}), [str(f) for f in checkpoint_files or ()]
            if names is not None:
                if not names:  # a full-precision export: load what it holds
                    self._plain_checkpoint = True
                    return
                config = dataclasses.replace(config, module_filter=_OnlyThese(names))
        global _loading
        _loading = True  # transformers attaches this quantizer itself: quantize_'s hook must not
        try:
            quantize_(model, config)  # on the meta device: int8 metadata, hooks, the rounding seed
        finally:
            _loading = False
        if self.pre_quantized:
            if names is not None:
                missed = sorted(n for n in names if not is_int8(model.get_submodule(n)))
                if missed:
                    raise ValueError(f"the checkpoint holds int8 rows for layers quantize_ cannot make int8: {missed}")
            self._add_placeholders(model)

    def _add_placeholders(self, model: PreTrainedModel) -> None:
        """Each int8 parameter ``<p>``: an int8 tensor of the checkpoint's shape, and ``<p>_scale``."""
        for name, module in model.named_modules():
            for param_name in int8_parameter_names(module):
                weight = module._parameters[param_name]
                self._placeholders[(name, param_name)] = weight
                scale = torch.empty(weight.shape[:-1], dtype=torch.float32, device="meta")
                module.register_parameter(param_name + SCALE_SUFFIX, nn.Parameter(scale, requires_grad=False))
                if self.quantization_config.format_version >= 2:  # rows flat per leading index on disk
                    rows = torch.empty(*weight.shape[:-2], weight.shape[-2:].numel(), dtype=torch.int8, device="meta")
                    setattr(module, param_name, nn.Parameter(rows, requires_grad=False))

    def postprocess_model(self, model: PreTrainedModel, **kwargs: Any) -> PreTrainedModel:
        """transformers' step after loading; a folder without int8 entries gives the plain model."""
        if self._plain_checkpoint:
            self.remove_quantization_config(model)
            return model
        return super().postprocess_model(model, **kwargs)

    def _process_model_after_weight_loading(self, model: PreTrainedModel, **kwargs: Any) -> PreTrainedModel:
        # transformers has tied the weights by now: every holder of a loaded int8 tensor (an
        # output head tied to an int8 embedding) gets the Int8Weight made of it
        owners = parameter_owners(model)
        made: dict[int, str] = {}  # each Int8Weight made here -> its entry
        for (name, param_name), placeholder in self._placeholders.items():
            module = model.get_submodule(name)
            scale = module._parameters.pop(param_name + SCALE_SUFFIX)
            data = module._parameters[param_name]
            key = f"{name}.{param_name}"
            if id(data) in made:  # tied to an entry made above: its own scales must be that one's
                check_tied_copy(key, scale.detach(), data, made[id(data)], self._files.get(name))
                continue
            if data.dtype != torch.int8 or data.is_meta or scale.is_meta:
                raise ValueError(f"{key}: the checkpoint has no int8 rows with scales for this weight")
            # finite, non-negative scales and int8 values in -127..127, before the model is returned
            rows = checked_rows(model, key, data.detach(), scale.detach(), shape=tuple(placeholder.shape),
                                source=self._files.get(name), files=self._checkpoint_files)
            weight = nn.Parameter(placeholder.with_tensors(rows.to(scale.device), scale.detach().float()))
            made[id(weight)] = key
            for owner in owners.get(id(data), [name]):
                setattr(model.get_submodule(owner), param_name, weight)
        self._placeholders, self._files, self._checkpoint_files = {}, {}, []
        self.quantization_config.format_version = _FORMAT_VERSION  # what its next save writes
        add_load_hooks(model)
        return model

    def get_state_dict_and_metadata(self, model: PreTrainedModel) -> tuple[dict[str, Any], dict[str, str]]:
        """What ``save_pretrained`` writes: :func:`int8_safetensors_state_dict` of its state dict."""
        given = save_pretrained_argument("state_dict")
        state = int8_safetensors_state_dict(model.state_dict() if given is None else without_tied_copies(given, model))
        if save_pretrained_argument("save_original_format", True):
            add_scale_conversions(model, state)  # or refuses, before anything is written
        return state, {}


def attach_hf_quantizer(model: PreTrainedModel, config: Int8TrainingConfig | None = None) -> PreTrainedModel:
    """Give a transformers model with int8 weights the fsdp_int8 quantizer.

    Afterwards the model behaves as one loaded with ``quantization_config=Int8TrainingHfConfig()``:
    ``save_pretrained`` (so ``Trainer.save_model`` and every Trainer checkpoint) writes int8
    rows with scales, ``config.json`` records the method, and each int8 layer's
    ``load_state_dict`` takes those entries (``Trainer``'s ``resume_from_checkpoint``).
    ``quantize_`` and ``shard_model`` call it for every transformers model they quantize:
    call it only for a model made int8 otherwise (by hand, or unpickled from an earlier
    fsdp_int8). A repeated call only adds the load hooks of newly quantized layers.

    Args:
        model: A transformers model with int8 weights.
        config: The config ``quantize_`` used (recorded in ``config.json``; default
            ``Int8TrainingConfig()``).

    Returns:
        ``model``.

    Raises:
        TypeError: ``model`` is not a ``transformers.PreTrainedModel``.
        ValueError: it has no int8 weight, or another quantization method.
    """
    if not isinstance(model, PreTrainedModel):
        raise TypeError(f"attach_hf_quantizer needs a transformers PreTrainedModel, got {type(model).__name__}")
    if not any(is_int8(m) for m in model.modules()):
        raise ValueError("the model has no int8 weights: call fsdp_int8.quantize_(model) first")
    current = getattr(model, "hf_quantizer", None)
    if current is not None and not isinstance(current, Int8TrainingHfQuantizer):
        raise ValueError(f"the model is already quantized with {current.quantization_config.quant_method}")
    if current is None:
        hf_config = Int8TrainingHfConfig.from_training_config(config, model)
        model.hf_quantizer = Int8TrainingHfQuantizer(hf_config, pre_quantized=False)
        model.is_quantized = True
        model.quantization_method = QUANT_METHOD
        model.config.quantization_config = hf_config
        for module in model.modules():  # as transformers marks a model it quantized
            if isinstance(module, PreTrainedModel):
                module.config._is_quantized = True
    add_load_hooks(model)
    return model


def attach_after_quantize(model: nn.Module, config: Int8TrainingConfig) -> None:
    """``quantize_``'s hook: :func:`attach_hf_quantizer`, unless transformers is loading the
    model with this quantizer (it attaches it then)."""
    if isinstance(model, PreTrainedModel) and not _loading:
        attach_hf_quantizer(model, config)


def _register() -> None:
    """Register the method once per process (a re-import replaces only its own classes)."""
    for mapping, cls, register in (
        (AUTO_QUANTIZATION_CONFIG_MAPPING, Int8TrainingHfConfig, register_quantization_config),
        (AUTO_QUANTIZER_MAPPING, Int8TrainingHfQuantizer, register_quantizer),
    ):
        known = mapping.get(QUANT_METHOD)
        if known is None:
            register(QUANT_METHOD)(cls)
        elif getattr(type(known), "stands_in_for_fsdp_int8", False):  # import fsdp_int8's placeholder
            mapping[QUANT_METHOD] = cls
        elif known.__qualname__ == cls.__qualname__ and known.__module__ == cls.__module__:
            mapping[QUANT_METHOD] = cls
        elif known is not cls:
            raise RuntimeError(f"transformers already has a quantization method {QUANT_METHOD!r}: {known}")


_register()
