"""The cost model of one FSDP2 training step per rank behind ``python -m benchmarks.scaling``
(whose docstring states its formulas): the model's sizes, the bytes each precision puts
on the wire, the links and devices, and the step time from compute and communication."""

from __future__ import annotations

import math
from dataclasses import dataclass

from launch.precisions import PRECISIONS

KINDS = ("bf16", "int8", "int8-mm", "int8-grads")  # measured by the check, and projected
PROJECTED_KINDS = KINDS + ("int8-mm-grads",)
LABELS = {kind: PRECISIONS[kind].label for kind in PROJECTED_KINDS}
GRAD_BLOCK = 256  # values per fp32 scale in the int8 reduce-scatter


# ---------------------------------------------------------------- the model's sizes
@dataclass(frozen=True)
class Shape:
    """A Llama-style decoder as ``launch.model.Transformer`` builds it (no GQA, untied head)."""

    name: str
    dim: int
    n_layers: int
    vocab: int
    seq: int
    hidden: int = 0

    @property
    def ffn(self) -> int:
        return self.hidden or 16 * math.ceil(8 * self.dim / 3 / 16)

    def linear_rows(self) -> list[tuple[int, int]]:
        """``(out, in)`` of every quantized linear layer (fsdp_int8's default filter: all
        but the output head)."""
        block = [(self.dim, self.dim)] * 4 + [(self.ffn, self.dim)] * 2 + [(self.dim, self.ffn)]
        return block * self.n_layers

    @property
    def block_linear(self) -> int:
        return sum(o * i for o, i in self.linear_rows()[:7])

    @property
    def quantized(self) -> int:
        return self.block_linear * self.n_layers

    @property
    def embedding(self) -> int:
        return self.vocab * self.dim

    @property
    def full_precision(self) -> int:
        """Embedding, norms and output head: left in the compute dtype by fsdp_int8."""
        return 2 * self.vocab * self.dim + (2 * self.n_layers + 1) * self.dim

    @property
    def params(self) -> int:
        return self.quantized + self.full_precision

    @property
    def matmul_params(self) -> int:
        return self.quantized + self.vocab * self.dim  # the head is a GEMM too


def launcher_shape(name: str, dim: int, n_layers: int, seq: int) -> Shape:
    return Shape(name, dim=dim, n_layers=n_layers, vocab=256, seq=seq)


# ---------------------------------------------------------------- bytes per step
def all_gather_elements(shape: Shape) -> tuple[float, float]:
    """``(quantized, full precision)`` parameters all-gathered per step: every group in
    forward; every block but the last, and the embedding, again in backward."""
    regathered = (shape.n_layers - 1) / shape.n_layers
    quantized = shape.quantized * (1 + regathered)
    full = shape.full_precision + shape.embedding + (2 * (shape.n_layers - 1)) * shape.dim
    return quantized, full


def step_bytes(shape: Shape, kind: str) -> dict:
    """Bytes of the step's all-gather output buffers and reduce-scatter input buffers (all
    ranks' shares: what ``fsdp_int8.collectives.count_collectives`` reports)."""
    quantized, full = all_gather_elements(shape)
    precision = PRECISIONS[kind]
    if not precision.int8:  # the bf16 baseline
        gather = 2 * (quantized + full)
    else:
        scale_per_weight = sum(o * 4 for o, _ in shape.linear_rows()) / shape.quantized  # 4 / K on average
        gather = (1 + scale_per_weight) * quantized + 2 * full
    reduce = shape.params * ((1 + 4 / GRAD_BLOCK) if precision.int8_gradients else 4)
    return dict(all_gather=gather, reduce_scatter=reduce)


def collectives_per_step(shape: Shape) -> tuple[int, int]:
    """``(all-gathers, reduce-scatters)`` per step: groups are the embedding, each block
    and the root (norm + head)."""
    groups = shape.n_layers + 2
    return groups + (shape.n_layers - 1) + 1, groups


# ---------------------------------------------------------------- hardware
@dataclass(frozen=True)
class Link:
    name: str
    alpha: float  # seconds per ring step
    beta: float  # bytes per second per rank, each direction (achieved)


