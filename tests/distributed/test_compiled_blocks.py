"""Transformer blocks compiled with ``torch.compile(fullgraph=True)`` under FSDP2, 2 gloo ranks,
one spawn.

With int8 matmuls and FSDP2's default ``reshard_after_forward=True`` the compiled graph
saves the unsharded weight's inner tensors (int8 rows, fp32 row scales) for backward, and
the backward all-gather refills them: the refill must not trip autograd's version check
("one of the variables needed for gradient computation has been modified by an inplace
operation: [torch.FloatTensor [64]] is at version 1; expected version 0"). Each case trains
three steps and must give the eager run's losses bit for bit: the ``aot_eager`` backend
runs the same kernels as eager through AOTAutograd, which is where saved tensors are
checked. CI runs four cases that together cover both compile orders, compiled kernels
inside the compiled block, activation checkpointing inside the compiled region, the int8
gradient reduce-scatter, weight-only int8 and a mixture of experts; the exhaustive matrix (``FSDP_INT8_FULL_MATRIX=1``) adds each option alone,
``reshard_after_forward=False``, HSDP (2 replicas of 1 shard), activation checkpointing
around the compiled block, torchtitan-style op-level selective checkpointing inside it,
tensor parallelism 2 ways (fsdp_int8's int8 styles), and inductor for every case (it
fuses the block's own fp32 ops in other orders: a bound instead of equality). Every case
compiles without a graph break into one graph that all blocks share (dynamo's counters).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

import fsdp_int8
from fsdp_int8 import Int8MatmulConfig, Int8TrainingConfig
from fsdp_int8._quant import kernels
from fsdp_int8.gradients import enable_quantized_reduce_scatter
from fsdp_int8.testing import run_distributed

from _cases import FULL_MATRIX, case
from _nets import tiny_transformer
from launch.model import tp_plan as block_tp_plan

STEPS = 3
INT8_MM = Int8TrainingConfig(int8_matmul=Int8MatmulConfig())
# the quantization kernels compiled on their own too (compile="auto"'s choice from width
# 512): traced into the block's graph, compiled outside it (the optimizer's write-back)
INT8_MM_KERNELS = Int8TrainingConfig(int8_matmul=Int8MatmulConfig(), compile="on")
WEIGHT_ONLY = Int8TrainingConfig()
# inductor fuses RMSNorm, softmax and the residual adds in other orders than eager: fp32
# rounding of those sums, ~1e-7 relative per op, a few ulps of the loss over 3 steps
INDUCTOR_RTOL = 1e-5


SAVED_OPS = (torch.ops.aten.mm.default, torch.ops.aten._int_mm.default)
POLICY_SAW: set = set()  # the ops _save_matmuls was asked about (this process)


def _save_matmuls(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    """torchtitan's op-level selective checkpointing, reduced to its core: keep the
    matmuls' outputs (the int8 GEMM's int32 result included), recompute everything else."""
    POLICY_SAW.add(op)
    return CheckpointPolicy.MUST_SAVE if op in SAVED_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def _selective(block: torch.nn.Module) -> torch.nn.Module:
    return checkpoint_wrapper(block, context_fn=functools.partial(create_selective_checkpoint_contexts,
                                                                  _save_matmuls))


def _mesh(layout: str | None):
    """``None``: all ranks, FSDP. ``"hsdp"``: 2 replicas of 1 shard each (the replicas'
    gradients all-reduced, the all-gather over one rank). ``"tp"``: tensor parallelism 2
    ways, one data-parallel rank."""
    if layout == "hsdp":
        return init_device_mesh("cpu", (2, 1), mesh_dim_names=("replicate", "shard"))
    if layout == "tp":
        return init_device_mesh("cpu", (1, 2), mesh_dim_names=("dp", "tp"))
    return None


def _train(rank: int, config: Int8TrainingConfig, *, compile_: str | None, backend,
           reshard: bool = True, checkpoint: str | None = None, int8_gradients: bool = False,
           layout: str | None = None, moe: bool = False) -> list[float]:
    """Losses of 3 AdamW steps. ``compile_``: ``None`` (eager), ``"before"`` (each block's
    ``Module.compile`` before ``shard_model``, torchtitan's order) or ``"after"`` (each block
    replaced by ``torch.compile(block)`` after ``shard_model``). ``checkpoint``: each block
    under full activation checkpointing inside the compiled region (``"inside"``), around
    it (``"outside"``), or under op-level selective checkpointing inside it
    (``"selective"``, :func:`_save_matmuls`); ``int8_gradients``: the int8 gradient
    reduce-scatter; ``layout``: see :func:`_mesh`; ``moe``: every block a top-2 of 4
    experts mixture (3-D int8 experts, ``torch._grouped_mm``), computing in bf16 (torch's
    ``_grouped_mm`` compiles for bf16 operands only)."""
    model = tiny_transformer(dim=64, vocab_size=64, n_experts=4 if moe else 0)
    wrap = {"inside": checkpoint_wrapper, "selective": _selective}.get(checkpoint)
    if wrap is not None:
        for index, block in enumerate(model.layers):
            model.layers[index] = wrap(block)
    if compile_ == "before":
        for block in model.layers:
            block.compile(fullgraph=True, backend=backend)
    if checkpoint == "outside":  # eager too: the same recomputation
        for index, block in enumerate(model.layers):
            model.layers[index] = checkpoint_wrapper(block)
    fsdp_int8.shard_model(model, config=config, reshard_after_forward=reshard, mesh=_mesh(layout),
                          tp_plan=block_tp_plan() if layout == "tp" else None,
                          mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16) if moe else None)
    if int8_gradients:
        enable_quantized_reduce_scatter(model)
    if compile_ == "after":
        for index, block in enumerate(model.layers):
            if checkpoint == "outside":  # the wrapper is the FSDP module: compile what it wraps
                block._checkpoint_wrapped_module = torch.compile(
                    block._checkpoint_wrapped_module, fullgraph=True, backend=backend)
            else:
                model.layers[index] = torch.compile(block, fullgraph=True, backend=backend)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    # tensor-parallel peers compute on the same tokens
    seed = 0 if layout == "tp" else rank
    tokens = torch.randint(0, 64, (2, 17), generator=torch.Generator().manual_seed(seed))
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
    from torch._dynamo.testing import CompileCounterWithBackend
    from torch._dynamo.utils import counters

    backends = ("aot_eager", "inductor") if FULL_MATRIX else ("aot_eager",)
    cases = [  # (name, config, order, options): the eager reference runs the same options
        ("int8 matmuls with compiled kernels, compiled after shard_model", INT8_MM_KERNELS, "after", {}),
        ("int8 matmuls, Module.compile before shard_model, full activation checkpointing inside, "
         "int8 gradient reduce-scatter", INT8_MM, "before", {"checkpoint": "inside", "int8_gradients": True}),
        ("mixture of experts, int8 matmuls, compiled after shard_model", INT8_MM, "after", {"moe": True}),
    ]
    if FULL_MATRIX:  # each option alone, FSDP2 keeping the weights gathered, other meshes
        cases += [
            ("weight-only, compiled after shard_model", WEIGHT_ONLY, "after", {}),
            ("int8 matmuls, compiled after shard_model", INT8_MM, "after", {}),
            ("mixture of experts, weight-only, Module.compile before shard_model", WEIGHT_ONLY, "before",
             {"moe": True}),
            ("int8 matmuls, Module.compile before shard_model", INT8_MM, "before", {}),
            ("int8 matmuls, reshard_after_forward=False", INT8_MM, "after", {"reshard": False}),
            ("int8 matmuls, full activation checkpointing inside", INT8_MM, "after", {"checkpoint": "inside"}),
            ("int8 matmuls, int8 gradient reduce-scatter", INT8_MM, "after", {"int8_gradients": True}),
            ("int8 matmuls, HSDP", INT8_MM, "after", {"layout": "hsdp"}),
            ("int8 matmuls, Module.compile before shard_model, HSDP", INT8_MM, "before", {"layout": "hsdp"}),
            ("int8 matmuls, full activation checkpointing outside", INT8_MM, "after", {"checkpoint": "outside"}),
            ("int8 matmuls, Module.compile before shard_model, full activation checkpointing outside",
             INT8_MM, "before", {"checkpoint": "outside"}),
            ("int8 matmuls, selective activation checkpointing inside", INT8_MM, "after",
             {"checkpoint": "selective"}),
            ("int8 matmuls, Module.compile before shard_model, selective activation checkpointing inside",
             INT8_MM, "before", {"checkpoint": "selective"}),
            ("int8 matmuls, tensor parallelism", INT8_MM, "after", {"layout": "tp"}),
            ("int8 matmuls, Module.compile before shard_model, tensor parallelism", INT8_MM, "before",
             {"layout": "tp"}),
            ("weight-only, tensor parallelism", WEIGHT_ONLY, "after", {"layout": "tp"}),
            ("mixture of experts, int8 matmuls, Module.compile before shard_model", INT8_MM, "before",
             {"moe": True}),
            ("mixture of experts, int8 matmuls, reshard_after_forward=False", INT8_MM, "after",
             {"moe": True, "reshard": False}),
            ("mixture of experts, int8 matmuls, HSDP", INT8_MM, "after", {"moe": True, "layout": "hsdp"}),
            ("mixture of experts, weight-only, compiled after shard_model", WEIGHT_ONLY, "after", {"moe": True}),
        ]
    eager: dict[tuple, list[float]] = {}
    for backend in backends:
        for name, config, order, options in cases:
            with case(f"{name} ({backend})"):
                key = (id(config), tuple(sorted(options.items())))
                if key not in eager:
                    eager[key] = _train(rank, config, compile_=None, backend="eager", **options)
                torch._dynamo.reset()
                counters.clear()
                POLICY_SAW.clear()
                # counts the blocks' graphs only, not the quantization kernels compiled on their own
                blocks_backend = CompileCounterWithBackend(backend)
                losses = _train(rank, config, compile_=order, backend=blocks_backend, **options)
                assert not counters["graph_break"], dict(counters["graph_break"])
                # one graph for every block: with a graph per block, fullgraph=True
                # raises at a deep model's ninth block (dynamo's recompile limit, 8)
                assert blocks_backend.frame_count == 1, blocks_backend.frame_count
                if options.get("checkpoint") == "selective":  # the policy saw the GEMMs it keeps
                    gemm = SAVED_OPS[1] if config.int8_matmul is not None else SAVED_OPS[0]
                    assert gemm in POLICY_SAW, sorted(map(str, POLICY_SAW))
                # no nested compile failed inside the block: the kernels outside it stay compiled
                assert not kernels.compile_failed()
                if backend == "aot_eager":
                    assert losses == eager[key], (losses, eager[key])
                else:
                    torch.testing.assert_close(losses, eager[key], rtol=INDUCTOR_RTOL, atol=0)
                assert losses[-1] < losses[0], losses


def test_compiled_blocks_train_like_eager_under_fsdp2():
    run_distributed(_compiled_like_eager, 2, timeout=3600 if FULL_MATRIX else 900)
