"""The fused int8 optimizers on FSDP2 (DTensor) parameters, in real processes.

One 2-rank spawn runs the training cases: parity with a single process, no collective
in a step, the optimizer state dict APIs, save / load / exact resume, FSDP2's CPU
offload (``shard_model(offload_policy=...)``) against the same run without it, and an
optimizer built before ``shard_model`` refused at its first step. A 4-rank spawn
loads the 2-rank checkpoint, and so does the test process itself into the unsharded
model (one rank, full tensors, no process group: the strictest resharding, and no spawn
to pay for). MLPNet(hidden=33): 33 rows never divide 2 or 4 ranks (uneven shards), and
with block_size=16 the rows of 33 elements end in a 1-element block.
"""

from __future__ import annotations

import copy
import tempfile

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.fsdp import CPUOffloadPolicy
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.debug import CommDebugMode

import fsdp_int8
import fsdp_int8.memory
import fsdp_int8.guard
import fsdp_int8.collectives
from fsdp_int8 import Int8AdamW, Int8SGD, Int8TrainingConfig, Int8Weight
from fsdp_int8.testing import run_distributed

from _cases import (
    assert_identical, assert_parity, case, compare_shards, local_of, mean_over_ranks,
    reference_step, snapshot,
)
from _nets import MLPNet

BATCH = 8  # global batch: divides 1, 2 and 4 ranks
BLOCK = 16  # rows of 32 -> 2 blocks; rows of 33 -> 16 + 16 + 1


def _adamw8(params):
    return Int8AdamW(params, lr=1e-2, weight_decay=0.1, state_bits=8, block_size=BLOCK)


def _adamw4(params):
    return Int8AdamW(params, lr=1e-2, weight_decay=0.1, state_bits=4, block_size=BLOCK)


OPTIMIZERS = {
    "adamw-8bit": _adamw8,
    "adamw-32bit": lambda params: Int8AdamW(params, lr=1e-2, weight_decay=0.01),
    "sgd-nesterov": lambda params: Int8SGD(params, lr=0.05, momentum=0.9, weight_decay=0.01, nesterov=True),
}


def _batch(step: int):
    data = torch.Generator().manual_seed(step)  # the batch depends on the step only
    return torch.randn(BATCH, 32, generator=data), torch.randn(BATCH, 4, generator=data)


def _mine(x: torch.Tensor) -> torch.Tensor:
    per_rank = BATCH // dist.get_world_size()
    rank = dist.get_rank()
    return x[rank * per_rank:(rank + 1) * per_rank]


# ---------------------------------------------------------------- parity and collectives
def _parity(rank: int, world: int, make_opt, steps: int = 4, hidden: int = 33) -> dict:
    """FSDP2 int8 training against one process with the whole batch, round to nearest."""
    torch.manual_seed(0)
    reference = MLPNet(hidden=hidden)
    model = copy.deepcopy(reference)
    config = Int8TrainingConfig(stochastic_rounding=False, min_features=1)
    fsdp_int8.quantize_(reference, config)
    fsdp_int8.shard_model(model, config=config)
    opt, ref_opt = make_opt(model.parameters()), make_opt(reference.parameters())
    losses, step_collectives = [], []
    for step in range(steps):
        x, y = _batch(step)
        loss = F.mse_loss(model(_mine(x)), _mine(y))
        loss.backward()
        with fsdp_int8.collectives.count_collectives() as counter, CommDebugMode() as comm:
            opt.step()
        step_collectives.append(
            ([(r.name, r.numel) for r in counter.records], comm.get_total_counts())
        )
        opt.zero_grad()
        losses.append((mean_over_ranks(loss), reference_step(reference, ref_opt, x, y)))
    assert all(isinstance(local_of(p), Int8Weight) for p in (model.layers[0].up.weight, model.layers[0].down.weight))
    assert isinstance(model.head.weight, DTensor)
    return dict(
        losses=losses, step_collectives=step_collectives,
        **compare_shards(model, reference, rank, world),
    )


# ---------------------------------------------------------------- checkpoints
def _model(seed: int = 7, make_opt=_adamw8):
    torch.manual_seed(0)
    model = fsdp_int8.shard_model(MLPNet(hidden=33), config=Int8TrainingConfig(seed=seed, min_features=1))
    return model, make_opt(model.parameters())


def _state_layout(opt) -> dict:
    """Each state entry's dtype and global shape, by parameter index and name: the
    precision of every state, which must not depend on the mesh."""
    params = [p for group in opt.param_groups for p in group["params"]]
    return {(index, name): (value.dtype, tuple(value.shape))
            for index, param in enumerate(params) for name, value in opt.state[param].items()}


