"""Grouped int8 GEMMs of a mixture of experts: int8 x int8 -> int32, one expert per group of
rows, scaled to floating point; the groups come from ``torch._grouped_mm``'s cumulative
``offs`` (one per expert), which stay on the device.

Two GEMMs, each with two implementations that give the same values bit for bit (integer
sums are exact, and the fp32 scaling runs the same operations in the same order):

* :func:`grouped_rows`: ``out[r, j] = row_scale[r] * col_scale[e(r), j] * sum_i a[r, i] * b[e(r), i, j]``
  where ``e(r)`` is row ``r``'s expert (the output and the input gradient of grouped experts);
  rows at or past the last offset are zero.
* :func:`grouped_sums`: ``out[e, n, k] = sum over e's rows r of a[r, n] * b[r, k]``, scaled
  by ``scale_a[e, n] * scale_b[e, k]`` (the experts' weight gradient).

The Triton kernels (CUDA, or any device under ``TRITON_INTERPRET=1``, Triton's CPU
interpreter, which the tests use) read the offsets on the device: no host sync, one launch
per GEMM whatever the number of experts. Elsewhere a loop over the experts runs
``torch._int_mm`` on each expert's rows, after reading the offsets on the host: free on the
CPU, a stall on a GPU without Triton.
"""

from __future__ import annotations

import functools
import importlib.util
import os

import torch

# |int32 sum| <= rows * 127 * 127 < 2**31 for up to 133,144 rows: the weight gradient sums
# an expert's rows in chunks below that, each scaled into an fp32 total.
MAX_ROWS_PER_INT32_SUM = 1 << 17


def on_device(device: torch.device) -> bool:
    """Whether the grouped GEMMs on ``device`` run as Triton kernels that read the offsets on
    the device (CUDA with Triton installed, or Triton's interpreter: ``TRITON_INTERPRET=1``)."""
    if importlib.util.find_spec("triton") is None:
        return False
    return device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"


def expert_of_rows(offs: torch.Tensor, rows: int) -> torch.Tensor:
    """Each row's expert, ``[rows]`` int64, on the device: the number of offsets at or
    before it. Rows at or past the last offset get ``len(offs)`` (no expert)."""
    positions = torch.arange(rows, device=offs.device, dtype=offs.dtype)
    return torch.searchsorted(offs, positions, right=True)


def host_groups(offs: torch.Tensor, experts: int) -> list[tuple[int, slice]]:
    """``(expert, its rows)`` of every expert with rows, read on the host (the loop's way)."""
    ends = offs.tolist()
    if len(ends) != experts:
        raise ValueError(f"grouped_mm: {len(ends)} offsets for {experts} experts")
    starts = [0, *ends[:-1]]
    return [(e, slice(a, b)) for e, (a, b) in enumerate(zip(starts, ends)) if b > a]


def grouped_rows(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor, row_scale: torch.Tensor,
                 col_scale: torch.Tensor | None, dtype: torch.dtype, *, b_transposed: bool) -> torch.Tensor:
    """``out[r, :] = row_scale[r] * col_scale[e(r)] * (a[r] @ B[e(r)])`` in ``dtype``.

    Args:
        a: ``[rows, I]`` int8.
        b: int8 experts, ``[E, J, I]`` with ``b_transposed`` (``B[e] = b[e].T``: the stored
            weight, for the output) or ``[E, I, J]`` (``B[e] = b[e]``: for the input gradient).
        offs: ``[E]`` int32, cumulative rows per expert.
        row_scale: ``[rows]`` fp32.
        col_scale: ``[E, J]`` fp32, or ``None`` for none.
    """
    experts = b.shape[0]
    cols = b.shape[1] if b_transposed else b.shape[2]
    if a.shape[0] and cols and on_device(a.device):
        out = _kernel_output((a.shape[0], cols), a.device, dtype)  # every element written
        _launch_rows(a, b, offs, row_scale, col_scale, out, b_transposed)
        return out.to(dtype)
    out = torch.zeros(a.shape[0], cols, device=a.device, dtype=dtype)
    if not out.numel():
        return out
    for expert, rows in host_groups(offs, experts):
        operand = b[expert].t() if b_transposed else b[expert]
        acc = torch._int_mm(a[rows], operand).float() * row_scale[rows].unsqueeze(1)
        out[rows] = (acc * col_scale[expert] if col_scale is not None else acc).to(dtype)
    return out


