"""FSDP2 with int8 weights, in real processes (CPU + gloo here, GPUs + NCCL where present).

Each test spawns its ranks once and runs many cases inside (a spawn costs seconds).
"""

from __future__ import annotations

import inspect
import os
import warnings

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from _cases import (
    BF16_POLICY,
    FULL_MATRIX,
    assert_parity,
    case,
    int8_params,
    local_of,
    train_parity,
    train_repeating_pattern,
)
from _nets import MLPNet, tiny_transformer
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

import fsdp_int8
import fsdp_int8.collectives
from fsdp_int8 import Int8TrainingConfig, Int8Weight
from fsdp_int8.testing import device_type_for, run_distributed

STEPS = 8 if FULL_MATRIX else 3


def _parity_matrix(rank: int, world: int, hiddens: tuple[int, ...], mesh=None) -> None:
    for hidden in hiddens:
        for bf16 in (False, True):
            for reshard in (True, False):
                name = f"world={world} rows={hidden} bf16={bf16} reshard={reshard} mesh={mesh}"
                with case(name):
                    result = train_parity(
                        rank, world, hidden=hidden, mp_policy=BF16_POLICY if bf16 else None,
                        reshard_after_forward=reshard, steps=STEPS, mesh=mesh,
                    )
                    if rank == 0 and os.environ.get("FSDP_INT8_PRINT_PARITY"):
                        print(name, {k: v for k, v in result.items() if k != "losses"}, flush=True)
                    assert_parity(result, bf16=bf16)


# ---------------------------------------------------------------- bytes on the wire
def _shard_blocks_plain(model: nn.Module, mesh, mp_policy) -> None:
    for block in model.layers[:-1]:
        fully_shard(block, mesh=mesh, mp_policy=mp_policy)
    fully_shard(model.layers[-1], mesh=mesh, mp_policy=mp_policy, reshard_after_forward=False)
    fully_shard(model, mesh=mesh, mp_policy=mp_policy, reshard_after_forward=False)


def _one_step_collectives(model: nn.Module, rank: int) -> fsdp_int8.collectives.CollectiveCounter:
    x = torch.randn(4, model.layers[0].up.in_features, generator=torch.Generator().manual_seed(rank))
    with fsdp_int8.collectives.count_collectives() as counter:
        model(x).sum().backward()
    return counter


