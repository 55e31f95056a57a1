"""Row-wise symmetric int8 quantization: pure functions on plain tensors.

A weight of shape ``[rows, K]`` is stored as ``int8`` values in ``[-127, 127]`` and one
fp32 scale per row, ``scale = amax(|row|) / 127``. All arithmetic runs in fp32 whatever
the input dtype, so the range stays symmetric (no -128) for bf16 and fp16 inputs too.
"""

from __future__ import annotations

import torch

from fsdp_int8 import _rng

__all__ = ["INT8_MAX", "quantize_rowwise", "dequantize_rowwise"]

INT8_MAX = 127


def _raise_if_not_finite(values: torch.Tensor, row_amax: torch.Tensor) -> None:
    # One reduction over the row maxima (NaN and Inf propagate into them) keeps the
    # check cheap; the full count is only computed for the error message.
    if values.is_meta or bool(torch.isfinite(row_amax).all()):
        return
    bad = int((~torch.isfinite(values)).sum())
    raise ValueError(
        f"cannot quantize a tensor of shape {tuple(values.shape)} to int8: it holds {bad} "
        "non-finite values (NaN or Inf). Check the loss, gradients and learning rate; "
        "a NaN scale would silently corrupt the weight."
    )


def quantize_rowwise(
    values: torch.Tensor, *, stochastic: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize a 2-D floating tensor row by row.

    Args:
        values: ``[rows, K]`` tensor of any floating dtype.
        stochastic: Round with ``floor(x / scale + u)``, ``u ~ U[0, 1)`` drawn from the
            process's stochastic-rounding generator (unbiased); otherwise round to nearest.

    Returns:
        ``(int_data, scale)``: ``int8 [rows, K]`` in ``[-127, 127]`` and ``fp32 [rows]``.

    Raises:
        ValueError: if ``values`` holds NaN or Inf.
    """
    if values.dim() != 2:
        raise ValueError(f"quantize_rowwise expects a 2-D tensor, got shape {tuple(values.shape)}")
    if not values.is_floating_point():
        raise TypeError(f"quantize_rowwise expects a floating tensor, got {values.dtype}")
    values = values.float()
    row_amax = values.abs().amax(dim=1) if values.shape[1] else values.new_zeros(values.shape[0])
    _raise_if_not_finite(values, row_amax)
    scale = row_amax / INT8_MAX
    # An all-zero row keeps scale 0 (it dequantizes to zeros); divide it by 1 instead of 0.
    divisor = torch.where(scale > 0, scale, torch.ones_like(scale))
    scaled = values / divisor.unsqueeze(1)
    if stochastic:
        noise = torch.rand(
            scaled.shape, dtype=torch.float32, device=scaled.device,
            generator=_rng.generator(scaled.device),
        )
        scaled = scaled.add_(noise).floor_()
    else:
        scaled = scaled.round_()
    # |scaled| <= 127 up to one ulp of the division; the clamp keeps the range exact.
    return scaled.clamp_(-INT8_MAX, INT8_MAX).to(torch.int8), scale


def dequantize_rowwise(
    int_data: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Inverse of :func:`quantize_rowwise`: ``int_data * scale[:, None]`` in ``dtype``."""
    # int8 * fp32 promotes to fp32 inside one kernel: no separate cast pass
    return torch.mul(int_data, scale.unsqueeze(1)).to(dtype)
