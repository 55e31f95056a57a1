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
    changed = dataclasses.replace(config, compile=True)
    assert changed.compile and changed.seed == 3 and not config.compile


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
    fsdp_int8.quantize_(model, Int8TrainingConfig(compile=compiled, int8_matmul=Int8MatmulConfig()))
    weights = [m.weight for m in model if isinstance(m, nn.Linear)]
    assert all(isinstance(w, Int8Weight) and w.compiled is compiled for w in weights)
    weight = weights[0].detach()
    buffer = io.BytesIO()
    torch.save(weight, buffer)
    buffer.seek(0)
    copies = {
        "derive": weight.derive(weight.int_data, weight.scale),
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
