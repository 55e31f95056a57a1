"""Gradient reduce-scatters for FSDP2: int8 blocks on the wire, or no copy on gloo.

FSDP2 reduce-scatters each parameter group's gradients through a ``ReduceScatter`` object
(``FSDPModule.set_custom_reduce_scatter``). :class:`QuantizedReduceScatter` quantizes each
peer's slice to int8 blocks with stochastic rounding and one fp32 scale per block,
exchanges them with one ``all_to_all_single`` and sums in fp32 on the receiving rank
(about a quarter of fp32's bytes, unbiased). :class:`InPlaceReduceScatter` keeps
full-precision sums like FSDP2's, without the copy of the whole input that gloo's
``reduce_scatter_tensor`` makes (the lean recipe's,
``Int8TrainingConfig.in_place_reduce_scatter``). :func:`enable_quantized_reduce_scatter`
and :func:`enable_in_place_reduce_scatter` install them on a sharded model. How
it works (wire format, bytes, noise): docs/design.md, "Quantized gradient reduce-scatter".

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
