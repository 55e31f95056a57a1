"""Checkpoints in one process: round trips, conversions, damaged files, atomicity."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import get_model_state_dict

import fsdp_int8
import fsdp_int8.checkpoint
from fsdp_int8 import Int8Weight, load_checkpoint, save_checkpoint
from fsdp_int8._quant.generators import WEIGHT_ROUNDING
from fsdp_int8.checkpoint import CheckpointError


def _mlp(seed: int = 0, hidden: int = 64) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(32, hidden), nn.ReLU(), nn.Linear(hidden, 32))


def _trained(seed: int = 0):
    model = fsdp_int8.quantize_(_mlp(seed))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    for _ in range(2):
        model(torch.randn(4, 32)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    return model, opt


def _assert_same_weights(a: nn.Module, b: nn.Module) -> None:
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        if isinstance(p, Int8Weight):
            assert torch.equal(p.int_data, q.int_data) and torch.equal(p.scale, q.scale), name
        else:
            assert torch.equal(p, q), name


def test_round_trip_is_bit_exact_with_optimizer_and_generator(tmp_path):
    model, opt = _trained()
    path = save_checkpoint(tmp_path, model, opt, step=2, extra={"note": "x"})
    assert path.name == "step_00000002" and (tmp_path / "latest").read_text().strip() == path.name
    expected_draw = torch.rand(8, generator=WEIGHT_ROUNDING.generator("cpu"))

    fresh, fresh_opt = _trained(seed=1)
    info = load_checkpoint(tmp_path, fresh, fresh_opt)
    assert info.step == 2 and info.extra == {"note": "x"} and info.rng_restored and not info.converted
    _assert_same_weights(model, fresh)
    for p, q in zip(model.parameters(), fresh.parameters()):
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(opt.state[p][key], fresh_opt.state[q][key]), key
    # the stochastic-rounding stream continues where the saver's was
    assert torch.equal(torch.rand(8, generator=WEIGHT_ROUNDING.generator("cpu")), expected_draw)


def test_layout_on_disk_and_keep(tmp_path):
    model, opt = _trained()
    for step in (1, 2, 3):
        save_checkpoint(tmp_path, model, opt, step=step, keep=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step_00000002", "step_00000003"]
    manifest = json.loads((tmp_path / "step_00000003" / "manifest.json").read_text())
    assert manifest["step"] == 3 and manifest["world_size"] == 1
    assert manifest["int8_keys"] == ["0.weight", "2.weight"]
    assert {".metadata", "__0_0.distcp", "rng/rank_00000.pt"} <= set(manifest["files"])
    assert fsdp_int8.checkpoint.latest_checkpoint(tmp_path).name == "step_00000003"


def test_plain_float_checkpoint_is_rounded_to_nearest_with_a_warning(tmp_path):
    float_model = _mlp(seed=3)
    dcp.save(get_model_state_dict(float_model), checkpoint_id=tmp_path / "fp32", no_dist=True)
    model = fsdp_int8.quantize_(_mlp(seed=4))
    with pytest.warns(UserWarning, match="rounded to nearest into int8"):
        info = load_checkpoint(tmp_path / "fp32", model, allow_unverified=True)
    assert info.converted == ["0.weight", "2.weight"]
    expected = Int8Weight.from_float(float_model[0].weight)  # round to nearest
    assert torch.equal(model[0].weight.int_data, expected.int_data)
    assert torch.equal(model[0].weight.scale, expected.scale)
    with pytest.raises(CheckpointError, match="holds no optimizer state"):
        load_checkpoint(tmp_path / "fp32", model, torch.optim.SGD(model.parameters(), lr=0.1), allow_unverified=True)


def test_export_full_precision_and_import_back(tmp_path):
    model, _ = _trained()
    exported = fsdp_int8.export_full_state_dict(model, dtype=torch.float32)
    assert all(type(v) is torch.Tensor for v in exported.values())
    plain = _mlp(seed=5)
    plain.load_state_dict(exported)  # the unquantized model's keys and shapes
    x = torch.randn(3, 32)
    # same values, computed in another order: fp32 rounding only
    torch.testing.assert_close(plain(x), model(x), rtol=1e-5, atol=1e-6)
    assert fsdp_int8.export_full_state_dict(model)["0.weight"].dtype == torch.bfloat16

    back = fsdp_int8.quantize_(_mlp(seed=6))
    fsdp_int8.checkpoint.load_full_state_dict(back, exported)
    # dequantize then round to nearest reproduces the same int8 values and scales
    _assert_same_weights(model, back)


def test_damaged_checkpoints_raise_clear_errors(tmp_path):
    model, opt = _trained()
    path = save_checkpoint(tmp_path, model, opt, step=1)
    shard = path / "__0_0.distcp"
    data = shard.read_bytes()

    shard.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match=r"__0_0.distcp: \d+ bytes, expected \d+ \(truncated\?\)"):
        load_checkpoint(tmp_path, model, opt)

    corrupted = bytearray(data)
    corrupted[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(corrupted))
    with pytest.raises(CheckpointError, match="checksum mismatch"):
        load_checkpoint(tmp_path, model, opt)

    (path / "manifest.json").unlink()
    os.remove(path / ".metadata")
    with pytest.raises(CheckpointError, match="not a complete checkpoint"):
        load_checkpoint(path, model, opt)
    with pytest.raises(CheckpointError, match="no complete checkpoint"):
        load_checkpoint(tmp_path / "empty", model)


def test_checkpoint_of_another_shape_is_refused(tmp_path):
    model, opt = _trained()
    save_checkpoint(tmp_path, model, opt, step=1)
    wider = fsdp_int8.quantize_(_mlp(hidden=48))
    with pytest.raises(CheckpointError, match=r"0.weight: checkpoint has shape \(64, 32\), model \(48, 32\)"):
        load_checkpoint(tmp_path, wider)
    other = fsdp_int8.quantize_(nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 32), nn.Linear(32, 32)))
    with pytest.raises(CheckpointError, match="3.weight: not in the checkpoint"):
        load_checkpoint(tmp_path, other)


_SAVER = textwrap.dedent(
    """
    import sys, torch, torch.nn as nn
    import fsdp_int8
    root = sys.argv[1]
    torch.manual_seed(0)
    model = fsdp_int8.quantize_(nn.Sequential(*[nn.Linear(1024, 1024) for _ in range(6)]))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(2, 1024)).sum().backward(); opt.step()
    fsdp_int8.save_checkpoint(root, model, opt, step=1)
    torch.save({n: (p.int_data, p.scale) for n, p in model.named_parameters() if isinstance(p, fsdp_int8.Int8Weight)}, root + "/expected.pt")
    print("saved", flush=True)
    model(torch.randn(2, 1024)).sum().backward(); opt.step()
    while True:  # keep saving step 2 until killed
        fsdp_int8.save_checkpoint(root, model, opt, step=2)
    """
)


def test_a_saver_killed_mid_write_leaves_the_previous_checkpoint(tmp_path):
    proc = subprocess.Popen(
        [sys.executable, "-c", _SAVER, str(tmp_path)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout.readline().strip() == "saved"
        deadline = time.monotonic() + 60
        # kill while a step-2 save is in flight: its temporary directory exists
        while not list(tmp_path.glob(".tmp-step_00000002-*/__0_0.distcp")):
            assert time.monotonic() < deadline, "the saver never started writing step 2"
            time.sleep(0.001)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    assert list(tmp_path.glob(".tmp-step_00000002-*")), "killed after the save completed"
    latest = fsdp_int8.checkpoint.latest_checkpoint(tmp_path)
    assert latest is not None and latest.name in ("step_00000001", "step_00000002")

    torch.manual_seed(1)
    model = fsdp_int8.quantize_(nn.Sequential(*[nn.Linear(1024, 1024) for _ in range(6)]))
    info = load_checkpoint(tmp_path, model, step=1)  # verified: sizes and sha256
    expected = torch.load(tmp_path / "expected.pt", weights_only=True)
    for name, param in model.named_parameters():
        if name in expected:
            assert torch.equal(param.int_data, expected[name][0]), name
            assert torch.equal(param.scale, expected[name][1]), name
    assert info.step == 1
    # the next save clears what the killed one left behind
    save_checkpoint(tmp_path, model, step=3)
    assert not list(tmp_path.glob(".tmp-*"))


class _Crash(BaseException):
    """A process killed here: no ``except Exception`` of the save runs its clean-up."""


def test_resaving_a_step_survives_a_crash_at_every_rename(tmp_path, monkeypatch):
    """Re-saving an existing step (a rolled-back run, a second run in the same folder),
    killed at each rename, replace or removal of the save: ``latest`` always resolves to a
    complete checkpoint of that step (the old copy or the new one), it loads, and the next
    save keeps it as ``step_00000002``."""
    import shutil

    old, old_opt = _trained(seed=0)
    new, new_opt = _trained(seed=1)
    copies = {}
    for seed, model in ((0, old), (1, new)):
        copies[seed] = {k: (v.int_data.clone(), v.scale.clone()) for k, v in model.state_dict().items()
                        if isinstance(v, Int8Weight)}
    real = {"rename": os.rename, "replace": os.replace, "rmtree": shutil.rmtree}
    point = 0
    while True:
        root = tmp_path / f"crash_{point}"
        save_checkpoint(root, old, old_opt, step=1)
        save_checkpoint(root, old, old_opt, step=2)
        calls = 0

        def crashing(name):
            def call(*args, **kwargs):
                nonlocal calls
                calls += 1
                if calls == point + 1:
                    raise _Crash(name)
                return real[name](*args, **kwargs)
            return call

        monkeypatch.setattr(os, "rename", crashing("rename"))
        monkeypatch.setattr(os, "replace", crashing("replace"))
        monkeypatch.setattr(shutil, "rmtree", crashing("rmtree"))
        try:
            save_checkpoint(root, new, new_opt, step=2)  # the re-save
            crashed = False
        except (_Crash, CheckpointError):  # dcp turns a crash inside it into its own error
            crashed = True
        finally:
            monkeypatch.undo()
        found = fsdp_int8.checkpoint.latest_checkpoint(root)
        assert found is not None, f"crash at call {point}: no checkpoint found"
        fresh = fsdp_int8.quantize_(_mlp(seed=5))
        info = load_checkpoint(root, fresh)
        assert info.step == 2, f"crash at call {point}: latest resolves to step {info.step}"
        weights = {k: (v.int_data, v.scale) for k, v in fresh.state_dict().items() if isinstance(v, Int8Weight)}
        which = [seed for seed, saved in copies.items()
                 if all(all(map(torch.equal, saved[k], weights[k])) for k in saved)]
        assert len(which) == 1, f"crash at call {point}: step 2 holds neither copy"
        save_checkpoint(root, new, new_opt, step=3)  # the next save: repairs, deletes no complete copy
        assert fsdp_int8.checkpoint.latest_checkpoint(root).name == "step_00000003"
        again = fsdp_int8.quantize_(_mlp(seed=5))
        load_checkpoint(root, again, step=2)
        _assert_same_weights(fresh, again)
        assert sorted(p.name for p in root.iterdir()) == ["latest", "step_00000001", "step_00000002", "step_00000003"]
        if not crashed:
            assert which == [1]  # the finished re-save replaced the old copy
            break
        point += 1
    # crashes were injected in dcp's rename, the manifest's replace, the two renames of the
    # publish, the replace of latest and the removal of the old copy
    assert point >= 6


# ---------------------------------------------------------------- issue 14: reliability
def _state_of(model: nn.Module, opt: torch.optim.Optimizer) -> dict:
    """Everything a load could change: weights (int8 bytes and scales), optimizer state and
    hyperparameters, the rounding and torch generators."""
    WEIGHT_ROUNDING.generator("cpu")  # exists before: its state is compared too
    weights = {
        name: (p.int_data.clone(), p.scale.clone()) if isinstance(p, Int8Weight) else p.detach().clone()
        for name, p in model.named_parameters()
    }
    saved = opt.state_dict()
    return {
        "weights": weights,
        "optimizer": {k: {n: v.clone() if torch.is_tensor(v) else v for n, v in s.items()} for k, s in saved["state"].items()},
        "groups": saved["param_groups"],
        "rounding": WEIGHT_ROUNDING.get_state(),
        "torch": torch.get_rng_state(),
    }


def _assert_unchanged(before: dict, after: dict) -> None:
    assert before["weights"].keys() == after["weights"].keys()
    for name, x in before["weights"].items():
        y = after["weights"][name]
        assert all(map(torch.equal, x, y)) if isinstance(x, tuple) else torch.equal(x, y), name
    assert before["optimizer"].keys() == after["optimizer"].keys(), "optimizer state changed"
    for key, state in before["optimizer"].items():
        for name, value in state.items():
            other = after["optimizer"][key][name]
            assert torch.equal(value, other) if torch.is_tensor(value) else value == other, (key, name)
    assert before["groups"] == after["groups"]
    assert before["rounding"].keys() == after["rounding"].keys()
    assert all(torch.equal(v, after["rounding"][k]) for k, v in before["rounding"].items()), "rounding generator moved"
    assert torch.equal(before["torch"], after["torch"]), "torch generator moved"


def test_keep_prunes_by_write_order_and_never_the_new_checkpoint(tmp_path):
    old, old_opt = _trained(seed=0)
    for step in (10, 20, 30):  # an earlier run, further along
        save_checkpoint(tmp_path, old, old_opt, step=step, keep=3)
    new, new_opt = _trained(seed=1)  # a new run in the same folder, from step 1
    save_checkpoint(tmp_path, new, new_opt, step=1, keep=2)
    assert (tmp_path / "step_00000001").is_dir(), "the checkpoint just written was pruned"
    save_checkpoint(tmp_path, new, new_opt, step=2, keep=2)
    assert sorted(p.name for p in tmp_path.glob("step_*")) == ["step_00000001", "step_00000002"]
    assert fsdp_int8.checkpoint.latest_checkpoint(tmp_path).name == "step_00000002"
    fresh, fresh_opt = _trained(seed=2)
    assert load_checkpoint(tmp_path, fresh, fresh_opt).step == 2
    _assert_same_weights(new, fresh)  # the new run's weights, not the old run's
    for keep in (0, -1):
        with pytest.raises(ValueError, match="keep must be >= 1"):
            save_checkpoint(tmp_path, new, step=3, keep=keep)
    assert not (tmp_path / "step_00000003").exists()


def _deeper(seed: int = 0) -> nn.Module:
    """``_mlp`` with one more layer: the same keys plus ``3.weight`` and ``3.bias``."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 32), nn.Linear(32, 32))


