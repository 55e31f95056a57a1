"""A small Llama-style decoder (RoPE, RMSNorm, SwiGLU): plain PyTorch.

Parallelism and quantization are applied from outside (``fsdp_int8.shard_model``);
``init_weights`` works on the sharded parameters they leave (DTensors), giving each rank
its piece of the single-process init.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel
from torch.utils.checkpoint import checkpoint

from fsdp_int8.weight import int8_grouped_mm
from launch.rope import apply_rope, rope_frequencies


@dataclass
class ModelArgs:
    """Shape of the decoder."""

    vocab_size: int = 256  # byte-level tokens
    dim: int = 64
    n_layers: int = 2
    n_heads: int = 4
    hidden_dim: int = 0  # 0: the Llama rule, about 8/3 * dim rounded up to a multiple of 16
    max_seq_len: int = 256
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    # mixture of experts: n_experts > 0 replaces every block's feed-forward by top_k-of-n_experts
    # SwiGLU experts of width expert_hidden_dim (0: hidden_dim / top_k, the dense block's
    # compute per token), plus one shared expert of that width if shared_expert
    n_experts: int = 0
    top_k: int = 2
    expert_hidden_dim: int = 0
    shared_expert: bool = False
    load_balance_coef: float = 0.01  # weight of the routers' load-balancing loss in training

    def __post_init__(self) -> None:
        if self.dim % self.n_heads:
            raise ValueError(f"dim={self.dim} is not divisible by n_heads={self.n_heads}")
        if (self.dim // self.n_heads) % 2:
            raise ValueError(f"head dim {self.dim // self.n_heads} must be even for RoPE")
        if not self.hidden_dim:
            self.hidden_dim = 16 * math.ceil(8 * self.dim / 3 / 16)
        if self.n_experts and not 1 <= self.top_k <= self.n_experts:
            raise ValueError(f"top_k={self.top_k} must be between 1 and n_experts={self.n_experts}")
        if self.n_experts and not self.expert_hidden_dim:
            self.expert_hidden_dim = 16 * math.ceil(self.hidden_dim / self.top_k / 16)


PRESETS: dict[str, ModelArgs] = {
    "tiny": ModelArgs(dim=64, n_layers=2, n_heads=4, max_seq_len=128),
    "small": ModelArgs(dim=256, n_layers=4, n_heads=8, max_seq_len=256),
    "base": ModelArgs(dim=768, n_layers=12, n_heads=12, max_seq_len=1024),
    "1b": ModelArgs(dim=2048, n_layers=16, n_heads=32, max_seq_len=2048),
    # mixture of experts: top-2 of 4 experts in every block (the demo's size), and top-2 of 8
    # with one shared expert
    "tiny-moe": ModelArgs(dim=64, n_layers=2, n_heads=4, max_seq_len=128, n_experts=4, top_k=2),
    "small-moe": ModelArgs(dim=256, n_layers=4, n_heads=8, max_seq_len=256, n_experts=8, top_k=2, shared_expert=True),
}


def model_args(
    preset: str, *, seq_len: int, dim: int | None = None, n_layers: int | None = None, n_heads: int | None = None,
    n_experts: int | None = None,
) -> ModelArgs:
    """``PRESETS[preset]`` with the given overrides (``None`` or 0 keeps the preset's) and
    room for sequences of ``seq_len``: the one shape rule of the launcher and benchmarks.
    ``n_experts`` makes every block's feed-forward a mixture of that many experts.

    Raises:
        ValueError: the overrides make an invalid shape (``dim`` not divisible by ``n_heads``).
    """
    fields = dict(PRESETS[preset].__dict__)
    overrides = {k: v for k, v in (("dim", dim), ("n_layers", n_layers), ("n_heads", n_heads),
                                   ("n_experts", n_experts)) if v}
    if overrides:
        fields.update(overrides, hidden_dim=0, expert_hidden_dim=0)  # 0: recomputed from the (new) width
    fields["max_seq_len"] = max(fields["max_seq_len"], seq_len)
    return ModelArgs(**fields)


def next_token_loss(model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of the model's logits for ``inputs`` against ``targets``, taken in
    fp32 whatever the compute dtype (a bf16 log-softmax would round the loss itself).
    A mixture-of-experts model trains on this plus :func:`load_balance_loss`."""
    return logits_loss(model(inputs), targets)


def routing_stats(model: nn.Module) -> dict[str, float]:
    """How evenly the last forward's routers spread this rank's tokens, for the log: the
    load-balancing loss (mean over MoE blocks, unweighted: 1.0 when balanced) and the
    busiest expert's tokens over the mean (max over blocks: 1.0 when balanced). Empty for
    a dense model."""
    blocks = [m for m in model.modules() if isinstance(m, MoE)]
    if not blocks:
        return {}
    balance = sum(float(m.balance_loss.detach()) for m in blocks) / len(blocks)
    busiest = max(float(m.tokens_per_expert.max() / m.tokens_per_expert.float().mean()) for m in blocks)
    return {"balance_loss": balance, "expert_load_max": busiest}


def load_balance_loss(model: nn.Module) -> torch.Tensor | float:
    """The routers' load-balancing loss of ``model``'s last forward, weighted by
    ``load_balance_coef`` and summed over its MoE blocks (0.0 for a dense model)."""
    return sum((m.balance_loss * m.coef for m in model.modules() if isinstance(m, MoE)), 0.0)


def logits_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of ``logits`` ``[B, T, vocab]`` against ``targets`` ``[B, T]``, in fp32
    (also the loss function of a pipeline schedule, which gets the last stage's output)."""
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def tp_plan() -> dict[str, ParallelStyle]:
    """The Llama tensor-parallel plan of a :class:`TransformerBlock` (names relative to it):
    q, k, v and the MLP's gate and up projections split by output features (each rank
    computes ``n_heads / tp`` whole heads and ``hidden_dim / tp`` hidden units), the
    attention output and the MLP's down projection by input features (their partial sums
    are all-reduced). Embedding, final norm and output head stay whole on each tp rank."""
    return {
        "attention.wq": ColwiseParallel(), "attention.wk": ColwiseParallel(), "attention.wv": ColwiseParallel(),
        "attention.wo": RowwiseParallel(),
        "feed_forward.w1": ColwiseParallel(), "feed_forward.w3": ColwiseParallel(),
        "feed_forward.w2": RowwiseParallel(),
    }


def check_tp(args: ModelArgs, tp: int) -> None:
    """Raise ``ValueError`` unless ``tp`` ranks can split the heads and hidden units of ``args``."""
    if args.n_experts and tp > 1:
        raise ValueError("--tp splits dense feed-forward layers; a mixture-of-experts preset has none: "
                         "train it with FSDP alone (drop --tp)")
    if args.n_heads % tp:
        raise ValueError(f"--tp {tp} does not divide the model's {args.n_heads} attention heads "
                         "(each tensor-parallel rank computes whole heads): pick a --tp that does, or set --n-heads")
    if args.hidden_dim % tp:
        raise ValueError(f"--tp {tp} does not divide the MLP's hidden width {args.hidden_dim}")


def check_pp(args: ModelArgs, pp: int) -> None:
    """Raise ``ValueError`` unless ``pp`` pipeline stages can hold equal shares of the blocks."""
    if args.n_experts and pp > 1:
        raise ValueError("--pp hands only the logits to the loss, and a mixture-of-experts preset also "
                         "trains on its routers' load-balancing loss: drop --pp")
    if args.n_layers % pp:
        raise ValueError(f"--pp {pp} does not divide the model's {args.n_layers} blocks (each pipeline "
                         "stage holds an equal share): pick a --pp that does, or set --n-layers")


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        normed = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps)
        return normed.type_as(x) * self.weight

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)


