"""examples/hf_trainer.py and examples/accelerate_fsdp2.py, run by their ``main`` on 2 gloo
ranks in one spawn: each trains a tiny Llama with FSDP2 through accelerate, keeps its
linear weights int8, and saves and reloads them through the framework's own API."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

from fsdp_int8.testing import run_distributed

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
INT8_WEIGHTS = 14  # 2 layers x (q, k, v, o, gate, up, down); lm_head stays full precision


def _run_examples(rank: int, world: int) -> dict:
    sys.path.insert(0, str(EXAMPLES))
    accelerate_example = importlib.import_module("accelerate_fsdp2")
    trainer_example = importlib.import_module("hf_trainer")
    return {
        "accelerate sharded": accelerate_example.main(["--steps", "5"]),
        "accelerate full": accelerate_example.main(["--steps", "3", "--state-dict-type", "FULL_STATE_DICT"]),
        "trainer": trainer_example.main(["--steps", "6"]),
    }


def test_hf_examples_on_two_ranks():
    results = run_distributed(_run_examples, 2, timeout=240)
    for rank, by_example in enumerate(results):
        for name in ("accelerate sharded", "accelerate full"):
            out = by_example[name]
            assert out["losses"][-1] < out["losses"][0], (rank, name, out["losses"])
            assert out["int8_weights"] == INT8_WEIGHTS, (rank, name, out)
            # cpu_ram_efficient_loading: every rank holds rank 0's int8 rows, bit for bit
            assert out["loaded_from_rank0_exact"], (rank, name)
            assert out["reload_exact"], (rank, name)  # save_state / load_state
        trainer = by_example["trainer"]
        assert trainer["losses"][-1] < trainer["losses"][0], (rank, trainer["losses"])
        assert trainer["int8_weights"] == trainer["int8_weights_resumed"] == INT8_WEIGHTS, (rank, trainer)
        assert "model.safetensors" in trainer["saved_files"], trainer["saved_files"]
        assert trainer["resume_matches"], (rank, trainer)  # resumed steps repeat the losses exactly
    assert results[0]["trainer"]["reload_exact"] is True  # checked where the full weights are
