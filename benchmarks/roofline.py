"""A roofline of one training step per recipe: estimated step-time ratios to bf16 FSDP2.

    python -m benchmarks.roofline --gpu h100 --shape llama-8b       # every recipe, H100 SXM
    python -m benchmarks.roofline --gpu b300 --shape llama-8b --world-size 8
    python -m benchmarks.roofline --gpu cpu                         # this CPU, benchmarks.ratios' shape
    python -m benchmarks.roofline --validate --dim 256 --steps 6    # + benchmarks.ratios' measurement
    python -m benchmarks.roofline --gpu h100 --shape qwen3-30b-a3b  # mixture of experts

Each recipe (a row of ``benchmarks.rows``, built and stepped as the timing benchmarks do:
``bf16`` FSDP2, ``int8`` weight-only, ``int8-mm`` int8 matmuls, ``lean``) is traced for
one training step on fake tensors, as rank 0 of a fake process group of ``--world-size``
ranks (``benchmarks._roofline_trace``): no memory, so Llama-8B's shapes trace on a
laptop. Per op it counts FLOPs by dtype, bytes read and written, kernel launches, host
syncs and the collectives' buffers (``benchmarks._op_trace``). Each op's time is
``max(FLOPs / peak of its dtype, bytes / memory bandwidth)`` plus a cost per launch and
per sync; the all-gathers and reduce-scatters FSDP2 issued move ``(W - 1) / W`` of their
buffers over the interconnect, overlapped with compute on GPUs
(``benchmarks._roofline_model``).

The peaks of ``--gpu h100|h200|b200|b300|...`` are the published dense ones of
``fsdp_int8.hardware.GPUS`` (the table the int8 rule reads). ``--gpu cpu`` measures this
CPU's own (fp32, bf16 and int8 GEMMs at ``--gemm-size``, default the model's width;
attention; a large copy; one small op; gloo's all-gather) and predicts
``benchmarks.ratios``' rows at its shape; ``--validate`` then runs ``benchmarks.ratios``'
measurement of the same rows in the same run and prints predicted against measured
ratios, twice: (A) from one GEMM rate per dtype, the roofline as written, and (B) with
every GEMM shape and layout of the traces timed on its own (a CPU's bf16 and int8
reference loops run 1-3 GFLOP/s depending on the shape, so one rate cannot hold for all).

Shapes are the launcher's Transformer (``launch.model``: multi-head attention without
grouped queries, SwiGLU, untied head) at published widths: ``llama-1b`` (Llama 3.2 1B),
``llama-8b`` (Llama 3 8B: 8.8B parameters here, its k and v projections being full
width), ``qwen3-30b-a3b`` (128 experts, top 8); ``ratios`` is ``benchmarks.ratios``'
default (``--dim`` and ``--n-layers`` change it). Models of more than two blocks are
traced at 1 and 2 blocks of real size and extrapolated (``--whole`` traces every block).

Everything printed for a GPU is an estimate from published peaks, not a measurement.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from typing import Sequence

from benchmarks import ratios
from benchmarks import rows as registry
from benchmarks._op_trace import OpCost
from benchmarks._roofline_model import (DevicePeaks, StepEstimate, estimate_step, gpu_peaks, measure_cpu_peaks,
                                         measure_gemm_rates)
from benchmarks._roofline_trace import Trace, trace_row_blocks
from fsdp_int8 import hardware
from launch.model import ModelArgs

GPU_ROWS = ("bf16", "int8", "int8-mm", "lean")
TOP = 10  # the largest costs printed per recipe


@dataclasses.dataclass(frozen=True)
class Shape:
    """A model and its tokens per rank."""

    name: str
    args: ModelArgs
    batch: int
    seq: int

    def describe(self) -> str:
        a = self.args
        experts = f", {a.n_experts} experts (top {a.top_k}, width {a.expert_hidden_dim})" if a.n_experts else ""
        return (f"{self.name}: launcher Transformer, dim {a.dim}, {a.n_layers} blocks, {a.n_heads} heads, "
                f"ffn {a.hidden_dim}{experts}, vocab {a.vocab_size}; {_params(a) / 1e6:,.1f}M parameters; "
                f"batch {self.batch} x {self.seq} tokens per rank")


def _params(a: ModelArgs) -> int:
    attention = 4 * a.dim * a.dim
    if a.n_experts:
        ffn = 3 * a.n_experts * a.dim * a.expert_hidden_dim + a.n_experts * a.dim
        ffn += 3 * a.dim * a.expert_hidden_dim if a.shared_expert else 0
    else:
        ffn = 3 * a.dim * a.hidden_dim
    return a.n_layers * (attention + ffn + 2 * a.dim) + 2 * a.vocab_size * a.dim + a.dim


def _llama(dim: int, n_layers: int, hidden: int, seq: int) -> ModelArgs:
    return ModelArgs(vocab_size=128256, dim=dim, n_layers=n_layers, n_heads=32, hidden_dim=hidden, max_seq_len=seq,
                     rope_theta=500000.0)


def shapes(dim: int = 1024, n_layers: int = 2, batch: int = 4, seq: int = 256) -> dict[str, Shape]:
    """The shapes ``--shape`` names; ``ratios`` at ``dim``, ``n_layers``, ``batch`` x ``seq``."""
    settings = ratios.settings_for(dim, [], steps=1, warmup=0, n_layers=n_layers, batch_size=batch, seq_len=seq)
    return {
        "ratios": Shape(f"benchmarks.ratios (dim {dim})", ratios.shape(settings), batch, seq),
        "tiny": Shape("tiny", ModelArgs(dim=64, n_layers=2, n_heads=1, max_seq_len=32), 2, 32),
        "llama-1b": Shape("llama-1b", _llama(2048, 16, 8192, 8192), 1, 8192),
        "llama-8b": Shape("llama-8b", _llama(4096, 32, 14336, 8192), 1, 8192),
        "qwen3-30b-a3b": Shape("qwen3-30b-a3b", ModelArgs(
            vocab_size=151936, dim=2048, n_layers=48, n_heads=32, max_seq_len=4096, rope_theta=1e6,
            n_experts=128, top_k=8, expert_hidden_dim=768), 1, 4096),
    }


# ---------------------------------------------------------------- the estimate
@dataclasses.dataclass(frozen=True)
class RowEstimate:
    """One recipe's trace and its estimate."""

    row: str
    trace: Trace
    step: StepEstimate

    def totals(self) -> OpCost:
        total = OpCost()
        for cost in self.trace.costs.values():
            total.add(cost)
        return total

    def collective_bytes(self, kind: str) -> float:
        return sum(c.collective_bytes for c in self.trace.costs.values() if c.collective == kind)