def _check_bytes(rank: int, world: int) -> None:
    dim, n_layers = 256, 2  # K = 256: scales add 4/256 to the int8 bytes
    mesh = init_device_mesh(device_type_for(world), (world,))
    torch.manual_seed(0)
    int8_model = MLPNet(dim=dim, hidden=dim, n_layers=n_layers, bias=False)
    bf16_model = MLPNet(dim=dim, hidden=dim, n_layers=n_layers, bias=False)
    fsdp_int8.shard_model(int8_model, mesh=mesh, mp_policy=BF16_POLICY)
    _shard_blocks_plain(bf16_model, mesh, BF16_POLICY)

    int8_counter = _one_step_collectives(int8_model, rank)
    bf16_counter = _one_step_collectives(bf16_model, rank)
    int8_gathers = int8_counter.of("all_gather_single")
    bf16_gathers = bf16_counter.of("all_gather_single")
    # forward: every block and the root; backward: the blocks that resharded (not the last).
    expected_calls = n_layers + 1 + (n_layers - 1)
    assert len(int8_gathers) == expected_calls, int8_counter.summary()
    assert len(bf16_gathers) == expected_calls, bf16_counter.summary()

    # Block all-gathers carry only int8 layers: one int8 buffer of [padded_rows, K + 4]
    # per weight and rank, nothing else.
    padded = -(-dim // world)
    block_numel = world * 2 * padded * (dim + 4)
    int8_blocks = [r for r in int8_gathers if r.numel == block_numel]
    assert len(int8_blocks) == n_layers + (n_layers - 1), [(r.dtype, r.numel) for r in int8_gathers]
    assert all(r.dtype == torch.int8 and r.bytes == block_numel for r in int8_blocks)
    bf16_blocks = [r for r in bf16_gathers if r.numel == world * 2 * padded * dim]
    assert all(r.dtype == torch.bfloat16 for r in bf16_blocks) and len(bf16_blocks) == len(int8_blocks)
    ratio = sum(r.bytes for r in int8_blocks) / sum(r.bytes for r in bf16_blocks)
    assert ratio <= 0.51, f"int8 all-gather is {ratio:.4f} of bf16"
    assert abs(ratio - (dim + 4) / (2 * dim)) < 1e-9, ratio

    # Gradients are reduce-scattered in full precision (reduce_dtype fp32), as without int8.
    assert int8_counter.total_bytes("reduce_scatter_single") == bf16_counter.total_bytes(
        "reduce_scatter_single"
    )


def _check_weight_only_unshards_plain(rank: int, world: int) -> None:
    """Weight-only under FSDP2: each unshard hands the layer a plain ``param_dtype`` weight
    (the gathered int8 rows dequantized once: plain ``F.linear``, no subclass), equal to the
    sharded ``Int8Weight``'s values, refilled in place on later unshards (backward after a
    reshard, the next step after an optimizer update); the all-gather still carries int8.
    With int8 matmuls the unsharded weight stays an ``Int8Weight`` (its GEMMs read int8)."""
    for matmul in (None, fsdp_int8.Int8MatmulConfig()):
        with case(f"unsharded weight type, int8_matmul={matmul}"):
            torch.manual_seed(0)
            model = fsdp_int8.shard_model(  # 33 rows: uneven shards, padding rows on the wire
                MLPNet(hidden=33, bias=False), mp_policy=BF16_POLICY,
                config=Int8TrainingConfig(int8_matmul=matmul),
            )
            seen: list[tuple[str, type, torch.Tensor]] = []  # a copy: FSDP2 frees the storage

            def record(module: nn.Module, args, name: str) -> None:
                weight = module.weight.detach()
                seen.append((name, type(weight), weight if isinstance(weight, Int8Weight) else weight.clone()))

            for i, block in enumerate(model.layers):
                for lin in ("up", "down"):
                    getattr(block, lin).register_forward_pre_hook(
                        lambda mod, args, name=f"layers.{i}.{lin}.weight": record(mod, args, name)
                    )
            opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
            x = torch.randn(4, 32, generator=torch.Generator().manual_seed(rank))
            for step in range(2):  # step 1 refills the buffers of step 0 (out=)
                expected = {n: p.full_tensor().dequantize(torch.bfloat16) for n, p in int8_params(model)}
                seen.clear()
                with fsdp_int8.collectives.count_collectives() as counter:
                    model(x).float().sum().backward()
                assert len(seen) == 4, [n for n, _, _ in seen]
                for name, kind, weight in seen:
                    if matmul is None:
                        assert kind is torch.Tensor and weight.dtype == torch.bfloat16, (name, kind)
                        assert torch.equal(weight, expected[name]), f"step {step}: {name} differs from its shard"
                    else:
                        assert kind is Int8Weight and weight.dtype == torch.bfloat16, name
                # the blocks' all-gathers (forward, and backward after the reshard) are int8 bytes
                # ([33, 32] and [32, 33] weights: padded rows of K + 4 bytes each)
                block_numel = world * (-(-33 // world) * (32 + 4) + -(-32 // world) * (33 + 4))
                gathers = [(r.dtype, r.numel) for r in counter.of("all_gather_single")]
                assert gathers.count((torch.int8, block_numel)) == 3, gathers
                # gradients still land on the sharded Int8Weights, in the outer dtype
                for name, param in int8_params(model):
                    assert param.grad is not None and param.grad.dtype == torch.float32, name
                opt.step()
                opt.zero_grad()
            assert all(isinstance(local_of(p), Int8Weight) for _, p in int8_params(model))


def _check_optimizer_step_is_local(rank: int, world: int) -> None:
    """Each rank requantizes only its own rows: the step's one collective is the default
    guard's one-element all-reduce of the finite-gradient verdict (no DTensor redistribution)."""
    torch.manual_seed(0)
    model = fsdp_int8.shard_model(MLPNet(hidden=33))
    x = torch.randn(4, 32)
    for options in (dict(foreach=False), dict(foreach=True), dict(fused=True)):
        with case(f"AdamW {options}"):
            opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, **options)
            model(x).sum().backward()
            before = [local_of(p).int_data.clone() for _, p in int8_params(model)]
            with fsdp_int8.collectives.count_collectives() as counter:
                opt.step()
            assert counter.summary() == {"all_reduce": {"calls": 1, "bytes": 4}}, counter.summary()
            after = [local_of(p).int_data for _, p in int8_params(model)]
            assert any(not torch.equal(a, b) for a, b in zip(before, after)), "step changed nothing"
            assert all(isinstance(local_of(p), Int8Weight) for _, p in int8_params(model))
            opt.zero_grad()


def _check_pre_all_gather_hook_runs(rank: int, world: int) -> None:
    """We rely on FSDP2 calling the 1-argument (backward-compatibility) hook form: if a
    torch release stops calling it, this fails loudly instead of a silent bf16 gather."""
    assert len(inspect.signature(Int8Weight.fsdp_pre_all_gather).parameters) == 2  # self, mesh
    calls = []
    original = Int8Weight.fsdp_pre_all_gather

    def spy(self, mesh):
        calls.append(mesh.size())
        return original(self, mesh)

    Int8Weight.fsdp_pre_all_gather = spy
    try:
        model = fsdp_int8.shard_model(MLPNet(hidden=33))
        model(torch.randn(2, 32)).sum().backward()
    finally:
        Int8Weight.fsdp_pre_all_gather = original
    # 2 blocks x 2 weights in forward, + first block again in backward
    assert len(calls) == 6 and set(calls) == {world}, calls


def _check_hand_sharded_model_rounds_each_shard_with_its_own_noise(rank: int, world: int) -> None:
    """``quantize_`` then ``fully_shard`` by hand (as frameworks do): the rounding stream
    learns this rank's shard at the first all-gather, so training gives the bytes that
    ``shard_model`` (seeded with the mesh up front) gives, and the shards' streams differ.
    Before, every rank drew coordinate 0's noise: rows ``i`` and ``i + rows / 2`` rounded
    alike."""
    from fsdp_int8._quant.generators import WEIGHT_ROUNDING

    config = Int8TrainingConfig(seed=11, min_features=1)
    results = {}
    for path in ("shard_model", "by hand"):
        torch.manual_seed(0)
        model = MLPNet(hidden=32)  # even shards: without their own streams, equal states
        if path == "shard_model":
            fsdp_int8.shard_model(model, config=config)
        else:
            fsdp_int8.quantize_(model, config)
            _shard_blocks_plain(model, None, MixedPrecisionPolicy())
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        data = torch.Generator().manual_seed(rank)
        for _ in range(3):
            model(torch.randn(4, 32, generator=data)).sum().backward()
            opt.step()
            opt.zero_grad()
        results[path] = [local_of(p).int_data.clone() for _, p in int8_params(model)]
        device = str(local_of(int8_params(model)[0][1]).device)
        states = [None] * world
        dist.all_gather_object(states, WEIGHT_ROUNDING.get_state()[device].cpu())
        with case(path):
            assert not torch.equal(states[0], states[1]), "both shards drew the same noise"
    with case("fully_shard by hand rounds as shard_model does"):
        assert all(torch.equal(a, b) for a, b in zip(results["shard_model"], results["by hand"]))


def _check_training_features(rank: int, world: int) -> None:
    x = torch.randn(8, 32, generator=torch.Generator().manual_seed(0))
    y = torch.randn(8, 4, generator=torch.Generator().manual_seed(1))
    config = Int8TrainingConfig(stochastic_rounding=False)

    def sharded(**kw) -> nn.Module:
        torch.manual_seed(0)
        net = MLPNet(hidden=33)
        for key, value in kw.items():
            setattr(net, key, value)
        return fsdp_int8.shard_model(net, config=config)

    mine = slice(rank * 4, rank * 4 + 4)
    with case("gradient accumulation"):
        # two micro-batches without sync == one batch of both (mean of two means)
        acc, full = sharded(), sharded()
        halves = (slice(rank * 4, rank * 4 + 2), slice(rank * 4 + 2, rank * 4 + 4))
        for i, part in enumerate(halves):
            acc.set_requires_gradient_sync(i == len(halves) - 1)
            (F.mse_loss(acc(x[part]), y[part]) / len(halves)).backward()
        F.mse_loss(full(x[mine]), y[mine]).backward()
        for (name, a), (_, b) in zip(acc.named_parameters(), full.named_parameters()):
            torch.testing.assert_close(a.grad.full_tensor(), b.grad.full_tensor(), rtol=1e-5, atol=1e-6, msg=name)

    with case("clip_grad_norm_ on the sharded model"):
        torch.manual_seed(0)
        reference = fsdp_int8.quantize_(MLPNet(hidden=33), config)
        F.mse_loss(reference(x), y).backward()
        ref_norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), max_norm=0.5)
        model = sharded()
        F.mse_loss(model(x[mine]), y[mine]).backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=0.5)
        norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
        torch.testing.assert_close(norm, ref_norm, rtol=1e-5, atol=0)  # fp32 sum order only
        clipped = torch.linalg.vector_norm(
            torch.stack([torch.linalg.vector_norm(p.grad.full_tensor()) for p in model.parameters()])
        )
        assert abs(clipped.item() - 0.5) < 1e-4, clipped

    with case("activation checkpointing of blocks"):
        plain = sharded()
        torch.manual_seed(0)
        wrapped_net = MLPNet(hidden=33)
        for i, block in enumerate(wrapped_net.layers):
            wrapped_net.layers[i] = checkpoint_wrapper(block)
        wrapped = fsdp_int8.shard_model(wrapped_net, config=config)
        for net in (plain, wrapped):
            F.mse_loss(net(x[mine]), y[mine]).backward()
        for p, q in zip(plain.parameters(), wrapped.parameters()):
            torch.testing.assert_close(p.grad.full_tensor(), q.grad.full_tensor(), rtol=0, atol=0)

    with case("meta-device init: build on meta, shard_model, to_empty, init in place"):
        with torch.device("meta"):
            model = tiny_transformer()
        fsdp_int8.shard_model(model)
        model.to_empty(device=device_type_for(world))
        model.init_weights()
        weights = int8_params(model)
        assert len(weights) == 2 * 7, [n for n, _ in weights]
        for name, param in weights:
            shard = local_of(param)
            assert shard.int_data.abs().max() == 127, name  # RTN of a fresh normal init
            assert torch.isfinite(shard.scale).all() and (shard.scale > 0).all(), name
            std = param.full_tensor().dequantize().std().item()
            assert 0.002 < std < 0.03, (name, std)  # normal_(std=0.02), or /sqrt(2 * n_layers)
        # every rank's rows are its rows of the single-process init (none repeats another's)
        alone = fsdp_int8.quantize_(tiny_transformer())  # init_weights(0) of the whole model here
        for name, param in model.named_parameters():  # before forward: the root is still sharded
            assert torch.equal(param.full_tensor().cpu(), alone.get_parameter(name)), name  # int8 + scales
        assert not torch.equal(tiny_transformer(seed=1).output.weight, tiny_transformer().output.weight)  # seeds count
        tokens = torch.randint(0, 64, (2, 16))
        loss = F.cross_entropy(model(tokens).flatten(0, 1), tokens.flatten())
        assert abs(loss.item() - torch.log(torch.tensor(64.0)).item()) < 0.2  # near-uniform start

    with case("multi-step init through init_int8_weights_ (trunc_normal_)"):
        model = sharded()
        fsdp_int8.init_int8_weights_(
            model, lambda name, t: nn.init.trunc_normal_(t, std=0.02, a=-0.04, b=0.04)
        )
        for name, param in int8_params(model):
            values = param.full_tensor().dequantize()
            # a normal truncated at 2 sigma has std 0.88 sigma = 0.0176; int8 rounding of
            # the 0.04 maximum is exact (it is the row absmax)
            assert values.abs().max() <= 0.04 + 1e-6, (name, values.abs().max())
            assert 0.015 < values.std() < 0.020, (name, values.std())


