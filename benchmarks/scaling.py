"""A cost model of one FSDP2 training step per rank: bytes, communication and compute time.

    python -m benchmarks.scaling                   # the projection to 8-1024 GPUs, table + plot
    python -m benchmarks.scaling --measure         # + the check against gloo runs on this machine
    python -m benchmarks.scaling --measure --write-docs docs   # also the tables into docs/scaling.md
    python -m benchmarks.scaling --measure --log   # + a dated section in benchmarks/results/scaling.md

Rows (precisions of ``launch.precisions``): ``bf16`` (bf16 FSDP2: bf16 parameters on the
wire, fp32 gradient reduce-scatter), ``int8`` (fsdp_int8 weight-only: int8 weights + row
scales on the wire, bf16 matmuls), ``int8-mm`` (the same wire, the GEMMs in int8),
``int8-grads`` (weight-only plus the int8 gradient reduce-scatter) and, projected only,
``int8-mm-grads`` (``int8-mm`` plus the int8 gradient reduce-scatter).

Per rank and step, with ``P`` parameters, ``N`` ranks, ``T`` tokens per rank:

* all-gather: FSDP2 gathers every group in forward and the resharded blocks again in
  backward (``shard_model``: all blocks but the last, and the embedding): the buffers hold
  2 bytes a parameter for bf16, ``1 + 4 / K`` for an int8 row of ``K`` weights (its fp32
  scale), 2 for the parameters fsdp_int8 leaves in full precision (embeddings, norms,
  head: bf16 under the bf16 policy);
* reduce-scatter: 4 bytes a parameter (fp32), or ``1 + 4 / 256`` on the int8 all-to-all;
* a ring sends ``(N - 1) / N`` of each buffer: ``time = (N - 1) * alpha + bytes / beta``
  per collective, ``beta`` the slowest link the ring crosses (NVLink inside a node of 8,
  the network between nodes);
* compute: ``6 * P_matmul * T`` GEMM FLOPs (2 forward, 4 backward) at the device's bf16
  rate, the int8 GEMMs (output and grad_input: two thirds of them) at its int8 rate,
  attention ``6 * layers * seq * dim * T`` at the bf16 rate, plus the memory-bound
  passes fsdp_int8 adds (quantizing activations and gradients, dequantizing int32 results
  and, for weight-only, the weight once per matmul) at the memory bandwidth;
* overlap: FSDP2 prefetches the next all-gather and reduce-scatters during backward, so
  on GPUs ``step = max(compute, communication) + one group's all-gather and
  reduce-scatter`` (the edges it cannot hide); on this CPU, where gloo's threads compete
  with the compute for the same two cores, ``step = compute + communication``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

from benchmarks._step_cost import (
    ETHERNET, H100, INFINIBAND, KINDS, LABELS, NVLINK, PROJECTED_KINDS, Device, Link, comm_seconds,
    compute_seconds, launcher_shape, ring_link, step_bytes, step_seconds,
)

PROJECTED = (
    (launcher_shape("1B (dim 2048, 16 blocks)", 2048, 16, 2048), 8192),
    (launcher_shape("7B-class (dim 4096, 32 blocks)", 4096, 32, 4096), 8192),
    (launcher_shape("7B-class (dim 4096, 32 blocks)", 4096, 32, 4096), 32768),
)
WORLDS = (8, 16, 32, 64, 128, 256, 512, 1024)
NETWORKS = (INFINIBAND, ETHERNET)


def projection_lines() -> tuple[list[str], dict]:
    lines, series = [], {}
    lines.append(f"Device {H100.name}: bf16 {H100.bf16 / 1e12:.0f} TFLOP/s and int8 {H100.int8 / 1e12:.0f} TOPS "
                 f"achieved (60% of dense peak), {H100.memory / 1e12:.2f} TB/s; links (80% achieved): "
                 + ", ".join(f"{l.name} {l.beta / 1e9:.1f} GB/s, alpha {l.alpha * 1e6:.0f} us"
                             for l in (NVLINK, INFINIBAND, ETHERNET)))
    for shape, tokens in PROJECTED:
        lines.append("")
        lines.append(f"{shape.name}: {shape.params / 1e9:.2f}B params ({shape.quantized / shape.params:.1%} in "
                     f"int8 linears), {tokens} tokens per GPU per step, sequence {shape.seq}")
        widths = {k: max(18, len(LABELS[k])) for k in PROJECTED_KINDS}
        header = (f"{'GPUs':>5} {'network':<20} " + " ".join(f"{LABELS[k]:>{widths[k]}}" for k in PROJECTED_KINDS)
                  + "  bound (bf16)")
        lines.append(header)
        for network in NETWORKS:
            for world in WORLDS:
                link = ring_link(world, network)
                times = {k: step_seconds(shape, k, world, tokens, H100, link) for k in PROJECTED_KINDS}
                base = times["bf16"]["total"]
                cells = []
                for k in PROJECTED_KINDS:
                    cells.append(f"{times[k]['total'] * 1e3:8.1f} ms {base / times[k]['total']:5.2f}x")
                    series.setdefault((shape.name, tokens, network.name, k), []).append(
                        (world, base / times[k]["total"]))
                bound = "comm" if times["bf16"]["comm"] > times["bf16"]["compute"] else "compute"
                lines.append(f"{world:5d} {link.name if world <= 8 else network.name:<20} " + " ".join(
                    f"{c:>{widths[k]}}" for c, k in zip(cells, PROJECTED_KINDS)) + f"  {bound}")
    lines.append("")
    lines.append("Each cell: step time and bf16's step time over it (the speed-up, higher is faster).")
    return lines, series


def plot(series: dict, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [(s.name, t) for s, t in PROJECTED]
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4.6), sharey=True)
    styles = {INFINIBAND.name: "-", ETHERNET.name: "--"}
    colors = {"int8": "tab:blue", "int8-mm": "tab:orange", "int8-grads": "tab:green", "int8-mm-grads": "tab:red"}
    for ax, (name, tokens) in zip(axes, panels):
        for network in NETWORKS:
            for kind in PROJECTED_KINDS[1:]:
                points = series[(name, tokens, network.name, kind)]
                ax.plot([w for w, _ in points], [r for _, r in points], styles[network.name], marker="o",
                        markersize=3, color=colors[kind], label=f"{LABELS[kind]}, {network.name}")
        ax.axhline(1.0, color="gray", linewidth=0.8)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("GPUs (8 per node; NVLink at 8)")
        ax.set_title(f"{name}\n{tokens} tokens per GPU", fontsize=9)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("speed-up over bf16 FSDP2 (model)")
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=4, fontsize=8)
    fig.tight_layout(rect=(0, 0.12, 1, 1))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


# ---------------------------------------------------------------- the check on this machine
def _gloo_body(rank: int, world: int, sizes: list[int], repeats: int) -> list[tuple[int, float]]:
    import time

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    out = []
    for size in sizes:
        send = torch.zeros(size // world, dtype=torch.int8)
        recv = torch.empty(size // world * world, dtype=torch.int8)
        times = []
        for _ in range(repeats):
            dist.barrier()
            began = time.perf_counter()
            dist.all_gather_into_tensor(recv, send)
            times.append(time.perf_counter() - began)
        out.append((size // world * world, statistics.median(times)))
    return out


def measure_link(world: int) -> Link:
    """alpha, beta of gloo's all-gather between ``world`` processes here: a least-squares
    line through (bytes each rank sends, seconds) over buffers of 64 KB to 32 MB."""
    from fsdp_int8.testing import run_distributed

    sizes = [1 << s for s in range(16, 26)]
    points = run_distributed(_gloo_body, world, sizes, 7)[0]
    xs = [b * (world - 1) / world for b, _ in points]
    ys = [t for _, t in points]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    intercept = max(my - slope * mx, 0.0)
    return Link(f"gloo, {world} ranks", alpha=intercept / (world - 1), beta=1 / slope)


def _gemm_rates(threads: int) -> tuple[float, float]:
    """Measured bf16 and int8 GEMM rates of one rank here (1024 x 1024 x 2736)."""
    import time

    import torch

    torch.set_num_threads(threads)
    a, b = torch.randn(1024, 1024).bfloat16(), torch.randn(2736, 1024).bfloat16()
    qa, qb = torch.randint(-127, 128, (1024, 1024), dtype=torch.int8), torch.randint(-127, 128, (2736, 1024),
                                                                                  dtype=torch.int8)
    rates = []
    for run in (lambda: a @ b.t(), lambda: torch._int_mm(qa, qb.t())):
        run()
        times = []
        for _ in range(9):
            began = time.perf_counter()
            run()
            times.append(time.perf_counter() - began)
        rates.append(2 * 1024 * 1024 * 2736 / statistics.median(times))
    return rates[0], rates[1]


def check_lines(dim: int, steps: int, cores: int) -> list[str]:
    from benchmarks.compare import timed_rows
    from fsdp_int8.testing import run_distributed

    shape = launcher_shape(f"launcher Transformer dim {dim}", dim, 2, 256)
    tokens = 4 * 256
    settings = dict(preset="base", dim=dim, n_layers=2, n_heads=max(1, dim // 64), seq_len=256, batch_size=4,
                    threads=1, lr=1e-3, max_bytes=4_000_000, timed_steps=steps, warmup=3)
    bf16_rate, int8_rate = _gemm_rates(1)
    cpu = Device("this CPU, 1 thread", bf16=bf16_rate, int8=int8_rate, memory=8e9)
    links = {world: measure_link(world) for world in (2, 4)}
    measured = {}
    for world in (1, 2, 4):
        measured[world] = run_distributed(timed_rows, world, list(KINDS), settings, timeout=3600)[0]
    lines = [f"{shape.name}, 2 blocks, heads of 64, batch 4 x 256 per rank, torch AdamW; {steps} steps per row "
             f"interleaved in one launch per world size; {cores} cores, 1 thread per rank.",
             f"Measured here: bf16 GEMM {bf16_rate / 1e9:.0f} GFLOP/s, int8 GEMM {int8_rate / 1e9:.0f} GOP/s "
             f"(one thread); gloo all-gather " + ", ".join(
                 f"{w} ranks: alpha {l.alpha * 1e6:.0f} us, beta {l.beta / 1e9:.2f} GB/s" for w, l in links.items()),
             "Predicted: bytes from the model above; time = compute measured at 1 rank, stretched by the CPU "
             "share (2 cores for N ranks), + alpha-beta communication, no overlap.", ""]
    width = max(18, *(len(LABELS[k]) for k in KINDS))
    lines.append(f"{'ranks':>5} {'row':<{width}} {'all-gather MB':>14} {'(counted)':>10} {'sent MB/rank':>13} "
                 f"{'(counted)':>10} {'step ms':>8} {'(measured)':>11} {'error':>7}")
    for world in (1, 2, 4):
        for kind in KINDS:
            row = measured[world][kind]
            compute = measured[1][kind]["step_s"] * max(1.0, world / cores)
            comm = comm_seconds(shape, kind, world, links[world])["total"] if world > 1 else 0.0
            predicted = compute + comm
            b = step_bytes(shape, kind)
            gather_mb = b["all_gather"] / 1e6 if world > 1 else 0.0
            sent_mb = (b["all_gather"] + b["reduce_scatter"]) * (world - 1) / world / 1e6
            lines.append(f"{world:5d} {LABELS[kind]:<{width}} {gather_mb:14.2f} {row['all_gather'] / 1e6:10.2f} "
                         f"{sent_mb:13.2f} {row['sent_per_rank'] / 1e6:10.2f} {predicted * 1e3:8.0f} "
                         f"{row['step_s'] * 1e3:11.0f} {predicted / row['step_s'] - 1:+7.0%}")
    gemm_only = {k: compute_seconds(shape, k, tokens, cpu) for k in KINDS}
    lines.append("")
    lines.append("Compute at 1 rank from the FLOP model (GEMMs at the measured rates, + the memory-bound passes) "
                 "against the measured step: " + ", ".join(
                     f"{LABELS[k]} {gemm_only[k]['total'] * 1e3:.0f} of {measured[1][k]['step_s'] * 1e3:.0f} ms"
                     for k in KINDS) + " (the rest: attention, norms, optimizer, Python).")
    return lines


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--measure", action="store_true", help="check the model against gloo runs at 1, 2, 4 ranks")
    parser.add_argument("--dim", type=int, default=512, help="width of the model of the check")
    parser.add_argument("--steps", type=int, default=10, help="interleaved timed steps per row in the check")
    parser.add_argument("--cores", type=int, default=2, help="CPU cores the ranks of the check share")
    parser.add_argument("--plot", type=Path, help="where the plot goes (default: DOCS/img/scaling.png with "
                        "--write-docs, else scaling.png here)")
    parser.add_argument("--write-docs", type=Path, help="write the printed tables into DOCS/scaling.md's "
                        "generated section")
    parser.add_argument("--log", action="store_true", help="also append a dated section (command, hardware line, "
                        "tables) to benchmarks/results/scaling.md")
    args = parser.parse_args(argv)
    lines, series = projection_lines()
    print("\n".join(lines))
    target = args.plot or (args.write_docs / "img" / "scaling.png" if args.write_docs else Path("scaling.png"))
    print(f"plot: {plot(series, target)}")
    check = []
    if args.measure:
        print()
        from fsdp_int8 import hardware

        check = [hardware.hardware_line(), *check_lines(args.dim, args.steps, args.cores)]
        print("\n".join(check))
    if args.write_docs:
        _write_generated(args.write_docs / "scaling.md", lines, check, argv if argv is not None else sys.argv[1:])
    if args.log:
        from benchmarks.report import log_run

        command = "python -m benchmarks.scaling " + " ".join(argv if argv is not None else sys.argv[1:])
        print(f"logged: {log_run('scaling.md', 'Scaling: check and projection', command, [*check, '', *lines])}")


BEGIN, END = "<!-- generated by benchmarks/scaling.py: begin -->", "<!-- generated by benchmarks/scaling.py: end -->"


def _write_generated(path: Path, projection: list[str], check: list[str], argv: list[str]) -> None:
    """Replace the text between the BEGIN and END markers of ``path`` with this run's output."""
    import datetime

    text = path.read_text()
    if BEGIN not in text or END not in text:
        raise SystemExit(f"{path} has no generated section ({BEGIN} ... {END})")
    body = [BEGIN, "", f"`python -m benchmarks.scaling {' '.join(argv)}`, run on {datetime.date.today()}:", ""]
    if check:
        body += ["Check against gloo runs on this machine:", "", "```", *check, "```", ""]
    body += ["Projection:", "", "```", *projection, "```", "", "![scaling](img/scaling.png)", "", END]
    head, rest = text.split(BEGIN, 1)
    path.write_text(head + "\n".join(body) + rest.split(END, 1)[1])


if __name__ == "__main__":
    main()
