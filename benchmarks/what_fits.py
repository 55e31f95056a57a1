"""What fits: the largest Llama 3 model each recipe trains per GPU size and count, from the
peak memory ``benchmarks.memory`` measured.

    python -m benchmarks.memory --checkpointing on --json memory.json
    python -m benchmarks.what_fits memory.json [--tokens 4096]

Measured on a mixture-of-experts shape (``benchmarks.memory --shape qwen3-moe-scaled``),
the table is of MoE models instead (Qwen3-30B-A3B, Qwen3-235B-A22B, a DeepSeek-V3-sized
671B model). With FSDP alone every block gathers all its experts, so the largest group is
a MoE block (11 billion elements in DeepSeek-V3). ``--expert-parallel`` adds rows with
the experts split over the GPUs (expert parallelism of degree ``min(GPUs, experts)``,
FSDP over the rest): a MoE block gathers its attention, router, shared expert and its
own experts only (4 of DeepSeek-V3's 256 on 64 GPUs), and each recomputed block holds
the all-to-all's buffers of its routed tokens. The sharded state per GPU is the same
(every parameter still lives on one GPU's share).

A step's peak (activation checkpointing on, as measured) is modelled as three terms:

* **sharded state**, ``s`` bytes per parameter per rank: sharded parameters, gradients and
  optimizer states at the peak, measured; it scales with ``parameters / GPUs``;
* **the largest group's transients**, ``u`` bytes per element of the largest FSDP2 group:
  its unsharded parameters and gradient, the all-gather and reduce-scatter buffers and
  the temporaries at the peak, measured (the peak falls at the end of backward, in the
  root group, which holds the token embedding: ``vocab x hidden`` elements); it does not
  shrink with more GPUs;
* **activations**: each block's bf16 input kept for recomputation (2 bytes per token per
  hidden unit per block), one block's recomputed activations (about 34 bytes per token
  per hidden unit, the estimate of Korthikanti et al. 2022 without attention scores,
  which fused attention never stores) and fp32 logits, their log-softmax and gradient
  (12 bytes per token per vocabulary entry). This term is a formula; the script prints it
  beside the measured activations of the benchmark's shape as a check.

With FSDP2's CPU offload (``shard_model(offload_policy=CPUOffloadPolicy())``, the
launcher's ``--cpu-offload``) the sharded state lives in host memory: each measured row
gets a "+ offload" row whose device peak is the largest group's transients and the
activations alone, and whose host memory is ``s`` bytes per parameter per rank (the
cell names it, per GPU). The all-gather's device copy of the group's shard (1 + 4/K
bytes per element over the GPUs) is left out: a fraction of the group term.

A model fits when the sum is at most 90% of the GPU's memory (the rest: CUDA context,
allocator fragmentation, NCCL buffers). The figures are estimates from a CPU measurement,
not GPU runs: ``python -m benchmarks.gpu`` measures ``torch.cuda.max_memory_allocated``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from dataclasses import dataclass

from benchmarks.report import RunLog

GIB = 1 << 30
USABLE = 0.9  # of a GPU's memory, for the step's peak
GPU_SIZES_GB = (16, 24, 40, 80)
GPU_COUNTS = (1, 8, 64)
SHARDED = ("Sharded Param", "Sharded Grad", "OptState")
GROUP = ("Unsharded Param", "Unsharded Grad", "Temp", "All Gather", "Reduce Scatter")
ACTIVATIONS = ("Activation", "Inputs")
BLOCK_INPUT_BYTES = 2  # per token per hidden unit per block: a bf16 checkpoint
RECOMPUTED_BLOCK_BYTES = 34  # per token per hidden unit, one block recomputed in backward
LOGIT_BYTES = 12  # per token per vocabulary entry: fp32 logits, log-softmax, gradient
MOE_FFN_BYTES = 6  # per token per routed expert unit of one recomputed MoE block (3 bf16 tensors)
ALL_TO_ALL_BYTES = 4  # per token per top-k slot per hidden unit: bf16 dispatch and combine buffers
EP = " + EP"  # suffix of the expert-parallel rows' names


@dataclass(frozen=True)
class LlamaShape:
    """A Llama 3 model's shape (Meta's published configs)."""

    name: str
    hidden: int
    layers: int
    ffn: int
    heads: int
    kv_heads: int
    vocab: int = 128_256
    tied: bool = False

    @property
    def parameters(self) -> int:
        head_dim = self.hidden // self.heads
        attention = 2 * self.hidden * self.hidden + 2 * self.hidden * self.kv_heads * head_dim
        block = attention + 3 * self.hidden * self.ffn + 2 * self.hidden
        embeddings = self.vocab * self.hidden * (1 if self.tied else 2)
        return self.layers * block + embeddings + self.hidden

    @property
    def largest_group(self) -> int:
        """Elements of the largest FSDP2 group ``shard_model`` makes: the embedding (or the
        untied head, in the root), or a block if that is larger."""
        head_dim = self.hidden // self.heads
        block = (2 * self.hidden * self.hidden + 2 * self.hidden * self.kv_heads * head_dim
                 + 3 * self.hidden * self.ffn)
        return max(self.vocab * self.hidden, block)


LLAMA3 = (
    LlamaShape("Llama-3.2-1B", 2048, 16, 8192, 32, 8, tied=True),
    LlamaShape("Llama-3.2-3B", 3072, 28, 8192, 24, 8, tied=True),
    LlamaShape("Llama-3.1-8B", 4096, 32, 14336, 32, 8),
    LlamaShape("Llama-3.1-70B", 8192, 80, 28672, 64, 8),
    LlamaShape("Llama-3.1-405B", 16384, 126, 53248, 128, 8),
)


@dataclass(frozen=True)
class MoEShape:
    """A mixture-of-experts model's shape: ``attention`` elements per block, ``experts``
    SwiGLU experts of width ``expert_ffn`` (top ``top_k``) plus ``shared_ffn`` of shared
    expert width in each MoE block, and ``dense_layers`` leading dense blocks of width
    ``dense_ffn`` (DeepSeek-V3's first three)."""

    name: str
    hidden: int
    layers: int
    attention: int
    experts: int
    expert_ffn: int
    top_k: int
    vocab: int
    shared_ffn: int = 0
    dense_layers: int = 0
    dense_ffn: int = 0
    tied: bool = False

    def moe_block_under(self, expert_parallel: int) -> int:
        """Elements one rank gathers of a MoE block when ``expert_parallel`` ranks split its
        experts: attention, router and shared expert whole, ``experts / expert_parallel``
        routed experts."""
        local_experts = self.experts // expert_parallel
        return (self.attention + 3 * self.hidden * (local_experts * self.expert_ffn + self.shared_ffn)
                + self.hidden * self.experts)

    @property
    def parameters(self) -> int:
        dense_block = self.attention + 3 * self.hidden * self.dense_ffn
        embeddings = self.vocab * self.hidden * (1 if self.tied else 2)
        return (self.dense_layers * dense_block + (self.layers - self.dense_layers) * self.moe_block_under(1)
                + embeddings + (2 * self.layers + 1) * self.hidden)

    def largest_group_under(self, expert_parallel: int) -> int:
        """Elements of the largest FSDP2 group with ``expert_parallel`` ranks splitting the
        experts: a MoE block with its share of the experts (all of them under FSDP alone),
        or the embedding if larger."""
        return max(self.vocab * self.hidden, self.moe_block_under(expert_parallel),
                   self.attention + 3 * self.hidden * self.dense_ffn)

    def expert_parallel_on(self, gpus: int) -> int:
        """The degree of expert parallelism on ``gpus`` GPUs: all of them, at most one
        expert each (both are powers of two in every shape here)."""
        if self.experts % min(gpus, self.experts):
            raise ValueError(f"{self.name}'s {self.experts} experts do not split over {gpus} GPUs")
        return min(gpus, self.experts)

    @property
    def ffn(self) -> int:
        """Activation width per token of one recomputed block (its routed experts' and shared
        expert's), for :func:`activation_bytes`."""
        return self.top_k * self.expert_ffn + self.shared_ffn

    @classmethod
    def of_hf(cls, name: str, fields: dict) -> "MoEShape":
        """The shape of a transformers Qwen3-MoE config's fields (``benchmarks.memory``)."""
        hidden, heads, kv_heads = fields["hidden_size"], fields["num_attention_heads"], fields["num_key_value_heads"]
        head_dim = fields.get("head_dim", hidden // heads)
        return cls(name, hidden, fields["num_hidden_layers"], 2 * hidden * head_dim * (heads + kv_heads),
                   fields["num_experts"], fields["moe_intermediate_size"], fields["num_experts_per_tok"],
                   fields["vocab_size"], tied=fields.get("tie_word_embeddings", False))


def _gqa(hidden: int, heads: int, kv_heads: int, head_dim: int) -> int:
    return 2 * hidden * head_dim * (heads + kv_heads)


# DeepSeek-V3's multi-head latent attention: q down / up, kv down / up, output
_DEEPSEEK_V3_ATTENTION = 7168 * 1536 + 1536 * 128 * 192 + 7168 * 576 + 512 * 128 * 256 + 128 * 128 * 7168
MOE = (
    MoEShape("Qwen3-30B-A3B", 2048, 48, _gqa(2048, 32, 4, 128), 128, 768, 8, 151_936),
    MoEShape("Qwen3-235B-A22B", 4096, 94, _gqa(4096, 64, 4, 128), 128, 1536, 8, 151_936),
    MoEShape("DeepSeek-V3-671B", 7168, 61, _DEEPSEEK_V3_ATTENTION, 256, 2048, 8, 129_280,
             shared_ffn=2048, dense_layers=3, dense_ffn=18432),
)


@dataclass(frozen=True)
class Coefficients:
    """One recipe's measured costs (see the module docstring)."""

    sharded: float  # bytes per parameter per rank, on the GPU
    group: float  # bytes per element of the largest group
    host: float = 0.0  # bytes per parameter per rank in host memory (CPU offload)
    expert_parallel: bool = False  # MoE shapes: experts split over the GPUs

    def with_expert_parallel(self) -> "Coefficients":
        """The same recipe with the experts split over the GPUs (the same measured bytes)."""
        return dataclasses.replace(self, expert_parallel=True)

    def offloaded(self) -> "Coefficients":
        """The same recipe under FSDP2's CPU offload: the sharded state moves to the host."""
        return dataclasses.replace(self, sharded=0.0, host=self.sharded + self.host)


OFFLOAD = " + offload"  # suffix of the offloaded rows' names


def activation_bytes(tokens: int, hidden: int, layers: int, vocab: int, moe_ffn: int = 0,
                     routed_slots: int = 0) -> float:
    """The activation term for ``tokens`` tokens per GPU (see the module docstring); a MoE
    block recomputes ``moe_ffn`` expert units per token more (its top-k experts' gate, up
    and product in bf16, ``MOE_FFN_BYTES`` each), and under expert parallelism holds the
    all-to-all's buffers of ``routed_slots`` (top-k) copies of each token."""
    return tokens * (hidden * (BLOCK_INPUT_BYTES * layers + RECOMPUTED_BLOCK_BYTES
                               + ALL_TO_ALL_BYTES * routed_slots)
                     + LOGIT_BYTES * vocab + MOE_FFN_BYTES * moe_ffn)


def coefficients(measured: dict) -> dict[str, Coefficients]:
    """Each measured row's coefficients, from ``benchmarks.memory --json``'s file."""
    share = measured["parameters"] / measured["world_size"]
    group = measured["largest_group"]
    found = {}
    for row, figures in measured["rows"].items():
        parts = figures["parts"]  # bytes per parameter per rank, by category
        found[row] = Coefficients(
            sharded=sum(parts.get(k, 0.0) for k in SHARDED),
            group=sum(parts.get(k, 0.0) for k in GROUP) * share / group,
        )
    return found


def peak_bytes(shape: LlamaShape | MoEShape, gpus: int, costs: Coefficients, tokens: int) -> float:
    if not isinstance(shape, MoEShape):
        return (costs.sharded * shape.parameters / gpus + costs.group * shape.largest_group
                + activation_bytes(tokens, shape.hidden, shape.layers, shape.vocab))
    expert_parallel = shape.expert_parallel_on(gpus) if costs.expert_parallel else 1
    routed_slots = shape.top_k if expert_parallel > 1 else 0
    return (costs.sharded * shape.parameters / gpus + costs.group * shape.largest_group_under(expert_parallel)
            + activation_bytes(tokens, shape.hidden, shape.layers, shape.vocab, shape.ffn, routed_slots))


def largest_fitting(gpu_gb: int, gpus: int, costs: Coefficients, tokens: int,
                    shapes: tuple = LLAMA3) -> str:
    fitting = [s for s in shapes if peak_bytes(s, gpus, costs, tokens) <= USABLE * gpu_gb * 1e9]
    if not fitting:
        return "none"
    best = fitting[-1]
    host = f"; host {costs.host * best.parameters / gpus / 1e9:.0f} GB" if costs.host else ""
    return f"{best.name} ({peak_bytes(best, gpus, costs, tokens) / 1e9:.0f} GB{host})"


def main(argv: list[str] | None = None) -> dict[tuple[int, int], dict[str, str]]:
    """Print the table; return ``{(GB, GPUs): {row: largest model}}``."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("measured", help="the JSON file of benchmarks.memory --json")
    parser.add_argument("--tokens", type=int, default=4096, help="tokens per GPU per micro-batch")
    parser.add_argument("--expert-parallel", action="store_true", help="MoE models: also rows with the experts "
                        "split over the GPUs (expert parallelism of degree min(GPUs, experts), FSDP over the rest)")
    parser.add_argument("--log", action="store_true", help="also append a dated section (command, the measurement's "
                        "machine, table) to benchmarks/results/memory.md")
    args = parser.parse_args(argv)
    log = RunLog("memory.md", "What fits", "benchmarks.what_fits", argv) if args.log else None
    with open(args.measured) as handle:
        measured = json.load(handle)
    costs = coefficients(measured)
    costs.update({row + OFFLOAD: found.offloaded() for row, found in list(costs.items())})
    shape = measured["shape"]
    moe = shape.get("model") == "qwen3_moe"  # measured on a MoE: MoE models are estimated
    if args.expert_parallel and not moe:
        parser.error("--expert-parallel needs a measurement of a MoE shape (benchmarks.memory --shape qwen3-moe-scaled)")
    if args.expert_parallel:
        costs.update({row + EP: found.with_expert_parallel() for row, found in list(costs.items())
                      if not row.endswith(OFFLOAD)})
    shapes, family = (MOE, "mixture-of-experts") if moe else (LLAMA3, "Llama 3")
    moe_ffn = MoEShape.of_hf("measured", shape).ffn if moe else 0
    predicted = activation_bytes(measured["tokens_per_rank"], shape["hidden_size"], shape["num_hidden_layers"],
                                 shape["vocab_size"], moe_ffn)
    share = measured["parameters"] / measured["world_size"]
    print(f"# from {args.measured}: {measured['machine']}")
    for row, figures in measured["rows"].items():
        seen = sum(figures["parts"].get(k, 0.0) for k in ACTIVATIONS) * share
        print(f"# {row}: sharded {costs[row].sharded:.2f} B/param, largest group {costs[row].group:.2f} B/element; "
              f"activations measured {seen / 1e6:.1f} MB, formula {predicted / 1e6:.1f} MB")
    for row in [row for row in costs if row.endswith(OFFLOAD)]:
        print(f"# {row}: device {costs[row].sharded:.2f} B/param, host {costs[row].host:.2f} B/param per rank")
    rows = list(costs)
    print(f"\nLargest {family} model per GPU, {args.tokens} tokens per GPU, activation checkpointing on, "
          f"{'FSDP, and FSDP with expert parallelism (+ EP)' if args.expert_parallel else 'FSDP alone'} "
          f"(estimated peak in brackets)\n")
    print("| GPU memory | GPUs | " + " | ".join(rows) + " |")
    print("|---|---:|" + "---|" * len(rows))
    table = {}
    for gpu_gb in GPU_SIZES_GB:
        for gpus in GPU_COUNTS:
            table[gpu_gb, gpus] = {row: largest_fitting(gpu_gb, gpus, costs[row], args.tokens, shapes) for row in rows}
            print(f"| {gpu_gb} GB | {gpus} | " + " | ".join(table[gpu_gb, gpus].values()) + " |")
    if log is not None:
        log.finish()
    return table


if __name__ == "__main__":
    main()
