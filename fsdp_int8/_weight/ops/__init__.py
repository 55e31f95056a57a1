"""The op table of :class:`~fsdp_int8.Int8Weight`: one small function per aten op.

Each module registers its ops into :mod:`fsdp_int8._weight.op_table` (``implements``); grouped by
role, one module a role, each with one rule:

* views and shard ops keep whole rows (a row's int8 values and its scale stay together)
  and share storage, as the op promises; anything else raises;
* factories: ``new_zeros`` / ``new_empty`` / ``empty_like`` / ``clone`` / ``_to_copy`` keep
  the subclass, ``zeros_like`` returns a plain tensor (optimizer states must not be int8);
* assignments (``copy_`` from a float tensor, ``fill_``, ``uniform_`` ...) quantize with
  round-to-nearest: they are initialisation or loading, not training;
* updates (``add_``, ``mul_``, ``addcdiv_`` ..., their ``_foreach_`` forms and the fused
  optimizers) dequantize, compute in fp32, and requantize once with the weight's rounding
  (stochastic in training), recomputing each row's scale;
* out-of-place math works on the dequantized values and returns plain tensors.
"""

from fsdp_int8._weight.ops import assignments, collectives, factories, math, updates, views  # noqa: F401