def test_fit_is_checked_both_ways_and_strict_false_loads_the_intersection(tmp_path):
    big = fsdp_int8.quantize_(_deeper(seed=0))
    big_opt = torch.optim.AdamW(big.parameters(), lr=1e-2)
    big(torch.randn(4, 32)).sum().backward()
    big_opt.step()
    save_checkpoint(tmp_path / "big", big, big_opt, step=1)
    small = fsdp_int8.quantize_(_mlp(seed=1))
    small_opt = torch.optim.AdamW(small.parameters(), lr=1e-3)
    before = _state_of(small, small_opt)
    with pytest.raises(CheckpointError, match=r"3.bias: in the checkpoint, not in the model.*strict=False"):
        load_checkpoint(tmp_path / "big", small, small_opt)
    _assert_unchanged(before, _state_of(small, small_opt))

    info = load_checkpoint(tmp_path / "big", small, small_opt, strict=False)
    assert info.unexpected_keys[:2] == ["3.bias", "3.weight"] and info.missing_keys == []
    assert "optimizer.state.3.weight.exp_avg" in info.unexpected_keys
    _assert_same_weights(small, big)  # the entries both have, optimizer states included
    assert torch.equal(small_opt.state[small[0].weight]["exp_avg"], big_opt.state[big[0].weight]["exp_avg"])

    save_checkpoint(tmp_path / "small", small, step=1)
    deeper = fsdp_int8.quantize_(_deeper(seed=2))
    untouched = deeper[3].weight.int_data.clone()
    info = load_checkpoint(tmp_path / "small", deeper, strict=False)
    assert info.missing_keys == ["3.bias", "3.weight"] and info.unexpected_keys == []
    assert torch.equal(deeper[3].weight.int_data, untouched)
    assert torch.equal(deeper[0].weight.int_data, small[0].weight.int_data)


