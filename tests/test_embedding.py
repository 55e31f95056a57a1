"""Int8 embeddings (``Int8TrainingConfig(quantize_embeddings=True)``), one process: the
lookup and its gradient against a plain embedding of the same values, what ``quantize_``
selects (a tied output head follows), training against fp32, and every save path."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

import fsdp_int8
from fsdp_int8 import Int8AdamW, Int8TrainingConfig, Int8Weight, quantize_
from launch.model import ModelArgs, Transformer, next_token_loss

from _models import fibonacci_mod_task

EMBEDDINGS = Int8TrainingConfig(quantize_embeddings=True, seed=3)


def _tied_llama(seed: int = 0) -> Transformer:
    """The launcher's Llama at a tiny shape, its head tied to the embedding (Llama-3.2-1B's
    ``tie_word_embeddings``)."""
    torch.manual_seed(seed)
    model = Transformer(ModelArgs(vocab_size=40, dim=32, n_layers=2, n_heads=2, max_seq_len=16))
    model.init_weights(seed)
    model.output.weight = model.tok_embeddings.weight
    return model


def _int8_table(rows: int = 11, dim: int = 16) -> Int8Weight:
    return Int8Weight.from_float(torch.randn(rows, dim, generator=torch.Generator().manual_seed(0)))


@pytest.mark.parametrize("padding_idx", [None, 2, -1])
@pytest.mark.parametrize("scale_grad_by_freq", [False, True])
def test_lookup_and_gradient_equal_a_plain_embedding_of_the_same_values(padding_idx, scale_grad_by_freq):
    table = _int8_table()
    plain = table.dequantize().requires_grad_(True)
    int8 = nn.Parameter(table)
    ids = torch.tensor([[0, 2, 2, 10], [10, 1, 2, 5]])
    grad_out = torch.randn(2, 4, table.shape[1])
    out = F.embedding(ids, int8, padding_idx=padding_idx, scale_grad_by_freq=scale_grad_by_freq)
    expected = F.embedding(ids, plain, padding_idx=padding_idx, scale_grad_by_freq=scale_grad_by_freq)
    # the same fp32 products q * scale, looked up: equal bit for bit
    assert type(out) is torch.Tensor and torch.equal(out, expected)
    out.backward(grad_out)
    expected.backward(grad_out)
    # the same aten kernel (embedding_dense_backward) on the same inputs
    assert type(int8.grad) is torch.Tensor and torch.equal(int8.grad, plain.grad)


class _TableSizedLookupGradients(TorchDispatchMode):
    """Counts the table-sized tensors that torch's lookup backward (a dense gradient) and
    autograd's out-of-place sum of two gradients make."""

    def __init__(self, shape: torch.Size):
        super().__init__()
        self.shape, self.count = shape, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in (torch.ops.aten.embedding_dense_backward.default, torch.ops.aten.add.Tensor):
            self.count += out.shape == self.shape
        return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("padding_idx, scale_grad_by_freq", [(None, False), (2, True)])
def test_a_table_tied_to_its_head_gets_one_dense_gradient_of_the_same_values(dtype, padding_idx, scale_grad_by_freq):
    int8_rows = _int8_table(rows=30)
    table = int8_rows.with_tensors(int8_rows.int_rows(), int8_rows.scale, dtype=dtype)
    int8 = nn.Parameter(table)
    plain = table.dequantize().to(dtype).requires_grad_(True)
    ids = torch.tensor([[0, 2, 2, 29], [29, 1, 2, 5]])
    grad_out = torch.randn(2, 4, 30, dtype=dtype)

    def backward(weight):  # two lookups (an encoder's and a decoder's) and the head
        hidden = [F.embedding(i, weight, padding_idx=padding_idx, scale_grad_by_freq=scale_grad_by_freq)
                  for i in (ids, ids.flip(-1))]
        out = F.linear(hidden[0] * hidden[1], weight)
        with _TableSizedLookupGradients(table.shape) as made:
            out.backward(grad_out)
        return made.count

    # torch's: each lookup's dense gradient, and autograd's sums of them and the head's
    assert backward(plain) == 4
    # ours: the lookups' rows go into the head's gradient, the one table-sized gradient
    assert backward(int8) == 0
    # Each id's rows summed by the same kernel, then added to the head's gradient once per
    # lookup, as autograd's sums do: equal bit for bit.
    assert torch.equal(int8.grad, plain.grad)
    assert not int8._backward_hooks  # the one-shot hook is gone
    # nothing refers to the weight: Module._apply can swap it (as .to() does for subclasses)
    holder = nn.Module()
    holder.weight = int8
    holder._apply(lambda t: t.clone())
    assert holder.weight is int8 and torch.equal(int8.grad, plain.grad)


