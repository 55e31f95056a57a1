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
from fsdp_int8 import CheckpointError, Int8Weight, load_checkpoint, save_checkpoint
from fsdp_int8._generators import WEIGHT_ROUNDING


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
    assert fsdp_int8.latest_checkpoint(tmp_path).name == "step_00000003"


def test_plain_float_checkpoint_is_rounded_to_nearest_with_a_warning(tmp_path):
    float_model = _mlp(seed=3)
    dcp.save(get_model_state_dict(float_model), checkpoint_id=tmp_path / "fp32", no_dist=True)
    model = fsdp_int8.quantize_(_mlp(seed=4))
    with pytest.warns(UserWarning, match="rounded to nearest into int8"):
        info = load_checkpoint(tmp_path / "fp32", model)
    assert info.converted == ["0.weight", "2.weight"]
    expected = Int8Weight.from_float(float_model[0].weight)  # round to nearest
    assert torch.equal(model[0].weight.int_data, expected.int_data)
    assert torch.equal(model[0].weight.scale, expected.scale)
    with pytest.raises(CheckpointError, match="holds no optimizer state"):
        load_checkpoint(tmp_path / "fp32", model, torch.optim.SGD(model.parameters(), lr=0.1))


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
    fsdp_int8.load_full_state_dict(back, exported)
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
    latest = fsdp_int8.latest_checkpoint(tmp_path)
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
