"""Int8 linear layers inside a graph that inductor compiles for the CPU: how the backward
reads the output gradient it quantizes when the op after the layer has a backward that
inductor's C++ code cannot vectorize.

The case is rotary position embedding that rotates interleaved channel pairs, written as
autograd sees it (the launcher's formula without its hand-written backward). Its backward
is a ``select_backward`` scatter. Inlined into the int8 linear's per-column absmax over
the tokens, it made a scalar loop that recomputed the scatter one element at a time down
each column, a whole row apart per load. The library hands the gradient to its quantizer as a buffer of its own
(``fsdp_int8._quant.kernels.as_buffer``): the scatter runs once, in row order, and every
quantization pass reads the buffer with vector loads.

Checked on inductor's generated code (the kernels, not a timing: on a CPU without AVX-512
the int8 and bf16 GEMMs take all the time) and on the gradients: the buffer holds the
gradient rounded to bf16, as eager quantizes it, where the inlined producer gave its fp32
value, so the compiled gradients move by that rounding; they stay as close to eager's.
"""

from __future__ import annotations

import re

import pytest
import torch
import torch._functorch.config as functorch_config
import torch._inductor.config as inductor_config
from torch._inductor.utils import run_and_get_code

import fsdp_int8
import launch.model
from fsdp_int8 import Int8MatmulConfig, Int8TrainingConfig
from fsdp_int8._quant.kernels import compiler_available
from fsdp_int8._weight import linear as int8_linear
from launch.model import Attention, ModelArgs
from launch.rope import rope_frequencies

pytestmark = pytest.mark.skipif(not compiler_available("cpu"), reason="inductor needs a C++ compiler")

# Distinct sizes, so that a load's stride tells which dimension it walks.
BATCH, SEQ, DIM, HEADS = 2, 40, 96, 4


def _rope_as_autograd_sees_it(x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    """The launcher's rotation of interleaved pairs with autograd's own backward."""
    pairs = x.float().unflatten(-1, (-1, 2))
    cos, sin = freqs[: x.shape[1], None, :, 0], freqs[: x.shape[1], None, :, 1]
    even, odd = pairs[..., 0], pairs[..., 1]
    return torch.stack([even * cos - odd * sin, even * sin + odd * cos], dim=-1).flatten(-2).type_as(x)


def _setup(make_module) -> tuple[torch.nn.Module, torch.Tensor]:
    """``make_module()`` with weights from seed 0, int8 matmuls, in bf16, and its input."""
    torch.manual_seed(0)
    module = make_module().to(torch.bfloat16)
    fsdp_int8.quantize_(module, Int8TrainingConfig(int8_matmul=Int8MatmulConfig()))
    x = torch.randn(BATCH, SEQ, DIM, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    return module, x.requires_grad_()


def _step(run, x: torch.Tensor, *extra) -> None:
    out = run(x, *extra)
    out = out[0] if isinstance(out, tuple) else out
    out.float().square().sum().backward()


def _eager_step(make_module, *extra) -> list[torch.Tensor]:
    module, x = _setup(make_module)
    _step(module, x, *extra)
    return [x.grad] + [p.grad for p in module.parameters()]


def _compiled_step(make_module, *extra) -> tuple[str, list[torch.Tensor]]:
    """Inductor's backward code of one forward and backward of ``make_module()`` (weights
    from seed 0, int8 matmuls, bf16) and the gradients it gave, compiled afresh (no cached
    graph of other code)."""
    torch._dynamo.reset()
    module, x = _setup(make_module)
    compiled = torch.compile(module, fullgraph=True, backend="inductor")
    with inductor_config.patch(fx_graph_cache=False, compile_threads=1), \
            functorch_config.patch(enable_autograd_cache=False):
        _, codes = run_and_get_code(_step, compiled, x, *extra)
    assert len(codes) == 2, "one forward and one backward graph"
    return codes[1], [x.grad] + [p.grad for p in module.parameters()]


def _cpp_kernels(code: str) -> dict[str, str]:
    found = re.findall(r"^(cpp_fused\w+) = async_compile\.cpp_pybinding\(.*?r'''(.*?)'''", code, re.S | re.M)
    assert found, "inductor generated C++ kernels"
    return dict(found)


def _column_walks(code: str) -> list[str]:
    """Scalar loads that step a whole row (``DIM`` elements) per iteration of the loop
    around them: a column read one element at a time."""
    loop = re.compile(r"for\(int64_t (x\d+)=.*\+=static_cast<int64_t>\(1L\)\)")
    walks = []
    for body in _cpp_kernels(code).values():
        inner = None  # the variable of the last loop opened: the one around the lines after it
        for line in body.splitlines():
            if found := loop.search(line):
                inner = found.group(1)
            elif "for(int64_t" in line:
                inner = None  # a vector loop: its loads are vector loads
            elif inner and re.search(rf"\b(?:in|out)_ptr\d+\[[^\]]*\b{DIM}L\*{inner}\b", line):
                walks.append(line.strip())
    return walks


def _vector_column_reads(code: str) -> bool:
    """Whether some loop reads a vector of columns per token (the per-column absmax)."""
    reads = re.compile(rf"loadu\([^;]*\b{DIM}L\*x1\b")
    return any(reads.search(body) for body in _cpp_kernels(code).values())


def _relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want.float()).norm() / want.float().norm())


