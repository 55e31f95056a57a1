"""The stochastic-rounding noise: 16 uniform random bits per value.

Stochastic rounding is ``round(x / scale + v)`` with ``v = (r + 1/2) / 2**16 - 1/2`` and
``r`` a uniform 16-bit integer: ``floor(x / scale + u)`` with ``u`` uniform on the 2**16
midpoints of ``[0, 1)``. It rounds up with probability equal to the fraction of a step to
within 2**-17 (fp32 resolves ``x / scale`` to 2**-17 near 127 anyway), so it is unbiased,
and updates smaller than one step survive on average. The 16 bits come four to a 64-bit
draw of the caller's generator (see :mod:`fsdp_int8._quant.generators`), a quarter of the draws
of one fp32 uniform per element: the same seed and saved state give the same rounding
(:func:`rounding_noise_bytes` says which bytes go to which value).
"""

from __future__ import annotations

import math

import torch

NOISE_BITS = 16
NOISE_STEP = 2.0 ** -NOISE_BITS  # r * NOISE_STEP, r in [-2**15, 2**15): the noise in steps
NOISE_OFFSET = 2.0 ** -(NOISE_BITS + 1)  # ... plus half a noise step: symmetric about 0
_INT64_MIN = -(2**63)


def _words_for(count: int) -> int:
    return -(-count // 4)  # four 16-bit values to a 64-bit draw


def rounding_noise_bytes(shape: tuple[int, ...], generator: torch.Generator | None, device: torch.device) -> torch.Tensor:
    """The random bytes of the noise, ``int8 [..., 2 * shape[-1]]``: per row of ``K``
    values, first their ``K`` high bytes, then their ``K`` low bytes.

    Eight bytes (four 16-bit values) to each 64-bit draw. Each half of a row is contiguous,
    so a compiled kernel reads both with vector loads (:func:`noise_from_bytes`); interleaved
    little-endian pairs would need gathers, which cost inductor's CPU code a quarter of the
    weight update.
    """
    count = math.prod(shape)
    words = torch.empty(_words_for(count), dtype=torch.int64, device=device)
    words.random_(_INT64_MIN, None, generator=generator)  # all 64 bits
    return words.view(torch.int8)[: 2 * count].view(*shape[:-1], 2 * shape[-1])


def noise_from_bytes(noise_bytes: torch.Tensor) -> torch.Tensor:
    """The 16-bit noise ``[..., K]`` from :func:`rounding_noise_bytes`' ``[..., 2K]`` bytes,
    as int32 (``high * 256 + unsigned low``): the form compiled kernels use, since inductor's
    CPU code vectorizes int8 loads and not int16 ones."""
    length = noise_bytes.shape[-1] // 2
    high, low = noise_bytes[..., :length], noise_bytes[..., length:]
    return high.to(torch.int32) * 256 + (low.to(torch.int32) & 255)


def noise_values(shape: tuple[int, ...], generator: torch.Generator | None, device: torch.device) -> torch.Tensor:
    """The noise ``r`` of ``shape`` as fp32 (exact: ``|r| < 2**15``), what the eager
    rounding adds: ``high * 256 + unsigned low``, built in fp32. Arithmetic, not an
    interleaving copy (a byte-strided ``torch.stack``, 5x slower on a CPU), and fp32, not
    int16 (an int16 operand sends ``add_`` down its type-promoting loop, 3x slower)."""
    noise_bytes = rounding_noise_bytes(shape, generator, device)
    length = shape[-1]
    high, low = noise_bytes[..., :length], noise_bytes[..., length:].view(torch.uint8)
    return high.to(torch.float32).mul_(256).add_(low.to(torch.float32))


def rounding_noise(shape: tuple[int, ...], generator: torch.Generator | None, device: torch.device) -> torch.Tensor:
    """``int16`` uniform noise of ``shape``: :func:`noise_from_bytes`' values."""
    return noise_values(shape, generator, device).to(torch.int16)
