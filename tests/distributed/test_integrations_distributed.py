"""Frameworks on 2 gloo ranks, in one spawn: plain DDP around a quantized model (replicas
stay bit-identical), Hugging Face Llama with tied embeddings under ``shard_model`` (int8
embeddings too: saved from the gathered state dict, loaded exactly in a fresh process), the
stock transformers ``Trainer`` and accelerate saving int8 weights (DDP, as accelerate
picks on CPU, and FSDP2), torchtitan's Llama built on the meta device, initialised by
torchtitan and checkpointed through its own fused-QKV state-dict hooks, and GPT-2's Conv1D
layers sharded (tests/test_gpt2.py's body, in this spawn so it costs no spawn of its own).
"""

from __future__ import annotations

import copy
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel

import fsdp_int8
from fsdp_int8 import Int8TrainingConfig, Int8Weight
from fsdp_int8.testing import run_distributed

from _cases import case, int8_params, local_of
from _nets import MLPNet

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the framework models
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))  # accelerate on CPU
from _frameworks import VOCAB, hf_loss, tiny_llama, titan_init, titan_loss, titan_model  # noqa: E402
from _models import fibonacci_mod_task, train_steps  # noqa: E402

STEPS = 8


def _bytes_of(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter's stored bytes (int8 data and scales for int8 weights), on this rank."""
    out = {}
    for name, param in model.named_parameters():
        local = local_of(param)
        if isinstance(local, Int8Weight):
            out[name + ".int_data"], out[name + ".scale"] = local.int_data.clone(), local.scale.clone()
        else:
            out[name] = local.detach().clone()
    return out


def _ddp_replicas(rank: int) -> dict[str, dict[str, torch.Tensor]]:
    """DDP broadcasts rank 0's parameters at wrap time (int8 weights in buckets with plain
    tensors, and buckets of int8 weights only), then trains with stochastic rounding."""
    out = {}
    for name, bias in (("mixed buckets", True), ("int8-only buckets", False)):
        with case(f"DDP, {name}"):
            torch.manual_seed(rank)  # every replica starts different: DDP must sync them
            model = fsdp_int8.quantize_(MLPNet(hidden=64, bias=bias), Int8TrainingConfig(seed=3))
            model.head.weight.requires_grad_(bias)  # int8-only: the fp32 head sits out
            ddp = DistributedDataParallel(model)
            opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2, weight_decay=0.1)
            x, y = torch.randn(16, 32, generator=torch.Generator().manual_seed(rank)), torch.randn(16, 4)
            losses = train_steps(ddp, lambda m, _: F.mse_loss(m(x), y), opt, x, STEPS)
            assert losses[-1] < losses[0], losses
            assert len(int8_params(model)) == 4
            out[name] = _bytes_of(model)
    return out


def _tied_llama_under_fsdp(rank: int, root: str) -> dict:
    with case("HF Llama, tie_word_embeddings=True, shard_model"):
        model = fsdp_int8.shard_model(tiny_llama(tie=True))
        assert model.lm_head.weight is model.model.embed_tokens.weight  # one parameter, one group
        assert len(int8_params(model)) == 14
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        tokens = fibonacci_mod_task(8, 16, vocab=VOCAB, seed=rank)
        losses = train_steps(model, hf_loss, opt, tokens, 4)
        assert losses[-1] < losses[0], losses
        assert model.lm_head.weight is model.model.embed_tokens.weight
    with case("sharded state dict deep-copies (FSDP2 itself refuses to deep-copy modules)"):
        state = model.state_dict()
        copied = copy.deepcopy(state)
        name = "model.layers.0.mlp.up_proj.weight"
        assert isinstance(copied[name], DTensor) and isinstance(copied[name]._local_tensor, Int8Weight)
        assert torch.equal(copied[name]._local_tensor, state[name]._local_tensor)
        assert copied[name]._local_tensor.data_ptr() != state[name]._local_tensor.data_ptr()
    with case("save_pretrained of the exported state dict, on rank 0"):
        exported = fsdp_int8.export_full_state_dict(model, torch.float32)
        if rank == 0:
            from transformers import LlamaForCausalLM

            model.save_pretrained(root, state_dict=exported)
            plain = LlamaForCausalLM.from_pretrained(root)
            assert plain.lm_head.weight is plain.model.embed_tokens.weight
            reloaded = plain.state_dict()
            for key, value in exported.items():  # the tied pair is exported once
                assert torch.equal(reloaded[key], value), key
        dist.barrier()
    return {"loss": losses[-1]}