@pytest.mark.exhaustive  # a speed property of inductor's code, not of the values (tested in CI elsewhere)
def test_interleaved_rope_gradient_is_quantized_with_vector_loads(monkeypatch):
    """The launcher's attention with autograd's backward of its rotary embedding: the int8
    q / k projections' gradient quantization reads no column element by element, and the
    gradients are as close to eager's as with the producer inlined (without the buffer
    inductor generated 4 such scalar column reads here, torch 2.13)."""
    monkeypatch.setattr(launch.model, "apply_rope", _rope_as_autograd_sees_it)
    args = ModelArgs(dim=DIM, n_heads=HEADS, n_layers=1, max_seq_len=SEQ)
    freqs = rope_frequencies(DIM // HEADS, SEQ, args.rope_theta)

    code, grads = _compiled_step(lambda: Attention(args), freqs)
    assert not _column_walks(code), _column_walks(code)[:4]
    assert _vector_column_reads(code)

    eager_grads = _eager_step(lambda: Attention(args), freqs)
    monkeypatch.setattr(int8_linear, "as_buffer", lambda values: values)  # the inlined form
    inlined_code, inlined_grads = _compiled_step(lambda: Attention(args), freqs)
    assert inlined_code != code
    for got, inlined, want in zip(grads, inlined_grads, eager_grads, strict=True):
        assert _relative_error(got, want) <= 1.05 * _relative_error(inlined, want) + 1e-6


@pytest.mark.exhaustive
def test_hugging_face_rope_gradient_is_quantized_with_vector_loads():
    """Hugging Face's ``rotate_half`` (slices and a cat): its backward inductor vectorizes
    with masked loads, inlined or not; the quantization stays vectorized with the buffer."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaAttention, LlamaRotaryEmbedding

    config = LlamaConfig(hidden_size=DIM, num_attention_heads=HEADS, num_key_value_heads=HEADS,
                         intermediate_size=2 * DIM, num_hidden_layers=1, vocab_size=64,
                         attn_implementation="sdpa")
    x = torch.zeros(BATCH, SEQ, DIM)
    cos, sin = LlamaRotaryEmbedding(config)(x, torch.arange(SEQ)[None].expand(BATCH, SEQ))
    code, _ = _compiled_step(lambda: LlamaAttention(config, 0), (cos.bfloat16(), sin.bfloat16()), None)
    assert not _column_walks(code), _column_walks(code)[:4]
    assert _vector_column_reads(code)
