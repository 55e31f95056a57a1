"""Tiny models of the frameworks fsdp_int8 integrates with, built from configs (no weights
are downloaded). Shared by tests/test_integrations.py and its multi-process sibling in
tests/distributed; not collected by pytest.

transformers, accelerate and torchtitan are in the ``test`` extra: these tests must run in
CI, never skip.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

VOCAB = 128


def tiny_llama(*, tie: bool = False, seed: int = 0) -> nn.Module:
    """A transformers ``LlamaForCausalLM``: hidden 64, 2 layers, GQA (4 heads, 2 kv heads)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        tie_word_embeddings=tie,
    )
    torch.manual_seed(seed)
    return LlamaForCausalLM(config)


def tiny_gpt2() -> nn.Module:
    """A transformers ``GPT2LMHeadModel``, whose linears are ``Conv1D`` (weight ``[in, out]``)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(
        vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=64,
        bos_token_id=0, eos_token_id=0,
    )
    torch.manual_seed(0)
    return GPT2LMHeadModel(config)


def hf_loss(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    return model(input_ids=tokens, labels=tokens).loss


def titan_config(n_layers: int = 2):
    """torchtitan's Llama 3 debug model, shrunk: dim 64, 4 heads, 2 kv heads, fused QKV."""
    from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm, compute_ffn_hidden_dim
    from torchtitan.models.llama3 import (
        _EMBEDDING_INIT, _NORM_INIT, Llama3Model, _build_llama3_layers, _output_linear_init,
    )

    dim, heads = 64, 4
    return Llama3Model.Config(
        dim=dim, vocab_size=VOCAB,
        tok_embeddings=Embedding.Config(num_embeddings=VOCAB, embedding_dim=dim, param_init=_EMBEDDING_INIT),
        norm=RMSNorm.Config(normalized_shape=dim, param_init=_NORM_INIT),
        lm_head=Linear.Config(in_features=dim, out_features=VOCAB, param_init=_output_linear_init(dim)),
        layers=_build_llama3_layers(
            fuse_qkv=True, n_layers=n_layers, dim=dim, n_heads=heads, n_kv_heads=2,
            hidden_dim=compute_ffn_hidden_dim(dim, multiple_of=64),
            rope=ComplexRoPE.Config(dim=dim // heads, max_seq_len=64, theta=500000, scaling="llama"),
            attn_backend="flex",
        ),
    )


def titan_model(*, meta: bool = False) -> nn.Module:
    """The model of :func:`titan_config`, with SDPA inside its attention: FlexAttention (the
    config's backend) has no backward on CPU."""
    from torchtitan.models.common.attention import ScaledDotProductAttention

    with torch.device("meta" if meta else "cpu"):
        model = titan_config().build()
    for layer in model.layers.values():
        layer.attention.inner_attention = ScaledDotProductAttention.Config().build()
    return model


def titan_moe_config(n_layers: int = 2):
    """torchtitan's Qwen3 MoE (its debugmodel_moe's recipe), shrunk: dim 64, 4 experts of
    width 64, top 2, 4 heads of 16, 2 kv heads."""
    from torchtitan.models.common import CosSinRoPE, Embedding, Linear
    from torchtitan.models.qwen3 import (
        _EMBEDDING_INIT, _LINEAR_INIT, Qwen3Model, _build_qwen3_moe_layers, _qwen3_norm,
    )

    dim, head_dim = 64, 16
    return Qwen3Model.Config(
        vocab_size=VOCAB, dim=dim, norm=_qwen3_norm(dim),
        tok_embeddings=Embedding.Config(num_embeddings=VOCAB, embedding_dim=dim, param_init=_EMBEDDING_INIT),
        lm_head=Linear.Config(in_features=dim, out_features=VOCAB, param_init=_LINEAR_INIT),
        layers=_build_qwen3_moe_layers(
            fuse_qkv=True, n_layers=n_layers, dim=dim, n_heads=4, n_kv_heads=2, head_dim=head_dim,
            moe_hidden_dim=64, num_experts=4, top_k=2, attn_backend="flex", moe_comm_backend="standard",
            rope=CosSinRoPE.Config(dim=head_dim, max_seq_len=64, theta=1000000.0),
        ),
    )


def titan_init(model: nn.Module) -> None:
    """torchtitan's own initialisation (trunc_normal_ on every linear, fused-QKV aware)."""
    with torch.no_grad():
        model.init_states(buffer_device=torch.device("cpu"))


def titan_loss(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    logits = model(tokens[:, :-1])
    return F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())
