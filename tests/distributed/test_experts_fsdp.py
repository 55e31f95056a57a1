"""Mixture-of-experts weights under FSDP2, in real processes: 3-D int8 experts sharded on
the expert dim (expert counts that do not divide the ranks, fewer experts than ranks),
int8 bytes plus scales in the all-gather, parity with one process, checkpoints at other
world sizes, HSDP. One spawn per world size: many cases run inside.
"""

from __future__ import annotations

import copy
import tempfile

import torch
import torch.nn.functional as F
from _cases import (
    BF16_POLICY,
    assert_identical,
    assert_parity,
    case,
    compare_shards,
    local_of,
    mean_over_ranks,
    replicas_differ,
    snapshot,
)
from _nets import tiny_transformer
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import fsdp_int8
import fsdp_int8.collectives
from fsdp_int8 import Int8MatmulConfig, Int8TrainingConfig, Int8Weight
from fsdp_int8.testing import device_type_for, run_distributed
from launch.model import load_balance_loss

STEPS = 3
VOCAB = 64


def _moe(experts: int, seed: int = 0):
    # top_k 1 with one expert, else 2; expert width 32 (rows of the down projection: 32)
    return tiny_transformer(seed, n_experts=experts, top_k=min(2, experts), expert_hidden_dim=32)


def _batch(step: int, world: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (2 * world, 9), generator=torch.Generator().manual_seed(step))


def _loss(model, tokens: torch.Tensor, *, balance: bool = True) -> torch.Tensor:
    logits = model(tokens[:, :-1])
    loss = F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())
    return loss + load_balance_loss(model) if balance else loss


def _parity(rank: int, world: int, experts: int, *, reshard: bool, int8_matmul, bf16: bool, mesh=None) -> dict:
    """An FSDP2 MoE model against one process holding the whole model, same data (each
    rank its slice of the batch); round to nearest, so the two can agree exactly. The
    next-token loss only: the load-balancing loss of half a batch is not half of the whole
    batch's (it multiplies two batch means), under any data parallelism."""
    reference = _moe(experts)
    model = copy.deepcopy(reference)
    config = Int8TrainingConfig(stochastic_rounding=False, min_features=1, int8_matmul=int8_matmul)
    fsdp_int8.quantize_(reference, config)
    fsdp_int8.shard_model(model, config=config, mp_policy=BF16_POLICY if bf16 else None,
                          reshard_after_forward=reshard, mesh=mesh)
    experts_weight = local_of(model.layers[0].feed_forward.experts.w1)
    assert isinstance(experts_weight, Int8Weight) and experts_weight.dim() == 3
    # SGD: its update is proportional to the gradient. AdamW's divides by sqrt(v) and turns
    # a last-bit difference of a near-zero gradient (an expert row few tokens reach) into a
    # step of 2 * lr, as train_parity explains for bf16.
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.05, momentum=0.9)
    # Int8 GEMMs: one step. The ranks' gradients agree with one process's to fp32 summation
    # order (2e-7 relative), but from the second step on, a weight one int8 step apart
    # moves an activation across a rounding boundary of its per-row int8 quantization,
    # which no fp32 tolerance bounds.
    steps = 1 if int8_matmul is not None else STEPS
    losses = []
    for step in range(steps):
        tokens = _batch(step, world)
        loss = _loss(model, tokens[2 * rank: 2 * rank + 2], balance=False)
        loss.backward()
        opt.step()
        opt.zero_grad()
        ref_loss = _loss(reference, tokens, balance=False)
        ref_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        losses.append((mean_over_ranks(loss), ref_loss.item()))
    shard = (rank, world) if mesh is None else (mesh.get_local_rank(1), mesh.size(1))
    return dict(losses=losses, **compare_shards(model, reference, *shard))


