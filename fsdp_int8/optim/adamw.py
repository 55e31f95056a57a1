"""``Int8AdamW``: AdamW with one requantization per int8 weight and step, and optional
block-wise 8-bit or 4-bit moments (:mod:`fsdp_int8.optim._state_codec`)."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch.optim.optimizer import ParamsT
from torch.utils._foreach_utils import _get_fused_kernels_supported_devices

from fsdp_int8._dist import local_shard
from fsdp_int8._quant.kernels import ceil_div
from fsdp_int8._weight import update_checks
from fsdp_int8.optim._base import FusedInt8Optimizer, Slot, column_parts, like_param
from fsdp_int8.optim._checks import check_number
from fsdp_int8.optim._state_codec import DEFAULT_BLOCK, STATE_NAMES, dequantize_moments, packed_columns, quantize_moment

__all__ = ["Int8AdamW"]


def _row_len(param: torch.Tensor) -> int | None:
    """Elements per dim-0 row of a parameter with >= 2 dims and >= 1 row (global shape)."""
    if param.dim() < 2 or param.shape[0] == 0:
        return None
    return param.numel() // param.shape[0]


def _check_blocks_align(param: torch.Tensor, row_len: int, block: int, bits: int) -> int:
    """Into how many pieces the ranks split each row (see ``column_parts``), if the
    quantized states' blocks fit them: whole rows, or pieces of whole blocks (then each
    rank's blocks are the whole row's, the states are split like the parameter, and
    checkpoints reshard them bit-exactly across layouts)."""
    parts = column_parts(param)
    if parts is None:
        raise ValueError(
            f"{bits}-bit optimizer states need whole rows, or rows split along their last dim, on "
            f"each rank; got a parameter placed as {tuple(param.placements)}. Use "
            "state_bits=32 for it (a separate parameter group)"
        )
    if parts > 1 and (row_len % parts or (row_len // parts) % block):
        raise ValueError(
            f"{bits}-bit optimizer states of a parameter whose rows of {row_len} elements are split "
            f"{parts} ways ({tuple(param.placements)}, tensor parallelism's RowwiseParallel) "
            f"need each rank's {row_len / parts:g} elements of a row to be whole blocks of "
            f"block_size={block}, so that the blocks are the whole rows' and checkpoints "
            "reshard them across layouts. Pick a block_size that divides "
            f"{row_len / parts:g}, or use state_bits=32 for it (a separate parameter group)"
        )
    return parts


def _block_size(group: dict[str, Any]) -> int:
    """A group's elements per state block: its ``block_size``, or its precision's default."""
    block = group["block_size"]
    return DEFAULT_BLOCK[group["state_bits"]] if block is None else block


def _use_fused(fused: bool | None, device: torch.device) -> bool:
    """``fused``, or (``None``) whether torch has a fused AdamW kernel for ``device``."""
    if fused is not None:
        return fused
    return device.type in _get_fused_kernels_supported_devices()


# The lean recipe's bound on one update's elements: its fp32 temporaries (about 21 bytes
# per element with 8-bit states) stay under about 5 MB, a small share of any model's peak.
LEAN_STEP_ELEMENTS = 1 << 18


class Int8AdamW(FusedInt8Optimizer):
    r"""AdamW for int8 weights: one dequantization and one requantization per step.

    The update of ``torch.optim.AdamW`` (decoupled weight decay, bias correction), with the
    fp32 operations of one of its kernels (formulas: docs/optim.md). Each
    :class:`~fsdp_int8.Int8Weight` (plain, or the local tensor of an FSDP2 DTensor) is
    dequantized once to fp32 and requantized once with its own rounding
    (``weight.assign_(w, stochastic=weight.stochastic_rounding)``); from the same state the
    values before requantization are bit-identical to ``torch.optim.AdamW``'s (see ``fused``).
    Other parameters are updated in place with the same math (in fp32 for bf16 / fp16
    ones, then cast back). Any mix of int8 weights, plain tensors and FSDP2 DTensors works;
    DTensor parameters are updated through their local tensors, so the only collective is
    the finite-gradient verdict: a NaN or Inf gradient on any rank raises
    :class:`~fsdp_int8.guard.NonFiniteGradientError` on every rank before anything changes.
    A step with ``lr == 0`` leaves int8 weights untouched.

    **8-bit and 4-bit states** (``state_bits=8`` or ``4``) go to every parameter with at
    least 2 dims whose rows (``numel // shape[0]`` elements, global shape) hold at least
    ``block_size`` elements (:meth:`uses_quantized_state`); others (biases, norms, short
    rows) keep fp32 ``exp_avg`` / ``exp_avg_sq``. Which parameters get them depends on
    their global shapes only, never on the mesh. Each row is cut into blocks of
    ``block_size`` (the last may be shorter) with one fp32 scale each: the first moment
    and the second moment's square root. 8 bits: ``exp_avg_int8`` (int8 ``[rows, K]``)
    with ``exp_avg_scale`` (fp32 ``[rows, ceil(K / block_size)]``) and
    ``exp_avg_sq_sqrt_uint8`` (uint8) with ``exp_avg_sq_sqrt_scale``: linear levels.
    4 bits: ``exp_avg_4bit`` and ``exp_avg_sq_sqrt_4bit``, two codes per byte (uint8
    ``[rows, ceil(K / 2)]``), with the same scales: sixteen levels of a table each
    (docs/optim.md, "4-bit states"), about 1.06 bytes per parameter for both moments
    at ``block_size=128``. Each step dequantizes them, updates in fp32 and requantizes
    with round to nearest (deterministic: resume is exact). A block never spans two rows,
    so checkpoints reshard bit-exactly at any world size. A weight split by columns
    (tensor parallelism's ``RowwiseParallel``) keeps quantized states when each rank's
    part of a row is whole blocks (``in_features / tp`` divisible by ``block_size``). Why
    the square root, the levels and round to nearest, and the bytes per parameter:
    docs/optim.md.

    State dicts: state tensors of DTensor parameters are DTensors placed like the parameter,
    so ``get_optimizer_state_dict`` / ``set_optimizer_state_dict`` and
    :func:`~fsdp_int8.save_checkpoint` / :func:`~fsdp_int8.load_checkpoint` save and reshard
    them; ``step`` is a 0-d fp32 tensor. With ``state_bits=32`` the state is
    ``torch.optim.AdamW``'s layout in fp32 (its state dicts load here). A checkpoint loads
    only into an optimizer with the same ``state_bits`` and ``block_size``.

    Args:
        params: Parameters or parameter groups (as for any ``torch.optim`` optimizer).
        lr: Learning rate, >= 0.
        betas: ``(beta1, beta2)``, each in ``[0, 1)``.
        eps: Added to the denominator, >= 0.
        weight_decay: Decoupled weight decay, >= 0.
        state_bits: ``32`` (fp32 moments), ``8`` or ``4`` (block-wise quantized moments, above).
        block_size: Elements per block of a quantized state (>= 1, even for 4 bits); also the
            shortest row that gets quantized states. ``None`` (default): 64 for 8 bits, 128
            for 4 bits.
        fused: ``True``: torch's fused AdamW kernel (``torch._fused_adamw_``, one pass over
            each tensor); ``False``: its ``torch._foreach_*`` operations in their order.
            ``None`` (default): fused on the devices torch has the kernel for (CPU, CUDA).
            The values before requantization are bit-identical to
            ``torch.optim.AdamW(fused=True)``'s with the fused kernel, to its for-loop and
            foreach forms' with ``fused=False``; the two round a few values differently.
        step_in_backward: Update each parameter inside backward as soon as its gradient is
            final (FSDP2: right after its reduce-scatter) and free the gradient at once, so
            gradients never all live together. The loop stays ``loss.backward();
            opt.step(); opt.zero_grad()`` (``step()`` completes the step); weights and
            states equal stepping after backward bit for bit (each int8 weight rounds from
            a seed of its own, drawn per step in parameter order). Until ``step()`` each
            ``.grad`` is a storage-free ``AppliedGradient`` on which any op
            (``clip_grad_norm_``'s too) raises ``RuntimeError`` naming the parameter: clip
            with ``max_grad_norm``. Accumulate with FSDP2's
            ``set_requires_gradient_sync(False)``. A non-finite gradient leaves its
            parameter unchanged and ``step()`` raises. What it saves: docs/memory.md.
        max_grad_norm: With ``step_in_backward=True`` only: clip by the step's global
            gradient norm as estimated when each gradient arrives. Each gradient is scaled
            by ``min(1, max_grad_norm / norm)``: ``norm²`` is this step's squared norms so
            far (its own included) scaled up by the previous step's proportions (its squared
            norm over the part the parameters seen so far carried); exact when they hold,
            and at the last parameter. One scalar all-reduce per parameter. The step's norm
            is kept in each group's ``"previous_grad_norm"`` (read as :attr:`grad_norm`),
            each parameter's squared norm in its state's ``"previous_grad_norm_sq"``
            (checkpoints resume both). ``None`` (default): no clipping (after backward, use
            ``torch.nn.utils.clip_grad_norm_``).
        step_elements: The most parameter elements one update works on at once (whole
            dim-0 rows, one row at least): its fp32 temporaries, about 21 bytes per element
            with 8-bit states, never exceed that many elements' worth. ``None`` (default):
            chunks of 2^24 on accelerators (about 350 MB with 8-bit states); on the CPU one
            parameter at a time, in pieces of 2^20. Smaller bounds cost more, smaller
            kernels. The rounding noise is drawn per row in row order (the same stream for
            any bound when rows hold a multiple of 4 values), but a piece too small to fill
            the fused kernel's vectors may round its last bit differently.
        grad_dtype: Keep each gradient in this dtype (``torch.bfloat16``,
            ``torch.float16`` or ``torch.float32``) from the moment it is final until
            ``step()``: a post-accumulate-grad hook casts it right after FSDP2's
            reduce-scatter (or autograd's accumulation). bf16 halves the gradients' memory,
            the largest part of the peak when stepping after backward (docs/memory.md). ``None`` (default):
            the parameter's dtype. The update equals the update from the fp32 gradient
            rounded to ``grad_dtype``, bit for bit; ``clip_grad_norm_`` works as usual.
            Accumulation across synchronised backwards adds in ``grad_dtype``; FSDP2's
            ``set_requires_gradient_sync(False)`` accumulates in its reduce dtype and
            rounds once. Sets each parameter's ``grad_dtype`` attribute to ``None``.

    Raises:
        ValueError: a hyperparameter out of range, ``state_bits`` not 8 or 32,
            ``block_size < 1``, ``step_elements < 1``, ``grad_dtype`` not a floating dtype of
            at most 32 bits or given with ``step_in_backward``, ``max_grad_norm`` not
            positive or given without ``step_in_backward``, or a complex or non-floating
            parameter. At a step: 8-bit states for a parameter split other than by dim-0
            rows or by whole blocks of columns (use ``state_bits=32`` for it, in a group of
            its own), or NaN or Inf produced in an int8 weight or an 8-bit state (some
            parameters may be updated: restore a checkpoint).
        TypeError: a hyperparameter of the wrong type.
        RuntimeError: at a step, a sparse gradient or one placed unlike its parameter; with
            ``step_in_backward`` or ``grad_dtype``, a plain parameter in a multi-process run
            (DDP), at the first backward; with ``step_in_backward``, a second gradient
            for a parameter before ``step()``.
        NonFiniteGradientError: from ``step()``, a gradient holds NaN or Inf on some rank.

    Example::

        optimizer = fsdp_int8.Int8AdamW(model.parameters(), lr=3e-4, weight_decay=0.1, state_bits=8)
    """

    def __init__(
        self,
        params: ParamsT,
        lr: float | torch.Tensor = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.01,
        *,
        state_bits: int = 32,
        block_size: int | None = None,
        fused: bool | None = None,
        step_in_backward: bool = False,
        step_elements: int | None = None,
        grad_dtype: torch.dtype | None = None,
        max_grad_norm: float | None = None,
    ) -> None:
        defaults = dict(
            lr=lr, betas=tuple(betas) if isinstance(betas, (tuple, list)) else betas, eps=eps,
            weight_decay=weight_decay, state_bits=state_bits, block_size=block_size, fused=fused,
        )
        self._check_group(defaults)
        super().__init__(params, defaults, step_in_backward=step_in_backward, step_elements=step_elements,
                         grad_dtype=grad_dtype, max_grad_norm=max_grad_norm)

    @classmethod
    def lean(cls, params: ParamsT, lr: float | torch.Tensor = 1e-3, **changes: Any) -> "Int8AdamW":
        """The lean-memory recipe's optimizer (docs/memory.md), for a model configured with
        :meth:`fsdp_int8.Int8TrainingConfig.lean`.

        ``state_bits=8``, ``step_in_backward=True``, ``max_grad_norm=1.0`` and
        ``step_elements=2**18`` (an update's fp32 temporaries stay under about 5 MB).
        ``changes`` replace any of these or set other keywords (``weight_decay``,
        ``betas``, ...): ``state_bits=4`` is the leanest recipe (docs/memory.md)."""
        recipe = dict(state_bits=8, step_in_backward=True, max_grad_norm=1.0, step_elements=LEAN_STEP_ELEMENTS)
        return cls(params, lr, **{**recipe, **changes})

    def _check_group(self, group: dict[str, Any]) -> None:
        check_number("lr", group["lr"], 0.0)
        betas = group["betas"]
        if not isinstance(betas, (tuple, list)) or len(betas) != 2:
            raise ValueError(f"betas must be a pair (beta1, beta2), got {betas!r}")
        check_number("beta1", betas[0], 0.0, 1.0)
        check_number("beta2", betas[1], 0.0, 1.0)
        check_number("eps", group["eps"], 0.0)
        check_number("weight_decay", group["weight_decay"], 0.0)
        bits, block = group["state_bits"], group["block_size"]
        if isinstance(bits, bool) or bits not in DEFAULT_BLOCK:
            raise ValueError(f"state_bits must be 4, 8 or 32, got {bits!r}")
        if block is not None and (isinstance(block, bool) or not isinstance(block, int)):
            raise TypeError(f"block_size must be an int or None, got {block!r}")
        if block is not None and block < 1:
            raise ValueError(f"block_size must be >= 1, got {block}")
        if bits == 4 and _block_size(group) % 2:
            raise ValueError(f"4-bit states pack two values per byte, so a block is whole bytes: "
                             f"block_size must be even, got {block}")
        if group.get("fused") not in (None, True, False):
            raise TypeError(f"fused must be None, True or False, got {group['fused']!r}")

    @staticmethod
    def uses_quantized_state(param: torch.Tensor, state_bits: int, block_size: int | None = None) -> bool:
        """Whether a parameter gets 8-bit or 4-bit moments: ``state_bits`` 8 or 4, at least
        2 dims, and rows (``numel // shape[0]`` elements, global shape) of at least
        ``block_size`` (``None``: that precision's default)."""
        row_len = _row_len(param)
        block = DEFAULT_BLOCK.get(state_bits, 0) if block_size is None else block_size
        return state_bits in (4, 8) and row_len is not None and row_len >= block

    def _init_state(self, param, local, group) -> dict:
        state: dict[str, torch.Tensor] = {}
        # A 0-d fp32 step on the CPU, as torch.optim.AdamW keeps it (no device sync to read).
        state["step"] = torch.tensor(0.0, dtype=torch.float32)
        bits, block = group["state_bits"], _block_size(group)
        if not self.uses_quantized_state(param, bits, block):
            state["exp_avg"] = self._fp32_state(param, local)
            state["exp_avg_sq"] = self._fp32_state(param, local)
            return state
        rows, row_len = param.shape[0], _row_len(param)
        parts = _check_blocks_align(param, row_len, block, bits)
        local_len = row_len // parts  # a rowwise tp split: each rank's part of every row
        local_rows = local.numel() // local_len
        nblocks = ceil_div(row_len, block)

        def zeros(cols: int, dtype: torch.dtype, global_cols: int) -> torch.Tensor:
            tensor = torch.zeros(local_rows, cols, dtype=dtype, device=local.device)
            return like_param(param, tensor, (rows, global_cols))

        names = STATE_NAMES[bits]
        if bits == 8:
            state[names[0]] = zeros(local_len, torch.int8, row_len)
            state[names[2]] = zeros(local_len, torch.uint8, row_len)
        else:  # two codes per byte; a split row's parts are whole blocks of an even size
            state[names[0]] = zeros(packed_columns(local_len), torch.uint8, packed_columns(row_len))
            state[names[2]] = zeros(packed_columns(local_len), torch.uint8, packed_columns(row_len))
        state[names[1]] = zeros(nblocks // parts, torch.float32, nblocks)
        state[names[3]] = zeros(nblocks // parts, torch.float32, nblocks)
        return state

    @staticmethod
    def _state_bits(state: dict) -> int:
        """32, 8 or 4: the precision a parameter's state is kept in (by its entries)."""
        return next((bits for bits, names in STATE_NAMES.items() if names[0] in state), 32)

    def _moments(self, slot: Slot, block: int) -> tuple[torch.Tensor, torch.Tensor]:
        """fp32 ``(m, v)`` of the local shape: the states themselves, or dequantized."""
        state, bits = slot.state, self._state_bits(slot.state)
        if bits == 32:
            return local_shard(state["exp_avg"]), local_shard(state["exp_avg_sq"])
        q_m, s_m, q_r, s_r = (local_shard(state[name]) for name in STATE_NAMES[bits])
        length = math.prod(slot.local.shape[1:])
        if s_m.shape[1] != ceil_div(length, block):
            raise RuntimeError(
                f"{bits}-bit state with {s_m.shape[1]} blocks per row of {length} does not fit "
                f"block_size={block}: was the state saved with another block_size?"
            )
        m, r = dequantize_moments(bits, (q_m, s_m, q_r, s_r), block, length)
        return m.view(slot.local.shape), r.mul_(r).view(slot.local.shape)

    def _update(self, slots: list[Slot], group: dict[str, Any]) -> None:
        lr = float(group["lr"])
        beta1, beta2 = (float(b) for b in group["betas"])
        eps, weight_decay, block = float(group["eps"]), float(group["weight_decay"]), _block_size(group)
        works = [s.work for s in slots]
        grads = [s.grad for s in slots]
        moments = [self._moments(s, block) for s in slots]
        exp_avgs = [m for m, _ in moments]
        exp_avg_sqs = [v for _, v in moments]
        del moments
        steps = self._step_counts(slots)

        if _use_fused(group.get("fused"), works[0].device):
            # torch.optim.AdamW(fused=True)'s kernel, in place on the fp32 work tensors
            on_device: dict[float, torch.Tensor] = {}  # one tensor per step count, not per parameter
            step_tensors = [
                on_device.setdefault(step, torch.tensor(step, dtype=torch.float32, device=works[0].device))
                for step in steps
            ]
            torch._fused_adamw_(
                works, grads, exp_avgs, exp_avg_sqs, [], step_tensors, lr=lr, beta1=beta1, beta2=beta2,
                weight_decay=weight_decay, eps=eps, amsgrad=False, maximize=False,
            )
            for slot, m, v in zip(slots, exp_avgs, exp_avg_sqs):
                if self._state_bits(slot.state) != 32:
                    self._store(slot, m, v.sqrt(), block)
            return
        # torch.optim.AdamW's operations, in its order (_multi_tensor_adam, non-capturable).
        if weight_decay != 0:
            torch._foreach_mul_(works, 1 - lr * weight_decay)
        torch._foreach_lerp_(exp_avgs, grads, 1 - beta1)
        torch._foreach_mul_(exp_avg_sqs, beta2)
        torch._foreach_addcmul_(exp_avg_sqs, grads, grads, 1 - beta2)
        del grads
        step_sizes = [(lr / (1 - beta1**step)) * -1 for step in steps]
        bias_correction2_sqrt = [(1 - beta2**step) ** 0.5 for step in steps]
        denoms = torch._foreach_sqrt(exp_avg_sqs)  # sqrt(v): what the 8-bit state stores
        for slot, m, r in zip(slots, exp_avgs, denoms):
            if self._state_bits(slot.state) != 32:
                self._store(slot, m, r, block)
        del exp_avg_sqs
        torch._foreach_div_(denoms, bias_correction2_sqrt)
        torch._foreach_add_(denoms, eps)
        torch._foreach_addcdiv_(works, exp_avgs, denoms, step_sizes)

    @staticmethod
    def _step_counts(slots: list[Slot]) -> list[float]:
        """Count this step in each parameter's ``step`` (once for a parameter cut into
        pieces) and read the counts: the counters live on the CPU, as in ``torch.optim``,
        so reading them waits for no device."""
        for slot in slots:
            if slot.first:
                slot.state["step"] += 1
        return [slot.state["step"].item() for slot in slots]

    def _store(self, slot: Slot, m: torch.Tensor, r: torch.Tensor, block: int) -> None:
        """Requantize ``m`` and ``r = sqrt(v)`` into the 8-bit or 4-bit states, in place."""
        state, bits = slot.state, self._state_bits(slot.state)
        q_m, s_m, q_r, s_r = (local_shard(state[name]) for name in STATE_NAMES[bits])
        rows_shape = (q_m.shape[0], math.prod(slot.local.shape[1:]))
        # on accelerators the finiteness verdict joins the step's single read
        deferred = update_checks.defers(m.device)
        nonfinite = "propagate" if deferred else "raise"
        finite = []
        for q, s, values, signed in ((q_m, s_m, m, True), (q_r, s_r, r, False)):
            s.copy_(quantize_moment(bits, values.reshape(rows_shape), block, signed=signed, out=q, nonfinite=nonfinite))
            if deferred:
                finite.append(torch.isfinite(s).all())
        if deferred:
            update_checks.defer(finite[0] & finite[1], update_checks.describe("optimizer state", rows_shape))