def estimate(rows: Sequence[str], shape: Shape, peaks: DevicePeaks, world: int, *, whole: bool = False,
             say=print) -> dict[str, RowEstimate]:
    """Trace each row at ``shape`` on ``world`` ranks (with fsdp_int8's accelerator policy
    where ``peaks`` are a GPU's: its collectives overlap) and estimate its step on ``peaks``."""
    out = {}
    for row in rows:
        say(f"  tracing {row} ...")
        trace = trace_row_blocks(row, shape.args, batch=shape.batch, seq=shape.seq, world=world, whole=whole,
                                 accelerator=peaks.overlap)
        out[row] = RowEstimate(row, trace, estimate_step(trace.costs, peaks, world))
    return out


def _tera(x: float) -> str:
    return f"{x / 1e12:.2f}"


def table_lines(estimates: dict[str, RowEstimate], baseline: str) -> list[str]:
    """The per-recipe table: estimated step, its ratio to ``baseline``'s, and the counts."""
    base = estimates[baseline].step.seconds
    lines = [f"{'recipe':<10} {'step ms':>9} {'ratio':>7} {'compute':>9} {'comm':>8} {'bf16 TF':>8} "
             f"{'int8 TOP':>8} {'fp32 TF':>8} {'GB r+w':>8} {'launches':>9} {'syncs':>6} {'gather GB':>9} "
             f"{'r-scat GB':>9}"]
    for row, e in estimates.items():
        total = e.totals()
        lines.append(
            f"{row:<10} {e.step.seconds * 1e3:9.2f} {e.step.seconds / base:6.3f}x {e.step.compute * 1e3:9.2f} "
            f"{e.step.communication * 1e3:8.2f} {_tera(total.flops.get('bfloat16', 0.0)):>8} "
            f"{_tera(total.flops.get('int8', 0.0)):>8} {_tera(total.flops.get('float32', 0.0)):>8} "
            f"{total.bytes / 1e9:8.2f} {total.launches:9.0f} {total.host_syncs:6.0f} "
            f"{e.collective_bytes('all_gather') / 1e9:9.3f} {e.collective_bytes('reduce_scatter') / 1e9:9.3f}")
    return lines


