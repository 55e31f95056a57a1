"""Every script in examples/ run by its ``main`` on 2 gloo ranks, all in one spawn (each
spawned process pays seconds to import torch, transformers, Lightning and torchtitan
once): each trains a few steps with loss falling, keeps its int8 weights after the
framework touched the model, and saves and reloads through the framework's own
checkpoint API. The examples run in an order that also checks they leave the caller's
process group and environment as they found them.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from fsdp_int8.testing import run_distributed

from _cases import FULL_MATRIX

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
STEPS = 6
TINY_LM_INT8_WEIGHTS = 4  # examples/_common.TinyLM: 2 blocks x 2 nn.Linear; the head is skipped by name
LLAMA_INT8_WEIGHTS = 14  # 2 layers x (q, k, v, o, gate, up, down); lm_head stays full precision


def _run_examples(rank: int, world_size: int) -> dict:
    sys.path.insert(0, str(EXAMPLES))
    import accelerate_fsdp2
    import fsdp2
    import hf_trainer
    import lightning_model_parallel
    import torchtitan_debug

    environ = dict(os.environ)  # after importing Lightning, which sets some variables
    results = {"lightning": lightning_model_parallel.main(["--steps", str(STEPS)])}
    if FULL_MATRIX:  # the variants of a script: the exhaustive run (README, "Tests")
        results["lightning lean"] = lightning_model_parallel.main(["--steps", str(STEPS), "--lean"])
        results["lightning_single_file_bf16"] = lightning_model_parallel.main(
            ["--steps", str(STEPS), "--single-file", "--precision", "bf16-mixed"]
        )
    # the caller's environment and process group survive Lightning: run the others in them
    results["environ_restored"] = dict(os.environ) == environ
    results["fsdp2"] = fsdp2.main(["--steps", str(STEPS)])
    results["accelerate sharded"] = accelerate_fsdp2.main(["--steps", "5"])
    if FULL_MATRIX:
        results["accelerate full"] = accelerate_fsdp2.main(["--steps", "3", "--state-dict-type", "FULL_STATE_DICT"])
    results["trainer"] = hf_trainer.main(["--steps", str(STEPS)])
    results["torchtitan"] = torchtitan_debug.main(["--steps", str(STEPS)])
    if FULL_MATRIX:
        results["torchtitan lean"] = torchtitan_debug.main(["--steps", str(STEPS), "--lean"])
    # torchtitan's own per-block compile (compile.enable) over the int8 converter; aot_eager
    # runs eager's kernels through AOTAutograd (inductor: examples/README.md)
    if FULL_MATRIX:
        results["torchtitan compiled"] = torchtitan_debug.main(["--steps", str(STEPS), "--compile", "aot_eager"])
    results["lightning default strategy"] = _lightning_default_strategy(lightning_model_parallel)  # last: a failed fit
    return results


def _lightning_default_strategy(example) -> str:
    """``fit`` of the Lightning example's module under ``ModelParallelStrategy()`` (every
    rank on ``tensor_parallel``, a data-parallel mesh of 1 rank): the error ``shard_model``
    raises, or ``""`` if the run trained unsynchronised copies instead."""
    import lightning.pytorch as L
    from lightning.pytorch.strategies import ModelParallelStrategy
    from torch.utils.data import DataLoader

    os.environ.setdefault("LOCAL_RANK", os.environ.get("RANK", "0"))  # the caller's process group
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=ModelParallelStrategy(), max_steps=1,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False)
    try:
        trainer.fit(example.TinyLM(), DataLoader(example.dataset(16), batch_size=8))
    except ValueError as error:
        return str(error)
    return ""


def _assert_trained(losses: list[float], steps: int, what: str) -> None:
    assert len(losses) == steps, (what, losses)
    # From about ln(64) = 4.2 (random init); a few AdamW steps learn the permutation.
    assert losses[-1] < 0.5 * losses[0], (what, losses)


def _check_plain_and_lightning(runs: list[dict]) -> None:
    for rank, run in enumerate(runs):
        assert run["environ_restored"], rank
        for name in ("lightning", "lightning_single_file_bf16"):
            if name not in run:
                continue
            result = run[name]
            what = f"{name} on rank {rank}"
            assert result["rank"] == rank, what
            _assert_trained(result["losses"], STEPS, what)
            assert result["int8_weights"] == TINY_LM_INT8_WEIGHTS, (what, result)
            assert result["resumed_int8_weights"] == TINY_LM_INT8_WEIGHTS, (what, result)
            # fit(ckpt_path=...) continued at the saved step, from the trained weights
            # (a model trained from scratch would start again near 4.2).
            assert result["resumed_from_step"] == STEPS, (what, result)
            assert len(result["resumed_losses"]) == STEPS, (what, result)
            assert max(result["resumed_losses"]) < 0.5 * result["losses"][0], (what, result)
            assert result["restored_exactly"], what
            # Int8RoundingCheckpoint: every rank's rounding generators came back with it
            assert result["rounding_restored"], what
        sharded = run["lightning"]["checkpoint"]
        assert {".metadata", "meta.pt", "__0_0.distcp", "__1_0.distcp"} <= set(sharded), sharded
        if "lightning_single_file_bf16" in run:
            assert run["lightning_single_file_bf16"]["checkpoint"] == "file"

        plain = run["fsdp2"]
        what = f"fsdp2 on rank {rank}"
        _assert_trained(plain["losses"], STEPS, what)
        assert plain["int8_weights"] == TINY_LM_INT8_WEIGHTS, (what, plain)
        assert plain["resumed_step"] == STEPS, (what, plain)
        assert plain["restored_exactly"], what
    # The exported float state dict in the unquantized model computes what the sharded
    # int8 model computes: the same fp32 weight values (int8 * scale), only the order of
    # fp32 sums may differ (a few ulps of the largest logit); a wrong row or scale would
    # move logits by about 1e-2 of their size.
    assert runs[0]["fsdp2"]["export_max_diff"] <= 1e-5, runs[0]["fsdp2"]
    assert runs[1]["fsdp2"]["export_max_diff"] is None


def _check_lean(result: dict, what: str, int8_weights: int) -> None:
    """The lean recipe in effect: int8 embedding and gathered weights (the int8 weight count
    includes the embedding), bf16 compute, 8-bit moments, the step inside backward, and a
    falling loss."""
    assert result["int8_embedding"] and result["int8_weights"] == int8_weights, (what, result)
    assert result["compute_dtypes"] == ["torch.bfloat16"], (what, result)
    assert result["optimizer"] == "Int8AdamW(step_in_backward=True, max_grad_norm=1.0)", (what, result)
    assert {"torch.int8", "torch.uint8"} <= set(result["state_dtypes"]), (what, result)
    assert len(result["losses"]) == STEPS and result["losses"][-1] < result["losses"][0], (what, result)


def _check_lightning_lean(runs: list[dict]) -> None:
    for rank, run in enumerate(runs):
        if "lightning lean" not in run:  # the exhaustive matrix's variant
            continue
        result, what = run["lightning lean"], f"lightning lean on rank {rank}"
        _check_lean(result, what, TINY_LM_INT8_WEIGHTS + 1)
        # every step had changed the weights before Lightning's optimizer.step(closure) returned
        assert result["updated_in_backward"] == [True] * STEPS, (what, result)
        _assert_trained(result["losses"], STEPS, what)
        assert result["resumed_from_step"] == STEPS and result["restored_exactly"], (what, result)
        assert result["rounding_restored"], what


def _check_hf(results: list[dict]) -> None:
    for rank, by_example in enumerate(results):
        for name in ("accelerate sharded", "accelerate full"):
            if name not in by_example:
                continue
            out = by_example[name]
            assert out["losses"][-1] < out["losses"][0], (rank, name, out["losses"])
            assert out["int8_weights"] == LLAMA_INT8_WEIGHTS, (rank, name, out)
            # cpu_ram_efficient_loading: every rank holds rank 0's int8 rows, bit for bit
            assert out["loaded_from_rank0_exact"], (rank, name)
            assert out["reload_exact"], (rank, name)  # save_state / load_state
        trainer = by_example["trainer"]
        assert trainer["losses"][-1] < trainer["losses"][0], (rank, trainer["losses"])
        assert trainer["int8_weights"] == trainer["int8_weights_resumed"] == LLAMA_INT8_WEIGHTS, (rank, trainer)
        assert "model.safetensors" in trainer["saved_files"], trainer["saved_files"]
        assert trainer["resume_matches"], (rank, trainer)  # resumed steps repeat the losses exactly
        # Int8Trainer with the lean recipe under FSDP2: the logged gradient norm is the
        # optimizer's, measured inside backward over both ranks' shards (the same on each)
        lean = trainer["lean"]
        _check_lean(lean, f"Int8Trainer lean on rank {rank}", LLAMA_INT8_WEIGHTS + 1)
        assert len(lean["grad_norms"]) == STEPS and all(0 < g < float("inf") for g in lean["grad_norms"]), lean
        assert lean["grad_norms"] == results[0]["trainer"]["lean"]["grad_norms"], (rank, lean)
    assert results[0]["trainer"]["reload_exact"] is True  # checked where the full weights are


def _check_torchtitan(results: list[dict]) -> None:
    for run in results:  # compiled blocks train exactly as eager ones
        if "torchtitan compiled" in run:
            assert run["torchtitan compiled"]["losses"] == run["torchtitan"]["losses"]
    names = ("torchtitan", "torchtitan compiled", "torchtitan lean")
    for name, summary in ((name, run[name]) for run in results for name in names if name in run):
        losses = summary["losses"]
        assert len(losses) == STEPS
        # from ln(2048) ~ 7.6 at init towards the 64 tokens the task uses (ln 64 ~ 4.2)
        assert max(losses[-2:]) < losses[0] - 2, losses
        # 6 blocks x (wqkv, wo, w1, w2, w3); the output head stays in full precision; the
        # lean recipe's embedding is int8 too
        int8_weights = 31 if name == "torchtitan lean" else 30
        assert summary["int8_weights"] == summary["int8_weights_after_load"] == int8_weights, (name, summary)
        assert summary["checkpoint_loaded"] and summary["step_after_load"] == STEPS
        # the reload is checked against a model that started out different
        assert summary["differed_before_load"] and summary["reload_exact"]
        # two more steps after the load repeat the uninterrupted run's bytes: the checkpoint
        # holds each rank's stochastic-rounding generators (Int8CheckpointManager)
        assert summary["resume_exact"]
        # torchtitan's FSDP gathers int8 rows + fp32 scales for the 5.1M int8 parameters,
        # fp32 for the embedding, norms and head: to the byte (0.38 of fp32 gathers; lean:
        # the embedding int8 too, the rest bf16, 0.27)
        gathered = summary["all_gather_bytes_per_forward"]
        assert gathered == summary["int8_all_gather_bytes_expected"]
        assert gathered < (0.3 if name == "torchtitan lean" else 0.4) * summary["fp32_param_bytes"]
    for rank, run in enumerate(results):  # the lean recipe's parts that torchtitan's Trainer takes
        if "torchtitan lean" not in run:  # the exhaustive matrix's variant
            continue
        lean, what = run["torchtitan lean"], f"torchtitan lean on rank {rank}"
        assert lean["int8_embedding"] and lean["compute_dtypes"] == ["torch.bfloat16"], (what, lean)
        assert lean["optimizer"] == "Int8AdamW" and {"torch.int8", "torch.uint8"} <= set(lean["state_dtypes"]), lean


def _check_lightning_default_refused(runs: list[dict]) -> None:
    for rank, run in enumerate(runs):
        error = run["lightning default strategy"]
        assert "'tensor_parallel' (size 2)" in error and "data_parallel_size=N" in error, (rank, error)


def test_every_example_on_two_ranks():
    runs = run_distributed(_run_examples, 2, timeout=480)
    _check_lightning_default_refused(runs)
    _check_plain_and_lightning(runs)
    _check_lightning_lean(runs)
    _check_hf(runs)
    _check_torchtitan(runs)