def _gathered_bytes(rank: int, world: int) -> tuple[int, int]:
    """All-gather bytes of one forward + backward: int8 experts against bf16 FSDP2."""
    mesh = init_device_mesh(device_type_for(world), (world,))
    int8_model, bf16_model = _moe(4), _moe(4)
    fsdp_int8.shard_model(int8_model, mesh=mesh, mp_policy=BF16_POLICY)
    for block in bf16_model.layers:
        fully_shard(block, mesh=mesh, mp_policy=BF16_POLICY)
    fully_shard(bf16_model, mesh=mesh, mp_policy=BF16_POLICY)
    sizes = []
    for model in (int8_model, bf16_model):
        with fsdp_int8.collectives.count_collectives() as counter:
            _loss(model, _batch(0, world)[2 * rank: 2 * rank + 2]).backward()
        sizes.append(sum(r.bytes for r in counter.of("all_gather_single")))
    return tuple(sizes)


# Output and grad_input GEMMs quantize per token row: the same on each rank as in one
# process, so the fp32 tolerances hold (the weight gradient's GEMM quantizes per channel
# over each rank's own tokens: it differs by design, as for dense layers in test_fsdp).
INT8_GEMMS = Int8MatmulConfig(grad_weight=False)


def _scatter_experts(rank: int, world: int) -> None:
    """``distribute_tensor`` scatters a 3-D int8 weight from rank 0 (torchtitan's expert
    parallelism does for a model initialised before it is parallelized): each rank gets
    its experts' bytes and scales exactly."""
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh(device_type_for(world), (world,))
    values = torch.randn(4, 8, 16, generator=torch.Generator().manual_seed(0))
    whole = Int8Weight.from_float(values)
    local = distribute_tensor(whole, mesh, [Shard(0)]).to_local()
    mine = slice(2 * rank, 2 * rank + 2)
    assert isinstance(local, Int8Weight)
    assert torch.equal(local.int_data, whole.int_data[mine]) and torch.equal(local.scale, whole.scale[mine])


def _fsdp_cases(rank: int, world: int) -> tuple[int, int]:
    from _quant import CountIntMM

    with case("distribute_tensor of int8 experts"):
        _scatter_experts(rank, world)

    for experts in (3, 1):  # 3 experts on 2 ranks: shards of 2 and 1; 1 expert: rank 1 holds none
        for reshard in (True, False):
            for int8_matmul in (None, INT8_GEMMS):
                name = f"experts={experts} reshard={reshard} int8_matmul={int8_matmul is not None}"
                with case(name), CountIntMM() as gemms:
                    assert_parity(
                        _parity(rank, world, experts, reshard=reshard, int8_matmul=int8_matmul, bf16=False),
                        bf16=False,
                    )
                    assert (gemms.calls > 0) == (int8_matmul is not None), gemms.calls
    with case("experts=3 bf16 policy"):
        assert_parity(_parity(rank, world, 3, reshard=True, int8_matmul=None, bf16=True), bf16=True)
    for family in ("gpt-oss", "dbrx"):
        for int8_matmul in (None, INT8_GEMMS):
            with case(f"{family}'s transposed experts, int8_matmul={int8_matmul is not None}"):
                _transposed_experts_as_one_process(family, int8_matmul)
    return _gathered_bytes(rank, world)