def largest_lines(e: RowEstimate, peaks: DevicePeaks, top: int = TOP) -> list[str]:
    """The ``top`` largest costs of one recipe's step, with what bounds each."""
    lines = [f"{e.row}: the {top} largest costs (ms per step; share of compute + communication)"]
    whole = e.step.compute + e.step.communication
    for name, seconds in sorted(e.step.per_op.items(), key=lambda kv: -kv[1])[:top]:
        cost = e.trace.costs[name]
        if cost.collective:
            bound = f"{cost.collective}, {cost.collective_bytes / 1e9:.3f} GB"
        else:
            flops = sum(cost.flops.values())
            compute = sum(f / peaks.flop_rate(d, "attention" in name) for d, f in cost.flops.items() if f)
            memory = cost.bytes / peaks.memory
            bound = "compute-bound" if flops and compute >= memory else "memory-bound"
            bound += f", {cost.bytes / 1e9:.3f} GB"
            if flops:
                bound += f", {flops / 1e12:.3f} TFLOP"
            if cost.launches * peaks.launch_s > max(compute, memory):
                bound += f", launch-bound ({cost.launches:.0f} launches)"
            if cost.host_syncs:
                bound += f", {cost.host_syncs:.0f} host syncs"
        lines.append(f"  {seconds * 1e3:9.3f} {seconds / whole * 100:5.1f}%  {name:<52} {cost.calls:7.0f} calls  {bound}")
    return lines


def report(estimates: dict[str, RowEstimate], baseline: str, peaks: DevicePeaks, shape: Shape, world: int,
           say=print) -> None:
    """Print the table and each recipe's largest costs."""
    how = next(iter(estimates.values())).trace.how
    say(f"shape: {shape.describe()}; {world} ranks")
    say(f"device: {peaks.name}: {peaks.measured}; {peaks.launch_s * 1e6:.1f} us per launch, "
        f"{peaks.sync_s * 1e6:.1f} us per host sync; collectives "
        f"{'overlapped with compute' if peaks.overlap else 'added to compute'}")
    say(f"trace: one step per recipe on fake tensors, rank 0 of a fake {world}-rank process group; {how}")
    for line in table_lines(estimates, baseline):
        say(line)
    say(f"(ratio: estimated step time over {baseline}'s; TF / TOP: tera-FLOPs / tera-ops per step and rank; "
        "GB r+w: bytes read and written by the ops; gather / r-scat: FSDP2's all-gather outputs and "
        "reduce-scatter inputs, all ranks' shares)")
    for e in estimates.values():
        say()
        for line in largest_lines(e, peaks):
            say(line)


