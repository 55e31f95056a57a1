"""Rotary position embeddings (RoPE) over interleaved channel pairs, as the launcher's
model applies them: a rotation whose backward is the inverse rotation."""

from __future__ import annotations

import torch


def rope_frequencies(head_dim: int, seq_len: int, theta: float) -> torch.Tensor:
    """``[seq_len, head_dim // 2, 2]``: cos and sin of each position's rotation."""
    inv = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    angles = torch.outer(torch.arange(seq_len, dtype=torch.float32), inv)
    return torch.stack([angles.cos(), angles.sin()], dim=-1)


def _rotate_pairs(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Each pair of channels ``(even, odd)`` of ``x`` rotated by the angle of ``(cos, sin)``,
    in fp32, then in ``x``'s dtype."""
    pairs = x.float().unflatten(-1, (-1, 2))
    even, odd = pairs[..., 0], pairs[..., 1]
    rotated = torch.stack([even * cos - odd * sin, even * sin + odd * cos], dim=-1)
    return rotated.flatten(-2).type_as(x)


class _Rope(torch.autograd.Function):
    """RoPE whose backward is the inverse rotation (by minus the angle).

    Its values are autograd's own, bit for bit (the same fp32 products and sums, in
    ``x``'s dtype at the end), but written as a rotation rather than autograd's scatter
    of the two halves (``select_backward``), which inductor's CPU code cannot vectorize:
    fused with the int8 matmuls' quantization of the same gradient, that scatter became
    scalar loops over strided memory. ``cos`` and ``sin`` are constants (no gradient).
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(cos, sin)
        return _rotate_pairs(x, cos, sin)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        cos, sin = ctx.saved_tensors
        return _rotate_pairs(grad, cos, -sin), None, None


def apply_rope(x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    """Rotate pairs of channels of ``x`` ``[B, T, H, D]`` by position."""
    cos, sin = freqs[: x.shape[1], None, :, 0], freqs[: x.shape[1], None, :, 1]
    return _Rope.apply(x, cos, sin)
