"""``fsdp_int8.integrations.hf_loss.chunked_causal_lm_loss`` against transformers' ``ForCausalLMLoss``:
the same loss and gradient, without fp32 logits of the whole batch (torch's MemTracker)."""

from __future__ import annotations

import pytest
import torch
from torch.distributed._tools.mem_tracker import MemTracker
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.loss.loss_utils import ForCausalLMLoss

from fsdp_int8.integrations.hf_loss import chunked_causal_lm_loss

VOCAB, BATCH, TOKENS = 1000, 2, 129


def _logits_and_labels() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    logits = (torch.randn(BATCH, TOKENS, VOCAB, generator=generator) * 3).bfloat16()
    labels = torch.randint(0, VOCAB, (BATCH, TOKENS), generator=generator)
    labels[0, :5] = -100  # a padded prompt: no loss there
    return logits, labels


def _loss_and_grad(loss_fn, logits: torch.Tensor, labels: torch.Tensor, **options):
    logits = logits.clone().requires_grad_()
    tracker = MemTracker()
    tracker.track_external(logits)
    with tracker:
        loss = loss_fn(logits, labels, VOCAB, **options)
        loss.backward()
    peak = tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"]
    return loss.detach(), logits.grad, peak


@pytest.mark.parametrize("options", [{}, {"num_items_in_batch": torch.tensor(300)}, {"num_items_in_batch": 300}],
                         ids=["mean", "sum over a tensor count", "sum over an int count"])
def test_same_loss_and_gradient_as_transformers(options):
    logits, labels = _logits_and_labels()
    expected, expected_grad, _ = _loss_and_grad(ForCausalLMLoss, logits, labels, **options)
    loss, grad, _ = _loss_and_grad(chunked_causal_lm_loss, logits, labels, chunk_tokens=64, **options)
    # the same fp32 terms summed in another order (chunk sums, then their sum): a few ulps
    torch.testing.assert_close(loss, expected, rtol=1e-6, atol=0)
    # each token's gradient is the same fp32 softmax - one-hot over the count, cast to bf16
    torch.testing.assert_close(grad, expected_grad, rtol=0, atol=0)


def test_shift_labels_given():
    logits, labels = _logits_and_labels()
    shifted = torch.nn.functional.pad(labels, (0, 1), value=-100)[..., 1:].contiguous()  # as transformers needs
    expected, _, _ = _loss_and_grad(ForCausalLMLoss, logits, None, shift_labels=shifted)
    loss, _, _ = _loss_and_grad(chunked_causal_lm_loss, logits, None, shift_labels=shifted, chunk_tokens=100)
    torch.testing.assert_close(loss, expected, rtol=1e-6, atol=0)


def test_no_fp32_logits_of_the_whole_batch():
    logits, labels = _logits_and_labels()
    _, _, transformers_peak = _loss_and_grad(ForCausalLMLoss, logits, labels)
    _, _, chunked_peak = _loss_and_grad(chunked_causal_lm_loss, logits, labels, chunk_tokens=8)
    fp32_logits = BATCH * TOKENS * VOCAB * 4
    # transformers keeps fp32 logits, their log-softmax and an fp32 gradient; the chunks
    # keep the bf16 gradient and one chunk's fp32 values (8 of 258 tokens): two fp32 copies less
    assert transformers_peak - chunked_peak >= 2 * fp32_logits, (transformers_peak, chunked_peak)
    # beyond the logits and their one gradient, two fp32 chunks (the chunk's log-softmax and
    # its gradient) and a few small tensors: no second gradient of the logits (the chunks'
    # gradients, then joined), no third fp32 chunk (log-softmax's backward writes in place)
    bf16_logits, fp32_chunk = BATCH * TOKENS * VOCAB * 2, 8 * VOCAB * 4
    assert chunked_peak - 2 * bf16_logits <= 2.5 * fp32_chunk, (chunked_peak, bf16_logits, fp32_chunk)


def test_a_hugging_face_model_trains_with_it():
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=1))
    ids = torch.randint(0, 128, (2, 33), generator=torch.Generator().manual_seed(1))
    expected = model(input_ids=ids, labels=ids).loss
    model.loss_function = chunked_causal_lm_loss
    torch.testing.assert_close(model(input_ids=ids, labels=ids).loss, expected, rtol=1e-6, atol=0)


def test_the_lean_config_gives_a_causal_lm_the_chunked_loss_and_others_keep_theirs():
    import fsdp_int8
    from fsdp_int8.config import LEAN_LOSS_CHUNK_TOKENS

    def llama() -> LlamaForCausalLM:
        torch.manual_seed(0)
        return LlamaForCausalLM(LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64,
                                            num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1))

    ids = torch.randint(0, 128, (2, 300), generator=torch.Generator().manual_seed(1))
    plain = fsdp_int8.quantize_(llama(), fsdp_int8.Int8TrainingConfig(quantize_embeddings=True))
    lean = fsdp_int8.quantize_(llama(), fsdp_int8.Int8TrainingConfig.lean(compute_dtype=None))
    assert "_loss_function" not in vars(plain)  # transformers' own
    assert lean.loss_function.func is chunked_causal_lm_loss
    assert lean.loss_function.keywords == {"chunk_tokens": LEAN_LOSS_CHUNK_TOKENS} and 300 > LEAN_LOSS_CHUNK_TOKENS
    # the same int8 model and tokens: the same loss up to fp32 summation order (3 chunks
    # summed, then divided, against one mean: a few ulps of a loss near ln(128))
    torch.testing.assert_close(lean(input_ids=ids, labels=ids).loss, plain(input_ids=ids, labels=ids).loss,
                               rtol=1e-6, atol=0)
    own = llama()
    own.loss_function = ForCausalLMLoss  # a loss the user chose stays
    fsdp_int8.quantize_(own, fsdp_int8.Int8TrainingConfig.lean(compute_dtype=None))
    assert own.loss_function is ForCausalLMLoss
    with pytest.raises(TypeError, match="loss_chunk_tokens takes a positive int or None, got 0"):
        fsdp_int8.Int8TrainingConfig(loss_chunk_tokens=0)


@pytest.mark.parametrize("arguments, message", [
    (dict(chunk_tokens=0), "chunk_tokens must be a positive int"),
    (dict(vocab_size=VOCAB + 1), "do not end in vocab_size"),
    (dict(labels=None), "needs labels or shift_labels"),
])
def test_bad_arguments_are_refused(arguments, message):
    logits, labels = _logits_and_labels()
    call = dict(logits=logits, labels=labels) | arguments
    with pytest.raises(ValueError, match=message):
        chunked_causal_lm_loss(**call)