def _int8_embeddings_tied_gathered_save(rank: int, root: str) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """The documented sharded save of a tied head with int8 embeddings: the trained int8
    rows and scales (rank 0's, gathered), for the fresh-process load of the caller."""
    from safetensors.torch import load_file
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    with case("HF Llama, int8 embeddings tied to the head: save_pretrained of the gathered state dict"):
        model = fsdp_int8.shard_model(tiny_llama(tie=True), config=Int8TrainingConfig(quantize_embeddings=True))
        assert model.lm_head.weight is model.model.embed_tokens.weight and len(int8_params(model)) == 15
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        train_steps(model, hf_loss, opt, fibonacci_mod_task(8, 16, vocab=VOCAB, seed=rank), 2)
        full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        model.save_pretrained(root, state_dict=full, is_main_process=rank == 0)
        trained = {n: local_of(p.full_tensor()) for n, p in int8_params(model)}  # a collective
        dist.barrier()
        if rank == 0:  # one process's layout: the tie once, under the embedding
            layout = {n + suffix for n, p in model.named_parameters()
                      for suffix in (("", "_scale") if isinstance(local_of(p), Int8Weight) else ("",))}
            assert load_file(f"{root}/model.safetensors").keys() == layout
    return {n: (w.int_data, w.scale) for n, w in trained.items()}


