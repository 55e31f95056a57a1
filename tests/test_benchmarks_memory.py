"""``python -m benchmarks.memory`` at its tiny shape: torch's FSDPMemTracker measures each
row in real 2-rank processes, and the figures keep their meaning (docs/memory.md); then
``python -m benchmarks.what_fits`` scales them to Llama 3 shapes."""

from __future__ import annotations

import json

import pytest
import torch

from benchmarks import memory, what_fits


def test_tracker_measures_bf16_fsdp2_and_the_lean_recipe_and_what_fits_scales_them(capsys, tmp_path):
    figures = tmp_path / "memory.json"
    results = memory.main(["--rows", "bf16", "lean", "--checkpointing", "on", "--shape", "tiny",
                           "--json", str(figures), "--where", "2", "--loss", "chunked"])
    bf16, lean = results[("bf16", True)], results[("lean", True)]
    # Between steps bf16 FSDP2 keeps fp32 parameters (4 bytes) and AdamW's two fp32
    # moments (8), nothing else: 12 bytes per parameter up to buffers and the tracker's
    # rounding of sizes to whole blocks.
    assert 12.0 <= bf16["after"] < 12.5, bf16
    # every weight int8 (~1 byte + a 4-byte scale per row of 64) and 8-bit moments (2 bytes
    # + a scale per block of 32): about 3.3 bytes, under a third of bf16's
    assert lean["after"] < 0.33 * bf16["after"], (lean, bf16)
    # at this shape activations and their gradients make most of the peak (~23 of 37
    # bytes/param for both rows); what is left is smaller with int8
    assert lean["peak"] < bf16["peak"], (lean, bf16)
    shown = capsys.readouterr().out
    assert "lean" in shown and "chunked loss" in shown
    # where the bytes are: module boundaries inside the step, none above the step's peak;
    # with the update inside backward, the lean peak is in a backward
    for row in (bf16, lean):
        assert len(row["where"]) == 2 and all(p["figures"]["Total"] <= row["peak"] + 1e-9 for p in row["where"])
    assert "Backward" in lean["where"][0]["phase"], lean["where"]

    table = what_fits.main([str(figures)])
    assert set(table) == {(gb, n) for gb in what_fits.GPU_SIZES_GB for n in what_fits.GPU_COUNTS}
    order = ["none", *(shape.name for shape in what_fits.LLAMA3)]

    def rank(entry: str) -> int:
        return order.index(entry.split(" (")[0])

    for (gb, gpus), fits in table.items():
        # the lean recipe's smaller state never fits a smaller model than bf16's
        assert rank(fits["lean"]) >= rank(fits["bf16"]), (gb, gpus, fits)
    # more GPUs or more memory never fit less
    for row in ("bf16", "lean"):
        assert rank(table[80, 64][row]) >= rank(table[80, 8][row]) >= rank(table[80, 1][row])
        assert rank(table[80, 8][row]) >= rank(table[40, 8][row]) >= rank(table[24, 8][row])
    # CPU offload moves the sharded state to the host: never a smaller model on the GPU,
    # and the host holds what the GPU held per parameter
    costs = what_fits.coefficients(json.loads(figures.read_text()))
    for row in ("bf16", "lean"):
        offloaded = row + what_fits.OFFLOAD
        assert costs[row].offloaded().host == costs[row].sharded > 0
        for fits in table.values():
            assert rank(fits[offloaded]) >= rank(fits[row]), fits
            assert fits[offloaded] == "none" or "; host " in fits[offloaded], fits
    shown = capsys.readouterr().out
    assert "| 80 GB | 64 |" in shown and "activations measured" in shown
    assert "lean + offload: device 0.00 B/param, host" in shown


