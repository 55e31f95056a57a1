"""``SubclassSpec``s of the weights the conformance tests run the suite on (module-level:
the spawned ranks unpickle them by name).

* ``INT8_WEIGHT``: :class:`fsdp_int8.weight.Int8Weight` as it trains by default
  (stochastic rounding of updates), through its public API only. It lives in the package
  (``fsdp_int8.testing.int8_weight_spec``): ``benchmarks.conformance_table`` runs it too.
* ``BF16_REFERENCE`` and the ``BROKEN_*`` mutations: the reference subclass of
  ``_reference_subclass``, which only the tests use.
"""

from __future__ import annotations

import torch
from _reference_subclass import (
    BF16WireWeight,
    BrokenOutWeight,
    BrokenViewWeight,
    BrokenWireWeight,
)

from fsdp_int8.testing import SubclassSpec
from fsdp_int8.testing.int8_weight_spec import INT8_WEIGHT

__all__ = ["INT8_WEIGHT", "BF16_REFERENCE", "BROKEN_OUT", "BROKEN_VIEW", "BROKEN_WIRE"]

BF16_ROUNDING_STEP = 2 ** -7  # bf16 keeps 8 significant bits: one ulp <= 2^-7 of a value


def bf16_to_float(weight: torch.Tensor) -> torch.Tensor:
    return weight.values()


def _bf16_spec(name: str, cls: type) -> SubclassSpec:
    return SubclassSpec(name=name, from_float=cls.from_float, to_float=bf16_to_float,
                        wire_bytes_per_element=2.0, rounding_step=BF16_ROUNDING_STEP)


BF16_REFERENCE = _bf16_spec("BF16WireWeight (reference)", BF16WireWeight)
BROKEN_OUT = _bf16_spec("BrokenOutWeight", BrokenOutWeight)
BROKEN_VIEW = _bf16_spec("BrokenViewWeight", BrokenViewWeight)
BROKEN_WIRE = _bf16_spec("BrokenWireWeight", BrokenWireWeight)
