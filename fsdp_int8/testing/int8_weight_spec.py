"""The :class:`SubclassSpec` of this package's own ``Int8Weight``, and the int8 numbers it uses.

Our conformance tests and ``benchmarks.conformance_table`` both run the suite on
``Int8Weight``; its spec lives here, next to the suite, so that neither has to import the
other. Module-level: the spawned ranks unpickle the spec's callables by name.
"""

from __future__ import annotations

import torch

from fsdp_int8.testing._spec import SubclassSpec
from fsdp_int8.weight import Int8Weight

__all__ = ["INT8_WEIGHT", "INT8_ROUNDING_STEP", "int8_wire_bytes", "int8_weight_to_float"]

INT8_ROUNDING_STEP = 1 / 127  # one int8 step of a row scaled by its absmax


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
"""``Int8Weight`` as it trains by default (stochastic rounding of updates), through its
public API only."""
