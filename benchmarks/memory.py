"""Peak memory per parameter, by category, from torch's own tracker: bf16 FSDP2 against int8.

    python -m benchmarks.memory                     # every row, with and without activation checkpointing
    python -m benchmarks.memory --rows bf16 lean --checkpointing on --json memory.json
    python -m benchmarks.memory --rows bf16 lean --checkpointing on --log   # + a dated section in benchmarks/results/memory.md

A Hugging Face Llama with Llama-3.2-1B's proportions scaled down (hidden 512, 12 blocks,
8 query / 2 key-value heads, MLP 2048, vocab 16,000, tied embeddings: ~15% of the
parameters) trains on 2 gloo ranks, batch 1 x 256 per rank; ``--shape qwen3-moe-scaled``
trains a Qwen3-MoE with Qwen3-30B-A3B's proportions scaled down (64 experts, top 8, 24
blocks: the experts hold 94.7% of the parameters) instead. The rows run one after the
other in one pair of processes (each row's model, optimizer and tracker collected before
the next: the figures of a fresh process per row, with one start-up; ``--shape tiny``
takes under a minute); a row's second (steady-state) step runs under
``torch.distributed._tools.fsdp2_mem_tracker.FSDPMemTracker``, which counts every live
storage by category (sharded / unsharded parameters and gradients, activations,
temporaries, optimizer states, all-gather and reduce-scatter buffers) and records the
categories at the moment of the peak. Figures are bytes per parameter per rank: a
category's bytes on rank 0 over rank 0's share of the parameters (all parameters / world
size), so a bf16 FSDP2 + AdamW model's fp32 parameters and states read 4 + 8.

Rows (each a recipe users run):

* ``bf16``: FSDP2 per block + root, fp32 parameters, bf16 compute, fp32 reduction
  (torchtitan's default), ``torch.optim.AdamW``: the baseline;
* ``fp32``: the same without mixed precision;
* ``int8``: ``shard_model`` (int8 linear weights) + ``Int8AdamW``;
* ``int8-8bit``: the same with ``Int8AdamW(state_bits=8)``;
* ``int8-8bit-bf16-grads``: that, with gradients kept in bf16 until the step
  (``Int8AdamW(state_bits=8, grad_dtype=torch.bfloat16)``);
* ``int8-8bit-in-backward``: ``Int8AdamW(state_bits=8, step_in_backward=True)``: each
  parameter is updated as soon as FSDP2 hands it its reduced gradient;
* ``lean``: the library's one lean call, ``Int8TrainingConfig.lean()`` (int8 embeddings,
  the tied head following, and FSDP2's gathered weights kept int8: each matmul
  dequantizes a transient copy, and the in-place gradient reduce-scatter: no copy of
  its input on gloo) with ``Int8AdamW.lean`` (8-bit states, the step inside backward,
  clipping at 1.0, updates of at most 2^18 elements): the launcher's ``--lean``;
* ``lean-4bit``: the lean call with 4-bit Adam states (``Int8AdamW.lean(...,
  state_bits=4)``): the launcher's ``--lean --optimizer int8-adamw-4bit``;
* ``lean-bf16-gathered``: the same with the gathered weights dequantized to bf16 once
  per unshard (weight-only int8's default; the same values).

``--loss transformers`` (the default) leaves each row its own loss: transformers', except
the lean rows, whose config installs
:func:`fsdp_int8.integrations.hf_loss.chunked_causal_lm_loss` (``loss_chunk_tokens``: 64
tokens a chunk). ``--loss chunked`` computes every row's loss with it (no fp32 logits of
the whole batch), ``--loss-chunk-tokens`` tokens at a time (64 by default: a quarter of
the 256 tokens per rank, as its own default of 1024 is of a 4096-token batch).

``--reduce-scatter chunks`` gives every row the library's in-place gradient reduce-scatter
(:class:`fsdp_int8.gradients.InPlaceReduceScatter`, which the lean rows' config installs
anyway): one ``dist.reduce`` per rank's chunk, in place in FSDP2's input, which is then
released; gloo's ``reduce_scatter_tensor`` all-reduces a copy of the whole input, one fp32
copy of the largest group's unsharded gradients that NCCL's reduce-scatter does not make.
``torch`` (the default) keeps each row's own. The same sums, bit for bit on 2 ranks.

``--step-elements N`` bounds each int8 update to N elements (``Int8AdamW(step_elements=N)``).
The default bound is the row's optimizer's own (``Int8AdamW``: 2^20 elements on CPU, ~21
bytes each with 8-bit states; ``Int8AdamW.lean``: 2^18).

``--where N`` also prints, under each row, the N largest snapshots the tracker took at
module boundaries (each FSDP module's peak in forward and backward, before and after its
hooks): where in the step the bytes are.

Columns: ``peak`` (bytes/param at the peak, all categories), ``vs bf16`` (over the bf16
row with the same checkpointing, measured in this run), the largest categories at the
peak, and ``after step`` (bytes/param live after ``zero_grad``: what the model keeps
between steps). On a GPU, ``torch.cuda.max_memory_allocated`` of the same step is
printed beside it.
"""

