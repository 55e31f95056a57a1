"""Pipeline parallelism (``torch.distributed.pipelining``) with int8 weights, on 4 processes.

Each pipeline stage holds two of the model's four blocks and is ``shard_model``-ed on its
own data-parallel (or dp x tp) sub-mesh; ``ScheduleGPipe`` / ``Schedule1F1B`` run it. The
reference is the same quantized model, unsharded, in each process, running the same
microbatches with gradient accumulation.
"""

from __future__ import annotations

import logging
import shutil
import tempfile
import warnings

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from _cases import assert_identical, case, int8_params, snapshot
from _nets import MLPBlock
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

import fsdp_int8
from fsdp_int8 import Int8TrainingConfig, _dist
from fsdp_int8._quant.generators import WEIGHT_ROUNDING
from fsdp_int8.testing import run_distributed

STAGES, LAYERS, DIM, HIDDEN = 2, 4, 32, 64
BATCH = 8  # global batch: 4 rows per dp rank, split into microbatches
CONFIG = Int8TrainingConfig(stochastic_rounding=False, min_features=1)
TP_PLAN = {"up": ColwiseParallel(), "down": RowwiseParallel()}


class PipeNet(nn.Module):
    """Residual MLP blocks in a ``ModuleDict`` keyed by index (torchtitan's layout) and a
    head. A stage deletes the blocks it does not run (and the head, but on the last
    stage): the blocks it keeps keep their names, so its state dict uses the full model's
    keys."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleDict({str(i): MLPBlock(DIM, HIDDEN) for i in range(LAYERS)})
        self.head: nn.Module | None = nn.Linear(DIM, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers.values():
            x = layer(x)
        return self.head(x) if self.head is not None else x


def _full_model() -> PipeNet:
    torch.manual_seed(0)
    return PipeNet()


def _stage_module(stage: int) -> PipeNet:
    """This stage's part of the full model (built alike on every rank)."""
    model = _full_model()
    per_stage = LAYERS // STAGES
    for key in list(model.layers.keys()):
        if int(key) // per_stage != stage:
            del model.layers[key]
    if stage != STAGES - 1:
        model.head = None
    return model


def _data(dp_rank: int, dp: int) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randn(BATCH, DIM, generator=torch.Generator().manual_seed(1))
    y = torch.randn(BATCH, 4, generator=torch.Generator().manual_seed(2))
    rows = slice(dp_rank * BATCH // dp, (dp_rank + 1) * BATCH // dp)
    return x[rows], y[rows]


def _reference(dp: int, n_microbatches: int) -> tuple[nn.Module, dict[int, list[float]]]:
    """The quantized full model in this process, every dp rank's microbatches accumulated
    as the pipeline schedule and FSDP2 do it: each microbatch's loss / n_microbatches
    (the schedule's ``scale_grads``), averaged over dp ranks (FSDP2's reduce-scatter)."""
    model = fsdp_int8.quantize_(_full_model(), CONFIG)
    losses = {}
    for dp_rank in range(dp):
        x, y = _data(dp_rank, dp)
        losses[dp_rank] = []
        for xm, ym in zip(x.chunk(n_microbatches), y.chunk(n_microbatches)):
            loss = F.mse_loss(model(xm), ym)
            (loss / (n_microbatches * dp)).backward()
            losses[dp_rank].append(loss.item())
    return model, losses


def _run_pipeline(mesh, pp_rank, dp_rank, dp, schedule_cls, n_microbatches, shard_mesh, tp_plan=None):
    """One schedule step of this rank's stage, ``shard_model``-ed on ``shard_mesh``; the
    stage and (on the last stage) its microbatch losses."""
    stage = fsdp_int8.shard_model(_stage_module(pp_rank), mesh=shard_mesh, config=CONFIG, tp_plan=tp_plan)
    pipe = PipelineStage(stage, pp_rank, STAGES, torch.device("cpu"), group=mesh["pp"].get_group())
    schedule = schedule_cls(pipe, n_microbatches=n_microbatches, loss_fn=F.mse_loss)
    x, y = _data(dp_rank, dp)
    losses: list[torch.Tensor] = []
    if pp_rank == 0:
        schedule.step(x)
    else:
        schedule.step(target=y, losses=losses)
    return stage, [loss.item() for loss in losses]


def _assert_matches_reference(stage: nn.Module, losses: list[float], reference: nn.Module,
                               ref_losses: list[float], last_stage: bool) -> float:
    """The stage's gradients (gathered) and, on the last stage, its microbatch losses
    equal the reference's; the largest gradient difference relative to its tensor's max.

    Tolerances: both sides run the same int8 bytes on the same rows, so they differ only
    in fp32 summation order (FSDP2's reduce-scatter averages the dp ranks, tensor
    parallelism adds partial sums): measured <= 4e-7 relative. rtol 1e-5 leaves 25x
    headroom; a lost microbatch, dp rank or tp shard changes gradients by O(10%) or more.
    """
    ref_params = dict(reference.named_parameters())
    worst = 0.0
    for name, param in stage.named_parameters():
        grad = param.grad.full_tensor() if isinstance(param.grad, DTensor) else param.grad
        ref = ref_params[name].grad
        worst = max(worst, float((grad - ref).abs().max() / ref.abs().max()))
        torch.testing.assert_close(grad, ref, rtol=1e-5, atol=1e-6, msg=name)
    if last_stage:
        assert len(losses) == len(ref_losses), losses
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=0)
    else:
        assert losses == [], losses
    return worst