@pytest.mark.parametrize("where", ["bias", "int8 scale", "optimizer state"])
def test_non_finite_state_is_never_saved(tmp_path, where):
    model, opt = _trained()
    save_checkpoint(tmp_path, model, opt, step=1)
    with torch.no_grad():
        if where == "bias":
            model[2].bias[3] = float("nan")
        elif where == "int8 scale":
            model[0].weight.scale[5] = float("inf")
        else:
            opt.state[model[0].bias]["exp_avg"][0] = float("nan")
    expected = {"bias": "model.2.bias", "int8 scale": "model.0.weight",
                "optimizer state": "optimizer.state.0.bias.exp_avg"}[where]
    with pytest.raises(CheckpointError, match=rf"NaN or Inf in 1 entries \({expected}\); nothing was written"):
        save_checkpoint(tmp_path, model, opt, step=2, keep=1)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step_00000001"]
    assert fsdp_int8.checkpoint.latest_checkpoint(tmp_path).name == "step_00000001"


def test_huge_finite_values_are_saved(tmp_path):
    # The check's fast path is a 2-norm, which overflows for values like these: finite
    # values must still be saved (and come back exactly).
    model, opt = _trained()
    with torch.no_grad():
        model[2].bias.fill_(3e30)
    save_checkpoint(tmp_path, model, opt, step=1)
    copy, copy_opt = _trained()
    load_checkpoint(tmp_path, copy, copy_opt)
    assert torch.equal(copy[2].bias, model[2].bias)


