"""Small models and tasks shared by the single-process tests (not collected by pytest).

The Llama the tests train is the launcher's own, ``launch.model.Transformer``, at a tiny
``ModelArgs``: one model in the repository, not a second copy here.
"""

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


def train_steps(model: nn.Module, loss_fn, optimizer: torch.optim.Optimizer, batch, steps: int) -> list[float]:
    """``steps`` optimizer steps of ``loss_fn(model, batch)`` on one batch; the losses."""
    losses = []
    for _ in range(steps):
        loss = loss_fn(model, batch)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def assert_same_model(got: nn.Module, want: nn.Module) -> None:
    """Every int8 byte and scale, and every other parameter, equal; int8 exactly where ``want`` is."""
    from fsdp_int8 import Int8Weight

    mine = dict(got.named_parameters())
    assert mine.keys() == dict(want.named_parameters()).keys()
    for name, param in want.named_parameters():
        assert type(mine[name]) is type(param), name
        if isinstance(param, Int8Weight):
            assert torch.equal(mine[name].int_data, param.int_data), name
            assert torch.equal(mine[name].scale, param.scale), name
            assert mine[name].dtype == param.dtype and mine[name].requires_grad, name
        else:
            assert torch.equal(mine[name], param), name