from __future__ import annotations

import argparse
import functools
import gc
import os

import torch

import fsdp_int8
from fsdp_int8 import Int8AdamW, Int8TrainingConfig
from fsdp_int8.gradients import enable_in_place_reduce_scatter


def _adamw(**options) -> functools.partial:
    return functools.partial(Int8AdamW, **options)


# row -> (its Int8TrainingConfig, what builds its optimizer from (params, lr, **keywords));
# bf16 and fp32 are plain FSDP2. "lean" is the library's one lean call.
INT8_ROWS: dict[str, tuple[Int8TrainingConfig, functools.partial]] = {
    "int8": (Int8TrainingConfig(), _adamw()),
    "int8-8bit": (Int8TrainingConfig(), _adamw(state_bits=8)),
    "int8-8bit-bf16-grads": (Int8TrainingConfig(), _adamw(state_bits=8, grad_dtype=torch.bfloat16)),
    "int8-8bit-in-backward": (Int8TrainingConfig(), _adamw(state_bits=8, step_in_backward=True)),
    "lean": (Int8TrainingConfig.lean(), Int8AdamW.lean),
    "lean-4bit": (Int8TrainingConfig.lean(), functools.partial(Int8AdamW.lean, state_bits=4)),
    "lean-bf16-gathered": (Int8TrainingConfig.lean(int8_matmul=None), Int8AdamW.lean),
    # the lean call with FSDP2's own reduce-scatter: on gloo it all-reduces a copy of its
    # whole input (NCCL makes none), what the bf16 row also pays
    "lean-torch-reduce-scatter": (Int8TrainingConfig.lean(in_place_reduce_scatter=False), Int8AdamW.lean),
}
ROWS = ("bf16", "fp32", *INT8_ROWS)
SHAPES = {
    # Llama-3.2-1B's proportions, scaled down: what the figures in docs/memory.md use
    "llama-1b-scaled": dict(hidden_size=512, num_hidden_layers=12, num_attention_heads=8, num_key_value_heads=2,
                            intermediate_size=2048, vocab_size=16_000, tie_word_embeddings=True),
    # the same proportions at a size the test suite can afford
    "tiny": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 intermediate_size=256, vocab_size=512, tie_word_embeddings=True),
    # a Hugging Face Qwen3-MoE with Qwen3-30B-A3B's proportions scaled down: 64 experts of
    # width 96 at hidden 256 (Qwen3: 128 of 768 at 2048), top 8, 24 blocks (48), vocab 4000;
    # the experts hold 94.7% of the 120M parameters (95.0% in Qwen3-30B-A3B), one block 4%
    # (2%): a block's gathered experts are the step's largest transient, as there
    "qwen3-moe-scaled": dict(model="qwen3_moe", hidden_size=256, num_hidden_layers=24, num_attention_heads=8,
                             num_key_value_heads=2, head_dim=32, intermediate_size=768,
                             moe_intermediate_size=96, num_experts=64, num_experts_per_tok=8,
                             vocab_size=4000, tie_word_embeddings=False),
    "tiny-moe": dict(model="qwen3_moe", hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, head_dim=16, intermediate_size=128, moe_intermediate_size=32,
                     num_experts=8, num_experts_per_tok=2, vocab_size=512, tie_word_embeddings=False),
}
REDUCE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
EIGHT_BIT_BLOCK = 128  # values per scale of 8-bit Adam states (at most half a row)