def _check_schedules(rank: int, world: int, worst: dict) -> None:
    mesh = init_device_mesh("cpu", (STAGES, world // STAGES), mesh_dim_names=("pp", "dp"))
    pp_rank, dp_rank, dp = mesh["pp"].get_local_rank(), mesh["dp"].get_local_rank(), mesh["dp"].size()
    for schedule_cls in (ScheduleGPipe, Schedule1F1B):
        for n_microbatches in (2, 4):
            name = f"pp=2 x dp=2 {schedule_cls.__name__} microbatches={n_microbatches}"
            with case(name):
                reference, ref_losses = _reference(dp, n_microbatches)
                stage, losses = _run_pipeline(mesh, pp_rank, dp_rank, dp, schedule_cls, n_microbatches, mesh["dp"])
                assert len(int8_params(stage)) == 4 and all(  # both blocks' linears, on the dp mesh
                    p.device_mesh.mesh_dim_names == ("dp",) for _, p in int8_params(stage)
                ), int8_params(stage)
                worst[name] = _assert_matches_reference(
                    stage, losses, reference, ref_losses[dp_rank], pp_rank == STAGES - 1
                )


def _check_tensor_parallel(rank: int, world: int, worst: dict) -> None:
    mesh = init_device_mesh("cpu", (STAGES, 1, world // STAGES), mesh_dim_names=("pp", "dp", "tp"))
    pp_rank = mesh["pp"].get_local_rank()
    # gathering a (dp, tp)-sharded gradient warns that it takes two all-gathers
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    for schedule_cls in (ScheduleGPipe, Schedule1F1B):
        name = f"pp=2 x tp=2 {schedule_cls.__name__}"
        with case(name):
            reference, ref_losses = _reference(1, 2)
            stage, losses = _run_pipeline(mesh, pp_rank, 0, 1, schedule_cls, 2, mesh[("dp", "tp")], TP_PLAN)
            assert len(int8_params(stage)) == 4 and all(  # split by tp, then FSDP2 on (dp, tp)
                p.device_mesh.mesh_dim_names == ("dp", "tp") for _, p in int8_params(stage)
            ), int8_params(stage)
            worst[name] = _assert_matches_reference(stage, losses, reference, ref_losses[0], pp_rank == STAGES - 1)


def _check_rounding_streams(rank: int, world: int) -> None:
    mesh = init_device_mesh("cpu", (STAGES, world // STAGES), mesh_dim_names=("pp", "dp"))
    pp_rank = mesh["pp"].get_local_rank()
    fsdp_int8.shard_model(_stage_module(pp_rank), mesh=mesh["dp"], config=Int8TrainingConfig(seed=5, min_features=1))
    coordinates = _dist.all_gather(_dist.rounding_coordinate(mesh["dp"]))
    states = _dist.all_gather(WEIGHT_ROUNDING.generator("cpu").get_state())
    with case("rounding streams differ between stages"):
        # ranks 0 and 2 (1 and 3) are dp shard 0 (1) of stages 0 and 1
        assert coordinates == [0, 1, 2, 3], coordinates
        for a in range(world):
            for b in range(a + 1, world):
                assert not torch.equal(states[a], states[b]), f"ranks {a} and {b} draw the same noise"


def _check_checkpoints(rank: int, world: int) -> None:
    """Each stage saves with the full model's keys into one checkpoint (one collective
    ``save_checkpoint`` call on every rank: dcp merges the stages' entries); a pp=1 model
    (FSDP2 on all 4 ranks) loads every stage's int8 bytes, scales and optimizer states
    bit-exactly, and each stage resumes from it at pp=2."""
    mesh = init_device_mesh("cpu", (STAGES, world // STAGES), mesh_dim_names=("pp", "dp"))
    pp_rank, config = mesh["pp"].get_local_rank(), Int8TrainingConfig(seed=5, min_features=1)
    stage = fsdp_int8.shard_model(_stage_module(pp_rank), mesh=mesh["dp"], config=config)
    opt = torch.optim.AdamW(stage.parameters(), lr=1e-2)
    pipe = PipelineStage(stage, pp_rank, STAGES, torch.device("cpu"), group=mesh["pp"].get_group())
    schedule = Schedule1F1B(pipe, n_microbatches=2, loss_fn=F.mse_loss)
    x, y = _data(mesh["dp"].get_local_rank(), mesh["dp"].size())
    for _ in range(2):  # stochastic rounding, repeated schedule steps
        schedule.step(x) if pp_rank == 0 else schedule.step(target=y)
        opt.step()
        opt.zero_grad()
    mine = snapshot(stage, opt)
    saved = {"weights": {}, "optimizer": {}}
    for part in _dist.all_gather(mine):  # both stages' entries
        for kind in saved:
            saved[kind].update(part[kind])
    directory = _dist.broadcast_from_rank0(tempfile.mkdtemp() if rank == 0 else None)
    fsdp_int8.save_checkpoint(directory, stage, opt, step=2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # e.g. a stage's int8 entries loaded as "rounded to nearest"
        with case("pp=1 (FSDP2 on 4 ranks) loads every stage bit-exactly"):
            model = fsdp_int8.shard_model(_full_model(), config=config)
            model_opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
            before = snapshot(model, model_opt)
            info = fsdp_int8.load_checkpoint(directory, model, model_opt)  # strict
            assert info.missing_keys == [] and info.unexpected_keys == [] and info.converted == [], info
            loaded = snapshot(model, model_opt)
            assert len(saved["weights"]) == 4 * LAYERS + 2 and saved["weights"].keys() == loaded["weights"].keys()
            assert_identical(loaded, saved, "pp=1 load")
            assert not all(map(torch.equal, before["weights"]["layers.3.up.weight"], loaded["weights"]["layers.3.up.weight"]))
        with case("pp=2 stages resume from it"):
            stage = fsdp_int8.shard_model(_stage_module(pp_rank), mesh=mesh["dp"], config=config)
            opt = torch.optim.AdamW(stage.parameters(), lr=1e-2)
            info = fsdp_int8.load_checkpoint(directory, stage, opt, strict=False)  # the other stage's keys
            assert info.rng_restored and info.missing_keys == [] and len(info.unexpected_keys) > 0, info
            assert_identical(snapshot(stage, opt), mine, "pp=2 resume")
    dist.barrier()
    if rank == 0:
        shutil.rmtree(directory)


def _body(rank: int, world: int) -> dict:
    worst: dict[str, float] = {}
    _check_schedules(rank, world, worst)
    _check_tensor_parallel(rank, world, worst)
    _check_rounding_streams(rank, world)
    _check_checkpoints(rank, world)
    return worst


def test_pipeline_parallel_int8() -> None:
    """pp=2 x dp=2 (GPipe, 1F1B), pp=2 x tp=2, rounding streams and stage checkpoints, in
    one 4-rank spawn."""
    worst = run_distributed(_body, 4)
    for name in worst[0]:  # shown with -s: the measured margins of the tolerances
        print(f"{name}: max relative gradient difference {max(w[name] for w in worst):.2e}")
