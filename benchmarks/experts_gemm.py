"""Grouped experts alone, int8 against bf16 ``torch._grouped_mm``, at a real model's expert shape.

    python -m benchmarks.ratios --experts qwen3-30b-a3b            # through the ratios CLI
    python -m benchmarks.experts_gemm --tokens 256 --steps 10      # the same, directly
    python -m benchmarks.experts_gemm --device cuda --tokens 4096  # on a GPU: Triton's kernels

One MoE block's experts (Qwen3-30B-A3B: hidden 2048, expert width 768, 128 experts, top 8;
the tokens scaled down to ``--tokens``, routed uniformly at random), forward and backward
of the SwiGLU experts ``down(silu(gate(x)) * up(x))`` with ``gate`` and ``up`` fused
(``[E, 2 * 768, 2048]``), as transformers and torchtitan run them:

* ``bf16``: bf16 expert weights, ``torch._grouped_mm`` (the baseline);
* ``int8-mm``: int8 experts (``Int8MatmulConfig()``), ``fsdp_int8.weight.int8_grouped_mm``.

The rows are timed interleaved in one process (``benchmarks.timing``); the ratio is the
median of the per-step ratios. Then, per forward + backward call, each row's kernels
(aten ops that launch one, and Triton launches), its host reads of tensor values, and the
bytes of expert weights it reads, for the int8 row both ways it runs: the loop over experts
(the CPU's, and a GPU's without Triton) and the Triton kernels (a GPU's; counted here in
Triton's interpreter at a narrower shape with the same experts, as counts do not depend on
the widths).
"""

from __future__ import annotations

import argparse
import contextlib
import os
from dataclasses import dataclass
from typing import Iterator

import torch
import torch.nn.functional as F

from benchmarks.timing import interleave, ratio_lines
from fsdp_int8 import Int8MatmulConfig, Int8Weight, hardware
from fsdp_int8.testing import count_host_syncs, count_kernels
from fsdp_int8.weight import int8_grouped_mm


@dataclass(frozen=True)
class ExpertShape:
    hidden: int
    width: int
    experts: int
    top_k: int


SHAPES = {
    "qwen3-30b-a3b": ExpertShape(hidden=2048, width=768, experts=128, top_k=8),
    "tiny": ExpertShape(hidden=64, width=32, experts=16, top_k=2),  # a smoke run of the code path
}


def _offsets(shape: ExpertShape, tokens: int, seed: int, device: str = "cpu") -> torch.Tensor:
    """Cumulative rows per expert of ``tokens`` routed to ``top_k`` distinct random experts each."""
    generator = torch.Generator().manual_seed(seed)
    choices = torch.rand(tokens, shape.experts, generator=generator).argsort(dim=1)[:, :shape.top_k]
    counts = torch.bincount(choices.flatten(), minlength=shape.experts)
    return counts.cumsum(0).to(device=device, dtype=torch.int32)


def _tokens(shape: ExpertShape, offs: torch.Tensor) -> torch.Tensor:
    rows = int(offs[-1])
    values = torch.randn(rows, shape.hidden, generator=torch.Generator().manual_seed(0))
    return values.bfloat16().to(offs.device).requires_grad_()