def _truncate(file) -> None:
    data = file.read_bytes()
    file.write_bytes(data[: len(data) * 3 // 4])


@pytest.mark.parametrize("make_optimizer", [
    lambda params: torch.optim.AdamW(params, lr=1e-2),  # fresh: torch primes it with a step
    lambda params: fsdp_int8.Int8AdamW(params, lr=1e-2),
])
def test_a_failed_load_leaves_model_optimizer_and_generators_as_they_were(tmp_path, make_optimizer):
    model, opt = _trained()
    path = save_checkpoint(tmp_path, model, opt, step=2)
    _truncate(path / "__0_0.distcp")
    fresh = fsdp_int8.quantize_(_mlp(seed=1))
    fresh_opt = make_optimizer(fresh.parameters())
    before = _state_of(fresh, fresh_opt)
    with pytest.raises(CheckpointError, match=r"reading .*step_00000002 failed: .*verify=True checks"):
        load_checkpoint(tmp_path, fresh, fresh_opt, verify=False)
    _assert_unchanged(before, _state_of(fresh, fresh_opt))

    # a trained optimizer, a checkpoint it does not fit (8-bit states): nothing moves either
    eight_bit = fsdp_int8.quantize_(_mlp(seed=2))
    eight_bit_opt = fsdp_int8.Int8AdamW(eight_bit.parameters(), lr=1e-2, state_bits=8, block_size=32)
    eight_bit(torch.randn(4, 32)).sum().backward()
    eight_bit_opt.step()
    save_checkpoint(tmp_path / "8bit", eight_bit, eight_bit_opt, step=1)
    fresh(torch.randn(4, 32)).sum().backward()
    fresh_opt.step()
    fresh_opt.zero_grad()
    before = _state_of(fresh, fresh_opt)
    with pytest.raises(CheckpointError, match=r"optimizer state of 0.weight: the checkpoint holds .*exp_avg_int8.*state_bits"):
        load_checkpoint(tmp_path / "8bit", fresh, fresh_opt)
    _assert_unchanged(before, _state_of(fresh, fresh_opt))


def test_a_folder_without_manifest_is_refused_unless_allowed(tmp_path):
    model, _ = _trained()
    dcp.save(get_model_state_dict(model), checkpoint_id=tmp_path / "plain", no_dist=True)
    fresh = fsdp_int8.quantize_(_mlp(seed=1))
    with pytest.raises(CheckpointError, match=r"has no manifest.json: it is a plain torch.distributed.checkpoint folder.*allow_unverified=True"):
        load_checkpoint(tmp_path / "plain", fresh)
    with pytest.warns(UserWarning, match="loaded without verification"):
        info = load_checkpoint(tmp_path / "plain", fresh, allow_unverified=True)
    assert info.step is None and info.world_size is None and not info.rng_restored
    _assert_same_weights(model, fresh)


def test_every_read_failure_is_a_checkpoint_error_naming_the_cause(tmp_path):
    model, opt = _trained()
    path = save_checkpoint(tmp_path, model, opt, step=1)
    (path / "__0_0.distcp").unlink()  # found missing before any read, even without verify
    with pytest.raises(CheckpointError, match=r"step_00000001 is incomplete \(saved by 1 rank\): __0_0.distcp: missing"):
        load_checkpoint(tmp_path, model, opt, verify=False)
    path = save_checkpoint(tmp_path, model, opt, step=2)
    (path / ".metadata").write_bytes(b"not an index")
    with pytest.raises(CheckpointError, match=r"reading the index of .*step_00000002 failed"):
        load_checkpoint(tmp_path, model, opt, verify=False)
    _truncate(save_checkpoint(tmp_path, model, opt, step=3) / "rng" / "rank_00000.pt")
    with pytest.raises(CheckpointError, match=r"rank 0: the generator states in .*step_00000003/rng/rank_00000.pt cannot be read"):
        load_checkpoint(tmp_path, model, opt, verify=False)


@pytest.mark.parametrize("direction", ["torch AdamW -> Int8AdamW", "Int8AdamW -> torch AdamW"])
def test_adamw_checkpoints_load_across_torch_and_int8_adamw(tmp_path, direction):
    torch_adamw = lambda params: torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)  # noqa: E731
    int8_adamw = lambda params: fsdp_int8.Int8AdamW(params, lr=1e-2, weight_decay=0.1)  # noqa: E731
    saver, loader = (torch_adamw, int8_adamw) if direction.startswith("torch") else (int8_adamw, torch_adamw)
    model = fsdp_int8.quantize_(_mlp(seed=0))
    opt = saver(model.parameters())
    for _ in range(2):
        model(torch.randn(4, 32)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    save_checkpoint(tmp_path, model, opt, step=2)
    fresh = fsdp_int8.quantize_(_mlp(seed=1))
    fresh_opt = loader(fresh.parameters())
    load_checkpoint(tmp_path, fresh, fresh_opt)
    _assert_same_weights(model, fresh)
    for p, q in zip(model.parameters(), fresh.parameters()):
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(opt.state[p][key], fresh_opt.state[q][key]), key
    assert fresh_opt.param_groups[0]["weight_decay"] == 0.1
    fresh(torch.randn(4, 32)).pow(2).mean().backward()
    fresh_opt.step()  # and it trains on


def test_a_hyperparameter_the_optimizer_lacks_is_refused_before_anything_changes(tmp_path):
    model = fsdp_int8.quantize_(_mlp(seed=0))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, maximize=True)
    model(torch.randn(4, 32)).sum().backward()
    opt.step()
    save_checkpoint(tmp_path, model, opt, step=1)
    fresh = fsdp_int8.quantize_(_mlp(seed=1))
    fresh_opt = fsdp_int8.Int8AdamW(fresh.parameters(), lr=1e-2)
    before = _state_of(fresh, fresh_opt)
    with pytest.raises(CheckpointError, match=r"does not fit this optimizer \(Int8AdamW\): .*maximize"):
        load_checkpoint(tmp_path, fresh, fresh_opt)
    _assert_unchanged(before, _state_of(fresh, fresh_opt))


# ------------------------------------------------------------------ wrapped optimizers
class _Forwarding:
    """A hand-written wrapper, as frameworks write them: the optimizer in ``.optimizer``,
    its ``param_groups``, ``state`` and state-dict methods forwarded, a ``step`` of its own
    (which a checkpoint must never call: torch primes a fresh optimizer with a step)."""

    def __init__(self, optimizer) -> None:
        self.optimizer = optimizer

    @property
    def param_groups(self):
        return self.optimizer.param_groups

    @property
    def state(self):
        return self.optimizer.state

    def state_dict(self):
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict) -> None:
        self.optimizer.load_state_dict(state_dict)

    def step(self, closure=None):
        raise AssertionError("the wrapper's step ran")


