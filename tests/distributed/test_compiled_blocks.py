"""Transformer blocks compiled with ``torch.compile(fullgraph=True)`` under FSDP2, 2 gloo ranks,
one spawn.

With int8 matmuls and FSDP2's default ``reshard_after_forward=True`` the compiled graph
saves the unsharded weight's inner tensors (int8 rows, fp32 row scales) for backward, and
the backward all-gather refills them: the refill must not trip autograd's version check
(it did: "[torch.FloatTensor [64]] is at version 1; expected version 0"). Each case trains
three steps and must give the eager run's losses bit for bit: the ``aot_eager`` backend
runs the same kernels as eager through AOTAutograd, which is where saved tensors are
checked (inductor fuses the block's own fp32 ops differently; the exhaustive matrix,
``FSDP_INT8_FULL_MATRIX=1``, runs it with a bound). Every case compiles without a graph
break and really runs compiled (dynamo's counters).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

import fsdp_int8
from fsdp_int8 import Int8MatmulConfig, Int8TrainingConfig
from fsdp_int8.testing import run_distributed

from _cases import FULL_MATRIX, case
from _nets import tiny_transformer

STEPS = 3
INT8_MM = Int8TrainingConfig(int8_matmul=Int8MatmulConfig())
WEIGHT_ONLY = Int8TrainingConfig()
# inductor fuses RMSNorm, softmax and the residual adds in other orders than eager: fp32
# rounding of those sums, ~1e-7 relative per op, a few ulps of the loss over 3 steps
INDUCTOR_RTOL = 1e-5


def _train(rank: int, config: Int8TrainingConfig, *, compile_: str | None, backend: str,
           reshard: bool = True) -> list[float]:
    """Losses of 3 AdamW steps. ``compile_``: ``None`` (eager), ``"before"`` (each block's
    ``Module.compile`` before ``shard_model``, torchtitan's order) or ``"after"`` (each block
    replaced by ``torch.compile(block)`` after ``shard_model``)."""
    model = tiny_transformer(dim=64, vocab_size=64)
    if compile_ == "before":
        for block in model.layers:
            block.compile(fullgraph=True, backend=backend)
    fsdp_int8.shard_model(model, config=config, reshard_after_forward=reshard)
    if compile_ == "after":
        for index, block in enumerate(model.layers):
            model.layers[index] = torch.compile(block, fullgraph=True, backend=backend)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    tokens = torch.randint(0, 64, (2, 17), generator=torch.Generator().manual_seed(rank))
    losses = []
    for _ in range(STEPS):
        logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def _compiled_like_eager(rank: int, world: int) -> None:
    from torch._dynamo.utils import counters

    backends = ("aot_eager", "inductor") if FULL_MATRIX else ("aot_eager",)
    cases = [
        ("int8 matmuls, compiled after shard_model, reshard_after_forward=True", INT8_MM, "after", True),
        ("int8 matmuls, Module.compile before shard_model, reshard_after_forward=True", INT8_MM, "before", True),
        ("int8 matmuls, compiled after shard_model, reshard_after_forward=False", INT8_MM, "after", False),
        ("weight-only, compiled after shard_model, reshard_after_forward=True", WEIGHT_ONLY, "after", True),
    ]
    eager = {id(config): _train(rank, config, compile_=None, backend="eager") for config in (INT8_MM, WEIGHT_ONLY)}
    for backend in backends:
        for name, config, order, reshard in cases:
            with case(f"{name} ({backend})"):
                torch._dynamo.reset()
                counters.clear()
                losses = _train(rank, config, compile_=order, backend=backend, reshard=reshard)
                assert not counters["graph_break"], dict(counters["graph_break"])
                assert counters["stats"]["unique_graphs"] >= 1, "nothing was compiled"
                if backend == "aot_eager":
                    assert losses == eager[id(config)], (losses, eager[id(config)])
                else:
                    torch.testing.assert_close(losses, eager[id(config)], rtol=INDUCTOR_RTOL, atol=0)
                assert losses[-1] < losses[0], losses


def test_compiled_blocks_train_like_eager_under_fsdp2():
    run_distributed(_compiled_like_eager, 2, timeout=900)
