"""The quantizer's machinery (private): :mod:`.noise` (the 16-bit stochastic-rounding
noise), :mod:`.kernels` (the kernel bodies the eager and compiled paths share, and the
one place that runs a kernel with stochastic or nearest rounding) and :mod:`.generators`
(the noise generators, one bank per purpose). The public quantizer is :mod:`fsdp_int8.quant`.
"""
