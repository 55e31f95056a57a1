"""Int8 weights arriving from outside are checked on the way in (``fsdp_int8._weight.load_checks``):
row scales finite and non-negative, int8 values in -127..127, shapes, rows with their
scales. Each edit of issue 35's table, in a Hugging Face folder (``from_pretrained`` and
``load_state_dict`` of its entries), a ``torch.load``ed state dict and a dcp folder, is
refused at load naming the layer (and the file where there is one), and a refused load
leaves the model and optimizer as they were; so do accelerate's ``load_state`` and
Lightning's ``fit(ckpt_path=...)``. Tiny models; nothing is downloaded.
"""

from __future__ import annotations

import io
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
import torch.nn as nn

import fsdp_int8
from fsdp_int8 import Int8Weight, load_checkpoint
from fsdp_int8._weight.load_checks import Int8LoadError, check_rows
from fsdp_int8.checkpoint import CheckpointError

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _frameworks import tiny_llama  # noqa: E402

from fsdp_int8.integrations import hf_quantizer as hfq  # noqa: E402  (registers the method)

LAYER = "model.layers.1.mlp.down_proj.weight"  # the edited layer of the HF model: one of the last

# Each edit of an int8 weight (int8 rows, row scales) and the error it meets.
VALUE_EDITS = {
    "nan_scale": (lambda rows, scale: scale.__setitem__(2, float("nan")), r"1 of \d+ row scales are NaN.*row 2, nan"),
    "negative_scale": (lambda rows, scale: scale.neg_(), r"row scales are NaN, infinite or negative \(first: row 0, -"),
    "inf_scale": (lambda rows, scale: scale.__setitem__(0, float("inf")), r"row 0, inf"),
    "minus_128": (lambda rows, scale: rows[3].__setitem__(slice(0, 2), -128), r"2 int8 value\(s\) are -128 \(first in row 3\).*clamp"),
}


def _mlp(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return fsdp_int8.quantize_(nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 32)))