def grouped_sums(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor, scale_a: torch.Tensor,
                 scale_b: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """``out[e] = scale_a[e][:, None] * scale_b[e][None, :] * (a[rows of e].T @ b[rows of e])``
    ``[E, N, K]`` in ``dtype``; ``a`` ``[rows, N]`` and ``b`` ``[rows, K]`` int8, the scales
    ``[E, N]`` and ``[E, K]`` fp32 (``scale_b`` ``None``: none). Sums over more than
    :data:`MAX_ROWS_PER_INT32_SUM` rows are split, each part scaled and added in fp32."""
    experts = offs.shape[0]
    shape = (experts, a.shape[1], b.shape[1])
    if a.shape[1] and b.shape[1] and on_device(a.device):
        out = _kernel_output(shape, a.device, dtype)  # every element written, empty experts too
        _launch_sums(a, b, offs, scale_a, scale_b, out)
        return out.to(dtype)
    out = torch.zeros(shape, device=a.device, dtype=dtype)
    if not a.shape[0] or not out.numel():
        return out
    for expert, rows in host_groups(offs, experts):
        total = None
        for start in range(rows.start, rows.stop, MAX_ROWS_PER_INT32_SUM):
            chunk = slice(start, min(start + MAX_ROWS_PER_INT32_SUM, rows.stop))
            part = torch._int_mm(a[chunk].t(), b[chunk]).float() * scale_a[expert].unsqueeze(1)
            if scale_b is not None:
                part = part * scale_b[expert]
            total = part if total is None else total + part
        out[expert] = total.to(dtype)
    return out


# ---------------------------------------------------------------- Triton
def _tile(device: torch.device) -> int:
    """Rows, columns and sum length of a kernel's tile: 32 on a GPU (int8 dots need at
    least 16 per dim, 32 along the sum; a starting point, not tuned); 64 under the CPU
    interpreter, which runs each tile as numpy: a quarter of the programs to run, the same
    values (integer sums are exact whatever the tiling)."""
    return 32 if device.type == "cuda" else 64


def _kernel_output(shape: tuple[int, ...], device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """Where a kernel stores its results: a ``dtype`` tensor on a GPU (Triton rounds fp32 to
    bf16 to nearest even, as torch does); an fp32 one under the interpreter, which rounds
    to bf16 by truncation, for torch to round afterwards."""
    return torch.empty(shape, device=device, dtype=dtype if device.type == "cuda" else torch.float32)


def _launch_rows(a, b, offs, row_scale, col_scale, out, b_transposed: bool) -> None:
    kernel = _kernels()[0]
    experts, inner = b.shape[0], a.shape[1]
    # B[e][i, j] at b + e * stride_e + i * stride_i + j * stride_j
    stride_e = b.stride(0)
    stride_i, stride_j = (b.stride(2), b.stride(1)) if b_transposed else (b.stride(1), b.stride(2))
    has_cols = col_scale is not None
    row_scale = row_scale.contiguous()
    cols_ptr = col_scale.contiguous() if has_cols else row_scale
    tile = _tile(a.device)
    grid = (triton_cdiv(a.shape[0], tile), triton_cdiv(out.shape[1], tile))
    kernel[grid](
        a, b, offs, row_scale, cols_ptr, out,
        a.shape[0], out.shape[1], inner, experts,
        a.stride(0), a.stride(1), stride_e, stride_i, stride_j,
        cols_ptr.stride(0) if has_cols else 0, out.stride(0),
        HAS_COL_SCALE=has_cols, SEARCH_STEPS=experts.bit_length(),
        BLOCK_M=tile, BLOCK_N=tile, BLOCK_K=tile,
    )


def _launch_sums(a, b, offs, scale_a, scale_b, out) -> None:
    kernel = _kernels()[1]
    experts, n, k = out.shape
    has_b = scale_b is not None
    scale_a = scale_a.contiguous()
    b_scale_ptr = scale_b.contiguous() if has_b else scale_a
    tile = _tile(a.device)
    grid = (experts, triton_cdiv(n, tile), triton_cdiv(k, tile))
    kernel[grid](
        a, b, offs, scale_a, b_scale_ptr, out, n, k,
        a.stride(0), a.stride(1), b.stride(0), b.stride(1),
        scale_a.stride(0), b_scale_ptr.stride(0) if has_b else 0,
        out.stride(0), out.stride(1),
        HAS_B_SCALE=has_b, CHUNK=MAX_ROWS_PER_INT32_SUM,
        BLOCK_M=tile, BLOCK_N=tile, BLOCK_K=tile,
    )


def triton_cdiv(a: int, b: int) -> int:
    return -(-a // b)


@functools.cache
def _kernels():
    """The two Triton kernels (:mod:`._grouped_triton`), imported on first use: ``triton.jit``
    reads ``TRITON_INTERPRET`` when it wraps a function, so the environment of the first
    grouped GEMM on the device decides between compiled and interpreted kernels."""
    from fsdp_int8._quant import _grouped_triton

    return _grouped_triton.rows_kernel, _grouped_triton.sums_kernel