def _weights(shape: ExpertShape, int8: bool, device: str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    made = []
    for out, inner in ((2 * shape.width, shape.hidden), (shape.hidden, shape.width)):
        values = torch.randn(shape.experts, out, inner, generator=generator) * inner ** -0.5
        if int8:
            weight = Int8Weight.from_float(values.to(device), int8_matmul=Int8MatmulConfig(), dtype=torch.bfloat16)
            made.append(weight.requires_grad_())
        else:
            made.append(values.bfloat16().to(device).requires_grad_())
    return made[0], made[1]


def _experts_step(x: torch.Tensor, offs: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> None:
    """Forward and backward of one block's experts; weights' gradients dropped after."""
    grouped = int8_grouped_mm if isinstance(gate_up, Int8Weight) else (
        lambda a, w, o: torch._grouped_mm(a, w.transpose(-2, -1), offs=o))
    gate, up = grouped(x, gate_up, offs).chunk(2, dim=-1)
    out = grouped(F.silu(gate) * up, down, offs)
    out.float().square().mean().backward()
    gate_up.grad = down.grad = x.grad = None


@contextlib.contextmanager
def triton_interpreted(on: bool) -> Iterator[None]:
    """On the CPU: the grouped int8 GEMMs as Triton's interpreter runs a GPU's kernels
    (``on``) or as the loop over experts; elsewhere nothing changes."""
    previous = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1" if on else "0"
    try:
        yield
    finally:
        if previous is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = previous


def _counts(shape: ExpertShape, tokens: int, int8: bool, triton: bool, device: str) -> dict:
    """Kernels and host reads of one forward + backward call."""
    with triton_interpreted(triton and device == "cpu"):
        gate_up, down = _weights(shape, int8, device)
        offs = _offsets(shape, tokens, 1, device)
        x = _tokens(shape, offs)
        _experts_step(x, offs, gate_up, down)  # first call: caches, kernels' compilation
        with count_host_syncs() as reads, count_kernels() as kernels:
            _experts_step(x, offs, gate_up, down)
    return {"aten kernels": kernels.aten, "triton launches": kernels.triton, "host reads": reads.count}


def run(shape_name: str, *, tokens: int, steps: int, warmup: int, threads: int, device: str = "cpu") -> list[str]:
    """Time the rows on ``device`` and count their kernels; the report's lines."""
    torch.set_num_threads(threads)
    shape = SHAPES[shape_name]
    offs = _offsets(shape, tokens, 0, device)
    x = _tokens(shape, offs)
    weights = {"bf16": _weights(shape, False, device), "int8-mm": _weights(shape, True, device)}
    rows = {name: (lambda i, w=w: _experts_step(x, offs, *w)) for name, w in weights.items()}
    lines = [f"experts of {shape_name}: hidden {shape.hidden}, width {shape.width}, {shape.experts} experts, "
             f"top {shape.top_k}; {tokens} tokens ({int(offs[-1])} routed rows), forward + backward, "
             f"{threads} thread(s); {steps} timed steps after {warmup}, interleaved",
             hardware.hardware_line(device)]
    with triton_interpreted(False):  # the timed int8 row: this machine's own path
        times = interleave(rows, steps=steps, warmup=warmup)
    lines += ratio_lines(times, "bf16")
    narrow = ExpertShape(hidden=64, width=32, experts=shape.experts, top_k=shape.top_k)
    lines.append(f"per call (forward + backward; counted at hidden {narrow.hidden}, width {narrow.width}, "
                 f"{narrow.experts} experts, {tokens} tokens; weight bytes at the real shape):")
    ways = [("bf16 torch._grouped_mm", False, False), ("int8-mm, Triton kernels (a GPU's path)", True, True)]
    if device == "cpu":  # a GPU with Triton has no loop to count
        ways.insert(1, ("int8-mm, loop over experts", True, False))
    for name, int8, triton in ways:
        counts = ", ".join(f"{what} {n}" for what, n in _counts(narrow, tokens, int8, triton, device).items())
        weight_mb = shape.experts * 3 * shape.width * shape.hidden * (1 if int8 else 2) / 1e6
        lines.append(f"  {name}: {counts}, expert weights read {weight_mb:.4g} MB")
    return lines


def main(argv: list[str] | None = None) -> list[str]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="qwen3-30b-a3b", choices=list(SHAPES))
    parser.add_argument("--tokens", type=int, default=128, help="tokens routed (each to top_k experts)")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--device", default="cpu", help="cpu, or cuda (Triton's kernels, timed on the GPU)")
    args = parser.parse_args(argv)
    lines = run(args.shape, tokens=args.tokens, steps=args.steps, warmup=args.warmup, threads=args.threads,
                device=args.device)
    for line in lines:
        print(line, flush=True)
    return lines


if __name__ == "__main__":
    main()
