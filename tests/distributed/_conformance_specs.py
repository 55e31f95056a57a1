"""``SubclassSpec``s of the weights the conformance suite is run on (module-level: the
spawned ranks unpickle them by name).

* ``INT8_WEIGHT``: :class:`fsdp_int8.Int8Weight` as it trains by default (stochastic
  rounding of updates), through its public API only.
* ``BF16_REFERENCE`` and the ``BROKEN_*`` mutations: the reference subclass of
  ``_reference_subclass``.
* :func:`torchao_spec`: torchao's ``Int8QuantizedTrainingLinearWeight`` (optional).
"""

from __future__ import annotations

import torch

from fsdp_int8 import Int8Weight
from fsdp_int8.testing import SubclassSpec

from _reference_subclass import (
    BF16WireWeight, BrokenOutWeight, BrokenViewWeight, BrokenWireWeight,
)

INT8_ROUNDING_STEP = 1 / 127  # one int8 step of a row scaled by its absmax
BF16_ROUNDING_STEP = 2 ** -7  # bf16 keeps 8 significant bits: one ulp <= 2^-7 of a value


def int8_wire_bytes(shape: torch.Size) -> float:
    """One int8 byte per element plus one fp32 scale per row of ``shape[1]`` elements."""
    return 1 + 4 / shape[1]


def int8_weight_to_float(weight: torch.Tensor) -> torch.Tensor:
    return weight.dequantize(torch.float32)


INT8_WEIGHT = SubclassSpec(
    name="fsdp_int8.Int8Weight",
    from_float=Int8Weight.from_float,
    to_float=int8_weight_to_float,
    wire_bytes_per_element=int8_wire_bytes,
    rounding_step=INT8_ROUNDING_STEP,
)


def bf16_to_float(weight: torch.Tensor) -> torch.Tensor:
    return weight.values()


def _bf16_spec(name: str, cls: type) -> SubclassSpec:
    return SubclassSpec(name=name, from_float=cls.from_float, to_float=bf16_to_float,
                        wire_bytes_per_element=2.0, rounding_step=BF16_ROUNDING_STEP)


BF16_REFERENCE = _bf16_spec("BF16WireWeight (reference)", BF16WireWeight)
BROKEN_OUT = _bf16_spec("BrokenOutWeight", BrokenOutWeight)
BROKEN_VIEW = _bf16_spec("BrokenViewWeight", BrokenViewWeight)
BROKEN_WIRE = _bf16_spec("BrokenWireWeight", BrokenWireWeight)


# ---------------------------------------------------------------- torchao (optional)
def torchao_from_float(tensor: torch.Tensor) -> torch.Tensor:
    from torchao.prototype.quantized_training.int8 import Int8QuantizedTrainingLinearWeight

    return Int8QuantizedTrainingLinearWeight.from_float(tensor)


def torchao_to_float(weight: torch.Tensor) -> torch.Tensor:
    return weight.dequantize()


def torchao_spec() -> SubclassSpec:
    """torchao 0.18's int8 training weight: int8 data plus one scale per row (in the
    weight's dtype, fp32 here); every in-place update rounds stochastically."""
    import torchao

    return SubclassSpec(
        name=f"torchao {torchao.__version__} Int8QuantizedTrainingLinearWeight",
        from_float=torchao_from_float,
        to_float=torchao_to_float,
        wire_bytes_per_element=int8_wire_bytes,
        rounding_step=INT8_ROUNDING_STEP,
    )
