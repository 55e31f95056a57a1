"""Block discovery (``find_blocks``) and ``shard_model``'s argument checks, in one process.

Nothing here needs a process group: ``find_blocks`` is pure module-tree inspection, and
``shard_model`` validates ``reshard_after_forward`` before it looks for one.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

import fsdp_int8
from fsdp_int8 import Int8Weight
from fsdp_int8.sharding import find_blocks


# ---------------------------------------------------------------- tiny models
class Block(nn.Module):
    def __init__(self, dim: int = 16) -> None:
        super().__init__()
        self.fc = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc(x)


class LayersModel(nn.Module):
    """(a) Llama / torchtitan style: ``self.layers`` of one block type."""

    def __init__(self, n_layers: int = 3) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 16)
        self.layers = nn.ModuleList([Block() for _ in range(n_layers)])
        self.norm = nn.LayerNorm(16)
        self.output = nn.Linear(16, 10)


class GPT2Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(16)
        self.attn = nn.Linear(16, 48)
        self.mlp = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 16))


class GPT2Transformer(nn.Module):
    def __init__(self, n_layers: int) -> None:
        super().__init__()
        self.wte = nn.Embedding(10, 16)
        self.wpe = nn.Embedding(8, 16)
        self.drop = nn.Dropout(0.0)
        self.h = nn.ModuleList([GPT2Block() for _ in range(n_layers)])
        self.ln_f = nn.LayerNorm(16)


class GPT2LikeModel(nn.Module):
    """(b) GPT-2 style: blocks at ``model.transformer.h``."""

    def __init__(self, n_layers: int = 4) -> None:
        super().__init__()
        self.transformer = GPT2Transformer(n_layers)
        self.lm_head = nn.Linear(16, 10, bias=False)


class MyDecoderLayer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.self_attn = nn.Linear(16, 16)
        self.mlp = nn.Linear(16, 16)


class MyOtherLayer(nn.Module):
    """Has parameters too, but is not named in ``_no_split_modules``."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(16, 16)


class MyInnerModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(10, 16)
        # Mixed types: no "ModuleList of repeated modules" here, so the ModuleList fallback
        # finds nothing and only the class names can pick out the decoder layers.
        self.layers = nn.ModuleList(
            [MyDecoderLayer(), MyOtherLayer(), MyDecoderLayer(), MyDecoderLayer()]
        )
        # A ModuleList of repeated modules that is NOT the block list: the fallback would
        # return these two if it ran.
        self.adapters = nn.ModuleList([MyOtherLayer(), MyOtherLayer()])
        self.norm = nn.LayerNorm(16)


class MyForCausalLM(nn.Module):
    """(c) Hugging Face style: ``_no_split_modules`` on the class, layers at ``model.model.layers``."""

    _no_split_modules = ["MyDecoderLayer"]

    def __init__(self) -> None:
        super().__init__()
        self.model = MyInnerModel()
        self.lm_head = nn.Linear(16, 10, bias=False)


