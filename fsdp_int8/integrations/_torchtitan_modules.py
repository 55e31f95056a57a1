"""The int8 module classes :class:`~fsdp_int8.integrations.torchtitan.Int8LinearConverter`
puts in a torchtitan model config: a subclass of each converted module class (torchtitan's
``Linear`` classes, ``GroupedExperts``, ``Embedding``) whose weights are int8 from
``__init__`` on, made once per class (as torchtitan's LoRA makes its classes)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from torch import nn
from torch.distributed.tensor import DTensor
from torchtitan.models.common.moe import GroupedExperts

from fsdp_int8._dist import local_shard
from fsdp_int8._weight.grouped_experts import Int8TorchtitanExperts
from fsdp_int8._weight.tensor import Int8Weight
from fsdp_int8.config import Int8TrainingConfig, expert_weight_names
from fsdp_int8.convert import int8_parameter

# module class -> its int8 subclass
_INT8_CLASSES: dict[type, type] = {}


def int8_class(parent: type) -> type:
    """``parent`` (a torchtitan ``Linear`` class, ``GroupedExperts`` or ``Embedding``) whose
    weight (its 3-D expert weights) is int8 from ``__init__`` on."""
    if parent in _INT8_CLASSES:
        return _INT8_CLASSES[parent]

    bases = (Int8TorchtitanExperts, parent) if issubclass(parent, GroupedExperts) else (parent,)

    class Int8Module(*bases):  # type: ignore[valid-type, misc]
        @dataclass(kw_only=True, slots=True)
        class Config(parent.Config):  # type: ignore[misc, name-defined]
            # a leading underscore keeps it out of torchtitan's config dumps (to_dict)
            _int8: Int8TrainingConfig = field(default_factory=Int8TrainingConfig)
            _quantize_gradients: bool = False

        def __init__(self, config: Any) -> None:
            super().__init__(config)
            self._fsdp_int8_training = config._int8
            self._fsdp_int8_quantize_gradients = config._quantize_gradients
            for name in expert_weight_names(self) or ("weight",):
                setattr(self, name, int8_parameter(getattr(self, name), config._int8))

        def parallelize(self, parallel_dims: Any) -> None:
            """torchtitan's placement, then: an int8 expert weight cut by expert parallelism
            (whole experts per ep rank) is the whole weight FSDP2 shards on the efsdp mesh."""
            super().parallelize(parallel_dims)
            for name in expert_weight_names(self):
                param = getattr(self, name)
                local = local_shard(param)
                if isinstance(local, Int8Weight) and local.unsharded_rows != local.rows:
                    whole = local.with_tensors(local.int_data, local.scale, unsharded_rows=local.rows)
                    if isinstance(param, DTensor):
                        whole = DTensor.from_local(whole, param.device_mesh, param.placements, run_check=False,
                                                   shape=param.shape, stride=param.stride())
                    setattr(self, name, nn.Parameter(whole, requires_grad=param.requires_grad))

    Int8Module.__name__ = Int8Module.__qualname__ = f"Int8{parent.__name__}"
    _INT8_CLASSES[parent] = Int8Module
    return Int8Module


def is_int8_config(config: Any) -> bool:
    """Whether a module config builds one of the classes :func:`int8_class` made."""
    return config._owner in _INT8_CLASSES.values()
