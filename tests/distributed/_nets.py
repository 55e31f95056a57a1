"""Tiny models for the multi-process tests (module-level: spawned ranks import them)."""

from __future__ import annotations

import torch
import torch.nn as nn

from launch.model import ModelArgs, Transformer


class MLPBlock(nn.Module):
    def __init__(self, dim: int, hidden: int, bias: bool = True) -> None:
        super().__init__()
        self.up = nn.Linear(dim, hidden, bias=bias)
        self.down = nn.Linear(hidden, dim, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(x)))


class MLPNet(nn.Module):
    """Residual MLP blocks in ``self.layers`` and a small head: rows = ``hidden`` (uneven at will)."""

    def __init__(self, dim: int = 32, hidden: int = 33, n_layers: int = 2, bias: bool = True) -> None:
        super().__init__()
        self.layers = nn.ModuleList(MLPBlock(dim, hidden, bias) for _ in range(n_layers))
        self.head = nn.Linear(dim, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def tiny_transformer(seed: int = 0, **overrides) -> Transformer:
    args = dict(vocab_size=64, dim=32, n_layers=2, n_heads=2, max_seq_len=32)
    args.update(overrides)
    model = Transformer(ModelArgs(**args))
    model.init_weights(seed)
    return model
