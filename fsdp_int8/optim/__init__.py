"""Fused optimizers for int8 weights: one dequantization and one requantization per step.

``torch.optim.AdamW`` works on :class:`~fsdp_int8.Int8Weight` parameters through the op
table. In its default (for-loop and foreach) forms its weight decay (``mul_`` by a
scalar) is exact: the op table rescales the weight's row scales, with no requantization.
Only its step (``addcdiv_``) dequantizes and requantizes the weight, once per step, but
each of these ops is a separate pass over the weight, and any other in-place op on it
(``add_``, ``lerp_``, ...) requantizes it each time. Its ``fused=True`` form requantizes
once too, but runs on fp32 copies of all parameters at once.

:class:`Int8AdamW` and :class:`Int8SGD` dequantize every int8 weight once, run the whole
update in fp32 with ``torch._foreach_*`` ops over bounded chunks of parameters, and
requantize once with the weight's own rounding. :class:`Int8AdamW` can also keep its
moments in 8 bits (``state_bits=8``), block-wise within each row.

Both work on FSDP2 (DTensor) parameters by updating each rank's local tensors: the update
is elementwise, so a step issues no collective but the one-element all-reduce of the
finite-gradient verdict (:mod:`fsdp_int8.guard`). Formulas, layouts and the bytes per
parameter they cost: docs/optim.md.

A ``torch.optim`` optimizer's updates do their end-of-step work (finiteness verdicts on
accelerators, tensor-parallel rounding) one weight at a time unless it is passed to
:func:`batch_int8_updates` (``_batching``).

Modules: :mod:`~fsdp_int8.optim.adamw`, :mod:`~fsdp_int8.optim.sgd`; the shared step
(``_base``), argument checks (``_checks``) and the 8-bit state codec (``_state_codec``).
"""

from fsdp_int8.optim.adamw import Int8AdamW
from fsdp_int8.optim._batching import BatchedUpdates, batch_int8_updates
from fsdp_int8.optim.sgd import Int8SGD

__all__ = ["Int8AdamW", "Int8SGD", "batch_int8_updates", "BatchedUpdates"]
