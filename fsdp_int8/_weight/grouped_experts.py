"""Experts modules with int8 weights computing through ``int8_grouped_mm``: transformers',
Llama 4's and torchtitan's.

An int8 expert weight takes part in one computation only, :func:`.grouped_mm.int8_grouped_mm`
(and, per expert, ``F.linear(x, w[e])``: the eager loops of JetMoE, LongCat-Flash and the
like). ``quantize_`` therefore swaps the class of each experts module whose own code would
compute otherwise (``__class__`` assignment, as ``fully_shard`` does) for one whose
``forward`` computes the same function through that op:

* a class under transformers' ``use_experts_implementation`` (Mixtral, Qwen3-MoE,
  DeepSeek-V3, gpt-oss, ...): the tokens sorted by expert, one grouped matmul per
  projection, the biases, gate, activation and post-expert norm the module names, whatever
  ``config._experts_implementation`` says (eager, batched_mm and grouped_mm compute the
  same function; this is grouped_mm's algorithm, its offsets counted on the device);
* Llama 4's ``Llama4TextExperts``: every expert applied to its own equal block of rows
  (the model sends each expert every token, scaled by its routing score);
* torchtitan's ``GroupedExperts`` (``w1_EFD``, ``w2_EDF``, ``w3_EFD``): its own
  computation, minus the cast and transpose of the weights before its ``_grouped_mm``.

Each reads the weights in the ``[E, out, in]`` layout in which they are held, transposed
ones included (:mod:`.transposed_experts`), and work on the plain tensors FSDP2
all-gathers for weight-only int8 as on ``Int8Weight``s.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from fsdp_int8._moe.layout import dbrx_expert_names, transposed_expert_weights
from fsdp_int8._weight.grouped_mm import expert_offsets, int8_grouped_mm
from fsdp_int8._weight.transposed_experts import _TransposedExperts, hold_transposed_, swapped_class

__all__ = ["Int8TorchtitanExperts", "forward_mixin", "int8_experts_", "why_not_int8_experts"]


class _Int8GroupedExperts(_TransposedExperts):
    """Mixed in before a transformers experts class (``use_experts_implementation``)."""

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        experts, top_k = self.num_experts, top_k_index.shape[-1]
        expert_ids = top_k_index.reshape(-1)
        sorted_ids, order = torch.sort(expert_ids, stable=True)
        offs = expert_offsets(expert_ids, experts)
        bias_rows = sorted_ids.clamp(max=experts - 1)  # a sentinel's row is masked below
        rows = hidden_states[order // top_k]
        up = self.gate_up_proj if self.has_gate else self.up_proj
        projected = self._biased(int8_grouped_mm(rows, up, offs), "gate_up_proj_bias" if self.has_gate
                                 else "up_proj_bias", bias_rows)
        hidden = self._apply_gate(projected) if self.has_gate else self.act_fn(projected)
        out = self._biased(int8_grouped_mm(hidden, self.down_proj, offs), "down_proj_bias", bias_rows)
        if self.has_post_expert_norm:
            out = self.post_expert_norm(out)
        out = out * top_k_weights.reshape(-1)[order].unsqueeze(-1)
        if self._is_expert_parallel:  # tokens routed to another rank's experts add nothing
            out = out.masked_fill((sorted_ids >= experts).unsqueeze(-1), 0.0)
        unsorted = torch.empty_like(out).index_copy_(0, order, out)
        # the top-k terms of each token summed in one reduction, as transformers sums them
        return unsorted.view(-1, top_k, out.shape[-1]).sum(dim=1).to(hidden_states.dtype)

    def _biased(self, out: torch.Tensor, name: str, bias_rows: torch.Tensor) -> torch.Tensor:
        return out + getattr(self, name)[bias_rows] if self.has_bias else out


class _Int8Llama4Experts(_TransposedExperts):
    """Mixed in before Llama 4's ``Llama4TextExperts``: ``hidden_states`` ``[E * T, hidden]``,
    expert ``e`` applied to rows ``[e * T, (e + 1) * T)``."""

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        experts = self.gate_up_proj.shape[0]
        rows = hidden_states.view(-1, self.hidden_size)
        block = rows.shape[0] // experts
        offs = torch.arange(1, experts + 1, device=rows.device, dtype=torch.int32) * block
        gate, up = int8_grouped_mm(rows, self.gate_up_proj, offs).chunk(2, dim=-1)
        return int8_grouped_mm(up * self.act_fn(gate), self.down_proj, offs)


class Int8TorchtitanExperts(_TransposedExperts):
    """Mixed in before torchtitan's ``GroupedExperts`` (by ``quantize_``, or as a base of
    the converter's int8 class): its computation (bf16 operands, SwiGLU, the output in the
    input's dtype), the weights handed to ``int8_grouped_mm`` as they are."""

    def forward(self, x_RD: torch.Tensor, num_tokens_per_expert_E: torch.Tensor) -> torch.Tensor:
        # expert parallelism shards whole experts (DTensors): each rank computes with its own
        w1, w2, w3 = (w.to_local() if isinstance(w, DTensor) else w for w in (self.w1_EFD, self.w2_EDF, self.w3_EFD))
        offs = torch.cumsum(num_tokens_per_expert_E, dim=0, dtype=torch.int32)
        x = x_RD.bfloat16()
        hidden = F.silu(int8_grouped_mm(x, w1, offs)) * int8_grouped_mm(x, w3, offs)
        return int8_grouped_mm(hidden, w2, offs).type_as(x_RD)


_TORCHTITAN_WEIGHTS = ("w1_EFD", "w2_EDF", "w3_EFD")


def _uses_experts_implementation(module: nn.Module) -> bool:
    """What transformers' ``use_experts_implementation`` gives an experts module."""
    return all(hasattr(module, name) for name in (
        "has_gate", "has_bias", "has_post_expert_norm", "is_transposed", "_is_expert_parallel", "_apply_gate",
        "num_experts", "down_proj"))


def forward_mixin(module: nn.Module) -> type | None:
    """The mixin whose ``forward`` computes ``module``'s function through
    ``int8_grouped_mm``, or ``None`` where none is known (its own code then runs)."""
    if _uses_experts_implementation(module):
        return _Int8GroupedExperts
    if type(module).__name__ == "Llama4TextExperts" and hasattr(module, "act_fn"):
        return _Int8Llama4Experts
    if all(isinstance(module._parameters.get(name), torch.Tensor) for name in _TORCHTITAN_WEIGHTS):
        return Int8TorchtitanExperts
    return None


def why_not_int8_experts(module: nn.Module) -> str | None:
    """Why ``module``'s experts stay in full precision, or ``None``: experts stored
    ``[E, in, out]`` are read only by a class that computes on their held transpose."""
    if not transposed_expert_weights(module) or forward_mixin(module) or dbrx_expert_names(module):
        return None
    return ("experts stored [E, in, out] by a module whose forward fsdp_int8 does not know: int8 experts "
            "compute through fsdp_int8.weight.int8_grouped_mm")


def int8_experts_(module: nn.Module, transposed: dict[str, nn.Parameter], blocks: dict[str, int]) -> None:
    """Swap, in place, ``module``'s class for the one of :func:`forward_mixin` (or, with
    ``transposed`` weights and none known, the layout alone), and give it the
    ``transposed`` weights held as their transpose (``blocks`` by name)."""
    mixin = forward_mixin(module) or (_TransposedExperts if transposed else None)
    if mixin is not None and not isinstance(module, mixin):
        module.__class__ = swapped_class(mixin, type(module))
    if transposed:
        hold_transposed_(module, transposed, blocks)
