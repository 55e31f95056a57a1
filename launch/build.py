"""The one builder: the launcher's Transformer, sharded over all ranks for any recipe of
:mod:`launch.precisions` (what the launcher trains and the benchmarks' rows build)."""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.distributed.tensor.parallel import parallelize_module

import fsdp_int8
from fsdp_int8.gradients import enable_quantized_reduce_scatter
from fsdp_int8.sharding import find_blocks
from launch import parallel
from launch.model import ModelArgs, Transformer, check_tp, tp_plan
from launch.precisions import BF16_POLICY, Recipe

# FSDP2 mixed precision of each compute dtype of an fsdp_int8 precision (bf16-model: the
# model is cast to bf16, no policy)
_COMPUTE_POLICY = {"bf16": BF16_POLICY, "fp32": None, "bf16-model": None}


def build_model(recipe: Recipe, args: ModelArgs, device: torch.device | str, *, seed: int = 0,
                replicas: int = 1, full_init: bool = False, mesh: DeviceMesh | None = None,
                stage: tuple[int, int] = (0, 1), quantize_embeddings: bool = False,
                activation_checkpointing: bool = False, int8_gathered_weights: bool = False,
                cpu_offload: bool = False, lean: bool = False) -> Transformer:
    """The launcher's Transformer of shape ``args``, sharded over all ranks for ``recipe``.

    Weights come from ``Transformer.init_weights(seed)`` (fsdp_int8's stochastic rounding
    from ``seed`` too). By default the model is built on the meta device, sharded,
    allocated on ``device`` and initialised shard by shard: no rank holds more than one
    whole parameter at a time, which large models need. ``full_init=True`` initialises the
    whole model on ``device`` first and then shards it (``torchao`` is built this way only).
    Both give every rank, layout and recipe bit for bit the single-process weights.

    Args:
        recipe: What to build (see :class:`Recipe`).
        args: The model's shape.
        device: Where the shards live (one GPU per rank, or the CPU).
        seed: Seed of the initial weights and of stochastic rounding.
        replicas: HSDP: replicate the sharded model over this many groups of ranks.
        full_init: Initialise the whole model before sharding (see above).
        mesh: The mesh to shard over (default: all ranks, ``replicas`` groups of them), from
            :func:`launch.parallel.device_mesh`. With a last ``"tp"`` dim the blocks are split
            by tensor parallelism first (:func:`launch.model.tp_plan`; fsdp_int8's int8-aware
            styles for int8 precisions, torch's own for the baselines). Under pipeline
            parallelism: this stage's mesh (:func:`launch.parallel.stage_mesh`, no ``"pp"`` dim).
        stage: ``(index, count)``: build pipeline stage ``index`` of ``count`` only
            (:meth:`launch.model.Transformer.keep_stage`; its parameters keep the whole
            model's names, so a stage's weights are the whole model's).
        quantize_embeddings: An int8 precision's token embedding is int8 too
            (``Int8TrainingConfig.quantize_embeddings``).
        activation_checkpointing: Each block recomputes its activations in backward
            (:attr:`launch.model.Transformer.checkpoint_blocks`).
        int8_gathered_weights: A weight-only int8 precision keeps FSDP2's gathered weights
            int8 and dequantizes a transient copy per matmul (``Int8MatmulConfig`` with no
            int8 GEMM): the same values, half the gathered bytes. Int8-matmul precisions
            gather int8 anyway.
        cpu_offload: FSDP2's ``CPUOffloadPolicy``: the shards, gradients and optimizer step
            live in host memory (pinned when ``device`` is an accelerator), built there.
        lean: An int8 precision is quantized and sharded with the library's lean
            configuration (``Int8TrainingConfig.lean``, in this recipe's compute dtype and
            matmuls; it implies ``quantize_embeddings``): what ``--lean`` trains.
    """
    device = torch.device(device)
    precision = recipe.precision
    if quantize_embeddings and not precision.int8:
        raise ValueError(f"quantize_embeddings needs an int8 precision, not {precision.name}")
    if (int8_gathered_weights or lean) and not precision.int8:
        raise ValueError(f"int8_gathered_weights and lean need an int8 precision, not {precision.name}")
    if cpu_offload and precision.family == "torchao":
        raise ValueError("torchao's int8 weights are not run with CPU offload: drop cpu_offload")
    offload = CPUOffloadPolicy(pin_memory=device.type != "cpu") if cpu_offload else None
    if precision.family == "torchao" and not full_init:
        raise ValueError("torchao's int8 weights are built from initialised weights: pass full_init=True")
    mesh = mesh or parallel.device_mesh(device.type, replicas=replicas)
    tensor_parallel = parallel.has_tp(mesh)
    if tensor_parallel:
        if precision.family == "torchao":
            raise ValueError("torchao's int8 weights do not run under tensor parallelism: use a tp-free mesh")
        check_tp(args, mesh["tp"].size())
    index, count = stage
    if full_init:
        with torch.device(device):
            model = Transformer(args)
        model.init_weights(seed)
    else:
        with torch.device("meta"):
            model = Transformer(args)
    if count > 1:
        model.keep_stage(index, count)
    model.checkpoint_blocks = activation_checkpointing
    if recipe.compute_dtype == "bf16-model":
        model.to(torch.bfloat16)
    if recipe.blocks:  # torchtitan's order: compile each block in place, then shard
        for block in model.blocks():
            block.compile(fullgraph=True)
    if precision.int8:
        fields = dict(seed=seed, compile=recipe.compile)
        if precision.int8_matmul is not None:
            fields["int8_matmul"] = precision.int8_matmul
        elif int8_gathered_weights:  # else the config's own: none, or the lean call's gathered int8
            fields["int8_gathered_weights"] = True
        if lean:  # the library's lean call, computing in this recipe's dtype
            config = fsdp_int8.Int8TrainingConfig.lean(
                **fields, compute_dtype=torch.bfloat16 if recipe.compute_dtype == "bf16" else None)
        else:
            config = fsdp_int8.Int8TrainingConfig(**fields, quantize_embeddings=quantize_embeddings)
        fsdp_int8.shard_model(model, mesh=mesh, config=config, mp_policy=_COMPUTE_POLICY[recipe.compute_dtype],
                              tp_plan=tp_plan() if tensor_parallel else None, offload_policy=offload)
        if precision.int8_gradients:
            enable_quantized_reduce_scatter(model, seed=seed)
    else:
        if precision.family == "torchao":
            from torchao.prototype.quantized_training import int8_weight_only_quantized_training
            from torchao.quantization import quantize_

            quantize_(model, int8_weight_only_quantized_training())
        _fully_shard(model, mesh, precision.policy, offload)
    if not full_init:
        model.to_empty(device="cpu" if cpu_offload else device)  # FSDP2 offloads shards that are on the host
        model.init_weights(seed)  # each rank's piece of the whole model's init (any mesh, any device)
    return model


