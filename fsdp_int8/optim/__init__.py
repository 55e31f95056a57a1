"""Fused optimizers for int8 weights: one dequantization and one requantization per step.

:class:`Int8AdamW` and :class:`Int8SGD` dequantize every int8 weight once, run the whole
update in fp32 over bounded chunks of parameters, and requantize once with the weight's
own rounding; :class:`Int8AdamW` can keep its moments in 8 or 4 bits (``state_bits=8`` or ``4``). Both
take parameters or parameter groups like any ``torch.optim`` optimizer, any mix of
``Int8Weight`` s, plain tensors and FSDP2 DTensors, and work with
``get_optimizer_state_dict`` / ``set_optimizer_state_dict`` and
:func:`~fsdp_int8.save_checkpoint` / :func:`~fsdp_int8.load_checkpoint`. On DTensor
parameters a step issues no collective but the one-element all-reduce of the
finite-gradient verdict (:mod:`fsdp_int8.guard`).

``torch.optim`` optimizers work on int8 weights too, through the op table (one
requantization per update op instead of one per step); :func:`batch_int8_updates` gives
them one end-of-step per step for their updates' checks. Why fused, formulas, layouts and
bytes per parameter: docs/optim.md.

Modules: :mod:`~fsdp_int8.optim.adamw`, :mod:`~fsdp_int8.optim.sgd`; the shared step
(``_base``), argument checks (``_checks``) and the 8-bit state codec (``_state_codec``).
"""

from fsdp_int8.optim.adamw import Int8AdamW
from fsdp_int8.optim._batching import BatchedUpdates, batch_int8_updates
from fsdp_int8.optim.sgd import Int8SGD

__all__ = ["Int8AdamW", "Int8SGD", "batch_int8_updates", "BatchedUpdates"]