def _check_errors(rank: int, world: int) -> None:
    with case("integer reshard_after_forward"):
        try:
            fsdp_int8.shard_model(MLPNet(), reshard_after_forward=2)
        except ValueError as error:
            assert "all-gather hooks" in str(error) and "docs/limits.md" in str(error)
        else:
            raise AssertionError("no error")
    with case("already sharded"):
        model = fsdp_int8.shard_model(MLPNet())
        for call in (fsdp_int8.shard_model, fsdp_int8.quantize_):
            try:
                call(model)
            except RuntimeError as error:
                assert "already sharded" in str(error)
            else:
                raise AssertionError(f"{call.__name__}: no error")
    with case("nothing to shard"):
        try:
            fsdp_int8.shard_model(nn.Sequential(nn.Linear(32, 32), nn.ReLU()))
        except ValueError as error:
            assert "found no blocks" in str(error) and "blocks=" in str(error)
        else:
            raise AssertionError("no error")
    with case("mesh that leaves out ranks training other data (a 'tp' dim without tp_plan)"):
        mesh = init_device_mesh("cpu", (1, world), mesh_dim_names=("dp", "tp"))
        try:
            fsdp_int8.shard_model(MLPNet(), mesh=mesh["dp"])
        except ValueError as error:
            assert f"'tp' (size {world})" in str(error) and "unsynchronised" in str(error), error
        else:
            raise AssertionError("no error")
    with case("a mesh of some ranks that is no slice of a larger mesh: a warning"):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            alone = [dist.new_group([r]) for r in range(world)]  # every rank makes every group
            fsdp_int8.shard_model(MLPNet(), mesh=DeviceMesh.from_group(alone[rank], "cpu"))
        assert any("not a slice of a larger device mesh" in str(w.message) for w in caught), caught
    with case("mesh that does not hold this rank"):
        try:
            fsdp_int8.shard_model(MLPNet(), mesh=_FakeMesh(world + 1))
        except ValueError as error:
            assert f"this rank ({rank}) is not in the mesh" in str(error), error
            assert "this stage's mesh" in str(error)  # pipeline parallelism: a stage's mesh
        else:
            raise AssertionError("no error")


