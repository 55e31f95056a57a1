"""The configurations: frozen values, and the one compiled-kernel switch (``compile``)
reaching every int8 weight a model gets, through every way a weight is copied."""

from __future__ import annotations

import copy
import dataclasses
import io
import pickle

import pytest
import torch
import torch.nn as nn

import fsdp_int8
from fsdp_int8 import Int8MatmulConfig, Int8TrainingConfig, Int8Weight
from fsdp_int8.weight import _rebuild_int8_weight


def test_configs_are_frozen_values():
    config = Int8TrainingConfig(seed=3)
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.seed = 4
    with pytest.raises(dataclasses.FrozenInstanceError):
        Int8MatmulConfig().output = False
    changed = dataclasses.replace(config, compile="on")
    assert changed.compile == "on" and changed.seed == 3 and config.compile == "auto"


def test_removed_switches_are_gone_not_ignored():
    """One spelling each: a removed keyword fails loudly instead of doing nothing."""
    with pytest.raises(TypeError, match="quantize_gradients"):
        Int8TrainingConfig(quantize_gradients=True)
    with pytest.raises(TypeError, match="compile"):
        Int8MatmulConfig(compile=True)
    assert not hasattr(fsdp_int8.quant, "use_compiled_kernels")


@pytest.mark.parametrize("compiled", [False, True])
def test_compile_reaches_every_weight_and_survives_copies(compiled):
    model = nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 32))
    fsdp_int8.quantize_(model, Int8TrainingConfig(compile="on" if compiled else "off", int8_matmul=Int8MatmulConfig()))
    weights = [m.weight for m in model if isinstance(m, nn.Linear)]
    assert all(isinstance(w, Int8Weight) and w.compiled is compiled for w in weights)
    weight = weights[0].detach()
    buffer = io.BytesIO()
    torch.save(weight, buffer)
    buffer.seek(0)
    copies = {
        "derive": weight.with_tensors(weight.int_data, weight.scale),
        "deepcopy": copy.deepcopy(weight),
        "pickle": pickle.loads(pickle.dumps(weight)),
        "torch.load(weights_only=True)": torch.load(buffer, weights_only=True),
        "view(-1)": weight.view(-1),
    }
    names, ctx = weight.__tensor_flatten__()
    copies["unflatten"] = Int8Weight.__tensor_unflatten__(
        {n: getattr(weight, n) for n in names}, ctx, weight.shape, weight.stride()
    )
    for how, copied in copies.items():
        assert copied.compiled is compiled, how
        assert copied.int8_matmul == weight.int8_matmul, how


def test_weights_pickled_before_compile_moved_to_the_weight_load():
    """Older pickles carry ``Int8MatmulConfig`` as a 4-tuple whose last field was
    ``compile``: it becomes the weight's own ``compiled``."""
    weight = Int8Weight.from_float(torch.randn(4, 8))
    old = _rebuild_int8_weight(
        weight.int_data, weight.scale, torch.float32, 8, 4, True, False, False, (True, True, False, True)
    )
    assert old.int8_matmul == Int8MatmulConfig(output=True, grad_input=True, grad_weight=False)
    assert old.compiled is True
    assert torch.equal(old.int_data, weight.int_data)


def test_compile_auto_chooses_per_layer_width_device_and_compiler(monkeypatch):
    """``compile="auto"`` (the default): compiled kernels for layers of at least
    ``COMPILE_FROM_WIDTH`` inputs where the device has a compiler, eager elsewhere;
    ``"on"`` / ``"off"`` decide alone. The choice lands on each weight."""
    from fsdp_int8 import config as config_module

    auto = Int8TrainingConfig()
    assert auto.compile == "auto" and config_module.COMPILE_FROM_WIDTH == 512
    monkeypatch.setattr(config_module, "compiler_available", lambda device_type: device_type == "cpu")
    assert auto.compiles(512) and not auto.compiles(511)
    assert Int8TrainingConfig(compile="on").compiles(16) and not Int8TrainingConfig(compile="off").compiles(4096)
    model = fsdp_int8.quantize_(nn.Sequential(nn.Linear(512, 64), nn.Linear(64, 512)), auto)
    assert [model[0].weight.compiled, model[1].weight.compiled] == [True, False]
    # a device without a compiler (an accelerator without Triton, here): eager, whatever the width
    monkeypatch.setattr(config_module, "device_type_for", lambda: "cuda")
    assert not auto.compiles(4096)
    monkeypatch.setattr(config_module, "compiler_available", lambda device_type: False)
    monkeypatch.setattr(config_module, "device_type_for", lambda: "cpu")
    assert not auto.compiles(4096)


