"""DBRX's experts with int8 weights: ``DbrxExperts`` computing through grouped matmuls.

transformers' ``DbrxExperts`` keeps its experts in its ``mlp`` (``DbrxExpertGLU``) as 2-D
``w1``, ``v1``, ``w2`` ``[E * F, hidden]``, and its ``forward`` loops over the experts hit,
viewing each as ``[F, hidden]`` and computing ``x @ w1.T``, ``x @ v1.T`` and ``h @ w2``.
As int8, ``w1`` and ``v1`` keep that layout (a row is an output feature, with its scale)
and ``w2`` holds each expert's transpose, ``[E * hidden, F]`` (:mod:`.transposed_experts`),
so every weight has one scale per expert and output feature. The model's loop cannot read
that ``w2``, so ``quantize_`` swaps the class of each ``DbrxExperts`` whose ``mlp`` is
int8 for one whose ``forward`` computes the same sum,

    out[t] = sum over j of  p[t, j] * (act(x[t] W1_e^T) * (x[t] V1_e^T)) W2_e,   e = index[t, j],

over the tokens sorted by expert (stably, so that each token's terms are added in the
order of its experts, as the model's loop adds them). Each projection is one grouped
matmul over the ``[E, out, in]`` views of the weights:
:func:`.grouped_mm.int8_grouped_mm` where they run int8 GEMMs (its offsets stay on the
device), else one ``F.linear`` per expert with tokens (the offsets read on the host once
per forward, as the model's loop reads its ``nonzero``). An index of ``E`` (the model's one-hot keeps a
slot for it) picks no expert and adds nothing.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from fsdp_int8._dist import local_shard
from fsdp_int8._moe.layout import dbrx_expert_names
from fsdp_int8._weight.grouped_mm import int8_grouped_mm
from fsdp_int8._weight.tensor import Int8Weight
from fsdp_int8._weight.transposed_experts import swapped_class, transposed_names

__all__ = ["int8_dbrx_experts_", "is_int8_dbrx_experts"]


class _Int8DbrxExperts:
    """Mixed in before ``DbrxExperts``: its ``forward`` over the int8 layout of its ``mlp``."""

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        mlp, experts = self.mlp, self.num_experts
        x = hidden_states.reshape(-1, self.hidden_size)
        chosen = top_k_index.reshape(-1)
        order = torch.argsort(chosen, stable=True)
        token = order // top_k_index.shape[-1]
        counts = torch.zeros(experts + 1, dtype=torch.int64, device=x.device)
        counts.scatter_add_(0, chosen, torch.ones_like(chosen))  # on the device: no host read
        offs = counts[:experts].cumsum(0).to(torch.int32)
        rows = x[token]
        weights = [_per_expert(getattr(mlp, name), experts) for name in ("w1", "v1", "w2")]
        # the per-expert loop's bounds, read on the host once for the three projections
        bounds = None if all(map(_runs_int8_gemms, weights)) else [0, *offs.tolist()]
        w1, v1, w2 = weights
        hidden = mlp.activation_fn(_grouped(rows, w1, offs, bounds)) * _grouped(rows, v1, offs, bounds)
        out = _grouped(hidden, w2, offs, bounds) * top_k_weights.reshape(-1)[order, None]
        summed = torch.zeros_like(x).index_add_(0, token, out.to(x.dtype))
        return summed.view(hidden_states.shape[0], -1, self.hidden_size)


def _per_expert(weight: torch.Tensor, experts: int) -> torch.Tensor:
    """A 2-D ``[E * out, in]`` weight (int8, or the plain values FSDP2 gathered) as ``[E, out, in]``."""
    return weight.view(experts, -1, weight.shape[-1])


def _runs_int8_gemms(weight: torch.Tensor) -> bool:
    return isinstance(weight, Int8Weight) and weight.int8_matmul is not None


def _grouped(x: torch.Tensor, weight: torch.Tensor, offs: torch.Tensor, bounds: list[int] | None) -> torch.Tensor:
    """``torch._grouped_mm(x, weight.transpose(-2, -1), offs=offs)``: row ``r`` of ``x``
    times the expert whose offsets hold it; rows past the last offset give zeros. Without
    int8 GEMMs, one ``F.linear`` per expert between ``bounds`` (``[0, *offs]`` on the host)."""
    if _runs_int8_gemms(weight):
        return int8_grouped_mm(x, weight, offs)
    pieces = [F.linear(x[start:stop], weight[e]) for e, (start, stop) in enumerate(zip(bounds, bounds[1:]))
              if stop > start]
    if x.shape[0] > bounds[-1]:
        pieces.append(x.new_zeros(x.shape[0] - bounds[-1], weight.shape[1]))
    return torch.cat(pieces)


def is_int8_dbrx_experts(module: nn.Module) -> bool:
    """Whether ``module`` is a ``DbrxExperts`` whose class :func:`int8_dbrx_experts_` swapped."""
    return isinstance(module, _Int8DbrxExperts)


def _has_int8_dbrx_mlp(module: nn.Module) -> bool:
    mlp = getattr(module, "mlp", None)
    return (isinstance(mlp, nn.Module) and bool(dbrx_expert_names(mlp)) and "w2" in transposed_names(mlp)
            and isinstance(getattr(module, "num_experts", None), int) and hasattr(module, "hidden_size")
            and any(isinstance(local_shard(p), Int8Weight) for p in (mlp.w1, mlp.v1, mlp.w2)))


def int8_dbrx_experts_(model: nn.Module) -> None:
    """Swap, in place, the class of each ``DbrxExperts`` in ``model`` whose ``mlp`` holds
    int8 weights for one computing over their int8 layout (module docstring)."""
    for module in model.modules():
        if not is_int8_dbrx_experts(module) and _has_int8_dbrx_mlp(module):
            module.__class__ = swapped_class(_Int8DbrxExperts, type(module))
