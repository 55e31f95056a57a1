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
matmul over the ``[E, out, in]`` views of the weights, :func:`.grouped_mm.int8_grouped_mm`
(int8 GEMMs where the weights' config asks for them; the offsets counted and kept on the
device). An index of ``E`` (the model's one-hot keeps a slot for it) picks no expert and
adds nothing.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from fsdp_int8._dist import local_shard
from fsdp_int8._moe.layout import dbrx_expert_names
from fsdp_int8._weight.grouped_mm import expert_offsets, int8_grouped_mm
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
        offs = expert_offsets(chosen, experts)
        rows = x[token]
        w1, v1, w2 = (_per_expert(getattr(mlp, name), experts) for name in ("w1", "v1", "w2"))
        hidden = mlp.activation_fn(int8_grouped_mm(rows, w1, offs)) * int8_grouped_mm(rows, v1, offs)
        out = int8_grouped_mm(hidden, w2, offs) * top_k_weights.reshape(-1)[order, None]
        summed = torch.zeros_like(x).index_add_(0, token, out.to(x.dtype))
        return summed.view(hidden_states.shape[0], -1, self.hidden_size)


def _per_expert(weight: torch.Tensor, experts: int) -> torch.Tensor:
    """A 2-D ``[E * out, in]`` weight (int8, or the plain values FSDP2 gathered) as ``[E, out, in]``."""
    return weight.view(experts, -1, weight.shape[-1])


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
