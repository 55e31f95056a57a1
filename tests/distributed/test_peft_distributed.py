"""Issue 26 on 2 gloo ranks, in one spawn: LoRA (PEFT) on a frozen int8 base under
``shard_model`` (examples/peft_lora.py: only LoRA trains, the base's int8 bytes are what
the all-gathers carry, only LoRA gradients are reduce-scattered, the adapter saved from the
sharded model reloads exactly), and torchtitan's Llama, sharded, exported in full precision
by ``fsdp_int8.export_full_state_dict``.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

import fsdp_int8
from fsdp_int8 import Int8Weight
from fsdp_int8.testing import run_distributed

from _cases import case, local_of

TESTS = Path(__file__).resolve().parents[1]
EXAMPLES = TESTS.parent / "examples"
STEPS = 20
BASE_INT8 = 14  # 2 layers x (q, k, v, o, gate, up, down); lm_head stays in full precision
LORA_ELEMENTS = 32768  # rank 16 on those 14 layers: sum of (in + out) x 16


def _titan_export(rank: int) -> dict:
    """A sharded torchtitan model (meta device, shard_model, torchtitan's init): the export
    on rank 0, in torchtitan's keys, loads strictly into a plain model and holds every
    weight's int8 values dequantized, bit for bit."""
    sys.path.insert(0, str(TESTS))
    from _frameworks import titan_init, titan_model

    with case("torchtitan: export_full_state_dict of a sharded model"):
        model = titan_model(meta=True)
        fsdp_int8.shard_model(model)
        model.to_empty(device="cpu")
        torch.manual_seed(0)
        titan_init(model)
        exported = fsdp_int8.export_full_state_dict(model, torch.float32)  # every rank
        expected = {}  # every rank: full_tensor is a collective
        for name, param in model.named_parameters():
            whole = param.full_tensor()
            expected[name] = whole.dequantize(torch.float32) if isinstance(whole, Int8Weight) else whole
        int8 = sum(isinstance(local_of(p), Int8Weight) for p in model.parameters())
        if rank != 0:
            assert exported == {}
            return {"int8_weights": int8}
        plain = titan_model()
        plain.load_state_dict(exported, strict=True)  # wq / wk / wv merged by its hook
        for name, param in plain.named_parameters():
            assert torch.equal(param.detach(), expected[name]), name
        return {"int8_weights": int8, "keys": sorted(exported)}


def _body(rank: int, world: int) -> dict:
    sys.path.insert(0, str(EXAMPLES))
    import peft_lora

    with case("examples/peft_lora.py on 2 ranks"):
        lora = peft_lora.main(["--steps", str(STEPS)])
    return {"lora": lora, "titan": _titan_export(rank)}


def test_lora_on_an_int8_base_and_the_torchtitan_export_on_two_ranks():
    runs = run_distributed(_body, 2, timeout=240)
    for rank, run in enumerate(runs):
        out = run["lora"]
        what = f"rank {rank}: {out}"
        assert out["losses"][-1] < out["losses"][0] - 0.4, what  # measured 4.88 -> 4.2
        assert out["int8_weights"] == BASE_INT8, what  # rank 16: LoRA's layers stayed fp32
        assert all(".lora_A." in n or ".lora_B." in n for n in out["trainable_names"]), what
        assert out["optimizer_states"] == len(out["trainable_names"]) == 2 * BASE_INT8, what
        assert out["base_unchanged"] and out["states_only_for_trainable"], what
        # the all-gathers of one forward: int8 rows + one fp32 scale per row for the base,
        # fp32 for LoRA, norms, embedding and head, to the byte
        assert out["all_gather_bytes_per_forward"] == out["all_gather_bytes_expected"], what
        # the gradients that cross: LoRA's, in fp32; the frozen base sends none
        assert out["trainable_elements"] == LORA_ELEMENTS
        assert out["reduce_scatter_bytes_per_step"] == 4 * LORA_ELEMENTS, what
        assert run["titan"]["int8_weights"] == 2 * 5
    zero = runs[0]["lora"]
    assert "adapter_model.safetensors" in zero["adapter_files"]
    # the adapter saved from the sharded model, on a fresh int8 base in one process: the
    # sharded model's logits up to the order of fp32 sums
    assert zero["reload_max_diff"] < 1e-5, zero
    assert zero["merge_float_change"] < 1e-5 and 0 < zero["merge_int8_change"] < 0.05 * zero["adapter_effect"], zero
    assert "layers.1.attention.qkv_linear.wk.weight" in runs[0]["titan"]["keys"]