class Attention(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.head_dim = args.dim // args.n_heads
        self.wq = nn.Linear(args.dim, args.dim, bias=False)
        self.wk = nn.Linear(args.dim, args.dim, bias=False)
        self.wv = nn.Linear(args.dim, args.dim, bias=False)
        self.wo = nn.Linear(args.dim, args.dim, bias=False)

    def forward(self, x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
        batch, seq, _ = x.shape
        # -1 heads: under tensor parallelism wq/wk/wv give this rank dim / tp features, its heads
        q, k, v = (w(x).view(batch, seq, -1, self.head_dim) for w in (self.wq, self.wk, self.wv))
        q, k = apply_rope(q, freqs), apply_rope(k, freqs)
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
        )
        return self.wo(out.transpose(1, 2).reshape(batch, seq, -1))


class FeedForward(nn.Module):
    def __init__(self, args: ModelArgs, hidden_dim: int | None = None) -> None:
        super().__init__()
        hidden_dim = hidden_dim or args.hidden_dim
        self.w1 = nn.Linear(args.dim, hidden_dim, bias=False)  # gate
        self.w3 = nn.Linear(args.dim, hidden_dim, bias=False)  # up
        self.w2 = nn.Linear(hidden_dim, args.dim, bias=False)  # down

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Experts(nn.Module):
    """``num_experts`` SwiGLU experts as 3-D weights, in torchtitan's ``GroupedExperts``
    layout and computation: ``w1`` (gate) and ``w3`` (up) ``[experts, hidden, dim]``,
    ``w2`` (down) ``[experts, dim, hidden]``, each applied to its expert's tokens by one
    ``torch._grouped_mm`` over the transposed weight: ``fsdp_int8.weight.int8_grouped_mm``, which
    runs it for plain weights and int8 GEMMs for int8 ones with ``Int8MatmulConfig``."""

    def __init__(self, dim: int, hidden: int, num_experts: int) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.w1 = nn.Parameter(torch.empty(num_experts, hidden, dim))
        self.w3 = nn.Parameter(torch.empty(num_experts, hidden, dim))
        self.w2 = nn.Parameter(torch.empty(num_experts, dim, hidden))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        for weight in (self.w1, self.w3, self.w2):
            nn.init.normal_(weight, std=INIT_STD)

    def forward(self, x: torch.Tensor, tokens_per_expert: torch.Tensor) -> torch.Tensor:
        """``x`` ``[tokens, dim]`` sorted by expert, ``tokens_per_expert[e]`` rows each."""
        offsets = torch.cumsum(tokens_per_expert, dim=0, dtype=torch.int32)
        gate = int8_grouped_mm(x, self.w1, offsets)
        up = int8_grouped_mm(x, self.w3, offsets)
        return int8_grouped_mm(F.silu(gate) * up, self.w2, offsets)


class MoE(nn.Module):
    """Token-choice top-k routing over :class:`Experts`, with an optional shared expert.

    The router (``nn.Linear``, one logit per expert) stays in full precision under
    ``fsdp_int8`` (a linear layer directly under a module with ``num_experts``). Each
    forward keeps its load-balancing loss, ``n_experts * sum_e f_e * p_e`` (Switch
    Transformer's; 1.0 when balanced: ``f_e`` the share of routed slots, ``p_e`` the mean
    router probability of expert ``e``), in ``balance_loss``, and the routed slots per
    expert in ``tokens_per_expert``.
    """

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.num_experts, self.top_k, self.coef = args.n_experts, args.top_k, args.load_balance_coef
        self.router = nn.Linear(args.dim, args.n_experts, bias=False)
        self.experts = Experts(args.dim, args.expert_hidden_dim, args.n_experts)
        self.shared_expert = (
            FeedForward(args, hidden_dim=args.expert_hidden_dim) if args.shared_expert else None
        )
        self.balance_loss = torch.zeros(())
        self.tokens_per_expert = torch.zeros(args.n_experts, dtype=torch.long)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = x.reshape(-1, x.shape[-1])
        probs = self.router(tokens).float().softmax(dim=-1)
        weights, experts = probs.topk(self.top_k, dim=-1)  # [tokens, k]
        weights = (weights / weights.sum(dim=-1, keepdim=True)).type_as(x)
        slots = experts.flatten()
        counts = torch.bincount(slots, minlength=self.num_experts)
        self.tokens_per_expert = counts.detach()
        self.balance_loss = self.num_experts * (counts.float() / slots.numel() * probs.mean(dim=0)).sum()
        order = slots.argsort(stable=True)
        routed = self.experts(tokens[order // self.top_k], counts)
        per_slot = torch.empty_like(routed)
        per_slot[order] = routed
        out = (per_slot.view(-1, self.top_k, x.shape[-1]) * weights.unsqueeze(-1)).sum(dim=1)
        if self.shared_expert is not None:
            out = out + self.shared_expert(tokens)
        return out.view_as(x)


class TransformerBlock(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(args.dim, args.norm_eps)
        self.attention = Attention(args)
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps)
        self.feed_forward = MoE(args) if args.n_experts else FeedForward(args)

    def forward(self, x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), freqs)
        return x + self.feed_forward(self.ffn_norm(x))


class Transformer(nn.Module):
    """Token embedding, ``n_layers`` blocks in ``self.layers``, final norm, output head.

    A pipeline stage (:meth:`keep_stage`) holds a share of the blocks and, on the first and
    last stage, the embedding and the norm and head; its forward skips what it lacks.

    ``checkpoint_blocks`` (default ``False``): each block's forward runs under
    ``torch.utils.checkpoint`` (non-reentrant) while gradients are recorded, keeping only
    its input and recomputing the rest in backward."""

    checkpoint_blocks: bool = False

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.args = args
        self.tok_embeddings: nn.Embedding | None = nn.Embedding(args.vocab_size, args.dim)
        self.layers: nn.ModuleList | nn.ModuleDict = nn.ModuleList(
            TransformerBlock(args) for _ in range(args.n_layers))
        self.norm: RMSNorm | None = RMSNorm(args.dim, args.norm_eps)
        self.output: nn.Linear | None = nn.Linear(args.dim, args.vocab_size, bias=False)
        head_dim = args.dim // args.n_heads
        self.register_buffer(
            "freqs", rope_frequencies(head_dim, args.max_seq_len, args.rope_theta), persistent=False
        )

    def blocks(self) -> list[TransformerBlock]:
        """The blocks this model (or pipeline stage) holds, in order."""
        return list(self.layers.values() if isinstance(self.layers, nn.ModuleDict) else self.layers)

    def keep_stage(self, stage: int, n_stages: int) -> None:
        """Make this whole model pipeline stage ``stage`` of ``n_stages`` (in place): keep an
        equal share of the blocks, in an ``nn.ModuleDict`` keyed by their index in the whole
        model, so that parameter names (and checkpoint keys) stay the whole model's
        (``layers.3.attention.wq.weight``); the embedding only on the first stage, the final
        norm and the head only on the last. The forward then maps tokens or the previous
        stage's hidden states to hidden states or, on the last stage, logits."""
        check_pp(self.args, n_stages)
        if not isinstance(self.layers, nn.ModuleList) or not 0 <= stage < n_stages:
            raise ValueError(f"keep_stage({stage}, {n_stages}) needs a whole model and 0 <= stage < n_stages")
        share = self.args.n_layers // n_stages
        kept = range(stage * share, (stage + 1) * share)
        self.layers = nn.ModuleDict({str(i): self.layers[i] for i in kept})
        if stage > 0:
            self.tok_embeddings = None
        if stage < n_stages - 1:
            self.norm = None
            self.output = None

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        if tokens.shape[1] > self.args.max_seq_len:
            raise ValueError(f"sequence of {tokens.shape[1]} tokens > max_seq_len {self.args.max_seq_len}")
        x = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens  # a later stage: hidden states
        for layer in self.blocks():
            if self.checkpoint_blocks and torch.is_grad_enabled():
                x = checkpoint(layer, x, self.freqs, use_reentrant=False)
            else:
                x = layer(x, self.freqs)
        if self.norm is not None:
            x = self.norm(x)
        return self.output(x) if self.output is not None else x

    @torch.no_grad()
    def init_weights(self, seed: int = 0) -> None:
        """Initialise every parameter in place (also after ``to_empty`` on a meta model).

        Each parameter is drawn whole, on the CPU, from a generator of its own seeded by
        ``seed`` and its name (:func:`initial_value`), and each rank keeps its piece of it:
        a model sharded by FSDP2, tensor parallelism or pipeline stages (whose parameters keep
        the whole model's names) gets bit for bit the weights a single process gets, on
        every device. (DTensor's own random ops cannot promise that: on a CPU mesh every
        rank draws the same numbers for its own shard.)
        """
        head_dim = self.args.dim // self.args.n_heads
        self.freqs = rope_frequencies(head_dim, self.args.max_seq_len, self.args.rope_theta).to(
            self.freqs.device
        )
        residual = {f"{name}.weight" for name, module in self.named_modules()
                    if name.endswith(("attention.wo", "feed_forward.w2", "shared_expert.w2"))}
        residual |= {f"{name}.w2" for name, module in self.named_modules() if isinstance(module, Experts)}
        norms = {f"{name}.weight" for name, module in self.named_modules() if isinstance(module, RMSNorm)}
        for name, param in self.named_parameters():
            if name in norms:
                full = torch.ones(param.shape)
            else:
                # GPT-2's scaled init of the residual projections keeps early activations small.
                std = INIT_STD / math.sqrt(2 * self.args.n_layers) if name in residual else INIT_STD
                full = initial_value(seed, name, param.shape, std)
            param.copy_(_piece_like(full, param))


INIT_STD = 0.02  # the normal init of the embedding, the linear weights and the head


def initial_value(seed: int, name: str, shape: torch.Size, std: float) -> torch.Tensor:
    """The whole fp32 ``normal(0, std)`` tensor of parameter ``name``, on the CPU, from a
    generator seeded by ``seed`` and the name alone: the same on every rank and device."""
    # The CPU generator (mt19937) keeps 32 bits of a seed: hash (seed, name) into 32 bits.
    key = hashlib.blake2b(f"{seed}/{name}".encode(), digest_size=4).digest()
    generator = torch.Generator().manual_seed(int.from_bytes(key, "little"))
    return torch.randn(shape, generator=generator) * std


def _piece_like(full: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """``full`` placed as ``param`` is: on its device and, for a DTensor, as a DTensor of this
    rank's piece (a replicated DTensor redistributed to ``param``'s placements: slicing,
    no communication)."""
    full = full.to(param.device)
    if not isinstance(param, DTensor):
        return full
    mesh = param.device_mesh
    replicated = DTensor.from_local(full, mesh, [Replicate()] * mesh.ndim, run_check=False)
    return replicated.redistribute(mesh, param.placements)
