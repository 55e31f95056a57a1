"""examples/torchtitan_debug.py on 2 gloo ranks, in one spawn (~30 s, most of it importing
torchtitan): torchtitan's debug model converted by ``enable_int8_training``, sharded by
torchtitan's ``parallelize_llama``, trained, saved by the checkpoint manager and reloaded."""

from __future__ import annotations

import sys
from pathlib import Path

from fsdp_int8.testing import run_distributed

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def _example(rank: int, world: int) -> dict:
    sys.path.insert(0, str(EXAMPLES))
    import torchtitan_debug

    return torchtitan_debug.main(["--steps", "6"])


def test_torchtitan_debug_example_trains_int8_and_reloads_through_checkpoint_manager():
    zero, one = run_distributed(_example, 2)
    for summary in (zero, one):
        losses = summary["losses"]
        assert len(losses) == 6
        # from ln(2048) ~ 7.6 at init towards the 64 tokens the task uses (ln 64 ~ 4.2)
        assert max(losses[-2:]) < losses[0] - 2, losses
        # 6 blocks x (wqkv, wo, w1, w2, w3); the output head stays in full precision
        assert summary["int8_weights"] == 30
        assert summary["int8_weights_after_load"] == 30
        assert summary["checkpoint_loaded"] and summary["step_after_load"] == 6
        # the reload is checked against a model that started out different
        assert summary["differed_before_load"] and summary["reload_exact"]
        # torchtitan's FSDP gathers int8 rows + fp32 scales for the 5.1M int8 parameters,
        # fp32 for the embedding, norms and head: to the byte (0.38 of fp32 gathers)
        gathered = summary["all_gather_bytes_per_forward"]
        assert gathered == summary["int8_all_gather_bytes_expected"]
        assert gathered < 0.4 * summary["fp32_param_bytes"]