@dataclass(frozen=True)
class Device:
    name: str
    bf16: float  # achieved dense GEMM FLOP/s
    int8: float  # achieved dense int8 GEMM OP/s
    memory: float  # bytes/s for the memory-bound passes
    cores_per_rank: float = 1.0  # CPU: the share of a core each rank gets (1 on GPUs)


# Published peaks (H100 SXM: 989 TFLOP/s dense bf16, 1979 TOPS dense int8, 3.35 TB/s HBM3;
# NVLink 4: 900 GB/s per GPU, 450 each way; NDR InfiniBand 400 Gb/s and 100 Gb/s Ethernet,
# one NIC per GPU), derated to what is usually achieved: 60% of the GEMM peaks, 80% of the
# link and memory bandwidths.
H100 = Device("H100 SXM", bf16=0.6 * 989e12, int8=0.6 * 1979e12, memory=0.8 * 3.35e12)
NVLINK = Link("NVLink (one node)", alpha=3e-6, beta=0.8 * 450e9)
INFINIBAND = Link("400 Gb/s InfiniBand", alpha=5e-6, beta=0.8 * 400e9 / 8)
ETHERNET = Link("100 Gb/s Ethernet", alpha=10e-6, beta=0.8 * 100e9 / 8)


def ring_link(world: int, network: Link, gpus_per_node: int = 8) -> Link:
    return NVLINK if world <= gpus_per_node else network


# ---------------------------------------------------------------- time per step
def compute_seconds(shape: Shape, kind: str, tokens: int, device: Device) -> dict:
    """GEMM, attention and fsdp_int8's memory-bound passes, per rank and step."""
    gemm = 6 * shape.matmul_params * tokens
    precision = PRECISIONS[kind]
    matmuls = precision.int8_matmul
    if matmuls is not None:
        # each of output, grad_input and the weight gradient is 2 of the 6 FLOPs per weight and token
        int8_part = 2 * (matmuls.output + matmuls.grad_input + matmuls.grad_weight) * shape.quantized * tokens
        gemm_s = int8_part / device.int8 + (gemm - int8_part) / device.bf16
    else:
        gemm_s = gemm / device.bf16
    attention_s = 6 * shape.n_layers * shape.seq * shape.dim * tokens / device.bf16
    extra = 0.0
    rows = shape.linear_rows()
    if matmuls is not None:  # (the default Int8MatmulConfig: all three GEMMs in int8)
        # x and grad_y quantized by rows and by columns (2 bytes in, 1 out, twice each); the
        # int32 output and grad_input dequantized (4 in, 2 out); the int32 weight gradient too
        extra = sum(12 * (o + i) * tokens + 6 * o * i for o, i in rows)
    elif precision.int8:  # weight-only: the weight in bf16 for each of its 2 matmuls: 1 byte in, 2 out
        extra = sum(2 * 3 * o * i for o, i in rows)
    extra_s = extra / device.memory
    total = (gemm_s + attention_s + extra_s) / device.cores_per_rank
    return dict(gemm=gemm_s, attention=attention_s, extra=extra_s, total=total)


def comm_seconds(shape: Shape, kind: str, world: int, link: Link) -> dict:
    if world == 1:
        return dict(total=0.0, edge=0.0, sent=0.0)
    b = step_bytes(shape, kind)
    sent = (b["all_gather"] + b["reduce_scatter"]) * (world - 1) / world
    gathers, reduces = collectives_per_step(shape)
    latency = (gathers + reduces) * (world - 1) * link.alpha
    total = latency + sent / link.beta
    return dict(total=total, edge=total * 2 / (gathers + reduces), sent=sent)


def step_seconds(shape: Shape, kind: str, world: int, tokens: int, device: Device, link: Link,
                 overlap: bool = True) -> dict:
    compute = compute_seconds(shape, kind, tokens, device)["total"]
    comm = comm_seconds(shape, kind, world, link)
    total = max(compute, comm["total"]) + comm["edge"] if overlap else compute + comm["total"]
    return dict(compute=compute, comm=comm["total"], total=total, sent=comm["sent"])


# ---------------------------------------------------------------- projection
