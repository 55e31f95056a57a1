"""``F.linear`` with an :class:`~fsdp_int8.Int8Weight`: the matmul never keeps a dequantized weight.

Weight-only (default): ``y = x @ (q * scale)^T + b``, the weight rebuilt in the compute
dtype in one pass for this matmul only (a transient, never kept or saved: backward
rebuilds it). Backward: ``grad_x = grad_y @ (q * scale)`` and a plain
``grad_w = grad_y^T @ x`` in the compute dtype.

Int8 matmuls (``Int8MatmulConfig``): each enabled matmul quantizes its floating operand
per row on the fly (round to nearest) and runs ``torch._int_mm`` (int8 x int8 -> int32)
against the stored int8 weight; the scales are applied to the int32 result:

* output:      ``y[m, n]      = sx[m] * sw[n] * (qx @ qw^T)[m, n]``
* grad_input:  ``grad_x[m, k] = sg[m] * (qg @ qw)[m, k]`` where ``qg, sg`` quantize
  ``grad_y * sw`` (the weight's scale sits on the reduced dim, so it is folded in first);
* grad_weight: ``grad_w[n, k] = sgT[n] * sxT[k] * (qgT @ qxT^T)[n, k]``, ``grad_y`` quantized
  per output channel and ``x`` per input channel, both over the tokens (split into chunks
  so that int32 sums of 127 * 127 products cannot overflow).

With ``save_int8_input`` the forward's ``qx, sx`` are what backward keeps (one copy for
every layer reading the same input), and the weight gradient reuses them:
``grad_w[n, k] = sgT[n] * (qgT @ qx)[n, k]`` where ``qgT, sgT`` quantize ``grad_y * sx``
per output channel over the tokens.
"""

from __future__ import annotations

import weakref

import torch
import torch.nn.functional as F

from fsdp_int8 import hardware
from fsdp_int8._quant.kernels import (
    as_buffer,
    int8_columns,
    int8_rows,
    int8_rows_nearest,
    run_compiled,
    use_compiled,
)
from fsdp_int8._weight import op_table as _op_table
from fsdp_int8._weight import tied_release
from fsdp_int8._weight.tensor import Int8Weight
from fsdp_int8._weight.tied_gradient import note_dense_gradient
from fsdp_int8._weight.transient import grad_input_weight_only, weight_in
from fsdp_int8.quant import absmax_quantize

# |int32 sum| <= tokens * 127 * 127 < 2**31 holds for up to 133,144 tokens: chunk below it.
_MAX_TOKENS_PER_INT32_SUM = 1 << 17


# ---------------------------------------------------------------- kernels
# Each kernel below is written once and runs either eagerly or as one torch.compile-fused
# pass (the weight's ``compiled``, from ``Int8TrainingConfig.compile``), with
# the same fp32 operations in the same order: the same results, bit for bit. Eagerly,
# each is several passes over its tensor (CPU type promotion makes a temporary copy per
# mixed-dtype operand); compiled, one. None takes an integer argument: dynamic shapes
# would turn it into a symbol and the loops into scalar code.

