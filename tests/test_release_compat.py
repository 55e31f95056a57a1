"""What fsdp_int8 0.1.0 wrote still loads (tests/fixtures/release_0_1_0, one process).

The files record no generator layout: the checkpoint's manifest does, so ``load_checkpoint``
resumes its streams exactly; the integrations' rounding files carry none, so they load
without restoring (a stream continues only in a layout known to be the same).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

import fsdp_int8
from fsdp_int8 import Int8Weight
from fsdp_int8.checkpoint import restore_generators

RELEASE = Path(__file__).resolve().parent / "fixtures" / "release_0_1_0"


def _fresh_model() -> torch.nn.Module:
    torch.manual_seed(1)  # other values than the saved ones: a load must overwrite them
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.ReLU(), torch.nn.Linear(16, 16))
    return fsdp_int8.quantize_(model, fsdp_int8.Int8TrainingConfig(int8_matmul=fsdp_int8.Int8MatmulConfig()))


def test_a_pickled_model_loads_and_computes_what_it_did():
    model = torch.load(RELEASE / "model.pt", weights_only=False)
    expected = torch.load(RELEASE / "expected.pt")
    assert isinstance(model[0].weight, torch.nn.Parameter) and isinstance(model[0].weight.data, Int8Weight)
    assert model[0].weight.int8_matmul == fsdp_int8.Int8MatmulConfig()
    with torch.no_grad():
        assert torch.equal(model(expected["x"]), expected["y"])
    # and it pickles again under the public name
    assert type(model[0].weight.data).__module__ == "fsdp_int8.weight"


def test_a_pickled_models_load_hook_reads_its_bool_compile_as_the_word():
    """0.1.0 pickled each int8 layer's load hook with ``Int8TrainingConfig.compile`` as a
    bool (``False``): it reads as ``"off"``, and a float weight that
    ``load_state_dict(..., assign=True)`` assigns is rounded back into an eager int8 weight."""
    model = torch.load(RELEASE / "model.pt", weights_only=False)
    hook = next(iter(model[0]._load_state_dict_post_hooks.values()))
    assert hook.compiled == "off"
    floats = {k: v.dequantize() if isinstance(v, Int8Weight) else v for k, v in model.state_dict().items()}
    model.load_state_dict(floats, assign=True)
    assert isinstance(model[0].weight.data, Int8Weight) and model[0].weight.compiled is False


def test_a_checkpoint_loads_bit_exactly_and_resumes_its_streams(tmp_path):
    shutil.copytree(RELEASE / "checkpoint", tmp_path / "checkpoint")
    model = _fresh_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    info = fsdp_int8.load_checkpoint(tmp_path / "checkpoint", model, optimizer)
    assert info.step == 1 and info.rng_restored  # the manifest's layout is this run's
    saved = torch.load(RELEASE / "model.pt", weights_only=False)
    for ours, theirs in zip(model.parameters(), saved.parameters()):
        if isinstance(ours.data, Int8Weight):
            assert torch.equal(ours.data.int_data, theirs.data.int_data)
            assert torch.equal(ours.data.scale, theirs.data.scale)
        else:
            assert torch.equal(ours.data, theirs.data)
    rounding = torch.load(tmp_path / "checkpoint" / "step_00000001" / "rng" / "rank_00000.pt")["rounding"]
    from fsdp_int8._quant.generators import WEIGHT_ROUNDING

    assert all(torch.equal(WEIGHT_ROUNDING.get_state()[k], v) for k, v in rounding.items())


def test_integration_rounding_files_without_a_layout_load_and_restore_nothing():
    model = _fresh_model()
    from fsdp_int8._quant.generators import WEIGHT_ROUNDING

    before = WEIGHT_ROUNDING.get_state()
    hf = torch.load(RELEASE / "int8_rounding_0.pth", weights_only=True)
    lightning = torch.load(RELEASE / "lightning_rounding.pt", weights_only=True)
    assert not restore_generators(hf, model)
    assert not restore_generators(lightning["ranks"][0], model)
    assert all(torch.equal(WEIGHT_ROUNDING.get_state()[k], v) for k, v in before.items())


def test_the_lightning_callback_and_the_hf_mixin_accept_release_files(tmp_path):
    from fsdp_int8.integrations.lightning import Int8RoundingCheckpoint

    model = _fresh_model()
    callback = Int8RoundingCheckpoint()
    callback.setup(None, model, "fit")
    callback.load_state_dict(torch.load(RELEASE / "lightning_rounding.pt", weights_only=True))  # no error

    from fsdp_int8.integrations.hf import Int8SaveMixin

    class _Base:
        def _load_rng_state(self, checkpoint):
            pass

    class Trainer(Int8SaveMixin, _Base):
        def __init__(self):
            self.model = model
            self.args = type("Args", (), {"process_index": 0, "world_size": 1})()

    shutil.copy(RELEASE / "int8_rounding_0.pth", tmp_path / "int8_rounding_0.pth")
    Trainer()._load_rng_state(str(tmp_path))  # no error


def test_a_torchtitan_checkpoint_without_this_layouts_key_loads_the_rest(tmp_path):
    from fsdp_int8.integrations.torchtitan import ROUNDING_STATES, Int8CheckpointManager, _RoundingStreams

    model = _fresh_model()
    streams = _RoundingStreams([model])
    assert streams.key() == "world1_unsharded_tp1_rank0"
    manager = object.__new__(Int8CheckpointManager)
    manager.states, manager.sd_adapter = {}, None
    manager.dcp_load({ROUNDING_STATES: streams}, str(RELEASE / "torchtitan"), False, False)  # skips it
