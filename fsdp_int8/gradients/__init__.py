"""Quantized gradient reduce-scatter: int8 blocks on the wire, fp32 sums on the receiver.

FSDP2 reduce-scatters each parameter group's gradients through a ``ReduceScatter`` object
(``FSDPModule.set_custom_reduce_scatter``). It hands that object one flat, padded,
rank-major buffer in the reduce dtype: ``input[j * S:(j + 1) * S]`` is the part destined
for rank ``j`` of the reduce-scatter group, ``S = input.numel() // world_size``.
:class:`QuantizedReduceScatter` replaces the collective with:

1. **quantize** every peer's slice to int8 in fixed-size blocks (no row boundaries
   survive in the flat buffer), one fp32 absmax scale per block, with *stochastic*
   rounding: ``q = floor(x / scale + u)``, ``u ~ U[0, 1)``, so ``E[q * scale] = x``
   (:func:`fsdp_int8.quant.absmax_quantize`);
2. **exchange** the slices with ONE ``torch.distributed.all_to_all_single`` of int8 bytes,
   the scales packed behind the values of each slice (the wire format: ``_wire.py``);
3. **dequantize and sum in fp32** on the receiving rank (int8 is never summed on the wire:
   it would overflow), adding the rank's own slice exactly (it never crosses the wire);
4. apply the ``op`` FSDP2 asked for (``SUM``, ``AVG``, ``PREMUL_SUM(factor)``) and write
   the result into the output buffer in its dtype (the reduce dtype).

A block holding NaN or Inf arrives non-finite, so overflow checks such as ``GradScaler``'s
still see it; nothing raises, since one rank raising in the middle of a collective would
leave the others waiting forever.

The noise comes from a generator bank owned by the :class:`QuantizedReduceScatter` (one
generator per device), seeded from ``seed`` and the process's *global* rank: every rank,
HSDP replicas included, draws independent noise, and the weights' stochastic-rounding
stream (:data:`fsdp_int8._quant.generators.WEIGHT_ROUNDING`, which HSDP replicas must share) is
left untouched.

The package also holds :class:`InPlaceReduceScatter` (``in_place``): full-precision
sums like FSDP2's, without the copy of the whole input that gloo's ``reduce_scatter_tensor``
makes (the lean recipe's, ``Int8TrainingConfig.in_place_reduce_scatter``).

Modules: ``reduce_scatter`` (the ``ReduceScatter``), ``in_place`` (the in-place one),
``install`` (putting either on a model and finding the quantized one again), ``_wire``
(packing and summing the all-to-all buffers), ``_reduce_op`` (what FSDP2's ``op``
multiplies the sum by).
"""

from fsdp_int8.gradients.in_place import InPlaceReduceScatter
from fsdp_int8.gradients.install import enable_in_place_reduce_scatter, enable_quantized_reduce_scatter
from fsdp_int8.gradients.reduce_scatter import QuantizedReduceScatter

__all__ = ["InPlaceReduceScatter", "QuantizedReduceScatter", "enable_in_place_reduce_scatter",
           "enable_quantized_reduce_scatter"]