def _rows_eager(values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    # No NaN check: it would synchronise with the device, and a NaN activation makes a NaN
    # output anyway.
    return absmax_quantize(values, dim=-1, nonfinite="unchecked")


def _columns_eager(values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return absmax_quantize(values, dim=0, nonfinite="unchecked")


def _scaled_rows(values: torch.Tensor, column_scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``values * column_scale`` (fp32) quantized per row: grad_y with the weight's scales
    folded in, in one pass."""
    return int8_rows(values.float() * column_scale, None)


def _scaled_rows_eager(values: torch.Tensor, column_scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return _rows_eager(values.float() * column_scale)


def _dequantize(acc: torch.Tensor, row_scale: torch.Tensor, col_scale: torch.Tensor, dtype: torch.dtype):
    """``(acc * row_scale[:, None] * col_scale[None, :])`` of an int32 GEMM result, in fp32,
    then in ``dtype``."""
    return (acc.float() * row_scale.unsqueeze(1) * col_scale).to(dtype)


def _dequantize_bias(acc, row_scale, col_scale, bias: torch.Tensor, dtype: torch.dtype):
    """:func:`_dequantize` plus ``bias``, summed in fp32 and rounded to ``dtype`` once
    (inductor keeps fused intermediates in fp32: so does the eager form)."""
    return (acc.float() * row_scale.unsqueeze(1) * col_scale + bias.float()).to(dtype)


def _dequantize_rows(acc: torch.Tensor, row_scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return (acc.float() * row_scale.unsqueeze(1)).to(dtype)


_EAGER = {int8_rows_nearest: _rows_eager, int8_columns: _columns_eager}


def _run(kernel, compiled: bool, *args):
    """``kernel(*args)``, compiled when the weight asks for it."""
    if use_compiled(compiled, args[0]):
        return run_compiled(kernel, *args)
    return _EAGER.get(kernel, kernel)(*args)


def _quantize_activations(
    values: torch.Tensor, *, dim: int = -1, compiled: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """Int8 activations or gradients with one scale per row (``dim=-1``) or per column
    (``dim=0``, no transposed copy), rounded to nearest."""
    return _run(int8_rows_nearest if dim == -1 else int8_columns, compiled, values)


# CUDA's int8 GEMM (cuBLASLt) needs more than 16 rows in the left operand and a reduced
# dimension divisible by 8; the CPU kernel takes any shape.
_CUDA_MIN_ROWS = 17
_CUDA_K_MULTIPLE = 8


def _has_cuda_gemm_rules(device: torch.device) -> bool:
    return device.type == "cuda"


def _int_mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` for int8 operands, exactly, in int32.

    Where the device's GEMM has shape rules, the operands are zero-padded to meet them:
    zero rows give rows that are cut off, zeros along the reduced dimension add nothing
    to any sum, so the result is the same. (The weight-gradient GEMM reduces over tokens,
    whose count is the caller's: it is the one that needs the padding in practice.)
    """
    if not _has_cuda_gemm_rules(a.device):
        return torch._int_mm(a, b)
    rows, reduced = a.shape
    pad_rows = max(0, _CUDA_MIN_ROWS - rows)
    pad_reduced = -reduced % _CUDA_K_MULTIPLE
    if pad_rows or pad_reduced:
        a = torch.nn.functional.pad(a, (0, pad_reduced, 0, pad_rows))
        b = torch.nn.functional.pad(b, (0, 0, 0, pad_reduced))
    return torch._int_mm(a, b)[:rows]


def _weight_columns(weight: Int8Weight) -> torch.Tensor:
    """``qw^T`` ``[K, N]``, the right operand of the output GEMM. On CPU a transposed view
    of the (possibly strided: FSDP2's gathered buffer) int8 rows: the GEMM packs its
    operands itself, and a view is as fast as a contiguous copy, without the copy. CUDA
    keeps the contiguous copy that cuBLASLt's layouts were checked with."""
    rows = weight.int_rows()
    return rows.t().contiguous() if _has_cuda_gemm_rules(rows.device) else rows.t()


def _weight_rows(weight: Int8Weight) -> torch.Tensor:
    """``qw`` ``[N, K]``, the right operand of the grad_input GEMM (a view on CPU)."""
    rows = weight.int_rows()
    return rows.contiguous() if _has_cuda_gemm_rules(rows.device) else rows


def _transposed(values: torch.Tensor) -> torch.Tensor:
    """``values^T`` as a GEMM's left operand: a view on CPU, a copy for cuBLASLt."""
    return values.t().contiguous() if _has_cuda_gemm_rules(values.device) else values.t()


# ---------------------------------------------------------------- one compiled region per pass
# With the compiled kernels on, each direction of a linear layer is ONE compiled call: the
# forward quantizes x, runs the GEMM and dequantizes; the backward quantizes grad_y (per
# row for grad_input, per column for grad_weight) and x (per column), runs both GEMMs and
# dequantizes both results. The GEMMs inside are inductor's calls of the same
# ``aten._int_mm`` kernel, and the passes around them are the kernels above, fused: every
# value is the same, bit for bit, as running the kernels one by one. One call instead of
# two to five saves dynamo's guards and wrappers (tens of microseconds each) and lets
# inductor read grad_y once for its two quantizations. Eagerly the same functions run
# op by op (the eager path below keeps the cheaper eager kernels instead).

def _output_pass(x2d: torch.Tensor, w_columns: torch.Tensor, w_scale: torch.Tensor) -> torch.Tensor:
    qx, sx = int8_rows_nearest(x2d)
    return _dequantize(_int_mm(qx, w_columns), sx, w_scale, x2d.dtype)


def _output_bias_pass(x2d, w_columns, w_scale, bias: torch.Tensor) -> torch.Tensor:
    qx, sx = int8_rows_nearest(x2d)
    return _dequantize_bias(_int_mm(qx, w_columns), sx, w_scale, bias, x2d.dtype)


def _grad_input_pass(g2d: torch.Tensor, w_rows: torch.Tensor, w_scale: torch.Tensor) -> torch.Tensor:
    qg, sg = _scaled_rows(g2d, w_scale)
    return _dequantize_rows(_int_mm(qg, w_rows), sg, g2d.dtype)


def _grad_weight_pass(g2d: torch.Tensor, x2d: torch.Tensor) -> torch.Tensor:
    qg, sg = int8_columns(g2d)
    qx, sx = int8_columns(x2d)
    return _dequantize(_int_mm(_transposed(qg), qx), sg, sx, g2d.dtype)


def _grads_pass(g2d, w_rows, w_scale, x2d) -> tuple[torch.Tensor, torch.Tensor]:
    return _grad_input_pass(g2d, w_rows, w_scale), _grad_weight_pass(g2d, x2d)


def _int8_output(x2d: torch.Tensor, weight: Int8Weight, bias: torch.Tensor | None):
    if use_compiled(weight.compiled, x2d):
        if bias is None:
            return run_compiled(_output_pass, x2d, _weight_columns(weight), weight.scale)
        return run_compiled(_output_bias_pass, x2d, _weight_columns(weight), weight.scale, bias)
    return _int8_output_of_rows(*_rows_eager(x2d), weight, bias, x2d.dtype)


# The last input quantized for a layer that keeps its int8 input: (the input, its version
# then, its int8 rows and scales). q / k / v (and gate / up) read one input one after the
# other: the first quantizes it, the others reuse the same tensors, which autograd then
# saves once. Eager only: under torch.compile each layer quantizes, and inductor merges
# the identical kernels of one graph.
_last_quantized_input: tuple[weakref.ref, int, torch.Tensor, torch.Tensor] | None = None


def _shared_int8_rows(x: torch.Tensor, x2d: torch.Tensor, compiled: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``x2d`` (a view of ``x``) quantized per row, reusing the rows of the previous call
    when it quantized this very ``x``, unchanged since."""
    global _last_quantized_input
    if torch.compiler.is_compiling():
        return _quantize_activations(x2d, compiled=compiled)
    last = _last_quantized_input
    if last is not None and last[0]() is x and last[1] == x._version:
        return last[2], last[3]
    qx, sx = _quantize_activations(x2d, compiled=compiled)
    _last_quantized_input = (weakref.ref(x), x._version, qx, sx)
    return qx, sx


def _int8_output_of_rows(qx, sx, weight: Int8Weight, bias: torch.Tensor | None, dtype: torch.dtype):
    """The output GEMM of already quantized input rows, dequantized into ``dtype``."""
    acc = _int_mm(qx, _weight_columns(weight))
    if bias is None:
        return _run(_dequantize, weight.compiled, acc, sx, weight.scale, dtype)
    return _run(_dequantize_bias, weight.compiled, acc, sx, weight.scale, bias, dtype)


def _int8_grad_weight_of_rows(g2d: torch.Tensor, qx: torch.Tensor, sx: torch.Tensor, compiled: bool):
    """``grad_y^T x`` from the saved int8 rows ``qx`` and per-token scales ``sx`` of x."""

    def part(chunk: slice, dtype: torch.dtype) -> torch.Tensor:
        # x's per-token scale moves onto grad_y, which is then quantized per output channel
        qg, sg = _run(int8_columns, compiled, g2d[chunk].float() * sx[chunk].unsqueeze(1))
        return _run(_dequantize_rows, compiled, _int_mm(_transposed(qg), qx[chunk]), sg, dtype)

    return _summed_over_token_chunks(g2d, part)


def _int8_grad_input(g2d: torch.Tensor, weight: Int8Weight) -> torch.Tensor:
    if use_compiled(weight.compiled, g2d):
        return run_compiled(_grad_input_pass, g2d, _weight_rows(weight), weight.scale)
    qg, sg = _scaled_rows_eager(g2d, weight.scale)
    return _dequantize_rows(_int_mm(qg, _weight_rows(weight)), sg, g2d.dtype)


def _summed_over_token_chunks(g2d: torch.Tensor, part) -> torch.Tensor:
    """``sum(part(chunk, dtype))`` over chunks of ``g2d``'s tokens, each short enough that
    int32 sums of 127 * 127 products cannot overflow: one chunk straight in ``g2d``'s
    dtype, several summed in fp32 first; the sum in ``g2d``'s dtype."""
    tokens = g2d.shape[0]
    dtype = g2d.dtype if tokens <= _MAX_TOKENS_PER_INT32_SUM else torch.float32
    grad = None
    for start in range(0, tokens, _MAX_TOKENS_PER_INT32_SUM):
        piece = part(slice(start, start + _MAX_TOKENS_PER_INT32_SUM), dtype)
        grad = piece if grad is None else grad.add_(piece)
    return grad.to(g2d.dtype)


def _int8_grad_weight(g2d: torch.Tensor, x2d: torch.Tensor, compiled: bool) -> torch.Tensor:
    tokens = g2d.shape[0]
    if tokens <= _MAX_TOKENS_PER_INT32_SUM and use_compiled(compiled, g2d) and x2d.numel() > 0:
        return run_compiled(_grad_weight_pass, g2d, x2d)

    def part(chunk: slice, dtype: torch.dtype) -> torch.Tensor:
        # scales per output channel of grad_y and per input channel of x, over the tokens
        qg, sg = _run(int8_columns, compiled, g2d[chunk])
        qx, sx = _run(int8_columns, compiled, x2d[chunk])
        return _run(_dequantize, compiled, _int_mm(_transposed(qg), qx), sg, sx, dtype)

    return _summed_over_token_chunks(g2d, part)


def _int8_grads(g2d: torch.Tensor, weight: Int8Weight, x2d: torch.Tensor):
    """``(grad_x, grad_w)`` with both GEMMs in int8: one compiled call where it can be."""
    if (g2d.shape[0] <= _MAX_TOKENS_PER_INT32_SUM and use_compiled(weight.compiled, g2d)
            and x2d.numel() > 0):
        return run_compiled(_grads_pass, g2d, _weight_rows(weight), weight.scale, x2d)
    return _int8_grad_input(g2d, weight), _int8_grad_weight(g2d, x2d, weight.compiled)


def output_of(x2d: torch.Tensor, weight: Int8Weight, bias: torch.Tensor | None) -> torch.Tensor:
    """``x2d @ weight^T (+ bias)`` for a 2-D weight, as its ``int8_matmul`` says: an int8
    GEMM, or a transient weight in the compute dtype (one pass, not kept)."""
    config = weight.int8_matmul
    if config is not None and config.output:
        return _int8_output(x2d, weight, bias)
    out = torch.matmul(x2d, weight_in(weight, x2d.dtype).t())
    return out.add_(bias.to(x2d.dtype)) if bias is not None else out


def grads_of(
    g2d: torch.Tensor, x2d: torch.Tensor | None, weight: Int8Weight, *, need_input: bool
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """``(grad_x, grad_w)`` of ``y = x @ weight^T`` for a 2-D weight, as its ``int8_matmul``
    says; ``grad_x`` only if ``need_input``, ``grad_w`` only if ``x2d`` is given."""
    config = weight.int8_matmul
    int8_input = need_input and config is not None and config.grad_input
    int8_weight = x2d is not None and config is not None and config.grad_weight
    if int8_input and int8_weight:  # both int8 GEMMs: one compiled call where it can be
        return _int8_grads(g2d, weight, x2d)
    grad_x = grad_w = None
    if int8_input:
        grad_x = _int8_grad_input(g2d, weight)
    elif need_input:
        grad_x = grad_input_weight_only(g2d, weight)
    if int8_weight:
        grad_w = _int8_grad_weight(g2d, x2d, weight.compiled)
    elif x2d is not None:
        grad_w = g2d.t().matmul(x2d)
    return grad_x, grad_w


def module_output(values: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """``values``, a fresh result no one else holds, as ``shape`` without being a view of
    it: FSDP2 warns about a module output that is a view, because an in-place op on one
    (``out += y``) drops its pre-backward hook."""
    return torch.ops.aten._unsafe_view(values, shape)


class _Int8WeightLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: Int8Weight, bias: torch.Tensor | None):
        ctx.has_bias = bias is not None
        if any(ctx.needs_input_grad):
            tied_release.note_read(weight)
        config = weight.int8_matmul
        x2d = x.reshape(-1, x.shape[-1])
        ctx.int8_input = config is not None and config.save_int8_input and ctx.needs_input_grad[1]
        if ctx.int8_input:  # backward keeps the int8 rows and scales, not x
            qx, sx = _shared_int8_rows(x, x2d, weight.compiled)
            ctx.save_for_backward(qx, sx, weight)
            out = _int8_output_of_rows(qx, sx, weight, bias, x.dtype)
            return module_output(out, (*x.shape[:-1], out.shape[-1]))
        ctx.save_for_backward(x, weight)
        out = output_of(x2d, weight, bias)
        return module_output(out, (*x.shape[:-1], out.shape[-1]))

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        *saved, weight = ctx.saved_tensors
        g2d = grad_out.reshape(-1, grad_out.shape[-1])
        config = weight.int8_matmul
        if config is not None and (config.grad_input or config.grad_weight):
            g2d = as_buffer(g2d)  # quantized below: its producer computed once, not in every pass
        grad_b = None
        x2d = None
        if not ctx.int8_input and ctx.needs_input_grad[1]:
            x2d = saved[0].reshape(-1, saved[0].shape[-1]).to(g2d.dtype)
        both_int8 = config is not None and config.grad_input and config.grad_weight
        if x2d is not None and ctx.needs_input_grad[0] and both_int8:
            grad_x, grad_w = grads_of(g2d, x2d, weight, need_input=True)  # one pass
            tied_release.read_done(weight)
        else:  # grad_x reads the weight, grad_w never does: a released weight is freed before grad_w
            grad_x, _ = grads_of(g2d, None, weight, need_input=ctx.needs_input_grad[0])
            tied_release.read_done(weight)
            if ctx.int8_input:  # the weight gradient from the forward's int8 rows and scales
                grad_w = _int8_grad_weight_of_rows(g2d, *saved, weight.compiled)
            else:
                grad_w = grads_of(g2d, x2d, weight, need_input=False)[1] if x2d is not None else None
        if grad_x is not None:
            grad_x = grad_x.view(*grad_out.shape[:-1], grad_x.shape[-1])
        if grad_w is not None:
            note_dense_gradient(weight)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_b = g2d.sum(0)
        return grad_x, grad_w, grad_b


@_op_table.implements_function(F.linear)
def _int8_weight_linear(
    input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """``F.linear(input, weight, bias)`` when any of them is an ``Int8Weight``."""
    if not isinstance(weight, Int8Weight) or isinstance(input, Int8Weight) or isinstance(bias, Int8Weight):
        raise NotImplementedError("F.linear with an Int8Weight as input or bias is not supported")
    if not input.is_floating_point():
        raise TypeError(f"F.linear with an Int8Weight needs a floating input, got {input.dtype}")
    if input.shape[-1] != weight.row_len or weight.dim() != 2:
        raise RuntimeError(
            f"F.linear: input of shape {tuple(input.shape)} cannot multiply an Int8Weight of "
            f"shape {tuple(weight.shape)}"
        )
    int8_gemm = weight.int8_matmul is not None
    if int8_gemm and input.device.type == "cuda" and (weight.shape[0] % 8 or weight.shape[1] % 8):
        raise ValueError(
            f"int8 matmuls on CUDA need in and out features divisible by 8, got a weight of "
            f"shape {tuple(weight.shape)}: exclude this layer with Int8TrainingConfig.module_filter"
        )
    if not torch.compiler.is_compiling():
        hardware.warn_if_slow(input.device, input.dtype, int8_matmul=int8_gemm)
    return _Int8WeightLinear.apply(input, weight, bias)