def hf_model(shape: dict, seed: int = 0) -> torch.nn.Module:
    """A Hugging Face Llama (or, for ``model="qwen3_moe"``, a Qwen3-MoE) of ``shape``,
    initialised from ``seed`` (same on every rank)."""
    import transformers

    fields = dict(shape)
    kind = fields.pop("model", "llama")
    config_class, model_class = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "qwen3_moe": (transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM),
    }[kind]
    torch.manual_seed(seed)
    return model_class(config_class(max_position_embeddings=4096, use_cache=False, **fields))


def build(
    row: str, shape: dict, checkpointing: bool, reduce_dtype: torch.dtype = torch.float32,
    step_elements: int | None = None,
) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """The model of ``row``, sharded on the default process group, and its optimizer;
    gradients are reduced in ``reduce_dtype`` (the fp32 row always reduces in fp32);
    ``step_elements`` bounds an int8 row's update (``Int8AdamW``'s default if ``None``)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from fsdp_int8.sharding import find_blocks

    model = hf_model(shape)
    if checkpointing:
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    if row in ("bf16", "fp32"):
        policy = MixedPrecisionPolicy(torch.bfloat16, reduce_dtype) if row == "bf16" else MixedPrecisionPolicy()
        for block in find_blocks(model):
            fully_shard(block, mp_policy=policy)
        fully_shard(model, mp_policy=policy)
        return model, torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    config, optimizer = INT8_ROWS[row]
    fsdp_int8.shard_model(model, config=config, mp_policy=MixedPrecisionPolicy(torch.bfloat16, reduce_dtype))
    block = min(EIGHT_BIT_BLOCK, shape["hidden_size"] // 2)  # rows shorter than a block keep fp32 states
    bound = {} if step_elements is None else {"step_elements": step_elements}
    return model, optimizer(model.parameters(), lr=1e-3, weight_decay=0.1, block_size=block, **bound)


def _by_category(snapshot: dict, share: float) -> dict[str, float]:
    """One device's snapshot of the tracker, in bytes per parameter by category name."""
    device_key = next(iter(snapshot))
    return {str(k.value if hasattr(k, "value") else k): v / share for k, v in snapshot[device_key].items()}


def _module_peaks(tracker, share: float, count: int) -> list[dict]:
    """The ``count`` largest snapshots the tracker took at module boundaries (its peak in
    each module's forward and backward, and before and after each hook): where in the step
    the memory is, by module and phase."""
    largest: dict[tuple[str, str], dict[str, float]] = {}
    for stats in tracker.memory_tracking.values():
        for phase, snapshots in stats.snapshots.items():
            key = (stats.mod_fqn, str(getattr(phase, "value", phase)))
            for snapshot in snapshots:
                figures = _by_category(snapshot, share)
                if figures.get("Total", 0.0) > largest.get(key, {}).get("Total", -1.0):
                    largest[key] = figures
    ranked = sorted(largest.items(), key=lambda item: -item[1].get("Total", 0.0))[:count]
    return [dict(module=module, phase=phase, figures=figures) for (module, phase), figures in ranked]


def _measure_rows(rank: int, world: int, rows: list[tuple[str, bool]], *options) -> list[dict]:
    """:func:`_measure` of each ``(row, checkpointing)`` in turn, in this one process group:
    a row's model, optimizer and tracker are gone (collected) before the next is built, so
    each peak counts only its own storages (the same figures as a fresh process per row),
    without a start-up of torch and transformers per row."""
    results = []
    for row, checkpointing in rows:
        results.append(_measure(rank, world, row, checkpointing, *options))
        gc.collect()
    return results