@pytest.mark.exhaustive  # a variant: the rows measured above, on a mixture-of-experts shape
def test_a_mixture_of_experts_shape_is_measured_and_what_fits_scales_it_to_moe_models(capsys, tmp_path):
    figures = tmp_path / "memory-moe.json"
    results = memory.main(["--rows", "bf16", "lean", "--checkpointing", "on", "--shape", "tiny-moe",
                           "--json", str(figures)])
    bf16, lean = results[("bf16", True)], results[("lean", True)]
    assert 12.0 <= bf16["after"] < 12.5, bf16  # fp32 parameters and AdamW's two fp32 moments
    # experts and linears int8 (1 byte + a 4-byte scale per row of 64, or 32 for the
    # experts' down projection: at most 1.125), 8-bit moments in blocks of 32 (2 + 0.25),
    # routers and norms (0.4% of the parameters) with fp32 moments: under 4 bytes
    assert lean["after"] < 4.0, lean
    table = what_fits.main([str(figures)])
    shown = capsys.readouterr().out
    assert "Largest mixture-of-experts model per GPU" in shown
    order = ["none", *(shape.name for shape in what_fits.MOE)]

    def rank(entry: str) -> int:
        return order.index(entry.split(" (")[0])

    for fits in table.values():
        assert rank(fits["lean"]) >= rank(fits["bf16"]), fits
    assert rank(table[80, 64]["lean"]) >= rank(table[80, 8]["lean"]) >= rank(table[80, 1]["lean"])


def _lean_peaks(rank: int, world: int) -> dict[str, dict[str, int]]:
    """The tracked peak of a steady-state step of the launcher's tiny Transformer, built by
    the library's lean call and by the launcher's ``--lean``, by category (bytes)."""
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker

    import fsdp_int8
    from launch import precisions, train
    from launch.build import build_model
    from launch.model import Transformer, next_token_loss

    args = train.parse_args(["--lean", "--precision", "int8", "--compute-dtype", "bf16", "--preset", "tiny"])
    recipe = precisions.Recipe.of(args.precision, args.compute_dtype)

    def the_lean_call():
        with torch.device("meta"):
            model = Transformer(args.model)
        model.checkpoint_blocks = True  # activation checkpointing, the launcher model's own switch
        fsdp_int8.shard_model(model, config=fsdp_int8.Int8TrainingConfig.lean())
        model.to_empty(device="cpu")
        model.init_weights(0)
        return model, fsdp_int8.Int8AdamW.lean(model.parameters(), lr=args.lr, weight_decay=args.weight_decay)

    def the_launcher():
        model = build_model(recipe, args.model, "cpu", seed=args.seed, lean=args.lean,
                            quantize_embeddings=args.quantize_embeddings,
                            activation_checkpointing=args.activation_checkpointing,
                            int8_gathered_weights=args.int8_gathered_weights)
        return model, train.make_optimizer(args, model)

    def build_model_lean_alone():  # lean=True without the flags the launcher adds (benchmarks.gpu's row)
        model = build_model(recipe, args.model, "cpu", seed=args.seed, lean=True, activation_checkpointing=True)
        return model, fsdp_int8.Int8AdamW.lean(model.parameters(), lr=args.lr, weight_decay=args.weight_decay)

    peaks = {}
    for name, build in (("lean call", the_lean_call), ("launcher --lean", the_launcher),
                        ("build_model(lean=True)", build_model_lean_alone)):
        model, optimizer = build()
        data = torch.Generator().manual_seed(rank)

        def step() -> None:
            tokens = torch.randint(0, args.model.vocab_size, (2, 33), generator=data)
            next_token_loss(model, tokens[:, :-1], tokens[:, 1:]).backward()
            optimizer.step()
            optimizer.zero_grad()

        step()  # states exist from here on
        tracker = FSDPMemTracker(model, optimizer)
        with tracker:
            step()
        snapshot = next(iter(tracker.get_tracker_snapshot("peak").values()))
        peaks[name] = {str(getattr(k, "value", k)): v for k, v in snapshot.items()}
        del model, optimizer, tracker
    return peaks