def _wrapped(kind: str, model: nn.Module, optimizer: torch.optim.Optimizer):
    if kind == "accelerate":
        from accelerate import Accelerator

        return Accelerator(cpu=True).prepare(model, optimizer)  # one process: no group
    from lightning.pytorch.core.optimizer import LightningOptimizer

    if kind == "lightning":  # what Trainer hands training_step; its step needs a Trainer
        return model, LightningOptimizer(optimizer)
    if kind == "forwarding":
        return model, _Forwarding(optimizer)
    return model, LightningOptimizer(_Forwarding(optimizer))  # wrappers of wrappers


@pytest.mark.parametrize("kind", ["accelerate", "lightning", "forwarding", "lightning over forwarding"])
def test_wrapped_optimizers_save_and_load_bit_exactly(tmp_path, kind, accelerate_state):
    model, opt = _trained()
    model, wrapped = _wrapped(kind, model, opt)
    save_checkpoint(tmp_path, model, wrapped, step=2)
    expected_draw = torch.rand(8, generator=WEIGHT_ROUNDING.generator("cpu"))
    fresh = fsdp_int8.quantize_(_mlp(seed=1))
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-2, weight_decay=0.1)  # no state yet
    fresh, fresh_wrapped = _wrapped(kind, fresh, fresh_opt)
    info = load_checkpoint(tmp_path, fresh, fresh_wrapped)
    assert info.step == 2 and info.rng_restored
    _assert_same_weights(model, fresh)
    for p, q in zip(model.parameters(), fresh.parameters()):
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(opt.state[p][key], fresh_opt.state[q][key]), key
    assert torch.equal(torch.rand(8, generator=WEIGHT_ROUNDING.generator("cpu")), expected_draw)
    # a fresh wrapped optimizer saves too: torch primes the optimizer inside, not the wrapper
    unused = fsdp_int8.quantize_(_mlp(seed=2))
    save_checkpoint(tmp_path / "fresh", *_wrapped(kind, unused, torch.optim.AdamW(unused.parameters())), step=0)