def _transposed_experts_as_one_process(family: str, int8_matmul) -> None:
    """gpt-oss's experts (``[E, in, out]``, held as their int8 transpose) or DBRX's (2-D,
    ``w2`` held as each expert's transpose, computed by the swapped ``DbrxExperts``): FSDP2
    on 2 ranks and one process, from the same model and batches, round to nearest: equal
    losses and equal weights after 3 steps."""
    import transformers

    torch.manual_seed(0)
    if family == "gpt-oss":
        one = transformers.GptOssForCausalLM(transformers.GptOssConfig(
            hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, vocab_size=128, num_local_experts=4, num_experts_per_tok=2,
            layer_types=["full_attention"] * 2))
    else:  # transformers 5.23 cannot build DBRX without clip_qkv (its attention clamps by it) and rope_theta
        one = transformers.DbrxForCausalLM(transformers.DbrxConfig(
            d_model=64, n_heads=4, n_layers=2, max_seq_len=64, vocab_size=128,
            attn_config=dict(kv_n_heads=2, clip_qkv=8.0, rope_theta=1e4),
            ffn_config=dict(ffn_hidden_size=64, moe_num_experts=4, moe_top_k=2)))
    sharded = copy.deepcopy(one)
    settings = Int8TrainingConfig(stochastic_rounding=False, int8_matmul=int8_matmul)
    fsdp_int8.quantize_(one, settings)
    fsdp_int8.shard_model(sharded, config=settings)
    optimizers = [fsdp_int8.Int8AdamW(m.parameters(), lr=1e-2) for m in (one, sharded)]
    for step in range(3):
        torch.manual_seed(step)
        tokens = torch.randint(0, 128, (2, 16))
        losses = []
        for model, optimizer in zip((one, sharded), optimizers):
            loss = model(tokens, labels=tokens).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
        assert losses[0] == losses[1], (step, losses)
    whole = fsdp_int8.export_full_state_dict(sharded, torch.float32)  # rank 0 holds it
    if torch.distributed.get_rank() == 0:
        mine = fsdp_int8.export_full_state_dict(one, torch.float32)
        assert [k for k in mine if not torch.equal(whole[k], mine[k])] == []


def _save_trained(rank: int, world: int, root: str) -> dict:
    model, opt = _sharded_moe()
    for step in range(2):
        _loss(model, _batch(step, world)[2 * rank: 2 * rank + 2]).backward()
        opt.step()
        opt.zero_grad()
    fsdp_int8.save_checkpoint(root, model, opt, step=2)
    return snapshot(model, opt)


def _sharded_moe():
    model = _moe(3)
    fsdp_int8.shard_model(model, config=Int8TrainingConfig(min_features=1))
    return model, fsdp_int8.Int8AdamW(model.parameters(), lr=1e-2, state_bits=8)


def _load(rank: int, world: int, root: str, again: str | None) -> dict:
    model, opt = _sharded_moe()
    info = fsdp_int8.load_checkpoint(root, model, opt)
    assert info.step == 2
    if again:
        fsdp_int8.save_checkpoint(again, model, opt, step=2)
    loaded = snapshot(model, opt)
    if world == 4:  # and HSDP, 2 replicas of 2 shards: as one process, replicas identical
        mesh = init_device_mesh(device_type_for(world), (2, 2), mesh_dim_names=("replicate", "shard"))
        with case("2 x 2 HSDP, 3 experts"):
            assert_parity(_parity(rank, world, 3, reshard=True, int8_matmul=None, bf16=False, mesh=mesh), bf16=False)
        with case("2 x 2 HSDP with stochastic rounding: replicas stay identical"):
            model = _moe(3)
            fsdp_int8.shard_model(model, mesh=mesh, config=Int8TrainingConfig(min_features=1))
            opt = fsdp_int8.Int8AdamW(model.parameters(), lr=1e-2, state_bits=8)
            for step in range(2):
                _loss(model, _batch(step, world)[2 * rank: 2 * rank + 2]).backward()
                opt.step()
                opt.zero_grad()
            assert not replicas_differ(model, mesh, "replicate")
    return loaded


def test_moe_experts_shard_gather_and_train_as_one_process():
    int8_bytes, bf16_bytes = run_distributed(_fsdp_cases, 2)[0]
    # experts, attention and feed-forward rows int8 (+4 bytes a row), embedding, head and
    # norms in bf16: well under the 0.75 of bf16 a model half int8 would move
    assert int8_bytes < 0.75 * bf16_bytes, (int8_bytes, bf16_bytes)


def test_moe_checkpoints_load_bit_exactly_at_other_world_sizes():
    with tempfile.TemporaryDirectory() as tmp:
        saved = run_distributed(_save_trained, 2, f"{tmp}/two")[0]
        at_one = run_distributed(_load, 1, f"{tmp}/two", f"{tmp}/one")[0]
        assert_identical(saved, at_one, "2 -> 1")
        at_four = run_distributed(_load, 4, f"{tmp}/one", None)[0]  # 3 experts on 4 ranks
        assert_identical(saved, at_four, "2 -> 1 -> 4")