class _FakeMesh:
    """Stands in for a mesh of other ranks (a real one cannot be built that way here)."""

    ndim = 1
    mesh_dim_names = None

    def __init__(self, size: int) -> None:
        self._size = size

    def size(self, dim: int | None = None) -> int:
        return self._size

    def get_coordinate(self) -> None:  # the mesh does not hold this rank
        return None


def _check_transformer_learns(rank: int, world: int) -> None:
    """A small Llama-style model with stochastic rounding learns a repeating sequence."""
    model = fsdp_int8.shard_model(tiny_transformer(), config=Int8TrainingConfig(seed=3))
    losses = train_repeating_pattern(model, rank, world, steps=40)
    # ln(64) = 4.16 at the start; the 16-token cycle is learnable to well below 1 nat.
    assert losses[0] > 3.5 and losses[-1] < 1.5, losses


def _check_int8_matmuls_under_fsdp(rank: int, world: int) -> None:
    """Int8 GEMMs combine with int8 storage under FSDP2: they run (counted at the
    dispatcher) and the sharded run matches one process. Activations are quantized per
    token row, so splitting the batch over ranks changes nothing; the weight gradient
    (full precision by default) is summed in another order: the fp32 tolerances hold."""
    from _quant import CountIntMM

    with CountIntMM() as counter:
        result = train_parity(
            rank, world, hidden=33, mp_policy=None, reshard_after_forward=True, steps=STEPS,
            int8_matmul=fsdp_int8.Int8MatmulConfig(grad_weight=False),
        )
    # Output and grad_input quantize per token row: the same on each rank as in the one-
    # process reference, so the fp32 parity tolerances hold. (grad_weight quantizes per
    # channel over the tokens, and each rank sees only its own: its int8 weight gradient
    # differs from the reference's by design, and is not part of this exact check.)
    # Per step and model (reference, FSDP): 4 forward GEMMs, 3 grad_input GEMMs (the
    # first layer's input needs no gradient)
    assert counter.calls == STEPS * 2 * (4 + 3), counter.calls
    assert_parity(result, bf16=False)