def test_compiler_available_looks_for_the_devices_code_generator(monkeypatch):
    from fsdp_int8._quant import kernels

    monkeypatch.setattr(kernels.shutil, "which", lambda name: None)
    monkeypatch.delenv("CXX", raising=False)
    assert not kernels.compiler_available("cpu")  # no C++ compiler on the path
    monkeypatch.setattr(kernels.shutil, "which", lambda name: f"/usr/bin/{name}" if name == "g++" else None)
    assert kernels.compiler_available("cpu")
    assert not kernels.compiler_available("mps")  # nothing known


@pytest.mark.parametrize("kwargs, message", [
    (dict(int8_matmul=True), "int8_matmul takes an Int8MatmulConfig or None, got True"),
    (dict(int8_matmul={"output": True}), "int8_matmul takes an Int8MatmulConfig"),
    (dict(compile="yes"), "compile takes 'auto', 'on' or 'off', got 'yes'"),
    (dict(compile=1), "compile takes 'auto', 'on' or 'off', got 1"),
    (dict(compile=True), "not a bool: use compile='on' instead of compile=True"),
    (dict(compile=False), "not a bool: use compile='off' instead of compile=False"),
    (dict(module_filter="lm_head"), "module_filter takes a callable"),
    (dict(quantize_embeddings="yes"), "quantize_embeddings takes a bool"),
    (dict(reshard_early=1), "reshard_early takes a bool"),
])
def test_config_fields_of_the_wrong_type_are_refused_where_given(kwargs, message):
    with pytest.raises(TypeError, match=message):
        Int8TrainingConfig(**kwargs)


def test_the_lean_recipe_is_one_config_and_one_optimizer_call():
    from torch.distributed.fsdp import MixedPrecisionPolicy

    from fsdp_int8.optim.adamw import LEAN_STEP_ELEMENTS
    from fsdp_int8.sharding import _mixed_precision

    lean = Int8TrainingConfig.lean()
    assert lean.quantize_embeddings and lean.compute_dtype is torch.bfloat16
    assert lean.int8_matmul is None and lean.int8_gathered_weights and lean.reshard_early
    assert not Int8TrainingConfig().reshard_early
    assert Int8TrainingConfig.lean(seed=5, compute_dtype=None).seed == 5  # changes replace fields
    optimizer = fsdp_int8.Int8AdamW.lean(nn.Linear(8, 8).parameters(), lr=3e-4, weight_decay=0.1)
    group = optimizer.param_groups[0]
    assert (group["lr"], group["weight_decay"], group["state_bits"]) == (3e-4, 0.1, 8)
    assert optimizer._in_backward is not None and optimizer._in_backward._max_grad_norm == 1.0
    assert optimizer._step_elements == LEAN_STEP_ELEMENTS
    # shard_model's mixed precision: the config's compute dtype with an fp32 reduction,
    # FSDP2's default without one; an mp_policy that disagrees is refused
    assert _mixed_precision(None, lean) == MixedPrecisionPolicy(torch.bfloat16, torch.float32)
    assert _mixed_precision(None, Int8TrainingConfig()) == MixedPrecisionPolicy()
    given = MixedPrecisionPolicy(torch.bfloat16, torch.bfloat16)
    assert _mixed_precision(given, lean) is given
    with pytest.raises(ValueError, match="compute_dtype is torch.bfloat16 but mp_policy.param_dtype is torch.float16"):
        _mixed_precision(MixedPrecisionPolicy(torch.float16), lean)
    with pytest.raises(TypeError, match="compute_dtype takes a floating torch.dtype"):
        Int8TrainingConfig(compute_dtype=torch.int8)


def test_quantize_and_shard_model_refuse_a_config_of_another_type():
    message = r"config takes an Int8TrainingConfig, got Int8MatmulConfig \(an Int8MatmulConfig goes inside"
    model = nn.Sequential(nn.Linear(32, 32))
    with pytest.raises(TypeError, match=message):
        fsdp_int8.quantize_(model, Int8MatmulConfig())
    with pytest.raises(TypeError, match=message):  # before it needs a process group or changes anything
        fsdp_int8.shard_model(model, config=Int8MatmulConfig())
    assert type(model[0].weight) is nn.Parameter and not isinstance(model[0].weight.data, Int8Weight)