def test_the_lean_call_peaks_as_the_launchers_lean():
    from fsdp_int8.testing import run_distributed

    peaks = run_distributed(_lean_peaks, 2)[0]
    # one recipe built two ways: the same storages by category, to the byte
    assert peaks["lean call"] == peaks["launcher --lean"] == peaks["build_model(lean=True)"], peaks
    assert peaks["lean call"]["Total"] > 0


# benchmarks.memory --shape qwen3-moe-scaled's figures (2026-11-29, logged in
# benchmarks/results/memory.md), the parts what_fits reads
_MOE_MEASURED = dict(
    machine="AMD EPYC, avx2; torch 2.13.0+cpu", world_size=2, tokens_per_rank=256, parameters=119_633_664,
    largest_group=4_898_816,
    shape=dict(model="qwen3_moe", hidden_size=256, num_hidden_layers=24, num_attention_heads=8,
               num_key_value_heads=2, head_dim=32, moe_intermediate_size=96, num_experts=64,
               num_experts_per_tok=8, vocab_size=4000, tie_word_embeddings=False),
    rows={"bf16": dict(parts={"Sharded Param": 4.0, "Sharded Grad": 3.604, "OptState": 8.0, "Temp": 0.528,
                              "Unsharded Param": 0.068, "All Gather": 0.164, "Reduce Scatter": 0.328}),
          "lean-4bit": dict(parts={"Sharded Param": 1.06, "OptState": 1.063, "Temp": 0.381,
                                   "Unsharded Param": 0.12, "All Gather": 0.084, "Activation": 0.053})},
)


def test_what_fits_with_expert_parallelism(tmp_path, capsys):
    figures = tmp_path / "moe.json"
    figures.write_text(json.dumps(_MOE_MEASURED))
    table = what_fits.main([str(figures), "--expert-parallel"])
    order = ["none", *(shape.name for shape in what_fits.MOE)]

    def rank(entry: str) -> int:
        return order.index(entry.split(" (")[0])

    for fits in table.values():
        for row in ("bf16", "lean-4bit"):
            assert rank(fits[row + what_fits.EP]) >= rank(fits[row]), fits  # splitting experts never fits less
    # FSDP alone gathers all 256 of DeepSeek-V3's experts per block (11 billion elements):
    # no GPU here holds that; split 64 ways, 4-bit states fit it on 64 GPUs of 80 GB
    assert all(not fits[row].startswith("DeepSeek") for fits in table.values() for row in ("bf16", "lean-4bit"))
    assert table[80, 64]["lean-4bit" + what_fits.EP].startswith("DeepSeek-V3-671B"), table[80, 64]
    # the estimate's terms, by hand, for DeepSeek-V3 on 64 GPUs: 4 local experts per block
    deepseek = what_fits.MOE[-1]
    costs = what_fits.coefficients(_MOE_MEASURED)["lean-4bit"].with_expert_parallel()
    local_block = deepseek.attention + 3 * 7168 * (4 * 2048 + 2048) + 7168 * 256
    group = max(local_block, deepseek.vocab * 7168)
    activations = 4096 * (7168 * (2 * 61 + 34 + 4 * 8) + 12 * deepseek.vocab + 6 * (8 * 2048 + 2048))
    expected = costs.sharded * deepseek.parameters / 64 + costs.group * group + activations
    assert what_fits.peak_bytes(deepseek, 64, costs, 4096) == pytest.approx(expected, rel=1e-12)
    assert "+ EP" in capsys.readouterr().out


def test_what_fits_refuses_expert_parallelism_for_a_dense_measurement(tmp_path, capsys):
    figures = tmp_path / "dense.json"
    figures.write_text(json.dumps({**_MOE_MEASURED, "shape": {**_MOE_MEASURED["shape"], "model": "llama"}}))
    with pytest.raises(SystemExit):
        what_fits.main([str(figures), "--expert-parallel"])
    assert "--expert-parallel needs a measurement of a MoE shape" in capsys.readouterr().err