def _check_int8_weight_gradient_under_fsdp(rank: int, world: int) -> None:
    """The default ``Int8MatmulConfig`` runs the weight gradient's GEMM in int8 too, with
    scales per channel over the tokens of each rank; FSDP2 then averages the ranks'
    results. Reference: the same layer unsharded in this process, fed every rank's tokens
    in turn, the int8 gradients summed and divided by the world size."""
    from _quant import CountIntMM

    config = Int8TrainingConfig(int8_matmul=fsdp_int8.Int8MatmulConfig())
    assert config.int8_matmul.grad_weight  # the default under test

    def layer() -> nn.Module:
        torch.manual_seed(0)
        return fsdp_int8.quantize_(nn.Sequential(nn.Linear(64, 48, bias=False)), config)

    inputs = [torch.randn(24, 64, generator=torch.Generator().manual_seed(10 + r)) for r in range(world)]
    reference = layer()
    for x in inputs:  # .grad accumulates the ranks' int8 weight gradients
        reference(x).square().sum().backward()
    expected = reference[0].weight.grad / world

    sharded = fully_shard(layer())
    with CountIntMM() as counter:
        sharded(inputs[rank]).square().sum().backward()
    # forward and weight gradient; the input needs no gradient, so no grad_input GEMM
    assert counter.calls == 2, counter.calls
    got = sharded[0].weight.grad.full_tensor()
    # Each rank's int8 GEMM and its dequantization are the reference's for the same tokens,
    # bit for bit; only the average differs in order (a/2 + b/2 against (a + b)/2, exact
    # in fp32 for two ranks, one rounding per add for more): a few ulps at most.
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)
    # and it is a quantized gradient: not the fp32 one (int8 operands move it by ~1%)
    plain = nn.Linear(64, 48, bias=False)
    with torch.no_grad():
        plain.weight.copy_(reference[0].weight.dequantize())
    for x in inputs:
        plain(x).square().sum().backward()
    assert not torch.allclose(plain.weight.grad / world, expected, rtol=1e-4, atol=1e-4)