class Wrapper(nn.Module):
    """A block that contains blocks: for the outermost-only rule."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = Block()
        self.more = nn.ModuleList([Block(), Block()])


class NestedModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stages = nn.ModuleList([Wrapper(), Wrapper()])
        self.loose = Block()  # a matching block outside any wrapper
        self.head = nn.Linear(16, 4)


def _ids(modules) -> list[int]:
    return [id(m) for m in modules]


# ---------------------------------------------------------------- discovery
def test_layers_module_list():
    model = LayersModel(n_layers=3)
    found = find_blocks(model)
    assert _ids(found) == _ids(model.layers)  # every block, registration order, nothing else


def test_gpt2_transformer_h():
    model = GPT2LikeModel(n_layers=4)
    found = find_blocks(model)
    assert _ids(found) == _ids(model.transformer.h)
    assert all(type(b) is GPT2Block for b in found)


def test_hugging_face_no_split_modules_uses_class_names():
    model = MyForCausalLM()
    layers = model.model.layers
    found = find_blocks(model)
    assert _ids(found) == [id(layers[0]), id(layers[2]), id(layers[3])]
    assert all(type(b).__name__ == "MyDecoderLayer" for b in found)
    # Without the class names the fallback would pick the other ModuleList: proof that the
    # result above came from _no_split_modules.
    inner = MyInnerModel()  # same tree, no _no_split_modules
    assert _ids(find_blocks(inner)) == _ids(inner.adapters)


def test_hugging_face_names_matching_nothing_fall_back_to_module_lists():
    class Renamed(LayersModel):
        _no_split_modules = ["NoSuchLayer"]

    model = Renamed()
    assert _ids(find_blocks(model)) == _ids(model.layers)


def test_blocks_as_one_type():
    model = GPT2LikeModel(n_layers=2)
    assert _ids(find_blocks(model, GPT2Block)) == _ids(model.transformer.h)
    # an explicit type overrides discovery: here the embeddings become the "blocks"
    assert _ids(find_blocks(model, nn.Embedding)) == [id(model.transformer.wte), id(model.transformer.wpe)]


def test_blocks_as_tuple_and_list_of_types():
    model = GPT2LikeModel(n_layers=2)
    both = find_blocks(model, (GPT2Block, nn.Embedding))
    t = model.transformer
    assert _ids(both) == [id(t.wte), id(t.wpe), id(t.h[0]), id(t.h[1])]  # registration order
    assert _ids(find_blocks(model, [GPT2Block])) == _ids(t.h)


def test_blocks_as_predicate():
    model = MyForCausalLM()
    layers = model.model.layers
    found = find_blocks(model, lambda m: isinstance(m, (MyDecoderLayer, MyOtherLayer)) and m is not layers[1])
    assert _ids(found) == [id(layers[0]), id(layers[2]), id(layers[3])] + _ids(model.model.adapters)
    # a predicate is never asked about the root: the root is not a block
    seen = []
    find_blocks(model, lambda m: seen.append(m) or False)
    assert model not in seen and len(seen) == len(list(model.modules())) - 1


@pytest.mark.parametrize(
    "spec",
    [Block, (Block,), [Block, Wrapper], lambda m: isinstance(m, (Block, Wrapper))],
    ids=["type", "tuple", "list", "predicate"],
)
def test_outermost_matches_only(spec):
    model = NestedModel()
    found = find_blocks(model, spec)
    if spec is Block or spec == (Block,):
        # Block instances: 3 inside each Wrapper plus the loose one, each exactly once
        expected = [
            *(m for w in model.stages for m in (w.inner, *w.more)),
            model.loose,
        ]
    else:
        # Wrapper matches first; its inner Blocks are not returned a second time
        expected = [*model.stages, model.loose]
    assert _ids(found) == _ids(expected)
    assert len(set(_ids(found))) == len(found)
    # no returned module is inside another returned module
    for a in found:
        for b in found:
            if a is not b:
                assert all(m is not b for m in a.modules())


def test_default_discovery_is_outermost():
    # The outermost repeated ModuleList wins: the Wrappers, not the Blocks in them.
    model = NestedModel()
    assert _ids(find_blocks(model)) == _ids(model.stages)


def test_no_module_list_gives_empty_list():
    model = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4))
    assert find_blocks(model) == []
    assert find_blocks(nn.Linear(4, 4)) == []


def test_module_list_without_parameters_is_not_blocks():
    class Acts(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.acts = nn.ModuleList([nn.ReLU(), nn.ReLU()])
            self.fc = nn.Linear(4, 4)

    assert find_blocks(Acts()) == []


@pytest.mark.parametrize("bad", [3, 2.5, "Block", ["Block"], (Block, "Wrapper"), {Block}])
def test_wrong_kind_of_blocks_raises_type_error(bad):
    with pytest.raises(TypeError, match=r"blocks must be module types or a predicate, got "):
        find_blocks(LayersModel(), bad)


def test_shared_block_instance_is_returned_once():
    shared = Block()

    class SharedLayers(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.ModuleList([shared, shared, Block()])

    model = SharedLayers()
    # The explicit-type path returns each module once ...
    assert _ids(find_blocks(model, Block)) == [id(shared), id(model.layers[2])]
    # ... and the discovered blocks must too: shard_model wraps each one with fully_shard.
    assert _ids(find_blocks(model)) == [id(shared), id(model.layers[2])]


# ---------------------------------------------------------------- shard_model's early errors
def test_shard_model_without_process_group_raises_and_leaves_model_alone():
    assert not dist.is_initialized(), "this test needs a process without a process group"
    model = LayersModel()
    with pytest.raises(RuntimeError, match=r"init_process_group"):
        fsdp_int8.shard_model(model)
    # The check runs before quantization: the model is untouched.
    assert not any(isinstance(p, Int8Weight) for p in model.parameters())


def test_integer_reshard_after_forward_is_refused_first():
    # Runs before the process-group check: no group needed for the ValueError.
    assert not dist.is_initialized()
    model = LayersModel()
    for value in (2, 1, 0):
        with pytest.raises(ValueError, match=r"docs/limits\.md") as info:
            fsdp_int8.shard_model(model, reshard_after_forward=value)
        assert f"reshard_after_forward={value}" in str(info.value)
    assert not any(isinstance(p, Int8Weight) for p in model.parameters())


@pytest.mark.parametrize("value", ["yes", None, 1.0])
def test_non_bool_reshard_after_forward_is_a_type_error(value):
    with pytest.raises(TypeError, match=r"reshard_after_forward must be a bool"):
        fsdp_int8.shard_model(LayersModel(), reshard_after_forward=value)


@pytest.mark.parametrize("value", [True, False])
def test_bool_reshard_after_forward_passes_the_check(value):
    # A bool gets past the argument check and stops at the missing process group.
    assert not dist.is_initialized()
    with pytest.raises(RuntimeError, match=r"init_process_group"):
        fsdp_int8.shard_model(LayersModel(), reshard_after_forward=value)


def test_offload_policy_checks_come_first():
    # no process group needed: the argument is checked before the mesh is made
    assert not dist.is_initialized()
    from torch.distributed.fsdp import CPUOffloadPolicy

    with pytest.raises(TypeError, match=r"offload_policy must be .*OffloadPolicy.*got 'cpu'"):
        fsdp_int8.shard_model(LayersModel(), offload_policy="cpu")
    if not torch.accelerator.is_available():  # torch pins host memory only for an accelerator
        model = LayersModel()
        with pytest.raises(ValueError, match=r"pin_memory=False"):
            fsdp_int8.shard_model(model, offload_policy=CPUOffloadPolicy())
        assert not any(isinstance(p, Int8Weight) for p in model.parameters())
    with pytest.raises(RuntimeError, match=r"init_process_group"):  # a valid policy passes
        fsdp_int8.shard_model(LayersModel(), offload_policy=CPUOffloadPolicy(pin_memory=False))


# ---------------------------------------------------------------- torchtitan layouts, tied weights
class DictLayersModel(nn.Module):
    """torchtitan style: blocks in an ``nn.ModuleDict`` keyed "0", "1", ..."""

    def __init__(self, n_layers: int = 3) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(10, 16)
        self.layers = nn.ModuleDict({str(i): Block() for i in range(n_layers)})
        self.norm = nn.LayerNorm(16)
        self.output = nn.Linear(16, 10)


def test_layers_module_dict():
    model = DictLayersModel(n_layers=3)
    assert _ids(find_blocks(model)) == _ids(model.layers.values())


class TiedModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 16)
        self.layers = nn.ModuleList([Block(), Block()])
        self.lm_head = nn.Linear(16, 10, bias=False)
        self.lm_head.weight = self.embed.weight  # tie_word_embeddings


def test_embedding_tied_to_the_head_is_left_to_the_root_group():
    """FSDP2 needs both ends of a tie in one group: the root, which holds the head."""
    from fsdp_int8.sharding import _groups_below_root

    model = TiedModel()
    assert _ids(_groups_below_root(model, find_blocks(model))) == _ids(model.layers)
    untied = LayersModel()
    assert _ids(_groups_below_root(untied, find_blocks(untied))) == _ids([untied.embed, *untied.layers])


def test_block_tied_to_a_module_outside_it_is_refused_naming_both():
    from fsdp_int8.sharding import _groups_below_root

    model = LayersModel(n_layers=2)
    model.layers[1].fc.weight = model.layers[0].fc.weight  # two blocks share a weight
    with pytest.raises(ValueError, match=r"block layers\.0 shares parameters.*layers\.1\.fc.*blocks="):
        _groups_below_root(model, find_blocks(model))