def test_a_lookup_without_a_dense_gradient_before_it_returns_its_own():
    int8 = nn.Parameter(_int8_table(rows=30))
    plain = int8.detach().dequantize().requires_grad_(True)
    ids, x = torch.tensor([3, 3, 7]), torch.ones(1, 16)
    for weight in (plain, int8):
        F.embedding(ids, weight).sum().backward()  # the lookup alone
        # a head made before the lookup: its backward runs after the lookup's
        (F.embedding(ids, weight) * F.linear(x, weight).sum()).sum().backward()
    assert torch.equal(int8.grad, plain.grad) and not int8._backward_hooks


def test_lookup_dequantizes_only_the_rows_it_reads_in_the_weights_dtype():
    table = _int8_table(7, 8)
    bf16 = table.with_tensors(table.int_rows(), table.scale, dtype=torch.bfloat16)
    out = F.embedding(torch.tensor([3]), bf16)
    assert out.dtype == torch.bfloat16
    assert torch.equal(out, table.dequantize()[3:4].to(torch.bfloat16))


def test_refused_lookups_say_what_to_do():
    int8 = _int8_table()
    with pytest.raises(NotImplementedError, match="max_norm.*module_filter"):
        F.embedding(torch.tensor([1]), int8, max_norm=1.0)
    with pytest.raises(NotImplementedError, match="sparse"):
        F.embedding(torch.tensor([1]), int8, sparse=True)
    with pytest.raises(TypeError, match="int32 or int64 indices"):
        F.embedding(torch.tensor([1.0]), int8)


def test_off_by_default_and_a_tied_head_follows_the_embedding():
    model = _tied_llama()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        quantize_(model)
    assert not isinstance(model.tok_embeddings.weight, Int8Weight)
    assert not any("tied" in str(w.message) for w in caught)  # the head is a skip name

    model = _tied_llama()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing left behind, nothing to warn about
        quantize_(model, EMBEDDINGS)
    weight = model.tok_embeddings.weight
    assert isinstance(weight, Int8Weight) and model.output.weight is weight
    assert isinstance(weight, nn.Parameter) and weight.requires_grad


def test_module_filter_decides_and_unsupported_embeddings_stay_in_full_precision():
    model = nn.ModuleDict({"a": nn.Embedding(10, 16), "b": nn.Embedding(10, 16), "c": nn.Embedding(10, 16, max_norm=1.0)})
    only_a = Int8TrainingConfig(quantize_embeddings=True, module_filter=lambda m, name: name != "b")
    with pytest.warns(UserWarning, match=r"1 layer\(s\) in full precision that it cannot convert: c \(max_norm"):
        quantize_(model, only_a)
    assert isinstance(model["a"].weight, Int8Weight)
    assert not isinstance(model["b"].weight, Int8Weight) and not isinstance(model["c"].weight, Int8Weight)
    narrow = nn.ModuleDict({"e": nn.Embedding(10, 8)})
    quantize_(narrow, Int8TrainingConfig(quantize_embeddings=True, min_features=16))
    assert not isinstance(narrow["e"].weight, Int8Weight)  # rows shorter than min_features