def _fully_shard(model: Transformer, mesh: DeviceMesh, policy: MixedPrecisionPolicy | None,
                 offload: CPUOffloadPolicy | None = None) -> None:
    """Plain FSDP2 in the groups ``shard_model`` makes, found by its own
    ``fsdp_int8.sharding.find_blocks``: each embedding outside the blocks and not tied to
    another module, each block, then the root (the rest), so a baseline gathers and
    reduces what an fsdp_int8 run does. The last group and the root stay gathered after
    forward: backward needs them first. A mesh with a ``"tp"`` dim splits each block with
    torch's styles first, as shard_model does."""
    blocks = find_blocks(model)
    if parallel.has_tp(mesh):
        for block in blocks:
            parallelize_module(block, mesh["tp"], tp_plan())
    in_blocks = {id(m) for block in blocks for m in block.modules()}
    elsewhere = {id(p) for m in model.modules() if not isinstance(m, nn.Embedding) for p in m.parameters(recurse=False)}
    embeddings = [m for m in model.modules()
                  if isinstance(m, nn.Embedding) and id(m) not in in_blocks and id(m.weight) not in elsewhere]
    groups = [*embeddings, *blocks]
    options = dict(mesh=parallel.dp_mesh(mesh), mp_policy=policy or MixedPrecisionPolicy(),
                   offload_policy=offload or OffloadPolicy())
    for index, group in enumerate(groups):
        fully_shard(group, reshard_after_forward=index < len(groups) - 1, **options)
    fully_shard(model, reshard_after_forward=False, **options)
