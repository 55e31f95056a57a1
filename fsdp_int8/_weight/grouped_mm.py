"""``int8_grouped_mm``: the grouped matmul of experts, int8 GEMMs device-side.

``int8_grouped_mm(x, w, offs)`` is ``torch._grouped_mm(x, w.transpose(-2, -1), offs=offs)``
for expert weights ``w`` ``[E, out, in]``: the one op through which every int8 experts
module computes. For an ``Int8Weight`` with an ``Int8MatmulConfig``, each pass it runs in
int8 quantizes its floating operand once for all experts, on the device:

* forward: ``x`` per token row (round to nearest); one grouped GEMM against the int8
  experts, scaled by the rows' and the experts' scales;
* input gradient: ``grad_y`` times each row's expert scales, per row; one grouped GEMM;
* weight gradient: ``grad_y`` and ``x`` per channel over each expert's tokens (segmented
  absmax); one grouped sum per expert. With ``save_int8_input`` the forward's int8 rows
  and per-token scales are what backward keeps, and their scales fold into ``grad_y``.

A pass its config leaves in the compute dtype (every pass of a weight-only ``Int8Weight``)
is ``torch._grouped_mm`` on the experts' dequantized values (a transient of that pass); a
plain weight runs ``torch._grouped_mm`` as it is. Every int8 value equals what :mod:`.linear`
computes for each expert's rows alone (its per-expert path, bit for bit: the tests compare
them). The offsets never leave the device where
:func:`fsdp_int8._quant.grouped_gemm.on_device` holds; rows at or past the last offset give
zeros.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from fsdp_int8._quant.grouped_gemm import expert_of_rows, grouped_rows, grouped_sums
from fsdp_int8._quant.kernels import INT8_MAX, dequantize_whole, round_scaled
from fsdp_int8._weight.linear import _quantize_activations as quantize_activations
from fsdp_int8._weight.tensor import Int8Weight


class _Passes(NamedTuple):
    """Which passes run int8 GEMMs (an ``Int8MatmulConfig``'s fields)."""

    output: bool = False
    grad_input: bool = False
    grad_weight: bool = False
    save_int8_input: bool = False


# a weight-only expert weight: every pass on its values
_ALL_IN_COMPUTE_DTYPE = _Passes()


def _segment_columns(values: torch.Tensor, experts_of_rows: torch.Tensor,
                     experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``values`` ``[rows, C]`` as int8 with one scale per (expert, column) over that
    expert's rows: ``int8_columns`` of each expert's rows, for all experts in one pass.
    Returns ``(q [rows, C], scale [E, C])``; rows of no expert quantize to 0."""
    v = values.float()
    amax = v.new_zeros(experts + 1, v.shape[1])
    amax.scatter_reduce_(0, experts_of_rows.unsqueeze(1).expand_as(v), v.abs(), "amax")
    scale = amax / INT8_MAX
    divisor = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = round_scaled(v, divisor[experts_of_rows], None, -INT8_MAX, INT8_MAX, torch.int8)
    return q, scale[:experts]


def _padded(values: torch.Tensor, dims: tuple[int, ...]) -> torch.Tensor:
    """``values`` zero-padded at the end of ``dims`` to whole 16 bytes, contiguous:
    ``torch._grouped_mm`` needs strides of whole 16 bytes, and zeros change no sum."""
    multiple = max(1, 16 // values.element_size())
    pad = [0] * (2 * values.dim())
    for dim in dims:
        pad[2 * (values.dim() - 1 - dim % values.dim()) + 1] = -values.shape[dim] % multiple
    return torch.nn.functional.pad(values, pad).contiguous() if any(pad) else values.contiguous()


def _dense_rows(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor, past_the_end: torch.Tensor) -> torch.Tensor:
    """``out[r] = a[r] @ b[e(r)]`` (``b`` ``[E, I, J]``) in the compute dtype, rows of no
    expert zero (``torch._grouped_mm`` leaves them unwritten)."""
    rows, cols = a.shape[0], b.shape[2]
    out = torch._grouped_mm(_padded(a, (0, 1)), _padded(b, (1, 2)), offs=offs)[:rows, :cols]
    return out.masked_fill(past_the_end.unsqueeze(1), 0)


def _dense_sums(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """``out[e] = a[rows of e].T @ b[rows of e]`` ``[E, N, K]`` in the compute dtype."""
    n, k = a.shape[1], b.shape[1]
    return torch._grouped_mm(_padded(a, (0, 1)).t(), _padded(b, (0, 1)), offs=offs)[:, :n, :k]


@torch.library.custom_op("fsdp_int8::int8_grouped_mm", mutates_args=())
def _forward(x: torch.Tensor, int_data: torch.Tensor, scale: torch.Tensor, offs: torch.Tensor,
             compiled: bool, int8_output: bool, keep_int8_input: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(out, qx, sx)``; ``qx, sx`` empty unless ``keep_int8_input``."""
    if not int8_output:
        values = dequantize_whole(int_data, scale.unsqueeze(-1), x.dtype)
        past_the_end = expert_of_rows(offs, x.shape[0]) == int_data.shape[0]
        return _dense_rows(x, values.mT, offs, past_the_end), x.new_empty(0, dtype=torch.int8), scale.new_empty(0)
    qx, sx = quantize_activations(x, compiled=compiled)
    out = grouped_rows(qx, int_data, offs, sx, scale, x.dtype, b_transposed=True)
    if not keep_int8_input:
        qx, sx = qx.new_empty(0), sx.new_empty(0)
    return out, qx, sx


@_forward.register_fake
def _(x, int_data, scale, offs, compiled, int8_output, keep_int8_input):
    out = x.new_empty(x.shape[0], int_data.shape[1])
    if not keep_int8_input:
        return out, x.new_empty(0, dtype=torch.int8), x.new_empty(0, dtype=torch.float32)
    return out, x.new_empty(x.shape, dtype=torch.int8), x.new_empty(x.shape[0], dtype=torch.float32)


@torch.library.custom_op("fsdp_int8::int8_grouped_mm_backward", mutates_args=())
def _backward(grad_out: torch.Tensor, saved: torch.Tensor, saved_scale: torch.Tensor, int_data: torch.Tensor,
              scale: torch.Tensor, offs: torch.Tensor, compiled: bool, need_input: bool,
              need_weight: bool, int8_input: bool, int8_weight: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``(grad_x, grad_w)``, each empty when not needed; ``int8_input`` / ``int8_weight``:
    whether that gradient's GEMM runs in int8. ``saved`` is ``x`` (``saved_scale`` empty)
    or the forward's int8 rows with their per-token scales."""
    experts, dtype = int_data.shape[0], grad_out.dtype
    rows = expert_of_rows(offs, grad_out.shape[0])
    grad_x = grad_w = grad_out.new_empty(0)
    if need_input and not int8_input:
        grad_x = _dense_rows(grad_out, dequantize_whole(int_data, scale.unsqueeze(-1), dtype), offs, rows == experts)
    elif need_input:
        row_scales = torch.cat([scale, scale.new_zeros(1, scale.shape[1])])[rows]
        qg, sg = quantize_activations(grad_out.float() * row_scales, compiled=compiled)
        grad_x = grouped_rows(qg, int_data, offs, sg, None, dtype, b_transposed=False)
    if need_weight and not int8_weight:
        grad_w = _dense_sums(grad_out, saved.to(dtype), offs)
    elif need_weight:
        if saved_scale.numel():  # the forward's int8 rows: their scales move onto grad_y
            qg, sg = _segment_columns(grad_out.float() * saved_scale.unsqueeze(1), rows, experts)
            grad_w = grouped_sums(qg, saved, offs, sg, None, dtype)
        else:
            qg, sg = _segment_columns(grad_out, rows, experts)
            qx, sx = _segment_columns(saved.to(dtype), rows, experts)
            grad_w = grouped_sums(qg, qx, offs, sg, sx, dtype)
    return grad_x, grad_w


@_backward.register_fake
def _(grad_out, saved, saved_scale, int_data, scale, offs, compiled, need_input, need_weight, int8_input,
      int8_weight):
    grad_x = grad_out.new_empty(grad_out.shape[0], int_data.shape[2]) if need_input else grad_out.new_empty(0)
    grad_w = grad_out.new_empty(int_data.shape) if need_weight else grad_out.new_empty(0)
    return grad_x, grad_w


class _Int8GroupedMM(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: Int8Weight, offs: torch.Tensor) -> torch.Tensor:
        config = weight.int8_matmul or _ALL_IN_COMPUTE_DTYPE
        keep_int8_input = config.save_int8_input and config.output and ctx.needs_input_grad[1]
        out, qx, sx = _forward(x, weight.int_data, weight.scale, offs, weight.compiled, config.output, keep_int8_input)
        ctx.save_for_backward(qx if keep_int8_input else x, sx, weight, offs)
        return out

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        saved, saved_scale, weight, offs = ctx.saved_tensors
        need_input, need_weight = ctx.needs_input_grad[:2]
        config = weight.int8_matmul or _ALL_IN_COMPUTE_DTYPE
        grad_x, grad_w = _backward(grad_out.contiguous(), saved, saved_scale, weight.int_data, weight.scale, offs,
                                   weight.compiled, need_input, need_weight, config.grad_input, config.grad_weight)
        return grad_x if need_input else None, grad_w if need_weight else None, None


class _GroupedMM(torch.autograd.Function):
    """``torch._grouped_mm(x, weight.transpose(-2, -1), offs=offs)`` for a plain weight, at
    any shape (torch's CPU kernel needs 16-byte strides and a contiguous gradient), rows
    past the last offset zero."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
        past_the_end = expert_of_rows(offs, x.shape[0]) == weight.shape[0]
        ctx.save_for_backward(x, weight, offs, past_the_end)
        return _dense_rows(x, weight.to(x.dtype).mT, offs, past_the_end)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        x, weight, offs, past_the_end = ctx.saved_tensors
        need_input, need_weight = ctx.needs_input_grad[:2]
        grad_x = _dense_rows(grad_out, weight.to(grad_out.dtype), offs, past_the_end) if need_input else None
        grad_w = _dense_sums(grad_out, x.to(grad_out.dtype), offs).to(weight.dtype) if need_weight else None
        return grad_x, grad_w, None


def expert_offsets(expert_ids: torch.Tensor, experts: int) -> torch.Tensor:
    """``[E]`` int32 cumulative token counts of ``expert_ids``, the ``offs`` of
    :func:`int8_grouped_mm` for tokens sorted by expert, counted on the device (no host
    read). Ids ``>= E`` (expert parallelism's sentinels, DBRX's empty slot) count in none."""
    counts = torch.zeros(experts + 1, dtype=torch.int64, device=expert_ids.device)
    counts.scatter_add_(0, expert_ids.clamp(max=experts), torch.ones_like(expert_ids))
    return counts[:experts].cumsum(0).to(torch.int32)


def int8_grouped_mm(x: torch.Tensor, weight: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """``torch._grouped_mm(x, weight.transpose(-2, -1), offs=offs)``: the experts of a MoE
    block, each applied to its tokens. The one op every int8 experts module computes with
    (transformers', torchtitan's, DBRX's, the launcher's); a model's own experts module
    calls it in place of ``torch._grouped_mm``.

    Args:
        x: ``[tokens, in]`` floating, the tokens sorted by expert.
        weight: ``[E, out, in]``: an expert ``Int8Weight`` (the passes its ``int8_matmul``
            names run int8 GEMMs, the others, and all of a weight-only one, run on its
            values in ``x``'s dtype, dequantized for that pass), or a plain tensor (what
            FSDP2 all-gathers for weight-only int8, or a model left in full precision),
            which runs ``torch._grouped_mm`` itself on ``weight`` cast to ``x``'s dtype.
            The weight's gradient is in its own dtype.
        offs: ``[E]`` int32, cumulative tokens per expert, on ``x``'s device.

    Returns:
        ``[tokens, out]`` in ``x``'s dtype; rows at or past ``offs[-1]`` are zero.
        Differentiable in ``x`` and ``weight`` (an ``Int8Weight``'s gradient is a plain
        ``[E, out, in]`` tensor, what the optimizer writes back).

    Raises:
        ValueError: the shapes or dtypes do not fit.

    On CUDA with Triton (and under ``TRITON_INTERPRET=1``) each int8 pass is one kernel
    launch that reads ``offs`` on the device; elsewhere a loop over the experts reads
    ``offs`` on the host (docs/moe.md, "Grouped int8 GEMMs").
    """
    _check(x, weight, offs)
    if not isinstance(weight, Int8Weight):
        return _GroupedMM.apply(x, weight, offs)
    return _Int8GroupedMM.apply(x, weight, offs)


def _check(x: torch.Tensor, weight: torch.Tensor, offs: torch.Tensor) -> None:
    if not isinstance(weight, torch.Tensor) or weight.dim() != 3:
        raise ValueError(f"int8_grouped_mm takes expert weights [E, out, in], got {type(weight).__name__} "
                         f"of shape {tuple(getattr(weight, 'shape', ()))}")
    if x.dim() != 2 or x.shape[1] != weight.shape[2] or not x.is_floating_point():
        raise ValueError(f"int8_grouped_mm: tokens of shape {tuple(x.shape)} and dtype {x.dtype} cannot "
                         f"multiply experts of shape {tuple(weight.shape)}: [tokens, {weight.shape[2]}] floating")
    if offs.dim() != 1 or offs.shape[0] != weight.shape[0] or offs.dtype != torch.int32:
        raise ValueError(f"int8_grouped_mm: offs must be [{weight.shape[0]}] int32 (one cumulative count per "
                         f"expert), got {tuple(offs.shape)} {offs.dtype}")