def _train(model, opt, first_step: int, steps: int) -> None:
    for step in range(first_step, first_step + steps):
        x, y = _batch(step)
        F.mse_loss(model(_mine(x)), _mine(y)).backward()
        opt.step()
        opt.zero_grad()


def _check_8bit_layout(snapshot: dict) -> None:
    """The checkpointed states are the 8-bit ones, with global shapes."""
    states = snapshot["optimizer"]
    up = "layers.0.up.weight"  # [33, 32]: 2 blocks of 16 per row
    down = "layers.0.down.weight"  # [32, 33]: blocks of 16, 16, 1
    assert states[f"{up}.exp_avg_int8"].dtype == torch.int8
    assert states[f"{up}.exp_avg_int8"].shape == (33, 32)
    assert states[f"{up}.exp_avg_scale"].shape == (33, 2)
    assert states[f"{down}.exp_avg_sq_sqrt_uint8"].dtype == torch.uint8
    assert states[f"{down}.exp_avg_sq_sqrt_scale"].shape == (32, 3)
    assert states["head.weight.exp_avg_scale"].shape == (4, 2)  # a plain fp32 weight, 8-bit states
    assert states["head.bias.exp_avg"].dtype == torch.float32  # 1-D: fp32 states


def _check_4bit_layout(snapshot: dict) -> None:
    """The checkpointed 4-bit states: two codes per byte along each row, global shapes."""
    states = snapshot["optimizer"]
    up, down = "layers.0.up.weight", "layers.0.down.weight"  # [33, 32] and [32, 33]
    assert states[f"{up}.exp_avg_4bit"].dtype == torch.uint8 and states[f"{up}.exp_avg_4bit"].shape == (33, 16)
    assert states[f"{down}.exp_avg_sq_sqrt_4bit"].shape == (32, 17)  # 33 codes: the last byte half used
    assert states[f"{down}.exp_avg_sq_sqrt_scale"].shape == (32, 3)
    assert states["head.bias.exp_avg"].dtype == torch.float32


def _offload_run(rank: int, make_opt, offload: bool) -> tuple[list[float], dict]:
    """4 steps of MLPNet(hidden=33) (stochastic rounding), with or without CPU offload:
    each rank's losses and its shards and states."""
    torch.manual_seed(0)
    policy = CPUOffloadPolicy(pin_memory=False) if offload else None
    model = fsdp_int8.shard_model(MLPNet(hidden=33), config=Int8TrainingConfig(seed=7, min_features=1),
                                  offload_policy=policy)
    opt = make_opt(model.parameters())
    losses = []
    for step in range(4):
        x, y = _batch(step)
        loss = F.mse_loss(model(_mine(x)), _mine(y))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    weights = [local_of(p) for p in (model.layers[0].up.weight, model.layers[1].down.weight)]
    assert all(isinstance(w, Int8Weight) and w.device.type == "cpu" for w in weights), weights
    return losses, snapshot(model, opt)


OFFLOAD_OPTIMIZERS = {
    "Int8AdamW 8-bit states": _adamw8,
    "Int8AdamW step_in_backward, max_grad_norm": lambda params: Int8AdamW(
        params, lr=1e-2, state_bits=8, block_size=BLOCK, step_in_backward=True, max_grad_norm=0.5),
    "torch.optim.AdamW": lambda params: torch.optim.AdamW(params, lr=1e-2),
}