def _check_quantized_gradients_switch(rank: int, world: int) -> None:
    """enable_quantized_reduce_scatter on a shard_model'ed model replaces every gradient
    reduce-scatter with int8 all-to-alls, and checkpoints carry its noise generator for
    exact resume."""
    import tempfile

    from fsdp_int8.gradients import enable_quantized_reduce_scatter

    torch.manual_seed(0)
    model = fsdp_int8.shard_model(MLPNet(hidden=33), config=Int8TrainingConfig())
    assert enable_quantized_reduce_scatter(model) == 3  # 2 blocks + root
    x = torch.randn(4, 32, generator=torch.Generator().manual_seed(rank))
    with fsdp_int8.collectives.count_collectives() as counter:
        model(x).sum().backward()
    assert counter.of("reduce_scatter_single") == [], counter.summary()
    assert len(counter.of("all_to_all_single")) == 3 and all(
        r.dtype == torch.int8 for r in counter.of("all_to_all_single")
    ), counter.summary()  # one per FSDP group with parameters: 2 blocks + root
    comm = fsdp_int8.gradients.install.installed_quantized_reduce_scatter(model)
    saved = comm.rng_state()
    with tempfile.TemporaryDirectory() as tmp:
        root = fsdp_int8._dist.broadcast_from_rank0(tmp)
        fsdp_int8.save_checkpoint(root, model, step=1)
        model(x).sum().backward()  # draws more noise
        assert any(not torch.equal(saved[k], v) for k, v in comm.rng_state().items())
        fsdp_int8.load_checkpoint(root, model)
        assert all(torch.equal(saved[k], v) for k, v in comm.rng_state().items())
        dist.barrier()  # rank 0 removes the directory when it leaves this block


