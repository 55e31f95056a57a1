"""A causal-LM loss that never holds fp32 logits of the whole batch; it imports no framework.

transformers' causal-LM loss upcasts the logits to fp32 and keeps their log-softmax for
backward, then makes its fp32 gradient: three fp32 copies of ``tokens x vocabulary``,
the largest part of the lean recipe's peak (docs/memory.md) and, at a real vocabulary,
of any recipe's. :func:`chunked_causal_lm_loss` computes the same loss a chunk of tokens
at a time, so only the logits in their own dtype, their gradient in that dtype, and one
chunk in fp32 exist at once; :func:`use_chunked_loss` gives it to a model.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.nn.functional as F

__all__ = ["chunked_causal_lm_loss", "use_chunked_loss"]


def _summed_cross_entropy(logits: torch.Tensor, targets: torch.Tensor, ignore_index: int) -> torch.Tensor:
    return F.cross_entropy(logits.float(), targets, ignore_index=ignore_index, reduction="sum")


class _ChunkedCrossEntropy(torch.autograd.Function):
    """The summed fp32 cross-entropy of ``[tokens, vocabulary]`` logits, ``chunk_tokens``
    rows at a time. Forward keeps no fp32 tensor; backward recomputes each chunk's fp32
    log-softmax and writes the chunk's gradient into its rows of one gradient of the
    logits (never the chunks' gradients and their concatenation)."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, targets: torch.Tensor, chunk_tokens: int, ignore_index: int):
        ctx.save_for_backward(logits, targets)
        ctx.chunk_tokens, ctx.ignore_index = chunk_tokens, ignore_index
        chunks = zip(logits.split(chunk_tokens), targets.split(chunk_tokens))
        return sum(_summed_cross_entropy(chunk, chunk_targets, ignore_index) for chunk, chunk_targets in chunks)

    @staticmethod
    def backward(ctx, grad_total: torch.Tensor):
        logits, targets = ctx.saved_tensors
        grad = torch.empty_like(logits)
        rows = zip(grad.split(ctx.chunk_tokens), logits.split(ctx.chunk_tokens), targets.split(ctx.chunk_tokens))
        for grad_rows, chunk, chunk_targets in rows:
            # autograd's chain for this chunk, op by op (the same bits): log_softmax of the
            # fp32 logits; nll_loss's gradient, -grad_total at each counted token's target;
            # log_softmax's backward written over that gradient (each row sums it before
            # writing), so two fp32 chunks exist at once, not three; the cast into grad
            log_probs = torch.log_softmax(chunk.float(), dim=-1)
            counted = (chunk_targets != ctx.ignore_index).unsqueeze(1)
            grad_chunk = torch.zeros_like(log_probs).scatter_(
                1, chunk_targets.unsqueeze(1).masked_fill(~counted, 0), counted.to(log_probs.dtype) * -grad_total)
            torch.ops.aten._log_softmax_backward_data.out(grad_chunk, log_probs, -1, torch.float32, out=grad_chunk)
            grad_rows.copy_(grad_chunk)
            del log_probs, grad_chunk  # before the next chunk's are made
        return grad, None, None, None


def chunked_causal_lm_loss(
    logits: torch.Tensor,
    labels: torch.Tensor | None,
    vocab_size: int | None = None,
    num_items_in_batch: torch.Tensor | int | None = None,
    ignore_index: int = -100,
    shift_labels: torch.Tensor | None = None,
    *,
    chunk_tokens: int = 1024,
    **kwargs: Any,
) -> torch.Tensor:
    """Next-token cross-entropy in fp32, ``chunk_tokens`` tokens at a time.

    The value of transformers' ``ForCausalLMLoss`` (up to fp32 summation order): labels
    shifted left by one (or ``shift_labels`` as given), tokens labelled ``ignore_index``
    left out, the mean over the others, or the sum over ``num_items_in_batch`` when given
    (gradient accumulation); the gradient is the same bit for bit. Each chunk's fp32 logits
    and log-softmax are recomputed in backward instead of kept, and each chunk's gradient
    is written into its rows of the logits' gradient.
    A Hugging Face model uses it with ``model.loss_function = chunked_causal_lm_loss``
    (also after ``fully_shard``); what it saves: docs/memory.md.

    Args:
        logits: ``[..., vocabulary]`` in any floating dtype (bf16 under mixed precision).
        labels: The input ids, ``logits.shape[:-1]``; unused when ``shift_labels`` is given.
        vocab_size: The last dim of ``logits`` (checked when given).
        num_items_in_batch: Divide the summed loss by this instead of the token count.
        ignore_index: Label of the tokens that carry no loss.
        shift_labels: The targets themselves, already shifted.
        chunk_tokens: Tokens per chunk (>= 1): the fp32 temporaries of backward are
            about ``2 x 4 x chunk_tokens x vocabulary`` bytes.
        **kwargs: Accepted and ignored, as transformers' own loss ignores what it does not use.

    Returns:
        A 0-dim fp32 tensor.

    Raises:
        ValueError: ``chunk_tokens < 1``, neither ``labels`` nor ``shift_labels``, a
            ``vocab_size`` that is not the logits' last dim, or labels that do not match
            the logits' tokens.

    Example::

        model.loss_function = chunked_causal_lm_loss
        loss = model(input_ids=ids, labels=ids).loss
    """
    if isinstance(chunk_tokens, bool) or not isinstance(chunk_tokens, int) or chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be a positive int, got {chunk_tokens!r}")
    if vocab_size is not None and logits.shape[-1] != vocab_size:
        raise ValueError(f"logits of shape {tuple(logits.shape)} do not end in vocab_size={vocab_size}")
    if shift_labels is None:
        if labels is None:
            raise ValueError("chunked_causal_lm_loss needs labels or shift_labels")
        shift_labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    flat_logits = logits.reshape(-1, logits.shape[-1])
    targets = shift_labels.reshape(-1).to(flat_logits.device)
    if targets.shape[0] != flat_logits.shape[0]:
        raise ValueError(f"{targets.shape[0]} labels for {flat_logits.shape[0]} tokens of logits")
    total = _ChunkedCrossEntropy.apply(flat_logits, targets, chunk_tokens, ignore_index)
    if num_items_in_batch is None:
        count = (targets != ignore_index).sum()
    elif torch.is_tensor(num_items_in_batch):
        count = num_items_in_batch.to(flat_logits.device)
    else:
        count = num_items_in_batch
    return total / count


def use_chunked_loss(model: torch.nn.Module, chunk_tokens: int) -> bool:
    """Make a transformers causal LM compute its loss with :func:`chunked_causal_lm_loss`.

    Only a model whose loss is transformers' causal-LM loss (``loss_type`` ``"ForCausalLM"``)
    and that has no ``loss_function`` of its own set: any other keeps its loss.
    :func:`fsdp_int8.quantize_` calls it for ``Int8TrainingConfig(loss_chunk_tokens=N)``
    (which ``Int8TrainingConfig.lean()`` sets).

    Args:
        model: The model; its ``loss_function`` is set.
        chunk_tokens: Tokens per chunk of :func:`chunked_causal_lm_loss`.

    Returns:
        Whether the model now uses the chunked loss.
    """
    if getattr(model, "loss_type", None) != "ForCausalLM" or "_loss_function" in vars(model):
        return False
    model.loss_function = functools.partial(chunked_causal_lm_loss, chunk_tokens=chunk_tokens)
    return True