def test_an_optimizer_that_only_refers_to_another_is_refused_before_anything_changes(tmp_path):
    model, opt = _trained()
    save_checkpoint(tmp_path, model, opt, step=2)

    class OwnState(_Forwarding):  # Lookahead-like: the groups shared, a state of its own
        state = {}

    fresh = fsdp_int8.quantize_(_mlp(seed=1))
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
    before = _state_of(fresh, fresh_opt)
    with pytest.raises(TypeError, match=r"\(OwnState\) wraps AdamW in \.optimizer, but .* not that optimizer's"):
        load_checkpoint(tmp_path, fresh, OwnState(fresh_opt))
    with pytest.raises(TypeError, match=r"expected a torch.optim.Optimizer, or a wrapper .* got dict"):
        save_checkpoint(tmp_path, fresh, {"lr": 1e-2}, step=3)
    _assert_unchanged(before, _state_of(fresh, fresh_opt))
    assert not (tmp_path / "step_00000003").exists()


def test_dcp_async_save_says_what_to_use_instead(tmp_path):
    """dcp.async_save's default stager cannot copy an int8 weight: the error names it and
    the stager that can (docs/limits.md), which writes it bit-exactly."""
    import torch.distributed.checkpoint as dcp

    model = fsdp_int8.quantize_(nn.Sequential(nn.Linear(16, 16)), fsdp_int8.Int8TrainingConfig(min_features=1))
    with pytest.raises(NotImplementedError, match=r"async_save.*async_stager=fsdp_int8\.checkpoint\.CpuCopyStager\(\)"):
        dcp.async_save(model.state_dict(), checkpoint_id=str(tmp_path / "async"))
    # with the stager it names: the int8 weight is staged and written whole
    dcp.async_save(model.state_dict(), checkpoint_id=str(tmp_path / "async"),
                   async_stager=fsdp_int8.checkpoint.CpuCopyStager()).result()
    loaded = {k: v.detach().clone() for k, v in model.state_dict().items()}
    loaded["0.weight"].int_data.zero_()
    dcp.load(loaded, checkpoint_id=str(tmp_path / "async"))
    assert torch.equal(loaded["0.weight"].int_data, model[0].weight.int_data)
    assert torch.equal(loaded["0.weight"].scale, model[0].weight.scale)