def _measure(
    rank: int, world: int, row: str, checkpointing: bool, shape: dict, batch: int, seq_len: int, where: int = 0,
    reduce_dtype: str = "fp32", loss: str = "transformers", loss_chunk_tokens: int = 64,
    reduce_scatter: str = "torch", step_elements: int | None = None,
) -> dict:
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker

    from fsdp_int8.hardware import device_type_for

    torch.set_num_threads(max(1, (os.cpu_count() or 2) // world))
    device = device_type_for(world)
    model, optimizer = build(row, shape, checkpointing, REDUCE_DTYPES[reduce_dtype], step_elements)
    if loss == "chunked":
        from fsdp_int8.integrations.hf_loss import chunked_causal_lm_loss

        model.loss_function = functools.partial(chunked_causal_lm_loss, chunk_tokens=loss_chunk_tokens)
    if reduce_scatter == "chunks":
        enable_in_place_reduce_scatter(model)
    params = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
    data = torch.Generator().manual_seed(rank)

    def step() -> None:
        tokens = torch.randint(0, shape["vocab_size"], (batch, seq_len), generator=data).to(device)
        model(input_ids=tokens, labels=tokens).loss.backward()
        optimizer.step()
        optimizer.zero_grad()

    step()  # states exist from here on
    tracker = FSDPMemTracker(model, optimizer)
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    with tracker:
        step()
    cuda_peak = torch.cuda.max_memory_allocated() if device == "cuda" else None
    share = params / world
    return dict(peak=_by_category(tracker.get_tracker_snapshot("peak"), share),
                after=_by_category(tracker.get_tracker_snapshot("current"), share),
                cuda_peak=cuda_peak / share if cuda_peak else None, parameters=params,
                where=_module_peaks(tracker, share, where))


def _largest_parts(figures: dict[str, float]) -> str:
    """The categories of ``figures`` (bytes/param) from the largest, those of 0.05 or more."""
    return ", ".join(f"{k} {v:.2f}" for k, v in sorted(figures.items(), key=lambda kv: -kv[1]) if v >= 0.05)


def main(argv: list[str] | None = None) -> dict[tuple[str, bool], dict]:
    """Print the table; return each ``(row, checkpointing)``'s figures (bytes/param)."""
    from benchmarks.report import RunLog
    from fsdp_int8 import hardware
    from fsdp_int8.testing import run_distributed

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", nargs="+", default=list(ROWS), choices=ROWS)
    parser.add_argument("--checkpointing", choices=("on", "off", "both"), default="both")
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=1, help="sequences per rank")
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--shape", choices=list(SHAPES), default="llama-1b-scaled")
    parser.add_argument("--json", help="also write the figures here (what benchmarks.what_fits reads)")
    parser.add_argument("--reduce-dtype", choices=list(REDUCE_DTYPES), default="fp32",
                        help="gradient reduce-scatter dtype of every row but fp32 (default fp32: the baseline's)")
    parser.add_argument("--where", type=int, default=0, metavar="N",
                        help="also print each row's N largest snapshots by module and phase (where the peak is)")
    parser.add_argument("--loss", choices=("transformers", "chunked"), default="transformers",
                        help="transformers: each row's own (transformers', the lean rows' config's chunked one); chunked: "
                        "every row's fsdp_int8.integrations.hf_loss.chunked_causal_lm_loss (no fp32 logits of the batch)")
    parser.add_argument("--loss-chunk-tokens", type=int, default=64, help="tokens per chunk of --loss chunked")
    parser.add_argument("--reduce-scatter", choices=("torch", "chunks"), default="torch",
                        help="FSDP2's gradient reduce-scatter: torch's (gloo all-reduces a copy of the whole input), "
                        "or chunks: fsdp_int8's InPlaceReduceScatter on every row (one dist.reduce per rank's chunk in place, "
                        "no copy; what the lean rows use anyway)")
    parser.add_argument("--step-elements", type=int,
                        help="Int8AdamW's step_elements (the most elements one update works on) for the int8 rows; "
                        "default: its own (2^20 on CPU, a fixed size, so a larger share of a scaled-down model)")
    parser.add_argument("--log", action="store_true", help="also append a dated section (command, hardware line, "
                        "table) to benchmarks/results/memory.md")
    args = parser.parse_args(argv)
    log = RunLog("memory.md", "Peak memory", "benchmarks.memory", argv) if args.log else None
    shape = SHAPES[args.shape]
    capability = hardware.capability(torch.device("cpu"))
    print(f"# {capability.name}, {', '.join(capability.features) or 'no avx512_vnni/avx512_bf16/amx'}; "
          f"torch {torch.__version__}; {args.world_size} ranks, batch {args.batch_size} x {args.seq_len} per rank, "
          f"shape {args.shape}, gradients reduced in {args.reduce_dtype}, {args.loss} loss"
          f"{f' ({args.loss_chunk_tokens} tokens a chunk)' if args.loss == 'chunked' else ''}, "
          f"{args.reduce_scatter} reduce-scatter"
          f"{f', int8 updates of at most {args.step_elements} elements' if args.step_elements else ''}", flush=True)
    modes = {"on": [True], "off": [False], "both": [True, False]}[args.checkpointing]
    results: dict[tuple[str, bool], dict] = {}
    # every row of every mode in one process group: one start-up of torch and transformers
    runs = [(row, checkpointing) for checkpointing in modes for row in args.rows]
    figures = run_distributed(_measure_rows, args.world_size, runs, shape, args.batch_size, args.seq_len,
                              args.where, args.reduce_dtype, args.loss, args.loss_chunk_tokens,
                              args.reduce_scatter, args.step_elements, timeout=3600)[0]
    measured = {mode: [f for (_, m), f in zip(runs, figures) if m == mode] for mode in modes}
    for checkpointing in modes:
        print(f"\nactivation checkpointing {'on' if checkpointing else 'off'}; bytes/param per rank")
        baseline = None
        for row, result in zip(args.rows, measured[checkpointing]):
            peak, after = result["peak"], result["after"]
            total = peak.pop("Total", sum(peak.values()))
            after_total = after.pop("Total", sum(after.values()))
            if row == "bf16":
                baseline = total
            parts = _largest_parts(peak)
            ratio = f"{total / baseline:.2f}x" if baseline else "-"
            cuda = f"  cuda max allocated {result['cuda_peak']:.2f}" if result["cuda_peak"] else ""
            print(f"{row:22s} peak {total:6.2f} ({ratio} bf16)  after step {after_total:5.2f}{cuda}  | {parts}",
                  flush=True)
            for place in result["where"]:
                figures = dict(place["figures"])
                place_total = figures.pop("Total", sum(figures.values()))
                print(f"    {place_total:6.2f}  {place['module'] or '<root>'} {place['phase']}  | "
                      f"{_largest_parts(figures)}")
            results[(row, checkpointing)] = dict(peak=total, after=after_total, parts=peak,
                                                 parameters=result["parameters"], where=result["where"])
    if args.json:
        _write_json(args, capability, results)
    if log is not None:
        log.finish()
    return results


def _write_json(args: argparse.Namespace, capability, results: dict[tuple[str, bool], dict]) -> None:
    """The figures, with what ``benchmarks.what_fits`` needs to scale them."""
    import json

    from benchmarks.what_fits import LlamaShape, MoEShape

    shape = SHAPES[args.shape]
    if shape.get("model") == "qwen3_moe":
        measured = MoEShape.of_hf(args.shape, shape)
    else:
        measured = LlamaShape(
            args.shape, shape["hidden_size"], shape["num_hidden_layers"], shape["intermediate_size"],
            shape["num_attention_heads"], shape["num_key_value_heads"], shape["vocab_size"],
            shape["tie_word_embeddings"],
        )
    by_mode = {mode: {row: {k: v for k, v in figures.items() if k not in ("parameters", "where")}
                      for (row, checkpointing), figures in results.items() if checkpointing == (mode == "on")}
               for mode in ("on", "off")}
    record = dict(
        machine=f"{capability.name}, {', '.join(capability.features) or 'no avx512_vnni/avx512_bf16/amx'}; "
                f"torch {torch.__version__}",
        shape=shape, world_size=args.world_size, tokens_per_rank=args.batch_size * args.seq_len,
        parameters=next(iter(results.values()))["parameters"],
        largest_group=measured.largest_group,
        rows=by_mode["on"], rows_checkpointing_off=by_mode["off"],
    )
    with open(args.json, "w") as handle:
        json.dump(record, handle, indent=1)


if __name__ == "__main__":
    main()