# ---------------------------------------------------------------- validation against benchmarks.ratios
def with_gemm_rates(peaks: DevicePeaks, estimates: dict[str, RowEstimate], threads: int) -> DevicePeaks:
    """``peaks`` plus this CPU's measured rate of every 2-D GEMM shape the traces hold."""
    shapes = {key for e in estimates.values() for cost in e.trace.costs.values() for key in cost.gemms}
    rates = measure_gemm_rates(shapes, threads)
    slowest = min(rates.items(), key=lambda kv: kv[1] / peaks.flops.get(kv[0][0], 1.0))
    (dtype, m, k, n, a_t, b_t), rate = slowest
    text = (f"{peaks.measured}; {len(rates)} GEMM shapes and layouts measured one by one (the slowest against "
            f"its dtype's rate: {dtype} [{m}, {k}]{' (transposed)' if a_t else ''} @ [{k}, {n}]"
            f"{' (transposed)' if b_t else ''}, "
            f"{rate / 1e9:.2f} GFLOP/s)")
    return dataclasses.replace(peaks, gemm_rates=rates, measured=text)


def validate(rows: Sequence[str], shape: Shape, settings: dict, peaks: DevicePeaks, baseline: str, world: int,
             threads: int = 1, say=print) -> list[tuple[str, float, float, float]]:
    """Predict ``rows``' ratios to ``baseline`` on ``peaks`` (one GEMM rate per dtype) and
    with each GEMM shape's measured rate, measure them with
    ``benchmarks.ratios.measure(settings)`` and print all three; returns ``(row, predicted,
    predicted per shape, measured)`` per row."""
    from benchmarks.timing import paired_ratio

    estimates = estimate(rows, shape, peaks, world, say=say)
    report(estimates, baseline, peaks, shape, world, say=say)
    shaped_peaks = with_gemm_rates(peaks, estimates, threads)
    shaped = {row: estimate_step(e.trace.costs, shaped_peaks, world) for row, e in estimates.items()}
    say()
    say(f"per-shape GEMM rates: {shaped_peaks.measured}")
    say()
    say(f"measuring with benchmarks.ratios: {settings['steps']} timed steps after {settings['warmup']}, "
        f"{world} gloo ranks, {settings['threads']} thread(s) each ...")
    measured = ratios.measure(settings, world)["times"]
    base, shaped_base = estimates[baseline].step.seconds, shaped[baseline].seconds
    out = []
    say()
    say("ratio to " + baseline + ": predicted from one GEMM rate per dtype (A), from each GEMM shape's rate (B), "
        "and measured by benchmarks.ratios (median of paired ratios)")
    say(f"{'row':<20} {'A':>9} {'B':>9} {'measured':>9} {'A error':>8} {'B error':>8} {'A,B within 10%':>15}"
        f"   step ms A / B / measured")
    for row in rows:
        a = estimates[row].step.seconds / base
        b = shaped[row].seconds / shaped_base
        actual = paired_ratio(measured, row, baseline)
        errors = (a / actual - 1, b / actual - 1)
        verdict = ",".join("yes" if abs(e) <= 0.10 else "no" for e in errors)
        median_ms = sorted(measured[row])[len(measured[row]) // 2] * 1e3
        say(f"{row:<20} {a:8.3f}x {b:8.3f}x {actual:8.3f}x {errors[0] * 100:+7.1f}% {errors[1] * 100:+7.1f}% "
            f"{verdict:>15}   {estimates[row].step.seconds * 1e3:.1f} / {shaped[row].seconds * 1e3:.1f} / "
            f"{median_ms:.1f}")
        out.append((row, a, b, actual))
    if hasattr(os, "getloadavg"):
        load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
        say(f"(load average at the end, 1, 5, 15 min: {load}, on {os.cpu_count()} cores; the measurement's own "
            f"{world} ranks make {world})")
    return out


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gpu", default="h100", help=f"cpu (measured here) or one of {', '.join(hardware.GPUS)}")
    parser.add_argument("--shape", default=None, choices=list(shapes()),
                        help="default: llama-8b on a GPU, ratios on the CPU")
    parser.add_argument("--rows", nargs="+", type=registry.row_argument, metavar="ROW",
                        help=f"recipes (benchmarks.rows; default on a GPU: {' '.join(GPU_ROWS)}; on the CPU: "
                        "benchmarks.ratios' default rows and baseline)")
    parser.add_argument("--world-size", type=int, default=None, help="ranks (default: 8 on a GPU, 2 on the CPU)")
    parser.add_argument("--dim", type=int, default=1024, help="--shape ratios: the width (benchmarks.ratios' --dim)")
    parser.add_argument("--n-layers", type=int, default=2, help="--shape ratios: blocks")
    parser.add_argument("--batch-size", type=int, default=None, help="sequences per rank (default: the shape's)")
    parser.add_argument("--seq-len", type=int, default=None, help="tokens per sequence (default: the shape's)")
    parser.add_argument("--whole", action="store_true", help="trace every block instead of extrapolating from 1 and 2")
    parser.add_argument("--gemm-size", type=int, default=None, help="--gpu cpu: m = n = k of the measured GEMM "
                        "rates (default: the model's width)")
    parser.add_argument("--threads", type=int, default=1, help="--gpu cpu: threads per rank (benchmarks.ratios')")
    parser.add_argument("--validate", action="store_true",
                        help="--gpu cpu, and measure the same rows with benchmarks.ratios in this run")
    parser.add_argument("--steps", type=int, default=20, help="--validate: timed steps per row")
    parser.add_argument("--warmup", type=int, default=3, help="--validate: untimed steps per row first")
    parser.add_argument("--launch-us", type=float, default=None, help="a GPU's cost per kernel launch, us")
    parser.add_argument("--sync-us", type=float, default=None, help="a GPU's cost per host sync, us")
    args = parser.parse_args(argv)
    on_cpu = args.validate or args.gpu == "cpu"
    if not on_cpu and args.gpu not in hardware.GPUS:
        parser.error(f"--gpu {args.gpu}: one of cpu, {', '.join(hardware.GPUS)}")
    world = args.world_size or (2 if on_cpu else 8)
    name = args.shape or ("ratios" if on_cpu else "llama-8b")
    base_shape = shapes(args.dim, args.n_layers, args.batch_size or 4, args.seq_len or 256)[name]
    shape = dataclasses.replace(base_shape, batch=args.batch_size or base_shape.batch,
                                seq=args.seq_len or base_shape.seq)
    if shape.seq > shape.args.max_seq_len:
        shape = dataclasses.replace(shape, args=dataclasses.replace(shape.args, max_seq_len=shape.seq))
    print(hardware.hardware_line())
    if on_cpu:
        baseline = ratios.default_baseline("cpu")
        rows = list(dict.fromkeys([baseline, *(args.rows or ratios.DEFAULT_ROWS)]))
        a = shape.args
        peaks = measure_cpu_peaks(args.gemm_size or a.dim, threads=args.threads, world=world,
                                  attention=(a.n_heads, shape.seq, a.dim // a.n_heads, shape.batch))
    else:
        baseline = "bf16"
        rows = list(dict.fromkeys([baseline, *(args.rows or GPU_ROWS)]))
        overrides = {k: v * 1e-6 for k, v in (("launch_s", args.launch_us), ("sync_s", args.sync_us)) if v is not None}
        peaks = gpu_peaks(hardware.GPUS[args.gpu], **overrides)
    if args.validate:
        if name != "ratios":
            parser.error("--validate measures benchmarks.ratios' shape: --shape ratios")
        settings = ratios.settings_for(args.dim, rows, steps=args.steps, warmup=args.warmup, n_layers=args.n_layers,
                                       batch_size=shape.batch, seq_len=shape.seq, threads=args.threads,
                                       baseline=baseline)
        return dict(validation=validate(rows, shape, settings, peaks, baseline, world, args.threads))
    estimates = estimate(rows, shape, peaks, world, whole=args.whole)
    if not on_cpu:
        print(f"ESTIMATES from published peaks, not measurements ({peaks.name})")
    report(estimates, baseline, peaks, shape, world)
    return dict(estimates=estimates, baseline=baseline)


if __name__ == "__main__":
    main(sys.argv[1:])
