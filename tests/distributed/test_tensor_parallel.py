"""FSDP2 x tensor parallelism with int8 weights, on 4 processes: (dp, tp) = (2, 2) and HSDP x TP.

One spawn runs every case (a spawn costs seconds). The reference for numerics is a plain
fp32 model in each process holding the sharded model's dequantized weights.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
from _cases import BF16_POLICY, FULL_MATRIX, case, int8_params, local_of
from _nets import MLPNet
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import Replicate, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import fsdp_int8
import fsdp_int8.collectives
from fsdp_int8 import Int8MatmulConfig, Int8TrainingConfig
from fsdp_int8._dist import broadcast_from_rank0
from fsdp_int8._quant import kernels as _kernels
from fsdp_int8._quant.generators import WEIGHT_ROUNDING
from fsdp_int8.gradients import enable_quantized_reduce_scatter
from fsdp_int8.testing import device_type_for, run_distributed

PLAN = {"up": ColwiseParallel(), "down": RowwiseParallel()}
DIM, HIDDEN, BATCH = 32, 64, 8


def _config(**overrides) -> Int8TrainingConfig:
    return Int8TrainingConfig(min_features=1, **overrides)


def _model(bias: bool = True) -> MLPNet:
    torch.manual_seed(0)  # the same weights on every rank and in every layout
    return MLPNet(dim=DIM, hidden=HIDDEN, bias=bias)


def _reference(model: nn.Module, bias: bool = True) -> MLPNet:
    """A plain fp32 model holding ``model``'s dequantized weights (every rank)."""
    reference = MLPNet(dim=DIM, hidden=HIDDEN, bias=bias)
    reference.load_state_dict(broadcast_from_rank0(fsdp_int8.export_full_state_dict(model, torch.float32)))
    return reference


def _batch(seed: int = 1) -> torch.Tensor:
    return torch.randn(BATCH, 3, DIM, generator=torch.Generator().manual_seed(seed))


def _gathered(tensor: torch.Tensor, group) -> list[torch.Tensor]:
    tensor = tensor.contiguous()
    out = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
    dist.all_gather(out, tensor, group=group)
    return out


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