class _Patterns(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 32

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        tokens = (torch.arange(16) * 3 + i) % VOCAB
        return {"input_ids": tokens, "labels": tokens}


def _int8_bytes(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v for k, v in _bytes_of(model).items() if k.endswith((".int_data", ".scale"))}


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return len(a) > 0 and a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _saved_int8(path: str) -> dict[str, torch.Tensor]:
    """The int8 rows and scales of a save_pretrained folder, named as :func:`_bytes_of` names them."""
    from safetensors.torch import load_file

    saved = load_file(f"{path}/model.safetensors")
    out = {}
    for key, value in saved.items():
        if key.endswith(".weight_scale"):
            rows = saved[key.removesuffix("_scale")]  # flat on disk: one row per scale
            out[key.removesuffix("_scale") + ".int_data"] = rows.view(value.numel(), -1)
            out[key.removesuffix("_scale") + ".scale"] = value
    return out


def _hf_trainer_and_accelerate(rank: int, root: str) -> None:
    """The stock Trainer and accelerate on 2 processes, with nothing but the int8 model."""
    from accelerate import Accelerator
    from transformers import Trainer, TrainingArguments
    from transformers.utils import logging

    from _accelerate_cpu import accelerate_session, fsdp2_accelerator
    from fsdp_int8.integrations.hf_quantizer import attach_hf_quantizer

    logging.set_verbosity_error()

    def int8_llama() -> nn.Module:
        return attach_hf_quantizer(fsdp_int8.quantize_(tiny_llama()))

    with case("HF Trainer, DDP (accelerate's choice on CPU): checkpoints, save_model, resume"), accelerate_session():
        args = TrainingArguments(
            output_dir=f"{root}/trainer", use_cpu=True, max_steps=4, save_steps=2, per_device_train_batch_size=4,
            learning_rate=1e-2, logging_steps=1, report_to=[], disable_tqdm=True,
        )
        trainer = Trainer(model=int8_llama(), args=args, train_dataset=_Patterns())
        trainer.train()
        trainer.save_model(f"{root}/trainer/final")
        dist.barrier()
        assert _same(_saved_int8(f"{root}/trainer/final"), _int8_bytes(trainer.model))
        resumed = Trainer(model=int8_llama(), args=args, train_dataset=_Patterns())
        loaded = {}
        load = resumed._load_from_checkpoint
        resumed._load_from_checkpoint = lambda *a, **k: (load(*a, **k), loaded.update(_int8_bytes(resumed.model)))
        resumed.train(resume_from_checkpoint=f"{root}/trainer/checkpoint-2")
        assert _same(loaded, _saved_int8(f"{root}/trainer/checkpoint-2"))  # on every rank
        assert len(int8_params(resumed.model)) == 14

    with case("accelerate, DDP: save_pretrained of get_state_dict, save_state / load_state"), accelerate_session():
        accelerator = Accelerator(cpu=True)
        model = int8_llama()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        model, optimizer = accelerator.prepare(model, optimizer)
        tokens = fibonacci_mod_task(4, 16, vocab=VOCAB, seed=rank)
        accelerator.backward(hf_loss(model, tokens))
        optimizer.step()
        unwrapped = accelerator.unwrap_model(model)  # DDP's names start with "module."
        saved = _int8_bytes(unwrapped)
        unwrapped.save_pretrained(f"{root}/ddp", state_dict=accelerator.get_state_dict(model),
                                  is_main_process=accelerator.is_main_process)
        accelerator.save_state(f"{root}/ddp_state", safe_serialization=False)
        accelerator.wait_for_everyone()
        assert _same(_saved_int8(f"{root}/ddp"), saved)
        accelerator.backward(hf_loss(model, tokens))
        optimizer.step()
        assert not _same(_int8_bytes(unwrapped), saved)
        accelerator.load_state(f"{root}/ddp_state")
        assert _same(_int8_bytes(unwrapped), saved)

    with case("accelerate, FSDP2: save_pretrained of the gathered state dict"), accelerate_session():
        from accelerate.utils import FullyShardedDataParallelPlugin

        accelerator = fsdp2_accelerator(FullyShardedDataParallelPlugin(
            fsdp_version=2, auto_wrap_policy="transformer_based_wrap",
            transformer_cls_names_to_wrap=["LlamaDecoderLayer"],
        ))
        model = int8_llama()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        model, optimizer = accelerator.prepare(model, optimizer)
        accelerator.backward(hf_loss(model, fibonacci_mod_task(4, 16, vocab=VOCAB, seed=rank)))
        optimizer.step()
        unwrapped = accelerator.unwrap_model(model)
        try:  # without the gathered state dict a rank holds shards only: refused on every rank
            unwrapped.save_pretrained(f"{root}/refused", is_main_process=accelerator.is_main_process)
            raise AssertionError("save_pretrained wrote sharded int8 weights")
        except RuntimeError as error:
            assert "accelerator.get_state_dict(model)" in str(error), error
        full = accelerator.get_state_dict(model)  # on rank 0; {} elsewhere
        unwrapped.save_pretrained(f"{root}/fsdp", state_dict=full, is_main_process=accelerator.is_main_process)
        accelerator.wait_for_everyone()
        if rank == 0:
            expected = {}
            for key, value in full.items():
                if isinstance(value, Int8Weight):
                    expected[key + ".int_data"], expected[key + ".scale"] = value.int_data, value.scale
            assert len(expected) == 28 and _same(_saved_int8(f"{root}/fsdp"), expected)


def _torchtitan_meta_init_and_checkpoint(rank: int, root: str) -> dict[str, torch.Tensor]:
    with case("torchtitan Llama: meta device, shard_model, to_empty, torchtitan's init"):
        model = titan_model(meta=True)
        fsdp_int8.shard_model(model)  # finds the blocks in the layers ModuleDict
        model.to_empty(device="cpu")
        torch.manual_seed(0)
        titan_init(model)  # trunc_normal_ on DTensor(Int8Weight) shards, fused QKV views
        assert len(int8_params(model)) == 2 * 5
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        losses = train_steps(model, titan_loss, opt, fibonacci_mod_task(8, 16, vocab=VOCAB, seed=rank), 4)
        assert losses[-1] < losses[0], losses
    with case("torchtitan's state-dict hooks through dcp: int8 bytes round-trip exactly"):
        state = model.state_dict()  # wqkv split into wq / wk / wv by torchtitan's hook
        assert isinstance(local_of(state["layers.1.attention.qkv_linear.wv.weight"]), Int8Weight)
        dcp.save(state, checkpoint_id=root)
        fresh = titan_model(meta=True)
        fsdp_int8.shard_model(fresh)
        fresh.to_empty(device="cpu")
        titan_init(fresh)
        loaded = fresh.state_dict()
        dcp.load(loaded, checkpoint_id=root)
        fresh.load_state_dict(loaded)  # torchtitan's hook cats wq / wk / wv back into wqkv
        mine, theirs = _bytes_of(model), _bytes_of(fresh)
        for key, value in mine.items():
            assert torch.equal(theirs[key], value), key
    return mine


def _gpt2_sharded(rank: int, world: int, root: str) -> None:
    from test_gpt2 import _sharded

    with case("GPT-2 Conv1D: shard_model, training, export, sharded loads, checkpoints"):
        _sharded(rank, world, root)


def _frameworks(rank: int, world: int, root: str) -> dict:
    _gpt2_sharded(rank, world, f"{root}/gpt2")
    return {
        "ddp": _ddp_replicas(rank),
        "llama": _tied_llama_under_fsdp(rank, f"{root}/llama"),
        "tied_int8": _int8_embeddings_tied_gathered_save(rank, f"{root}/tied_int8"),
        "hf": _hf_trainer_and_accelerate(rank, f"{root}/hf"),
        "titan": _torchtitan_meta_init_and_checkpoint(rank, f"{root}/titan"),
    }


# A fresh process with fsdp_int8 imported loads the folder: its int8 rows and scales, and the tie.
_FRESH_LOAD = (
    "import sys, torch, fsdp_int8; from transformers import AutoModelForCausalLM; "
    "model = AutoModelForCausalLM.from_pretrained(sys.argv[1]); "
    "assert model.lm_head.weight is model.model.embed_tokens.weight; "
    "torch.save({n: (p.int_data, p.scale) for n, p in model.named_parameters() "
    "if type(p).__name__ == 'Int8Weight'}, sys.argv[2])"
)


def test_frameworks_on_two_ranks():
    with tempfile.TemporaryDirectory() as root:
        zero, one = run_distributed(_frameworks, 2, root)
        loaded = subprocess.run(
            [sys.executable, "-c", _FRESH_LOAD, f"{root}/tied_int8", f"{root}/loaded.pt"],
            capture_output=True, text=True, timeout=300,
        )
        assert loaded.returncode == 0, loaded.stderr[-3000:]
        rows = torch.load(f"{root}/loaded.pt", weights_only=True)
    trained = zero["tied_int8"]  # every int8 byte and scale as trained on 2 ranks
    assert rows.keys() == trained.keys() and "model.embed_tokens.weight" in rows
    for name, (data, scale) in trained.items():
        assert torch.equal(rows[name][0], data) and torch.equal(rows[name][1], scale), name
    for name, replica in zero["ddp"].items():  # DDP replicas: bit-identical, every byte
        differing = [k for k, v in replica.items() if not torch.equal(v, one["ddp"][name][k])]
        assert not differing, f"DDP ({name}): replicas drifted apart in {differing}"
    assert zero["llama"]["loss"] > 0 and zero["titan"].keys() == one["titan"].keys()
