"""The int8 weight: :class:`Int8Weight` (defined in the private ``fsdp_int8._weight`` package,
with its op table and FSDP2 hooks), its metadata, :class:`Int8WeightMeta`, and
:class:`Int8LoadError`, what every load path raises for an int8 weight it refuses, and
:func:`int8_grouped_mm`, the one grouped matmul of expert weights, int8 or plain (what a
model's own experts module calls in place of ``torch._grouped_mm``). Pickles
and ``torch.load(weights_only=True)`` allow-lists name the weight here."""

from fsdp_int8._weight.grouped_mm import int8_grouped_mm
from fsdp_int8._weight.load_checks import Int8LoadError
from fsdp_int8._weight.tensor import Int8Weight, Int8WeightMeta, _rebuild_int8_weight  # noqa: F401  (pickles name the first and last here)

__all__ = ["Int8Weight", "Int8WeightMeta", "Int8LoadError", "int8_grouped_mm"]