def _two_ranks(rank: int, world: int, root: str, root4: str) -> dict:
    out: dict = {}
    for name, make_opt in (("Int8AdamW", _adamw8), ("torch.optim.AdamW", OFFLOAD_OPTIMIZERS["torch.optim.AdamW"])):
        with case(f"{name} built before shard_model is refused at its first step; built after, it trains"):
            torch.manual_seed(0)
            model = MLPNet(hidden=33)
            early = make_opt(model.parameters())
            fsdp_int8.shard_model(model, config=Int8TrainingConfig(seed=7, min_features=1))
            x, y = _batch(0)
            F.mse_loss(model(_mine(x)), _mine(y)).backward()
            try:
                early.step()
                raise AssertionError("the step of an optimizer built before shard_model was not refused")
            except RuntimeError as error:
                assert "Build the optimizer after shard_model" in str(error), error
            opt = make_opt(model.parameters())
            before = local_of(model.layers[0].up.weight).int_data.clone()
            opt.step()  # the same gradients: this optimizer holds the model's parameters
            assert not torch.equal(before, local_of(model.layers[0].up.weight).int_data)
            del early
    for name, make_opt in OFFLOAD_OPTIMIZERS.items():
        with case(f"CPU offload, {name}: the losses, shards and states of the run without it"):
            # bit for bit: on a CPU mesh offload's host copies are no-ops, so every op and
            # every rounding draw is the same (int8 shards and the step already on the host)
            offloaded, plain = _offload_run(rank, make_opt, True), _offload_run(rank, make_opt, False)
            assert offloaded[0] == plain[0], (offloaded[0], plain[0])
            assert_identical(plain[1], offloaded[1], "offloaded")
            out[f"offload {name}"] = offloaded[0]
    for name, make_opt in OPTIMIZERS.items():
        with case(f"parity {name}"):
            out[f"parity {name}"] = _parity(rank, world, make_opt)
    with case("optimizer state dict APIs: flattened, full, full broadcast from rank 0"):
        model, opt = _model()
        _train(model, opt, 0, 2)
        expected = snapshot(model, opt)
        sharded_model = get_model_state_dict(model)
        on_rank0 = get_optimizer_state_dict(  # a collective: every rank gathers, rank 0 keeps
            model, opt, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
        )
        variants = {
            "flattened": (
                get_optimizer_state_dict(model, opt, options=StateDictOptions(flatten_optimizer_state_dict=True)),
                StateDictOptions(flatten_optimizer_state_dict=True),
            ),
            "full": (
                get_optimizer_state_dict(model, opt, options=StateDictOptions(full_state_dict=True)),
                StateDictOptions(full_state_dict=True),
            ),
            "full, broadcast": (
                on_rank0 if rank == 0 else {},
                StateDictOptions(full_state_dict=True, broadcast_from_rank0=True),
            ),
        }
        for name, (state, options) in variants.items():
            fresh, fresh_opt = _model(seed=5)
            set_model_state_dict(fresh, sharded_model)
            set_optimizer_state_dict(fresh, fresh_opt, state, options=options)
            assert_identical(expected, snapshot(fresh, fresh_opt), name)
        del model, opt, fresh, fresh_opt
    with case("a NaN gradient on one rank: every rank refuses the step, nothing changes"):
        model, opt = _model()
        _train(model, opt, 0, 1)
        x, y = _batch(1)
        F.mse_loss(model(_mine(x)), _mine(y)).backward()
        if rank == 1:  # only this rank's shard of a norm-free plain parameter is poisoned
            model.head.bias.grad.to_local()[0] = float("nan")
        before = snapshot(model, opt)
        try:
            opt.step()
            raise AssertionError("the step was not refused")
        except fsdp_int8.guard.NonFiniteGradientError:
            pass
        assert_identical(before, snapshot(model, opt), "after a refused step")
        opt.zero_grad()
        _train(model, opt, 2, 1)  # and training goes on on every rank (no rank is left waiting)
        del model, opt
    with case("save after 3 steps, 3 more"):
        model, opt = _model()
        _train(model, opt, 0, 3)
        fsdp_int8.save_checkpoint(root, model, opt, step=3)
        out["at_save"] = snapshot(model, opt)
        _check_8bit_layout(out["at_save"])
        _train(model, opt, 3, 3)
        out["uninterrupted"] = snapshot(model, opt)
        del model, opt
    with case("2 -> 2 load, resume"):
        model, opt = _model(seed=123)  # another seed: the checkpoint's generators must win
        info = fsdp_int8.load_checkpoint(root, model, opt)
        assert info.step == 3 and info.rng_restored
        out["loaded"] = snapshot(model, opt)
        _train(model, opt, 3, 3)
        out["resumed"] = snapshot(model, opt)
        out["bytes"] = fsdp_int8.memory.persistent_bytes(model, opt)  # this rank's shards only
    with case("4-bit states: save after 3 steps"):
        model, opt = _model(make_opt=_adamw4)
        _train(model, opt, 0, 3)
        fsdp_int8.save_checkpoint(root4, model, opt, step=3)
        out["4-bit at_save"], out["4-bit layout"] = snapshot(model, opt), _state_layout(opt)
    return out