def test_reset_parameters_keeps_the_padding_row_zero():
    embedding = nn.Embedding(12, 16, padding_idx=4)
    quantize_(nn.ModuleList([embedding]), EMBEDDINGS)
    embedding.reset_parameters()  # normal_, then the padding row filled with zero
    values = embedding.weight.dequantize()
    assert torch.equal(values[4], torch.zeros(16)) and values.abs().sum() > 0


def test_trains_like_fp32():
    """The tied Llama learns the Fibonacci-mod task with int8 embeddings (and head) as
    with fp32 weights: 60 AdamW steps from the same start."""
    seqs = fibonacci_mod_task(batch=32, seq_len=12, vocab=40)
    losses = {}
    for name, config in (("fp32", None), ("int8", EMBEDDINGS)):
        model = _tied_llama()
        if config is not None:
            quantize_(model, config)
            opt = Int8AdamW(model.parameters(), lr=3e-3)
        else:
            opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
        for _ in range(60):
            loss = next_token_loss(model, seqs[:, :-1], seqs[:, 1:])
            loss.backward()
            opt.step()
            opt.zero_grad()
        losses[name] = loss.item()
    first = next_token_loss(_tied_llama(), seqs[:, :-1], seqs[:, 1:]).item()
    assert losses["fp32"] < 0.8 * first  # the task is learnt in 60 steps
    # Per-row int8 (|error| <= half a step of 1/127 of the row's absmax) plus stochastic
    # rounding of every update: a few percent of the loss at this size, never a divergence.
    assert losses["int8"] == pytest.approx(losses["fp32"], rel=0.05)


def test_step_in_backward_equals_stepping_after_backward_with_a_tied_int8_embedding():
    seqs = fibonacci_mod_task(batch=8, seq_len=12, vocab=40)
    results = []
    for in_backward in (False, True):
        model = quantize_(_tied_llama(), EMBEDDINGS)
        opt = Int8AdamW(model.parameters(), lr=1e-2, step_in_backward=in_backward)
        for _ in range(3):
            next_token_loss(model, seqs[:, :-1], seqs[:, 1:]).backward()
            opt.step()
            opt.zero_grad()
        weight = model.tok_embeddings.weight
        results.append((weight.int_data.clone(), weight.scale.clone()))
    assert torch.equal(results[0][0], results[1][0]) and torch.equal(results[0][1], results[1][1])


def test_every_save_path_round_trips(tmp_path):
    model = quantize_(_tied_llama(), EMBEDDINGS)
    weight = model.tok_embeddings.weight
    # torch.save of the state dict (weights_only load), into a fresh quantized model
    torch.save(model.state_dict(), tmp_path / "sd.pt")
    fresh = quantize_(_tied_llama(seed=1), EMBEDDINGS)
    fresh.load_state_dict(torch.load(tmp_path / "sd.pt", weights_only=True))
    assert torch.equal(fresh.tok_embeddings.weight.int_data, weight.int_data)
    assert fresh.output.weight is fresh.tok_embeddings.weight  # still tied
    # fsdp_int8's own checkpoint, with the optimizer
    opt = Int8AdamW(model.parameters(), lr=1e-2)
    seqs = fibonacci_mod_task(batch=4, seq_len=12, vocab=40)
    next_token_loss(model, seqs[:, :-1], seqs[:, 1:]).backward()
    opt.step()
    fsdp_int8.save_checkpoint(tmp_path / "ckpt", model, opt, step=1)
    again = quantize_(_tied_llama(seed=2), EMBEDDINGS)
    again_opt = Int8AdamW(again.parameters(), lr=1e-2)
    fsdp_int8.load_checkpoint(tmp_path / "ckpt", again, again_opt)
    assert torch.equal(again.tok_embeddings.weight.int_data, weight.int_data)
    assert torch.equal(again.tok_embeddings.weight.scale, weight.scale)
    # the dequantized export: plain tensors under the unquantized model's keys
    exported = fsdp_int8.export_full_state_dict(model, dtype=torch.float32)
    plain = _tied_llama()
    plain.load_state_dict(exported)
    assert torch.equal(plain.tok_embeddings.weight, weight.dequantize())