@pytest.mark.parametrize("name, value, error", [
    ("step", "2", TypeError), ("step", 2.5, TypeError), ("step", True, TypeError), ("step", -1, ValueError),
    ("keep", "2", TypeError), ("keep", False, TypeError), ("keep", 0, ValueError),
])
def test_step_and_keep_are_checked_on_the_way_in(tmp_path, name, value, error):
    model, opt = _trained()
    arguments = {"step": 1, name: value}
    with pytest.raises(error, match=rf"{name} must be (an int|>= \d) \("):
        save_checkpoint(tmp_path, model, opt, **arguments)
    assert not any(tmp_path.iterdir()), "a refused save wrote something"


def test_a_model_with_other_heads_or_top_k_and_the_same_shapes_is_refused(tmp_path):
    from launch.model import ModelArgs, Transformer

    def model(**changes):
        torch.manual_seed(0)
        shape = dict(vocab_size=64, dim=32, n_layers=1, n_heads=4, max_seq_len=16, n_experts=4, top_k=2)
        return fsdp_int8.quantize_(Transformer(ModelArgs(**{**shape, **changes})))

    save_checkpoint(tmp_path, model(), step=1)
    assert load_checkpoint(tmp_path, model()).step == 1  # the control: the same model loads
    routing_one = model()
    routing_one.layers[0].feed_forward.top_k = 1  # the launcher sizes experts by top_k: set it after
    for other, named in [(model(n_heads=2), r"layers\.0\.attention\.head_dim: 8 in the checkpoint, 16 in this model"),
                         (model(n_heads=8), r"head_dim: 8 in the checkpoint, 4 in this model"),
                         (routing_one, r"layers\.0\.feed_forward\.top_k: 2 in the checkpoint, 1 in this model")]:
        before = {k: v.clone() for k, v in other.state_dict().items()}
        with pytest.raises(CheckpointError, match=named):
            load_checkpoint(tmp_path, other)
        assert all(torch.equal(before[k], v) for k, v in other.state_dict().items()), "the refused load changed the model"
        with pytest.warns(UserWarning, match=named):
            load_checkpoint(tmp_path, other, strict=False)


def test_shard_model_checks_min_features_and_mp_policy_on_the_way_in():
    with pytest.raises(TypeError, match=r"min_features takes an int .* got str '64'"):
        fsdp_int8.Int8TrainingConfig(min_features="64")
    with pytest.raises(TypeError, match=r"mp_policy takes a .*MixedPrecisionPolicy or None, got dtype "
                                        r"torch\.bfloat16 \(MixedPrecisionPolicy\(param_dtype=torch\.bfloat16\)\)"):
        fsdp_int8.shard_model(_mlp(), mp_policy=torch.bfloat16)
