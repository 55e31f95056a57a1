"""examples/lightning_model_parallel.py and examples/fsdp2.py on 2 gloo ranks, in one spawn.

Each example's ``main`` runs inside the process group that ``run_distributed`` created
(Lightning is told not to start processes of its own), so the spawn's cost (importing
torch and Lightning) is paid once. Each must train with its loss falling, keep int8
weights through everything the framework does to the model, and restore every int8
byte and optimizer state through the framework's own checkpoint API.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path
from types import ModuleType

from fsdp_int8.testing import run_distributed

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
STEPS = 6
# Both examples' TinyLM: 2 blocks x 2 nn.Linear; the head is skipped by name.
INT8_WEIGHTS = 4


def _example(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"example_{name}", EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def _run_examples(rank: int, world_size: int) -> dict:
    lightning, fsdp2 = _example("lightning_model_parallel"), _example("fsdp2")
    environ = dict(os.environ)  # after importing Lightning, which sets some variables
    results = {
        "lightning": lightning.main(["--steps", str(STEPS)]),
        "lightning_single_file_bf16": lightning.main(
            ["--steps", str(STEPS), "--single-file", "--precision", "bf16-mixed"]
        ),
        # the caller's environment and process group survive Lightning: run the next example in them
        "environ_restored": dict(os.environ) == environ,
    }
    results["fsdp2"] = fsdp2.main(["--steps", str(STEPS)])
    return results


def _assert_trained(losses: list[float], steps: int, what: str) -> None:
    assert len(losses) == steps, (what, losses)
    # From about ln(64) = 4.2 (random init); a few AdamW steps learn the permutation.
    assert losses[-1] < 0.5 * losses[0], (what, losses)


def test_lightning_and_fsdp2_examples():
    runs = run_distributed(_run_examples, 2)
    for rank, run in enumerate(runs):
        assert run["environ_restored"], rank
        for name in ("lightning", "lightning_single_file_bf16"):
            result = run[name]
            what = f"{name} on rank {rank}"
            assert result["rank"] == rank, what
            _assert_trained(result["losses"], STEPS, what)
            assert result["int8_weights"] == INT8_WEIGHTS, (what, result)
            assert result["resumed_int8_weights"] == INT8_WEIGHTS, (what, result)
            # fit(ckpt_path=...) continued at the saved step, from the trained weights
            # (a model trained from scratch would start again near 4.2).
            assert result["resumed_from_step"] == STEPS, (what, result)
            assert len(result["resumed_losses"]) == STEPS, (what, result)
            assert max(result["resumed_losses"]) < 0.5 * result["losses"][0], (what, result)
            assert result["restored_exactly"], what
        sharded = run["lightning"]["checkpoint"]
        assert {".metadata", "meta.pt", "__0_0.distcp", "__1_0.distcp"} <= set(sharded), sharded
        assert run["lightning_single_file_bf16"]["checkpoint"] == "file"

        plain = run["fsdp2"]
        what = f"fsdp2 on rank {rank}"
        _assert_trained(plain["losses"], STEPS, what)
        assert plain["int8_weights"] == INT8_WEIGHTS, (what, plain)
        assert plain["resumed_step"] == STEPS, (what, plain)
        assert plain["restored_exactly"], what
    # The exported float state dict in the unquantized model computes what the sharded
    # int8 model computes: the same fp32 weight values (int8 * scale), only the order of
    # fp32 sums may differ (a few ulps of the largest logit); a wrong row or scale would
    # move logits by about 1e-2 of their size.
    assert runs[0]["fsdp2"]["export_max_diff"] <= 1e-5, runs[0]["fsdp2"]
    assert runs[1]["fsdp2"]["export_max_diff"] is None