def _four_ranks(rank: int, world: int, root: str, root4: str) -> dict:
    with case("2 -> 4 load, 4-bit states"):
        model, opt = _model(seed=123, make_opt=_adamw4)
        fsdp_int8.load_checkpoint(root4, model, opt)
        loaded4, layout4 = snapshot(model, opt), _state_layout(opt)
    with case("2 -> 4 load"):
        model, opt = _model(seed=123)
        info = fsdp_int8.load_checkpoint(root, model, opt)
        assert info.world_size == 2 and not info.rng_restored
        loaded = snapshot(model, opt)
        _train(model, opt, 3, 1)  # and it trains on
    with case("3 rows on 4 ranks: rank 3 holds none"):
        parity = _parity(rank, world, _adamw8, steps=2, hidden=3)
    return dict(loaded=loaded, parity=parity, loaded4=loaded4, layout4=layout4)


def _load_unsharded(root: str, make_opt=_adamw8) -> tuple[dict, fsdp_int8.memory.PersistentBytes, dict]:
    """In this process, without a process group: the plain quantized model."""
    torch.manual_seed(0)
    model = fsdp_int8.quantize_(MLPNet(hidden=33), Int8TrainingConfig(seed=123, min_features=1))
    opt = make_opt(model.parameters())
    info = fsdp_int8.load_checkpoint(root, model, opt)
    assert info.world_size == 2 and not info.rng_restored
    assert type(opt.state[model.layers[0].up.weight]["exp_avg_scale"]) is torch.Tensor
    loaded, layout = snapshot(model, opt), _state_layout(opt)
    x, y = _batch(3)
    F.mse_loss(model(x), y).backward()  # and it trains on
    opt.step()
    return loaded, fsdp_int8.memory.persistent_bytes(model, opt), layout


def test_fused_optimizers_on_fsdp2():
    with tempfile.TemporaryDirectory() as tmp, tempfile.TemporaryDirectory() as tmp4:
        two, two1 = run_distributed(_two_ranks, 2, tmp, tmp4)
        for name in OPTIMIZERS:
            result = two[f"parity {name}"]
            with case(f"parity {name}"):
                # A step is elementwise on each rank's shard: no DTensor redistribution and
                # no collective but the one-element all-reduce of the finite-gradient
                # verdict (every rank refuses a step together, see fsdp_int8/guard.py).
                verdict_only = ([("all_reduce", 1)], 1)  # counted by both: the same call
                assert result["step_collectives"] == [verdict_only] * len(result["step_collectives"]), result
                # Same tolerances as the stock optimizers' parity (see _cases.assert_parity):
                # only the order of the gradient sums differs, by fp32 ulps, which may move
                # an int8 value (or an 8-bit state) across a rounding boundary.
                assert_parity(result, bf16=False)
        _check_8bit_layout(two["at_save"])
        assert_identical(two["at_save"], two["loaded"], "2 -> 2 load")
        assert_identical(two["uninterrupted"], two["resumed"], "save at 3, restart, 3 more == 6 steps")
        unsharded, unsharded_bytes, _ = _load_unsharded(tmp)
        assert_identical(two["at_save"], unsharded, "2 -> 1 unsharded load")
        # Rows (with their scales and blocks) are partitioned between the ranks: the ranks'
        # bytes add up to the unsharded model's, but for the step counters, which every
        # rank keeps (4 bytes per parameter tensor and rank).
        ranks = [two["bytes"], two1["bytes"]]
        n_tensors = len(list(MLPNet(hidden=33).parameters()))
        assert sum(b.params for b in ranks) == unsharded_bytes.params
        assert sum(b.weights for b in ranks) == unsharded_bytes.weights
        assert sum(b.grads for b in ranks) == unsharded_bytes.grads
        assert sum(b.states for b in ranks) == unsharded_bytes.states + 4 * n_tensors
        four = run_distributed(_four_ranks, 4, tmp, tmp4)[0]
        assert_identical(two["at_save"], four["loaded"], "2 -> 4 load")
        with case("4-bit states: 2 -> 1 and 2 -> 4 loads exact, the same precision on 1, 2 and 4 ranks"):
            _check_4bit_layout(two["4-bit at_save"])
            unsharded4, _, layout1 = _load_unsharded(tmp4, _adamw4)
            assert_identical(two["4-bit at_save"], unsharded4, "4-bit 2 -> 1 unsharded load")
            assert_identical(two["4-bit at_save"], four["loaded4"], "4-bit 2 -> 4 load")
            assert layout1 == two["4-bit layout"] == four["layout4"], (layout1, two["4-bit layout"])
        with case("3 rows on 4 ranks"):
            assert four["parity"]["step_collectives"] == [([("all_reduce", 1)], 1)] * 2, four["parity"]
            assert_parity(four["parity"], bf16=False)