def _check_dtensor_ops_on_uneven_shards(rank: int, world: int, rows: int) -> None:
    """DTensor gathers uneven shards by padding the short ones (aten.pad) and narrowing the
    result: an op refused on the short-shard ranks only would leave the others waiting."""
    with case(f"DTensor ops on {rows} rows over {world} ranks"):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(32, rows), nn.Linear(rows, 32))
        fsdp_int8.quantize_(model, Int8TrainingConfig(min_features=1))
        full = model[0].weight.dequantize(torch.float32)
        fully_shard(model)
        weight = model[0].weight
        assert isinstance(local_of(weight), Int8Weight)
        # Means of the same dequantized values: only the summation order differs (fp32).
        torch.testing.assert_close(weight.mean().full_tensor().float(), full.mean(), rtol=1e-5, atol=1e-6)
        assert torch.equal(weight[1:4].full_tensor().dequantize(torch.float32), full[1:4])
        for piece, expected in zip(weight.chunk(2), full.chunk(2)):
            assert torch.equal(piece.full_tensor().dequantize(torch.float32), expected)
        assert torch.equal(weight.full_tensor().dequantize(torch.float32), full)


def _check_broadcast_says_when_it_is_not_exact(rank: int, world: int) -> None:
    """dist.broadcast of an Int8Weight carries outer-dtype values: exact for fp32 weights as
    quantized (no warning); a bf16 wire cannot carry every scale, and the sender says so."""
    import warnings

    for dtype, exact in ((torch.float32, True), (torch.bfloat16, False)):
        with case(f"broadcast of a {dtype} Int8Weight"):
            torch.manual_seed(rank)  # different weights on each rank: rank 0's must win
            weight = Int8Weight.from_float(torch.randn(20, 256), dtype=dtype)
            sent = weight.clone()
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                dist.broadcast(weight, src=0)
            warned = any("round-trip bit-exactly" in str(w.message) for w in caught)
            assert warned == (rank == 0 and not exact), [str(w.message) for w in caught]
            reference = [sent.int_data.clone(), sent.scale.clone()]
            for t in reference:
                dist.broadcast(t, src=0)
            same = torch.equal(weight.int_data, reference[0]) and torch.equal(weight.scale, reference[1])
            assert same or not exact


def _two_rank_body(rank: int, world: int) -> None:
    _check_broadcast_says_when_it_is_not_exact(rank, world)
    _check_dtensor_ops_on_uneven_shards(rank, world, rows=21)
    _parity_matrix(rank, world, hiddens=(32, 33, 31) if FULL_MATRIX else (32, 33))
    _check_int8_matmuls_under_fsdp(rank, world)
    _check_int8_weight_gradient_under_fsdp(rank, world)
    _check_quantized_gradients_switch(rank, world)
    _check_bytes(rank, world)
    _check_weight_only_unshards_plain(rank, world)
    _check_optimizer_step_is_local(rank, world)
    _check_pre_all_gather_hook_runs(rank, world)
    _check_hand_sharded_model_rounds_each_shard_with_its_own_noise(rank, world)
    _check_training_features(rank, world)
    _check_errors(rank, world)
    _check_transformer_learns(rank, world)


