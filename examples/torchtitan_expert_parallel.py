"""Int8 experts under torchtitan's expert parallelism, on 4 processes, checkpointed by torchtitan.

Shows ``fsdp_int8.integrations.torchtitan`` with a mixture-of-experts model split by
torchtitan's expert parallelism: torchtitan's own ``qwen3_moe_debug()`` trainer config,
its Qwen3 MoE shrunk to run on a CPU in seconds (2 layers, dim 64, 4 experts, top 2),
switched to int8 by ``enable_int8_training`` with ``quantize_gradients=True``. The model
is built as torchtitan's ``Trainer`` builds it, at ``expert_parallel_degree`` 2 on 4
ranks: the dense weights FSDP-sharded over all 4 ranks, each rank holding 2 of the 4
experts (tokens travel to them by all-to-all) FSDP-sharded over the 2 ranks that hold
the same experts (torchtitan's ``efsdp`` mesh). The experts' weights are int8 (one scale
per expert and output feature), updated with stochastic rounding (the converter's
default); fsdp_int8's int8 gradient reduce-scatter serves both meshes (the first step's
collectives are counted as they cross ``torch.distributed``: int8 all-to-alls on groups
of 4 and of 2 ranks, no full-precision reduce-scatter).

A few steps train on a synthetic task; torchtitan's checkpoint manager as
``enable_int8_training`` configures it (``Int8CheckpointManager``) saves model, optimizer,
schedule and step; the same model built at expert-parallel degree 1 (experts FSDP-sharded
over all ranks like the dense weights) and 4 (one expert per rank), initialised
differently, loads all of it, and every parameter's full value (int8 bytes and fp32
scales of an int8 weight) must equal the trained model's bit for bit.

CPU changes to the debug config: SDPA instead of FlexAttention (no CPU backward), short
sequences, fp32 compute, FSDP2 on plain parameters (``spmd_backend="partial_dtensor"``).
The Trainer itself is not run: it needs a tokenizer and a dataset that are not part of
the torchtitan package.

Install: ``pip install "fsdp_int8[torchtitan]"``
Run:     ``torchrun --nproc-per-node 4 examples/torchtitan_expert_parallel.py [--steps 4]``
"""

from __future__ import annotations

import argparse
from typing import Any

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

import fsdp_int8
import fsdp_int8.collectives
from fsdp_int8.gradients.install import installed_quantized_reduce_scatter
from fsdp_int8.integrations.torchtitan import Int8LinearConverter, enable_int8_training
import _torchtitan_common as tt
from _common import int8_count

VOCAB = tt.VOCAB_USED  # the shrunk model's vocabulary: the synthetic task's tokens
EXPERTS = 4


def _small_moe(seq_len: int) -> Any:
    """torchtitan's debug Qwen3 MoE recipe at a CPU's size."""
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
            n_layers=2, dim=dim, n_heads=4, n_kv_heads=2, head_dim=head_dim, moe_hidden_dim=64,
            num_experts=EXPERTS, top_k=2, attn_backend="flex", moe_comm_backend="standard",
            rope=CosSinRoPE.Config(dim=head_dim, max_seq_len=seq_len, theta=1000000.0),
        ),
    )


def _trainer_config(args: argparse.Namespace, dump_folder: str, ep: int) -> Any:
    from torchtitan.models.common.attention import FlexAttention, ScaledDotProductAttention
    from torchtitan.models.qwen3.config_registry import qwen3_moe_debug

    config = qwen3_moe_debug()
    config.model_spec.model = _small_moe(args.seq_len)
    # the one int8 switch; the int8 gradient reduce-scatter is installed once the model is sharded
    enable_int8_training(config, Int8LinearConverter.Config(quantize_gradients=True))
    for _, _, parent, attr in list(config.model_spec.model.traverse(FlexAttention.Config)):
        setattr(parent, attr, ScaledDotProductAttention.Config())
    config.parallelism.data_parallel_shard_degree = -1  # every rank not taken by another dimension
    config.parallelism.expert_parallel_degree = ep
    # FSDP2 on plain parameters: torchtitan's default ("spmd_types") hands fully_shard
    # plain tensors in torch 2.13
    config.parallelism.spmd_backend = "partial_dtensor"
    config.training.seq_len = args.seq_len
    config.training.local_batch_size = args.batch
    config.training.steps = args.steps
    config.training.mixed_precision_param = "float32"
    config.optimizer.param_groups[0].optimizer_kwargs["lr"] = args.lr
    config.dump_folder = dump_folder
    config.checkpoint.enable = True
    config.checkpoint.interval = args.steps
    return config