def _check_weight_only_parity(mesh, dp_coordinate: int, dp_size: int) -> None:
    """Loss and input gradients of the (2, 2) model equal the fp32 reference's on the same
    dequantized weights, over two iterations with a stochastic-rounding AdamW step between.
    Tolerance 1e-4 relative: both compute in fp32 and differ only in summation order (TP
    partial sums, FSDP's gradient averaging), ~1e-7 per op."""
    rows = slice(dp_coordinate * BATCH // dp_size, (dp_coordinate + 1) * BATCH // dp_size)
    for reshard in (True, False):
        with case(f"weight-only parity at {tuple(mesh.shape)}, reshard_after_forward={reshard}"):
            model = fsdp_int8.shard_model(_model(), mesh=mesh, config=_config(seed=3), tp_plan=PLAN,
                                          reshard_after_forward=reshard)
            optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
            for iteration in range(2):
                reference = _reference(model)
                x = _batch(iteration)
                mine = x[rows].clone().requires_grad_()
                loss = model(mine).square().mean()
                loss.backward()
                full = x.clone().requires_grad_()
                expected = reference(full)[rows].square().mean()
                expected.backward()
                assert abs(loss.item() - expected.item()) <= 1e-4 * expected.item(), (iteration, loss, expected)
                assert _relative(mine.grad, full.grad[rows]) <= 1e-4, iteration
                optimizer.step()
                optimizer.zero_grad()
            _check_shared_scales_and_replicas(model, mesh)


def _check_shared_scales_and_replicas(model: nn.Module, mesh) -> None:
    """After stochastic-rounding steps: every rowwise weight's row scales are equal on its
    tp peers; a weight the plan leaves whole (the head) is bit-identical on tp peers (they
    are replicas, so they must draw the same noise)."""
    tp_group = mesh.get_group("tp")
    for name, param in int8_params(model):
        local = local_of(param)
        if local.tensor_parallel is not None and local.tensor_parallel.shares_row_scales:
            scales = _gathered(local.scale, tp_group)
            assert all(torch.equal(scales[0], s) for s in scales[1:]), f"{name}: tp peers' scales differ"
        elif local.tensor_parallel is None:
            data = _gathered(local.int_data, tp_group)
            assert all(torch.equal(data[0], d) for d in data[1:]), f"{name}: tp replicas drifted apart"


def _output_error(model: nn.Module, reference: nn.Module, x: torch.Tensor) -> float:
    with torch.no_grad():
        return _relative(model(x), reference(x))


def _check_int8_matmul_error(mesh) -> None:
    """Int8 matmuls at (2, 2) stay within the 1-D int8-matmul error on the same weights.
    Rowwise TP quantizes each token's activations over its in/tp features, with a scale no
    larger than the whole row's, so its rounding error is no larger per element; 1.5x
    leaves room for a different rounding realization."""
    with case("int8 matmuls under TP"):
        config = _config(int8_matmul=Int8MatmulConfig(), stochastic_rounding=False)
        one_d = fsdp_int8.shard_model(_model(), config=config)
        two_d = fsdp_int8.shard_model(_model(), mesh=mesh, config=config, tp_plan=PLAN)
        reference = _reference(one_d)
        x = _batch(5)
        error_1d, error_2d = _output_error(one_d, reference, x), _output_error(two_d, reference, x)
        assert 0 < error_2d <= 1.5 * error_1d and error_2d < 0.05, (error_1d, error_2d)


def _set_gradients(model: nn.Module) -> None:
    """The same full gradient for every parameter in any layout, placed like the parameter."""
    for index, (name, param) in enumerate(model.named_parameters()):
        full = torch.randn(param.shape, generator=torch.Generator().manual_seed(100 + index))
        mesh = param.device_mesh
        replicated = distribute_tensor(full, mesh, [Replicate()] * mesh.ndim)
        param.grad = replicated.redistribute(mesh, param.placements)


def _check_round_to_nearest_step_matches_1d(mesh) -> None:
    """A round-to-nearest optimizer step at (2, 2) writes the same int8 bytes and scales as
    at (4, 1), given the same gradients: the shared row scale is the whole row's absmax,
    exactly what one rank holding the row computes."""
    for optimizer_type in (torch.optim.AdamW, torch.optim.SGD):
        with case(f"round-to-nearest {optimizer_type.__name__} step: (2, 2) == (4, 1)"):
            results = []
            for layout in ("4x1", "2x2"):
                config = _config(stochastic_rounding=False)
                if layout == "4x1":
                    model = fsdp_int8.shard_model(_model(), config=config)
                else:
                    model = fsdp_int8.shard_model(_model(), mesh=mesh, config=config, tp_plan=PLAN)
                optimizer = optimizer_type(model.parameters(), lr=1e-2)
                for _ in range(2):
                    _set_gradients(model)
                    optimizer.step()
                results.append(fsdp_int8.export_full_state_dict(model, torch.float32))
            if dist.get_rank() == 0:
                one_d, two_d = results
                assert one_d.keys() == two_d.keys()
                changed = [k for k in one_d if not torch.equal(one_d[k], _reference_initial()[k])]
                assert changed, "the steps changed nothing"
                different = [k for k in one_d if not torch.equal(one_d[k], two_d[k])]
                assert not different, different


def _reference_initial() -> dict[str, torch.Tensor]:
    model = fsdp_int8.quantize_(_model(), _config(stochastic_rounding=False))
    return fsdp_int8.export_full_state_dict(model, torch.float32)


def _check_all_gather_bytes(mesh) -> None:
    """The FSDP2 all-gathers on the dp dim move int8 rows plus scales: at most 0.6x the
    bytes of bf16 FSDP2 x TP on the same parameters ((K + 4) / 2K = 0.5625: every local
    weight here has K = 32 columns), plus the alignment padding FSDP2 puts between the int8
    buffer and the bf16 bias in the root's all-gather (measured 0.576). Neither model
    reshards after forward, so each parameter is gathered once in both."""
    with case("dp all-gather bytes: int8 vs bf16 at (2, 2)"):
        x = _batch(7)
        int8 = fsdp_int8.shard_model(_model(bias=False), mesh=mesh, config=_config(), tp_plan=PLAN,
                                     mp_policy=BF16_POLICY, reshard_after_forward=False)
        baseline = _model(bias=False)
        for block in baseline.layers:
            parallelize_module(block, mesh["tp"], PLAN)
            fully_shard(block, mesh=mesh["dp"], mp_policy=BF16_POLICY, reshard_after_forward=False)
        fully_shard(baseline, mesh=mesh["dp"], mp_policy=BF16_POLICY, reshard_after_forward=False)
        totals = []
        for model in (int8, baseline):
            with fsdp_int8.collectives.count_collectives() as counter:
                model(x).float().sum().backward()
            totals.append(sum(r.bytes for r in counter.records if r.name.startswith("all_gather")))
        ratio = totals[0] / totals[1]
        if dist.get_rank() == 0:
            print(f"dp all-gather bytes per step at (2, 2): int8 {totals[0]}, bf16 {totals[1]}, ratio {ratio:.3f}")
        assert 36 / 64 <= ratio <= 0.6, totals


def _check_updates_batch_one_reduction_per_step(mesh) -> None:
    """With batch_int8_updates, every rowwise weight's update of one optimizer step waits
    for ONE all_reduce(MAX) of all their row absmaxes; without it, each rounds at once."""
    for batched in (True, False):
        with case(f"all_reduces per optimizer step for the shared row scales, batched={batched}"):
            model = fsdp_int8.shard_model(_model(), mesh=mesh, config=_config(), tp_plan=PLAN)
            optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
            if batched:
                fsdp_int8.optim.batch_int8_updates(optimizer)
            model(_batch()).sum().backward()
            with fsdp_int8.collectives.count_collectives() as counter:
                optimizer.step()
            # the shared row scales' reductions, over the tp peers (the other all-reduce is
            # the default guard's one-element finite-gradient verdict, over every rank)
            verdicts = [r for r in counter.records if r.name == "all_reduce" and r.world_size == 4]
            assert [(r.dtype, r.numel) for r in verdicts] == [(torch.int32, 1)], counter.records
            reductions = [r for r in counter.records if r.name == "all_reduce" and r.world_size == 2]
            rowwise = sum(1 for _, p in int8_params(model) if local_of(p).tensor_parallel.shares_row_scales)
            assert rowwise == 2 and len(reductions) == (1 if batched else 2), (rowwise, counter.records)
            _check_shared_scales_and_replicas(model, mesh)


def _check_rounding_streams(mesh) -> None:
    """No two shards share a noise stream: tp shards each have their own; the (pp, dp
    shard) stream is the same on tp peers (replicated weights round alike) and differs
    across dp shards."""
    with case("stochastic-rounding streams per (dp shard, tp)"):
        model = fsdp_int8.shard_model(_model(), mesh=mesh, config=_config(seed=9), tp_plan=PLAN)
        shard = next(local_of(p).tensor_parallel for _, p in int8_params(model) if local_of(p).tensor_parallel)
        seeds = torch.tensor([WEIGHT_ROUNDING.generator("cpu").initial_seed() % (1 << 62),
                              WEIGHT_ROUNDING.generator("cpu", shard).initial_seed() % (1 << 62)])
        everyone = _gathered(seeds, None)
        tp_streams = {int(s[1]) for s in everyone}
        dp_streams = [int(s[0]) for s in everyone]  # ranks in (dp, tp) order
        assert len(tp_streams) == 4, everyone
        assert dp_streams[0] == dp_streams[1] and dp_streams[2] == dp_streams[3], everyone
        assert dp_streams[0] != dp_streams[2] and not tp_streams & set(dp_streams), everyone


def _check_writes_keep_scales_shared(mesh) -> None:
    """Loads, initialisers and the int8 optimizers keep tp peers' row scales equal."""
    for what in ("init_int8_weights_", "normal_", "meta, then reset_parameters", "Int8AdamW", "Int8SGD"):
        with case(f"{what} keeps tp peers' row scales equal"):
            if what.startswith("meta"):
                with torch.device("meta"):
                    model = MLPNet(dim=DIM, hidden=HIDDEN)
            else:
                model = _model()
            model = fsdp_int8.shard_model(model, mesh=mesh, config=_config(), tp_plan=PLAN)
            if what.startswith("meta"):
                model.to_empty(device=device_type_for(4))
                torch.manual_seed(dist.get_rank())  # peers draw different values: scales must still agree
                for module in model.modules():
                    if isinstance(module, nn.Linear):
                        module.reset_parameters()
                model(_batch()).sum().backward()  # and it trains
            elif what == "init_int8_weights_":
                fsdp_int8.init_int8_weights_(model, lambda name, values: nn.init.trunc_normal_(values, std=0.1))
            elif what == "normal_":
                with torch.no_grad():
                    for _, param in int8_params(model):
                        param.normal_()
            else:
                optimizer_type = fsdp_int8.Int8AdamW if what == "Int8AdamW" else fsdp_int8.Int8SGD
                optimizer = optimizer_type(model.parameters(), lr=1e-2)
                for _ in range(2):
                    model(_batch()).square().mean().backward()
                    optimizer.step()
                    optimizer.zero_grad()
            _check_shared_scales_and_replicas(model, mesh)


def _check_hsdp_with_tp(rank: int) -> None:
    """HSDP x TP, mesh (dp_replicate, dp_shard, tp) = (2, 1, 2): loss matches the reference,
    and the dp replicas stay bit-identical through stochastic-rounding steps."""
    with case("HSDP x TP at (2, 1, 2)"):
        mesh = init_device_mesh(device_type_for(4), (2, 1, 2), mesh_dim_names=("dp_replicate", "dp_shard", "tp"))
        model = fsdp_int8.shard_model(_model(), mesh=mesh, config=_config(seed=4), tp_plan=PLAN)
        reference = _reference(model)
        replica = mesh.get_local_rank("dp_replicate")
        rows = slice(replica * BATCH // 2, (replica + 1) * BATCH // 2)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        x = _batch(2)
        loss = model(x[rows]).square().mean()
        expected = reference(x)[rows].square().mean()
        assert abs(loss.item() - expected.item()) <= 1e-4 * expected.item(), (loss, expected)  # as above
        loss.backward()
        optimizer.step()
        for _ in range(2):
            model(x[rows]).square().mean().backward()
            optimizer.step()
            optimizer.zero_grad()
        replicate_group = mesh.get_group("dp_replicate")
        for name, param in int8_params(model):
            data = _gathered(local_of(param).int_data, replicate_group)
            assert torch.equal(data[0], data[1]), f"{name}: HSDP replicas drifted apart"


def _check_mesh_and_plan_errors(mesh) -> None:
    """Wrong meshes and plans fail before anything is quantized or sharded, saying why."""
    world_mesh = init_device_mesh(device_type_for(4), (2, 2), mesh_dim_names=("pp", "dp"))
    cases = {
        "a tp mesh without a plan": (dict(mesh=mesh), "but no tp_plan"),
        "a plan without a tp dim": (dict(mesh=mesh["dp"], tp_plan=PLAN), "a dim named 'tp'"),
        "a pp dim in the mesh": (dict(mesh=world_mesh, tp_plan=None), "'pp' dim"),
        "a plan naming no module": (dict(mesh=mesh, tp_plan={"gate": ColwiseParallel()}), "does not have"),
        "rows that tp does not divide": (
            dict(mesh=mesh, tp_plan=PLAN, blocks=None, hidden=33), "not divisible by the tp size"),
    }
    for name, (kwargs, message) in cases.items():
        with case(name):
            model = MLPNet(dim=DIM, hidden=kwargs.pop("hidden", HIDDEN))
            try:
                fsdp_int8.shard_model(model, config=_config(), **kwargs)
            except ValueError as error:
                assert message in str(error), error
            else:
                raise AssertionError("no error")


def _check_quantized_reduce_scatter(mesh) -> None:
    """The int8 gradient reduce-scatter composes with TP: a regression target is learned
    (the loss falls below a fifth of its start in 12 AdamW steps; measured ~1/20)."""
    with case("int8 gradient reduce-scatter under TP"):
        model = fsdp_int8.shard_model(_model(), mesh=mesh, config=_config(), tp_plan=PLAN)
        enable_quantized_reduce_scatter(model)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        x = _batch(3)[mesh.get_local_rank("dp") * 4:][:4]
        losses = []
        for _ in range(12):
            loss = (model(x) - 1).square().mean()
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
        assert losses[-1] < 0.2 * losses[0], losses


def _check_compiled_kernels_match_eager(mesh) -> None:
    """``compile="on"`` runs the same arithmetic as eager under TP (the fused update of
    colwise weights on their tp stream, the shared-scale rounding of rowwise ones): three
    stochastic-rounding steps with int8 matmuls give the same losses, bit for bit. In the
    exhaustive matrix only: compiling costs about a minute on 2 cores."""
    with case("compiled kernels under TP equal eager"):
        losses = {}
        for compiled in (False, True):
            config = _config(seed=6, compile="on" if compiled else "off", int8_matmul=Int8MatmulConfig())
            model = fsdp_int8.shard_model(_model(), mesh=mesh, config=config, tp_plan=PLAN)
            optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
            x = _batch(4)[mesh.get_local_rank("dp") * 4:][:4]
            losses[compiled] = []
            for _ in range(3):
                loss = (model(x) - 1).square().mean()
                loss.backward()
                optimizer.step()
                optimizer.zero_grad()
                losses[compiled].append(loss.item())
            _check_shared_scales_and_replicas(model, mesh)
        assert not _kernels.compile_failed(), "torch.compile failed: the comparison would be eager vs eager"
        assert losses[True] == losses[False], losses


def _body(rank: int, world: int) -> None:
    mesh = init_device_mesh(device_type_for(world), (2, 2), mesh_dim_names=("dp", "tp"))
    _check_weight_only_parity(mesh, mesh.get_local_rank("dp"), 2)
    _check_int8_matmul_error(mesh)
    _check_round_to_nearest_step_matches_1d(mesh)
    _check_all_gather_bytes(mesh)
    _check_updates_batch_one_reduction_per_step(mesh)
    _check_rounding_streams(mesh)
    _check_writes_keep_scales_shared(mesh)
    _check_hsdp_with_tp(rank)
    _check_mesh_and_plan_errors(mesh)
    _check_quantized_reduce_scatter(mesh)
    if FULL_MATRIX:
        _check_compiled_kernels_match_eager(mesh)


def test_fsdp_by_tensor_parallel_four_ranks():
    run_distributed(_body, 4)