def _four_rank_body(rank: int, world: int) -> None:
    # 7 rows: shards of 2, 2, 2, 1; 5 rows: 2, 2, 1 and one empty rank.
    _parity_matrix(rank, world, hiddens=(7, 5, 32) if FULL_MATRIX else (7, 5))
    _check_dtensor_ops_on_uneven_shards(rank, world, rows=21)  # shards of 6, 6, 6, 3
    _check_dtensor_ops_on_uneven_shards(rank, world, rows=3)  # one rank holds no row
    mesh = init_device_mesh(device_type_for(world), (2, 2), mesh_dim_names=("replicate", "shard"))
    _parity_matrix(rank, world, hiddens=(7,), mesh=mesh)
    for path in ("shard_model", "quantize_ then fully_shard by hand"):
        _check_hsdp_replicas_round_alike(rank, mesh, path)
    _check_stock_tensor_parallel_styles_raise(rank, world)


def _check_stock_tensor_parallel_styles_raise(rank: int, world: int) -> None:
    """torch's ColwiseParallel once gave a silently wrong loss under fully_shard (the TP
    shard kept the whole weight's row count, so the all-gather misplaced rows); every
    stock style and path must raise instead, on every rank, naming the docs."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh = init_device_mesh(device_type_for(world), (2, 2), mesh_dim_names=("dp", "tp"))
    styles = {"ColwiseParallel": lambda: {"up": ColwiseParallel(output_layouts=Replicate())},
              "RowwiseParallel": lambda: {"down": RowwiseParallel()}}
    x = torch.randn(4, 32, generator=torch.Generator().manual_seed(0))
    for style, plan in styles.items():
        for int8_matmul in (None, fsdp_int8.Int8MatmulConfig()):
            for path in ("parallelize_module alone", "then fully_shard on dp", "then shard_model"):
                name = f"{style}, int8_matmul={int8_matmul is not None}, {path}"
                with case(name):
                    model = fsdp_int8.quantize_(
                        MLPNet(hidden=8, bias=False), Int8TrainingConfig(int8_matmul=int8_matmul, min_features=1)
                    )
                    try:
                        for block in model.layers:
                            parallelize_module(block, mesh["tp"], plan())
                        if path == "then fully_shard on dp":
                            _shard_blocks_plain(model, mesh["dp"], MixedPrecisionPolicy())
                        elif path == "then shard_model":
                            fsdp_int8.shard_model(model, mesh=mesh["dp"])
                        model(x).sum().backward()
                    except NotImplementedError as error:
                        assert "tensor parallelism" in str(error) and "docs/parallelism.md" in str(error), error
                    else:
                        raise AssertionError("no error: a stock TP style ran on int8 weights")


def _check_hsdp_replicas_round_alike(rank: int, mesh, path: str) -> None:
    with case(f"HSDP replicas round identically under stochastic rounding ({path})"):
        torch.manual_seed(0)
        config = Int8TrainingConfig(seed=5, min_features=1)
        if path == "shard_model":
            model = fsdp_int8.shard_model(MLPNet(hidden=7), mesh=mesh, config=config)
        else:
            model = fsdp_int8.quantize_(MLPNet(hidden=7), config)
            _shard_blocks_plain(model, mesh, MixedPrecisionPolicy())
        assert int8_params(model)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        x = torch.randn(8, 32, generator=torch.Generator().manual_seed(0))
        for _ in range(3):
            model(x[rank * 2: rank * 2 + 2]).sum().backward()
            opt.step()
            opt.zero_grad()
        replicate_group = mesh.get_group("replicate")
        for name, param in int8_params(model):
            mine = local_of(param).int_data.contiguous()
            gathered = [torch.empty_like(mine) for _ in range(2)]
            dist.all_gather(gathered, mine, group=replicate_group)
            assert torch.equal(gathered[0], gathered[1]), name


def _one_rank_body(rank: int, world: int) -> None:
    _parity_matrix(rank, world, hiddens=(33,))


def test_fsdp_two_ranks():
    run_distributed(_two_rank_body, 2)


def test_fsdp_four_ranks_uneven_and_hsdp():
    run_distributed(_four_rank_body, 4)


def test_fsdp_world_size_one():
    run_distributed(_one_rank_body, 1)