def _full_values(model: nn.Module) -> dict[str, tuple[torch.Tensor, ...]]:
    """Every parameter's whole value on every rank: int8 bytes and scales of an int8 weight."""
    values = {}
    for name, param in model.named_parameters():
        full = param.full_tensor() if isinstance(param, DTensor) else param.detach()
        values[name] = (full.int_data, full.scale) if isinstance(full, fsdp_int8.Int8Weight) else (full,)
    return values


def _same(a: dict[str, tuple[torch.Tensor, ...]], b: dict[str, tuple[torch.Tensor, ...]]) -> bool:
    return a.keys() == b.keys() and all(
        len(a[k]) == len(b[k]) and all(torch.equal(x, y) for x, y in zip(a[k], b[k])) for k in a
    )


def _int8_share(model: nn.Module) -> float:
    """The int8 weights' share of the model's parameter elements (global sizes)."""
    total = sum(p.numel() for p in model.parameters())
    int8 = sum(p.numel() for p in model.parameters()
               if isinstance(p.to_local() if isinstance(p, DTensor) else p, fsdp_int8.Int8Weight))
    return int8 / total


def main(argv: list[str] | None = None) -> dict:
    """Train at ep 2, checkpoint, reload at ep 1 and ep 4; returns the summary the test checks."""
    parser = tt.arguments(__doc__.splitlines()[0], steps=4)
    return tt.run_on_every_rank(_run, parser.parse_args(argv))


def _run(args: argparse.Namespace, folder: str, rank: int, world: int) -> dict:
    torch.manual_seed(0)
    run = tt.build(_trainer_config(args, folder, ep=2), world)
    model = run["model"]
    experts = model.layers["0"].moe.routed_experts.inner_experts.w1_EFD

    # the first step's gradient reduce-scatters, as they cross torch.distributed: int8
    # all-to-alls on the dense mesh (4 ranks) and on the experts' efsdp mesh (2 ranks)
    with fsdp_int8.collectives.count_collectives() as counter:
        losses = tt.train(run, range(1, 2), args, rank, world)
    int8_exchanges = [r.world_size for r in counter.of("all_to_all_single") if r.dtype == torch.int8]
    fp_reduce_scatters = len(counter.of("reduce_scatter_tensor")) + len(counter.of("reduce_scatter_single"))
    losses += tt.train(run, range(2, args.steps + 1), args, rank, world)
    if rank == 0:
        print("losses:", " ".join(f"{loss:.3f}" for loss in losses))

    run["checkpointer"].save(curr_step=args.steps)
    trained = _full_values(model)
    summary = {
        "losses": losses,
        "experts_weight": f"{type(experts.to_local()).__name__} {tuple(experts.shape)} on mesh "
                          f"{experts.device_mesh.mesh_dim_names} {experts.placements}",
        "int8_weights": int8_count(model),
        "int8_share": round(_int8_share(model), 4),
        "quantized_reduce_scatter_installed": installed_quantized_reduce_scatter(model) is not None,
        "int8_reduce_scatters_by_mesh_size": {size: int8_exchanges.count(size) for size in sorted(set(int8_exchanges))},
        "fp_reduce_scatters": fp_reduce_scatters,
    }
    run["checkpointer"].close()

    differed = []
    for ep in (1, 4):  # ep 1: experts FSDP-sharded over all 4 ranks; ep 4: one expert per rank
        torch.manual_seed(ep)  # a differently initialised model to load into
        other = tt.build(_trainer_config(args, folder, ep=ep), world)
        differed.append(not _same(_full_values(other["model"]), trained))
        other["checkpointer"].load(step=args.steps)
        summary[f"reload_exact_ep{ep}"] = tt.all_ranks(_same(_full_values(other["model"]), trained))
        summary[f"step_after_load_ep{ep}"] = other["state"].step
        other["checkpointer"].close()
    summary["differed_before_load"] = tt.all_ranks(all(differed))
    return summary


if __name__ == "__main__":
    main()