def _snapshot(model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> dict:
    """Every byte a load could change: int8 rows and scales, other parameters, optimizer state."""
    state = {
        name: (p.int_data.clone(), p.scale.clone()) if isinstance(p, Int8Weight) else (p.detach().clone(),)
        for name, p in model.named_parameters()
    }
    if optimizer is not None:
        for index, per_param in optimizer.state_dict()["state"].items():
            state.update({f"opt.{index}.{k}": (v.clone(),) for k, v in per_param.items() if torch.is_tensor(v)})
    return state


def _assert_unchanged(before: dict, after: dict) -> None:
    assert before.keys() == after.keys()
    for name, tensors in before.items():
        assert all(torch.equal(x, y) for x, y in zip(tensors, after[name], strict=True)), name


def _trained_mlp(seed: int = 0):
    model = _mlp(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(4, 32)).pow(2).mean().backward()
    opt.step()
    return model, opt


# ------------------------------------------------------------------ the check itself
@pytest.mark.parametrize("edit", sorted(VALUE_EDITS))
def test_check_rows_refuses_each_bad_value_naming_the_entry_and_file(edit):
    rows, scale = torch.randint(-127, 128, (6, 8), dtype=torch.int8), torch.rand(6) + 0.1
    check_rows("fc.weight", rows, scale, source="a.safetensors")  # valid: silent
    change, message = VALUE_EDITS[edit]
    change(rows, scale)
    with pytest.raises(Int8LoadError, match=r"int8 weight fc\.weight \(in a\.safetensors\): " + ".*" + message):
        check_rows("fc.weight", rows, scale, source="a.safetensors")


def test_check_rows_refuses_wrong_dtypes_and_shapes():
    rows, scale = torch.zeros(6, 8, dtype=torch.int8), torch.ones(6)
    with pytest.raises(Int8LoadError, match=r"needs int8 rows and fp32 row scales, got torch.float32"):
        check_rows("w", rows.float(), scale)
    with pytest.raises(Int8LoadError, match=r"\(6, 8\) int8 rows need \(6,\) row scales, got \(5,\)"):
        check_rows("w", rows, scale[:5])
    with pytest.raises(Int8LoadError, match=r"shape \(6, 8\), the layer's weight \(6, 9\)"):
        check_rows("w", rows, scale, shape=(6, 9))
    check_rows("w", torch.zeros(0, 8, dtype=torch.int8), torch.ones(0))  # empty: nothing to check


# ------------------------------------------------------------------ torch.load + load_state_dict
def _reloaded_state_dict(model: nn.Module) -> dict:
    buffer = io.BytesIO()
    torch.save(model.state_dict(), buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


@pytest.mark.parametrize("edit", sorted(VALUE_EDITS))
def test_torch_load_then_load_state_dict_refuses_and_leaves_the_model_unchanged(edit):
    model, opt = _trained_mlp()
    state = _reloaded_state_dict(_mlp(seed=1))
    weight = state["2.weight"]  # the last layer: the first layer would load first without the model-wide check
    VALUE_EDITS[edit][0](weight.int_data, weight.scale)
    before = _snapshot(model, opt)
    with pytest.raises(Int8LoadError, match=r"int8 weight 2\.weight: .*" + VALUE_EDITS[edit][1]):
        model.load_state_dict(state)
    _assert_unchanged(before, _snapshot(model, opt))
    with pytest.raises(Int8LoadError, match=r"int8 weight weight: "):  # the layer's own load is checked too
        model[2].load_state_dict({k.removeprefix("2."): v for k, v in state.items() if k.startswith("2.")})


def test_unpaired_or_misshapen_entries_are_refused_before_anything_loads():
    model = _mlp()
    good = _reloaded_state_dict(_mlp(seed=1))
    before = _snapshot(model)
    int8_no_scale = {**good, "2.weight": good["2.weight"].int_data.clone()}
    with pytest.raises(Int8LoadError, match=r"2\.weight: it holds int8 rows but no row scales \(2\.weight_scale is missing\)"):
        model.load_state_dict(int8_no_scale)
    scale_no_rows = {**good, "2.weight": torch.randn(32, 64), "2.weight_scale": torch.ones(32)}
    with pytest.raises(Int8LoadError, match=r"2\.weight: it holds torch.float32 values beside row scales 2\.weight_scale"):
        model.load_state_dict(scale_no_rows)
    short = good["2.weight"]
    short = short.with_tensors(short.int_data[:-1].clone(), short.scale[:-1].clone(), unsharded_rows=31)
    with pytest.raises(Int8LoadError, match=r"2\.weight: it has shape \(31, 64\), the layer's weight \(32, 64\)"):
        model.load_state_dict({**good, "2.weight": short})
    _assert_unchanged(before, _snapshot(model))
    model.load_state_dict(good)  # the valid dict loads, exactly
    assert torch.equal(model[2].weight.int_data, good["2.weight"].int_data)


def test_each_entry_is_checked_once_per_load_and_again_in_the_next_load(monkeypatch):
    from fsdp_int8._weight import load_checks

    model, state = _mlp(), _reloaded_state_dict(_mlp(seed=1))
    checked = []
    real = load_checks.check_entry
    monkeypatch.setattr(load_checks, "check_entry", lambda sd, prefix, *a, **k: (checked.append(prefix), real(sd, prefix, *a, **k)))
    model.load_state_dict(state)
    assert checked == ["0.", "2."]  # by the model's hook, before either layer loads; the layers' hooks skip
    checked.clear()
    model[2].load_state_dict({"weight": state["2.weight"], "bias": state["2.bias"]})
    assert checked == [""]
    state["2.weight"].scale[0] = float("nan")  # the same dict, edited in place, is checked again
    with pytest.raises(Int8LoadError, match=r"2\.weight: 1 of 32 row scales"):
        model.load_state_dict(state)


# ------------------------------------------------------------------ dcp folders written elsewhere
@pytest.mark.parametrize("edit", sorted(VALUE_EDITS))
def test_a_dcp_folder_with_bad_int8_values_is_refused_by_load_checkpoint_and_load_state_dict(tmp_path, edit):
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict
    from torch.utils._pytree import tree_map_only

    written, written_opt = _trained_mlp(seed=1)
    state = tree_map_only(torch.Tensor, lambda t: t.detach().clone(), {
        "model": get_model_state_dict(written), "optimizer": get_optimizer_state_dict(written, written_opt)
    })
    VALUE_EDITS[edit][0](state["model"]["2.weight"].int_data, state["model"]["2.weight"].scale)
    dcp.save(state, checkpoint_id=tmp_path / "plain", no_dist=True)

    model, opt = _trained_mlp()
    before = _snapshot(model, opt)
    with pytest.raises(CheckpointError, match=r"holds invalid int8 weights: refusing to load int8 weight 2\.weight \(in .*plain\)"):
        load_checkpoint(tmp_path / "plain", model, opt, allow_unverified=True)
    _assert_unchanged(before, _snapshot(model, opt))

    into = {"model": {k: v.detach().clone() for k, v in model.state_dict().items()}}  # dcp.load, then load_state_dict
    dcp.load(into, checkpoint_id=tmp_path / "plain", no_dist=True)
    with pytest.raises(Int8LoadError, match=r"2\.weight"):
        model.load_state_dict(into["model"])
    _assert_unchanged(before, _snapshot(model, opt))


# ------------------------------------------------------------------ Hugging Face folders
@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory):
    """A quantized tiny Llama saved with ``save_pretrained`` (int8 rows + fp32 scales)."""
    path = tmp_path_factory.mktemp("hf") / "int8"
    model = fsdp_int8.quantize_(tiny_llama())
    model.save_pretrained(path)
    return path


def _edited_folder(source: Path, target: Path, change) -> Path:
    """A copy of the folder ``source`` whose safetensors entries ``change(tensors)`` edited."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(source, target)
    tensors = load_file(target / "model.safetensors")
    change(tensors)
    save_file(tensors, target / "model.safetensors", metadata={"format": "pt"})
    return target


def _value_edit(edit):
    # the folder's int8 rows are flat (format version 2): edit them as rows, through a view
    return lambda t: VALUE_EDITS[edit][0](t[LAYER].view(len(t[LAYER + "_scale"]), -1), t[LAYER + "_scale"])


HF_EDITS = {
    **{name: (_value_edit(name), message) for name, (_, message) in VALUE_EDITS.items()},
    "scale_removed": (lambda t: t.pop(LAYER + "_scale"), r"it holds int8 rows but no row scales"),
    "scale_one_row_short": (
        lambda t: t.__setitem__(LAYER + "_scale", t[LAYER + "_scale"][:-1].clone()), r"need .*row scales.*63",
    ),
    "float_weight_beside_scale": (
        lambda t: t.__setitem__(LAYER, t[LAYER].float()), r"row scales .*_scale but F32 values, not int8 rows",
    ),
}


@pytest.mark.parametrize("edit", sorted(HF_EDITS))
def test_from_pretrained_refuses_each_edited_folder_naming_layer_and_file(tmp_path, hf_folder, edit):
    from transformers import AutoModelForCausalLM

    change, message = HF_EDITS[edit]
    folder = _edited_folder(hf_folder, tmp_path / edit, change)
    with pytest.raises(Int8LoadError, match=rf"{LAYER} \(in .*{edit}/model\.safetensors\): .*{message}"):
        AutoModelForCausalLM.from_pretrained(folder)


@pytest.mark.parametrize("edit", sorted(HF_EDITS))
def test_load_state_dict_of_edited_hf_entries_refuses_and_leaves_the_model_unchanged(hf_folder, edit):
    """What ``Trainer``'s ``resume_from_checkpoint`` does: ``load_state_dict`` of the file's entries."""
    from safetensors.torch import load_file

    model = fsdp_int8.quantize_(tiny_llama(seed=1))
    tensors = load_file(hf_folder / "model.safetensors")
    HF_EDITS[edit][0](tensors)
    before = _snapshot(model)
    with pytest.raises(Int8LoadError, match=rf"{LAYER}"):
        model.load_state_dict(tensors)
    _assert_unchanged(before, _snapshot(model))


# ------------------------------------------------------------------ the safetensors reader
def test_the_safetensors_reader_inverts_the_writer_and_checks_what_it_reads(tmp_path):
    from safetensors.torch import load_file, save_file

    written = _mlp(seed=1)
    save_file(hfq.int8_safetensors_state_dict(written.state_dict()), tmp_path / "mlp.safetensors")
    tensors = load_file(tmp_path / "mlp.safetensors")
    model = _mlp()
    model.load_state_dict(hfq.state_dict_from_int8_safetensors(tensors, source="mlp.safetensors"))
    for mine, theirs in zip(model.parameters(), written.parameters()):
        if isinstance(mine, Int8Weight):
            assert torch.equal(mine.int_data, theirs.int_data) and torch.equal(mine.scale, theirs.scale)
        else:
            assert torch.equal(mine, theirs)

    bad = dict(tensors, **{"2.weight_scale": -tensors["2.weight_scale"]})
    with pytest.raises(Int8LoadError, match=r"int8 weight 2\.weight \(in mlp\.safetensors\): .*negative"):
        hfq.state_dict_from_int8_safetensors(bad, source="mlp.safetensors")
    with pytest.raises(Int8LoadError, match=r"2\.weight \(in f\): it holds int8 rows but no row scales 2\.weight_scale"):
        hfq.state_dict_from_int8_safetensors({k: v for k, v in tensors.items() if k != "2.weight_scale"}, source="f")
    with pytest.raises(Int8LoadError, match=r"2\.weight: the file holds row scales 2\.weight_scale but no int8 rows"):
        hfq.state_dict_from_int8_safetensors({k: v for k, v in tensors.items() if k != "2.weight"})


# ------------------------------------------------------------------ a framework loader
def test_accelerate_load_state_of_an_edited_state_refuses_and_changes_nothing(tmp_path, accelerate_state):
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True)
    model, opt = accelerator.prepare(*_trained_mlp())
    accelerator.save_state(tmp_path / "state", safe_serialization=False)
    (weights,) = (tmp_path / "state").glob("pytorch_model*.bin")
    saved = torch.load(weights, weights_only=True)
    saved["2.weight"].scale[5] = -1.0
    torch.save(saved, weights)
    model(torch.randn(4, 32)).pow(2).mean().backward()
    opt.step()  # the state on disk differs from the model's
    before = _snapshot(model, opt.optimizer)
    with pytest.raises(Int8LoadError, match=r"2\.weight: 1 of 32 row scales .*row 5, -1\.0"):
        accelerator.load_state(tmp_path / "state")
    _assert_unchanged(before, _snapshot(model, opt.optimizer))


def test_lightning_resume_from_an_edited_checkpoint_refuses_and_changes_nothing(tmp_path):
    import lightning.pytorch as pl

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = _mlp()

        def training_step(self, batch, index):
            return self.net(batch).pow(2).mean()

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-2)

    def trainer(steps: int) -> pl.Trainer:
        return pl.Trainer(
            max_steps=steps, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
            enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path,
        )

    data = torch.utils.data.DataLoader(torch.randn(8, 32), batch_size=4)
    first = trainer(1)
    first.fit(Module(), data)
    first.save_checkpoint(tmp_path / "step1.ckpt")
    checkpoint = torch.load(tmp_path / "step1.ckpt", weights_only=False)
    checkpoint["state_dict"]["net.2.weight"].int_data[0, 0] = -128
    torch.save(checkpoint, tmp_path / "edited.ckpt")

    module = Module()
    before = _snapshot(module)
    with pytest.raises(Int8LoadError, match=r"net\.2\.weight: 1 int8 value\(s\) are -128 \(first in row 0\)"):
        trainer(2).fit(module, data, ckpt_path=tmp_path / "edited.ckpt")
    _assert_unchanged(before, _snapshot(module))
