"""Small models and tasks shared by the single-process tests (not collected by pytest)."""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F


class MLP(nn.Module):
    """``in -> hidden -> hidden -> out`` with SiLU; the last layer is the smallest."""

    def __init__(self, d_in: int = 32, hidden: int = 64, d_out: int = 8) -> None:
        super().__init__()
        self.fc1 = nn.Linear(d_in, hidden)
        self.fc2 = nn.Linear(hidden, hidden)
        self.fc3 = nn.Linear(hidden, d_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc3(F.silu(self.fc2(F.silu(self.fc1(x)))))


def regression_task(
    n: int = 256, d_in: int = 32, d_out: int = 8, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """A fixed nonlinear teacher: ``y = tanh(x @ A) @ B`` with a little structure to learn."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d_in, generator=gen)
    a = torch.randn(d_in, 48, generator=gen) / math.sqrt(d_in)
    b = torch.randn(48, d_out, generator=gen) / math.sqrt(48)
    return x, torch.tanh(x @ a) @ b * 2.0


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        norm = x.float().pow(2).mean(-1, keepdim=True).add(self.eps).rsqrt()
        return (x.float() * norm).type_as(x) * self.weight


def rope(x: torch.Tensor, base: float = 10000.0) -> torch.Tensor:
    """Rotary position embedding on ``[B, H, T, D]`` (D even), rotate-half convention."""
    t, d = x.shape[-2], x.shape[-1]
    inv_freq = 1.0 / (base ** (torch.arange(0, d, 2, dtype=torch.float32, device=x.device) / d))
    angles = torch.arange(t, dtype=torch.float32, device=x.device)[:, None] * inv_freq[None, :]
    cos = torch.cat([angles.cos(), angles.cos()], dim=-1).to(x.dtype)
    sin = torch.cat([angles.sin(), angles.sin()], dim=-1).to(x.dtype)
    x1, x2 = x[..., : d // 2], x[..., d // 2 :]
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


class Attention(nn.Module):
    def __init__(self, dim: int, n_heads: int) -> None:
        super().__init__()
        self.n_heads = n_heads
        self.head_dim = dim // n_heads
        self.q_proj = nn.Linear(dim, dim, bias=False)
        self.k_proj = nn.Linear(dim, dim, bias=False)
        self.v_proj = nn.Linear(dim, dim, bias=False)
        self.o_proj = nn.Linear(dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape

        def heads(proj: nn.Linear) -> torch.Tensor:
            return proj(x).view(b, t, self.n_heads, self.head_dim).transpose(1, 2)

        q, k, v = rope(heads(self.q_proj)), rope(heads(self.k_proj)), heads(self.v_proj)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, d))


class SwiGLU(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden, bias=False)
        self.up_proj = nn.Linear(dim, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    def __init__(self, dim: int, n_heads: int, hidden: int) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(dim)
        self.attn = Attention(dim, n_heads)
        self.mlp_norm = RMSNorm(dim)
        self.mlp = SwiGLU(dim, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x))
        return x + self.mlp(self.mlp_norm(x))


class TinyLlama(nn.Module):
    """Embedding, one Llama-style block, final RMSNorm and an ``lm_head`` (kept fp32)."""

    def __init__(self, vocab: int = 17, dim: int = 64, n_heads: int = 4, hidden: int = 128) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.block = Block(dim, n_heads, hidden)
        self.norm = RMSNorm(dim)
        self.lm_head = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.norm(self.block(self.embed(tokens))))


def fibonacci_mod_task(
    batch: int = 64, seq_len: int = 16, vocab: int = 17, seed: int = 0
) -> torch.Tensor:
    """Token sequences with ``x[t] = (x[t-1] + x[t-2]) mod vocab`` from random starting pairs.

    Predicting the next token needs the two previous tokens, so the attention layer (not
    only a bigram table) has to learn something. Fully deterministic given ``seed``.
    """
    gen = torch.Generator().manual_seed(seed)
    seqs = torch.empty(batch, seq_len, dtype=torch.long)
    seqs[:, :2] = torch.randint(0, vocab, (batch, 2), generator=gen)
    for t in range(2, seq_len):
        seqs[:, t] = (seqs[:, t - 1] + seqs[:, t - 2]) % vocab
    return seqs


def lm_loss(model: nn.Module, seqs: torch.Tensor) -> torch.Tensor:
    logits = model(seqs[:, :-1])
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), seqs[:, 1:].reshape(-1))
