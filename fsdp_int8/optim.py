"""Fused optimizers for int8 weights: one dequantization and one requantization per step.

``torch.optim.AdamW`` works on :class:`~fsdp_int8.Int8Weight` parameters through the op
table, but in its default (for-loop and foreach) forms each in-place op it issues on the
weight (``mul_`` for weight decay, ``addcdiv_`` for the step) dequantizes and requantizes
it again, drawing fresh rounding noise each time (its ``fused=True`` form requantizes
once, on fp32 copies of all parameters at once). :class:`Int8AdamW` and :class:`Int8SGD`
dequantize every int8 weight once, run the whole update in fp32 with ``torch._foreach_*``
ops over bounded chunks of parameters, and requantize once with the weight's own
rounding. :class:`Int8AdamW` can also keep its moments in 8 bits (``state_bits=8``),
block-wise within each row.

Both work on FSDP2 (DTensor) parameters by updating each rank's local tensors: the update
is elementwise, so a step issues no collective. Formulas, layouts and the bytes per
parameter they cost: docs/optim.md.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import DTensor
from torch.optim.optimizer import Optimizer, ParamsT

from fsdp_int8.weight import Int8Weight, contiguous_strides, local_shard

__all__ = [
    "Int8AdamW",
    "Int8SGD",
    "PersistentBytes",
    "persistent_bytes",
    "persistent_bytes_per_param",
]

# The update of a chunk of parameters runs on fp32 copies (dequantized weights, moments,
# the denominator): at most this many elements at a time (one parameter at least), so the
# step's transient memory stays ~16 bytes x 2^24 = 256 MiB instead of growing into an fp32
# copy of the whole model.
_CHUNK_ELEMENTS = 1 << 24

# 32-bit state entries: always fp32 (also when loaded from a torch.optim checkpoint of a
# bf16 model, whose states are bf16).
_FP32_STATES = ("exp_avg", "exp_avg_sq", "momentum_buffer")

_INT8_LEVELS = 127  # signed moments: [-127, 127], symmetric like the weights
_UINT8_LEVELS = 255  # sqrt of the second moment: [0, 255]


# ---------------------------------------------------------------- block-wise 8-bit states
def _blocks_view(values: torch.Tensor, block_size: int) -> torch.Tensor:
    """``[rows, K]`` as ``[rows, nblocks, block_size]``; the last block of each row is
    padded with zeros (which change no absmax). Blocks never span two rows."""
    rows, row_len = values.shape
    nblocks = -(-row_len // block_size)
    pad = nblocks * block_size - row_len
    if pad:
        values = F.pad(values, (0, pad))
    return values.reshape(rows, nblocks, block_size)


def _quantize_blocks_into(
    values: torch.Tensor, q_out: torch.Tensor, scale_out: torch.Tensor, block_size: int, *,
    signed: bool,
) -> None:
    """Round-to-nearest block-wise absmax quantization of ``values`` (fp32 ``[rows, K]``)
    into ``q_out`` (int8 or uint8 ``[rows, K]``) and ``scale_out`` (fp32 ``[rows, nblocks]``).

    See :func:`_quantize_blocks`.
    """
    rows, row_len = values.shape
    blocks = _blocks_view(values.float(), block_size)
    levels = _INT8_LEVELS if signed else _UINT8_LEVELS
    amax = (blocks.abs() if signed else blocks).amax(dim=2)  # unsigned values are >= 0
    if not bool(torch.isfinite(amax).all()):
        raise ValueError(
            f"cannot quantize an optimizer state of shape {(rows, row_len)} to 8 bits: it holds "
            "NaN or Inf (from NaN or Inf gradients). Check the loss and the learning rate."
        )
    scale_out.copy_(amax / levels)
    # Multiply by levels / amax (one division per block, not per element); an all-zero
    # block gets 0 and stays 0.
    inverse = torch.where(amax > 0, levels / amax, torch.zeros_like(amax))
    q = blocks.mul(inverse.unsqueeze(2)).round_()
    if signed:
        q.clamp_(-levels, levels)
    else:
        q.clamp_(max=levels)
        torch.maximum(q, blocks.sign(), out=q)  # level 0 only for exact zeros
    q_out.copy_(q.view(rows, q.shape[1] * q.shape[2])[:, :row_len])  # cast to 8 bits in the copy


def _quantize_blocks(
    values: torch.Tensor, block_size: int, *, signed: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Round-to-nearest block-wise absmax quantization of a ``[rows, K]`` float tensor.

    Returns ``(q, scale)``: ``q`` is ``[rows, K]`` int8 in ``[-127, 127]`` (``signed``) or
    uint8 in ``[0, 255]`` (``values`` must then be >= 0), ``scale`` is fp32
    ``[rows, ceil(K / block_size)]`` with ``scale = absmax(block) / levels``; blocks are
    consecutive ``block_size`` elements of one row, the last one of a row may be shorter.
    Unsigned quantization never rounds a positive value to 0: it is the square root of a
    second moment, and a zero there would turn the Adam denominator into ``eps`` (see
    :class:`Int8AdamW`).

    Raises:
        ValueError: if ``values`` holds NaN or Inf.
    """
    rows, row_len = values.shape
    q = torch.empty(rows, row_len, dtype=torch.int8 if signed else torch.uint8, device=values.device)
    scale = torch.empty(rows, -(-row_len // block_size), dtype=torch.float32, device=values.device)
    _quantize_blocks_into(values, q, scale, block_size, signed=signed)
    return q, scale


def _dequantize_blocks(q: torch.Tensor, scale: torch.Tensor, block_size: int) -> torch.Tensor:
    """Inverse of :func:`_quantize_blocks`: fp32 ``[rows, K]``, contiguous."""
    rows, row_len = q.shape
    values = torch.mul(_blocks_view(q, block_size), scale.unsqueeze(2))  # 8-bit x fp32 -> fp32
    values = values.view(rows, values.shape[1] * values.shape[2])
    return values if values.shape[1] == row_len else values[:, :row_len].contiguous()


# ---------------------------------------------------------------- helpers
def _row_len(param: torch.Tensor) -> int | None:
    """Elements per dim-0 row of a parameter with >= 2 dims and >= 1 row (global shape)."""
    if param.dim() < 2 or param.shape[0] == 0:
        return None
    return param.numel() // param.shape[0]


def _keeps_whole_rows(param: torch.Tensor) -> bool:
    """Whether each rank's local tensor holds whole dim-0 rows (Shard(0) / Replicate)."""
    if not isinstance(param, DTensor):
        return True
    return all(p.is_replicate() or p.is_shard(dim=0) for p in param.placements)


def _like_param(param: torch.Tensor, local: torch.Tensor, global_shape: tuple[int, ...]) -> torch.Tensor:
    """``local`` as a state of ``param``: a DTensor placed like it (so DCP reshards it)."""
    if not isinstance(param, DTensor):
        return local
    return DTensor.from_local(
        local, param.device_mesh, param.placements, run_check=False,
        shape=torch.Size(global_shape), stride=contiguous_strides(global_shape),
    )


def _check_floating(params: Iterable[torch.Tensor], owner: str) -> None:
    for param in params:
        if not isinstance(param, torch.Tensor):
            raise TypeError(f"{owner} optimizes tensors, got {type(param).__name__}")
        if param.is_complex():
            raise ValueError(
                f"{owner} does not support complex parameters (got one of dtype {param.dtype}): "
                "view it as real (torch.view_as_real) or use torch.optim"
            )
        if not param.is_floating_point():
            raise ValueError(f"{owner} optimizes floating parameters, got one of dtype {param.dtype}")


def _check_number(name: str, value: Any, low: float, high: float | None = None, *,
                  high_open: bool = True) -> None:
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ValueError(f"{name} must be a number or a one-element tensor, got shape {tuple(value.shape)}")
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number, got {value!r}")
    in_range = value >= low and (high is None or (value < high if high_open else value <= high))
    if not in_range:
        bound = f"[{low}, {high})" if high is not None and high_open else (
            f"[{low}, {high}]" if high is not None else f">= {low}"
        )
        raise ValueError(f"{name} must be in {bound}, got {value}")


class _KeepAsLoaded:
    """Hides a state tensor from ``Optimizer.load_state_dict``'s cast (see there)."""

    __slots__ = ("tensor",)

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor


@dataclass
class _Slot:
    """One parameter during a step: its local tensors and fp32 working copies."""

    param: torch.Tensor  # as the optimizer holds it (DTensor or plain)
    local: torch.Tensor  # this rank's tensor: an Int8Weight or a plain tensor
    state: dict
    work: torch.Tensor  # fp32 values updated in place (the local tensor itself if fp32)
    grad: torch.Tensor  # fp32, read only


# ---------------------------------------------------------------- shared machinery
class _FusedInt8Optimizer(Optimizer):
    """Parameter handling shared by :class:`Int8AdamW` and :class:`Int8SGD`."""

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        _check_floating(group["params"], type(self).__name__)
        self._check_group(group)

    def _check_group(self, group: dict[str, Any]) -> None:  # pragma: no cover - overridden
        raise NotImplementedError

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Perform one optimization step; returns ``closure()``'s loss if given."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            with_grad = [p for p in group["params"] if p.grad is not None]
            by_device: dict[torch.device, list[torch.Tensor]] = defaultdict(list)
            for param in with_grad:
                by_device[local_shard(param).device].append(param)
            for params in by_device.values():
                for chunk in _chunks(params):
                    slots = [self._slot(param, group) for param in chunk]
                    self._update(slots, group)
                    self._write_back(slots, skip_int8=float(group["lr"]) == 0.0)
        return loss

    def _slot(self, param: torch.Tensor, group: dict[str, Any]) -> _Slot:
        grad = param.grad
        if grad.is_sparse:
            raise RuntimeError(f"{type(self).__name__} does not support sparse gradients")
        if isinstance(param, DTensor) != isinstance(grad, DTensor) or (
            isinstance(param, DTensor) and tuple(grad.placements) != tuple(param.placements)
        ):
            raise RuntimeError(
                f"{type(self).__name__} updates each rank's local shard, so a gradient must be "
                f"placed like its parameter: parameter {_placement_text(param)}, gradient "
                f"{_placement_text(grad)}"
            )
        local, local_grad = local_shard(param), local_shard(grad)
        if local_grad.shape != local.shape:
            raise RuntimeError(
                f"gradient of shape {tuple(local_grad.shape)} for a parameter of shape {tuple(local.shape)}"
            )
        state = self.state.get(param)
        if not state:  # no entry for stateless parameters (SGD without momentum), as torch
            state = self._init_state(param, local, group)
            if state:
                self.state[param] = state
        if isinstance(local, Int8Weight):
            work = local.dequantize(torch.float32)  # one dequantization per step
        elif local.dtype == torch.float32:
            work = local  # updated in place, as torch.optim does
        else:
            work = local.float()
        return _Slot(param, local, state, work, local_grad.float())

    def _init_state(self, param: torch.Tensor, local: torch.Tensor,
                    group: dict[str, Any]) -> dict:  # pragma: no cover - overridden
        """The initial state of ``param`` (may be empty)."""
        raise NotImplementedError

    def _update(self, slots: list[_Slot], group: dict[str, Any]) -> None:  # pragma: no cover
        raise NotImplementedError

    def _write_back(self, slots: list[_Slot], *, skip_int8: bool) -> None:
        for slot in slots:
            if isinstance(slot.local, Int8Weight):
                # lr == 0 (warm-up from 0, or get_optimizer_state_dict's initialising step):
                # the fp32 values are exactly the old ones; requantizing could still move a
                # value by one step (recomputed scale, stochastic noise): leave it untouched.
                if not skip_int8:
                    slot.local.assign_(slot.work, stochastic=slot.local.stochastic_rounding)
            elif slot.work is not slot.local:
                slot.local.copy_(slot.work)

    def _fp32_state(self, param: torch.Tensor, local: torch.Tensor,
                    values: torch.Tensor | None = None) -> torch.Tensor:
        """An fp32 state like ``param`` (zeros, or a copy of ``values``)."""
        local_state = (
            torch.zeros(local.shape, dtype=torch.float32, device=local.device)
            if values is None else values.detach().clone()
        )
        return _like_param(param, local_state, tuple(param.shape))

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state from :meth:`state_dict` (or from ``set_optimizer_state_dict``).

        ``torch.optim.Optimizer.load_state_dict`` casts every floating state tensor to its
        parameter's dtype: that would turn 8-bit moments into floats and round fp32
        scales (and fp32 moments) of a bf16 model to bf16. Here every state keeps its own
        dtype and is only moved to the parameter's device; 32-bit moments are fp32 (so a
        ``torch.optim`` checkpoint of a bf16 model loads too). Load-state-dict pre-hooks
        see the state tensors wrapped in an internal holder.
        """
        state_dict = dict(state_dict)
        state_dict["state"] = {
            key: {
                name: _KeepAsLoaded(value) if isinstance(value, torch.Tensor) and name != "step" else value
                for name, value in per_param.items()
            } if isinstance(per_param, dict) else per_param
            for key, per_param in state_dict["state"].items()
        }
        super().load_state_dict(state_dict)
        for group in self.param_groups:
            # A torch.optim state dict has no state_bits / block_size: keep ours. Its
            # switches that this optimizer does not implement must be off.
            for key, value in self.defaults.items():
                group.setdefault(key, value)
            unsupported = [k for k in ("amsgrad", "maximize", "differentiable") if group.get(k)]
            if unsupported:
                raise ValueError(f"{type(self).__name__} does not implement {', '.join(unsupported)}")
            self._check_group(group)
        for param, per_param in self.state.items():
            if not isinstance(per_param, dict):
                continue
            device = local_shard(param).device if isinstance(param, torch.Tensor) else None
            for name, value in list(per_param.items()):
                if isinstance(value, _KeepAsLoaded):
                    tensor = value.tensor
                    if name in _FP32_STATES:
                        tensor = tensor.to(dtype=torch.float32)
                    per_param[name] = tensor.to(device=device) if device is not None else tensor


def _placement_text(tensor: torch.Tensor) -> str:
    if isinstance(tensor, DTensor):
        return f"DTensor{tuple(tensor.placements)}"
    return "plain tensor"


def _chunks(params: list[torch.Tensor]) -> Iterator[list[torch.Tensor]]:
    """Consecutive parameters, at most ``_CHUNK_ELEMENTS`` local elements per chunk."""
    chunk: list[torch.Tensor] = []
    total = 0
    for param in params:
        size = local_shard(param).numel()
        if chunk and total + size > _CHUNK_ELEMENTS:
            yield chunk
            chunk, total = [], 0
        chunk.append(param)
        total += size
    if chunk:
        yield chunk


# ---------------------------------------------------------------- AdamW
class Int8AdamW(_FusedInt8Optimizer):
    r"""AdamW for int8 weights: one dequantization and one requantization per step.

    The same update as ``torch.optim.AdamW`` (decoupled weight decay, bias correction),
    with the same fp32 operations in the same order (``torch._foreach_*`` over many
    parameters at a time)::

        step += 1
        w  = w * (1 - lr * weight_decay)
        m  = m.lerp(g, 1 - beta1)
        v  = v * beta2 + (1 - beta2) * g * g
        w  = w - lr / (1 - beta1**step) * m / (sqrt(v) / sqrt(1 - beta2**step) + eps)

    For an :class:`~fsdp_int8.Int8Weight` (plain, or the local tensor of an FSDP2 DTensor)
    ``w`` is the weight dequantized once to fp32, and the result is requantized once with
    the weight's own rounding (``weight.assign_(w, stochastic=weight.stochastic_rounding)``).
    So with round-to-nearest weights the values before requantization are bit-identical to
    ``torch.optim.AdamW``'s on the dequantized weight (tested). Other parameters are
    updated in place with the same math (in fp32 for bf16 / fp16 parameters, then cast
    back). DTensor parameters are updated through their local tensors: no collective.
    A step with ``lr == 0`` leaves int8 weights untouched (their values cannot change).

    **8-bit states** (``state_bits=8``) are used for every parameter with at least 2
    dims whose rows (``numel // shape[0]`` elements) are at least ``block_size`` long;
    1-D parameters (biases, norms) and short rows keep fp32 states. Each row is cut into
    blocks of ``block_size`` elements (the last one may be shorter): a block never spans
    two rows, so a checkpoint reshards bit-exactly at any world size (rows move between
    ranks whole). Per block:

    - ``m`` (``exp_avg_int8``: int8 ``[rows, K]``, ``exp_avg_scale``: fp32
      ``[rows, ceil(K / block_size)]``): symmetric absmax, ``m ~ q * absmax / 127``.
    - ``v`` is stored as its square root ``r = sqrt(v)`` (``exp_avg_sq_sqrt_uint8``:
      uint8 ``[rows, K]``, ``exp_avg_sq_sqrt_scale``: fp32 per block), ``r ~ q * max / 255``,
      ``v = r**2``. Why the square root: the update divides by ``sqrt(v)``, so linear
      steps in ``r`` give every element of a block the same absolute error on the
      denominator (at most ``max(r) / 510``, half a level), and ``r`` spans the square root of ``v``'s
      dynamic range; linear steps in ``v`` itself would zero every element below
      ``max(v) / 510``, i.e. with ``r`` below 4.4% of the block's largest.
      A positive ``r`` is never rounded to level 0 (it rounds up to level 1): a zero
      would make the denominator ``eps`` and the step ``m / eps``, huge. Small
      second moments are thus overestimated, which only shortens their steps.

    Each step dequantizes the states to fp32, updates them with the formulas above, uses
    the fp32 values for this step's update, and requantizes them with **round to nearest**.
    Stochastic rounding, unbiased per step, would make a slow moving average a random
    walk: each step adds rounding noise (standard deviation ~0.4 level) that ``v``
    forgets only at rate ``1 - beta2``, so it accumulates to ~``0.4 / sqrt(1 - beta2)``,
    about 13 levels for ``beta2 = 0.999``. Round to nearest errs by at most half a level
    per step, is deterministic (exact resume; no draws from the weights' rounding
    generator), and the absmax scale, recomputed every step, follows a block's common
    decay; its cost is that an element drifting relative to its block's largest by less
    than half a level per step keeps its level.

    Checkpoints: state tensors of DTensor parameters are DTensors placed like the
    parameter (the scales ``[rows, nblocks]`` sharded on rows like it), so
    ``get_optimizer_state_dict`` / ``set_optimizer_state_dict`` and
    :func:`fsdp_int8.save_checkpoint` / :func:`~fsdp_int8.load_checkpoint` save and
    reshard them; ``step`` is a 0-d fp32 tensor as in ``torch.optim``. With
    ``state_bits=32`` the state (``step``, ``exp_avg``, ``exp_avg_sq``) has the layout of
    ``torch.optim.AdamW``'s, in fp32. A checkpoint loads only into an optimizer with the
    same ``state_bits`` and ``block_size``.

    Args:
        params: Parameters or parameter groups (as for any ``torch.optim`` optimizer).
        lr: Learning rate, >= 0.
        betas: ``(beta1, beta2)``, each in ``[0, 1)``.
        eps: Added to the denominator, >= 0.
        weight_decay: Decoupled weight decay, >= 0.
        state_bits: ``32`` (fp32 moments) or ``8`` (block-wise 8-bit moments, see above).
        block_size: Elements per 8-bit block (>= 1). Also the minimum row length for
            8-bit states.

    Raises:
        ValueError: a hyperparameter out of range, ``state_bits`` not 8 or 32,
            ``block_size < 1``, or a complex or non-floating parameter.
        TypeError: a hyperparameter of the wrong type.
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
        block_size: int = 64,
    ) -> None:
        defaults = dict(
            lr=lr, betas=tuple(betas) if isinstance(betas, (tuple, list)) else betas, eps=eps,
            weight_decay=weight_decay, state_bits=state_bits, block_size=block_size,
        )
        self._check_group(defaults)
        super().__init__(params, defaults)

    def _check_group(self, group: dict[str, Any]) -> None:
        _check_number("lr", group["lr"], 0.0)
        betas = group["betas"]
        if not isinstance(betas, (tuple, list)) or len(betas) != 2:
            raise ValueError(f"betas must be a pair (beta1, beta2), got {betas!r}")
        _check_number("beta1", betas[0], 0.0, 1.0)
        _check_number("beta2", betas[1], 0.0, 1.0)
        _check_number("eps", group["eps"], 0.0)
        _check_number("weight_decay", group["weight_decay"], 0.0)
        bits, block = group["state_bits"], group["block_size"]
        if isinstance(bits, bool) or bits not in (8, 32):
            raise ValueError(f"state_bits must be 8 or 32, got {bits!r}")
        if isinstance(block, bool) or not isinstance(block, int):
            raise TypeError(f"block_size must be an int, got {block!r}")
        if block < 1:
            raise ValueError(f"block_size must be >= 1, got {block}")

    @staticmethod
    def uses_8bit_state(param: torch.Tensor, state_bits: int, block_size: int) -> bool:
        """Whether a parameter gets 8-bit moments: ``state_bits == 8``, at least 2 dims,
        and rows (``numel // shape[0]`` elements, global shape) of at least ``block_size``."""
        row_len = _row_len(param)
        return state_bits == 8 and row_len is not None and row_len >= block_size

    def _init_state(self, param, local, group) -> dict:
        state: dict[str, torch.Tensor] = {}
        # A 0-d fp32 step on the CPU, as torch.optim.AdamW keeps it (no device sync to read).
        state["step"] = torch.tensor(0.0, dtype=torch.float32)
        block = group["block_size"]
        if not self.uses_8bit_state(param, group["state_bits"], block):
            state["exp_avg"] = self._fp32_state(param, local)
            state["exp_avg_sq"] = self._fp32_state(param, local)
            return state
        if not _keeps_whole_rows(param):
            raise ValueError(
                "8-bit optimizer states need whole rows on each rank (Shard(0) or Replicate "
                f"placements), got a parameter placed as {tuple(param.placements)}; use "
                "state_bits=32 for it (a separate parameter group)"
            )
        rows, row_len = param.shape[0], _row_len(param)
        local_rows = local.numel() // row_len
        nblocks = -(-row_len // block)

        def zeros(cols: int, dtype: torch.dtype, global_cols: int) -> torch.Tensor:
            tensor = torch.zeros(local_rows, cols, dtype=dtype, device=local.device)
            return _like_param(param, tensor, (rows, global_cols))

        state["exp_avg_int8"] = zeros(row_len, torch.int8, row_len)
        state["exp_avg_scale"] = zeros(nblocks, torch.float32, nblocks)
        state["exp_avg_sq_sqrt_uint8"] = zeros(row_len, torch.uint8, row_len)
        state["exp_avg_sq_sqrt_scale"] = zeros(nblocks, torch.float32, nblocks)
        return state

    @staticmethod
    def _is_8bit(state: dict) -> bool:
        return "exp_avg_int8" in state

    def _moments(self, slot: _Slot, block: int) -> tuple[torch.Tensor, torch.Tensor]:
        """fp32 ``(m, v)`` of the local shape: the states themselves, or dequantized."""
        state = slot.state
        if not self._is_8bit(state):
            return local_shard(state["exp_avg"]), local_shard(state["exp_avg_sq"])
        q_m, s_m = local_shard(state["exp_avg_int8"]), local_shard(state["exp_avg_scale"])
        q_r, s_r = local_shard(state["exp_avg_sq_sqrt_uint8"]), local_shard(state["exp_avg_sq_sqrt_scale"])
        if s_m.shape[1] != -(-q_m.shape[1] // block):
            raise RuntimeError(
                f"8-bit state with {s_m.shape[1]} blocks per row of {q_m.shape[1]} does not fit "
                f"block_size={block}: was the state saved with another block_size?"
            )
        m = _dequantize_blocks(q_m, s_m, block).view(slot.local.shape)
        r = _dequantize_blocks(q_r, s_r, block)
        return m, r.mul_(r).view(slot.local.shape)

    def _update(self, slots: list[_Slot], group: dict[str, Any]) -> None:
        lr = float(group["lr"])
        beta1, beta2 = (float(b) for b in group["betas"])
        eps, weight_decay, block = float(group["eps"]), float(group["weight_decay"]), group["block_size"]
        works = [s.work for s in slots]
        grads = [s.grad for s in slots]
        moments = [self._moments(s, block) for s in slots]
        exp_avgs = [m for m, _ in moments]
        exp_avg_sqs = [v for _, v in moments]
        del moments
        steps = []
        for slot in slots:
            slot.state["step"] += 1
            steps.append(slot.state["step"].item())

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
            if self._is_8bit(slot.state):
                self._store_8bit(slot, m, r, block)
        del exp_avg_sqs
        torch._foreach_div_(denoms, bias_correction2_sqrt)
        torch._foreach_add_(denoms, eps)
        torch._foreach_addcdiv_(works, exp_avgs, denoms, step_sizes)

    @staticmethod
    def _store_8bit(slot: _Slot, m: torch.Tensor, r: torch.Tensor, block: int) -> None:
        state = slot.state
        q_m = local_shard(state["exp_avg_int8"])
        rows_shape = q_m.shape
        for (q_key, s_key), values, signed in (
            (("exp_avg_int8", "exp_avg_scale"), m, True),
            (("exp_avg_sq_sqrt_uint8", "exp_avg_sq_sqrt_scale"), r, False),
        ):
            _quantize_blocks_into(
                values.reshape(rows_shape), local_shard(state[q_key]), local_shard(state[s_key]), block,
                signed=signed,
            )


# ---------------------------------------------------------------- SGD
class Int8SGD(_FusedInt8Optimizer):
    """SGD (momentum, Nesterov, L2 weight decay) for int8 weights, one requantization per step.

    The update of ``torch.optim.SGD`` with ``dampening=0``, in fp32::

        g = g + weight_decay * w
        b = g                      (first step)     b = momentum * b + g   (later steps)
        g = g + momentum * b       (nesterov)       g = b                  (otherwise)
        w = w - lr * g

    As in :class:`Int8AdamW`, an int8 weight is dequantized once, updated in fp32 and
    requantized once with its own rounding; DTensor parameters are updated through their
    local tensors (no collective); ``lr == 0`` leaves int8 weights untouched. The
    momentum buffer (``momentum_buffer``, only when ``momentum != 0``) is fp32, placed
    like its parameter, with ``torch.optim.SGD``'s layout.

    Args:
        params: Parameters or parameter groups.
        lr: Learning rate, >= 0.
        momentum: Momentum factor, >= 0.
        weight_decay: L2 penalty added to the gradient, >= 0.
        nesterov: Nesterov momentum (needs ``momentum > 0``).

    Raises:
        ValueError: a hyperparameter out of range, ``nesterov`` without momentum, or a
            complex or non-floating parameter.
    """

    def __init__(
        self,
        params: ParamsT,
        lr: float | torch.Tensor,
        momentum: float = 0.0,
        weight_decay: float = 0.0,
        nesterov: bool = False,
    ) -> None:
        defaults = dict(lr=lr, momentum=momentum, weight_decay=weight_decay, nesterov=nesterov)
        self._check_group(defaults)
        super().__init__(params, defaults)

    def _check_group(self, group: dict[str, Any]) -> None:
        _check_number("lr", group["lr"], 0.0)
        _check_number("momentum", group["momentum"], 0.0)
        _check_number("weight_decay", group["weight_decay"], 0.0)
        if not isinstance(group["nesterov"], bool):
            raise TypeError(f"nesterov must be a bool, got {group['nesterov']!r}")
        if group["nesterov"] and group["momentum"] <= 0:
            raise ValueError("Nesterov momentum needs momentum > 0")

    def _init_state(self, param, local, group) -> dict:
        return {}  # the momentum buffer is made from the first gradient, as torch.optim.SGD does

    def _update(self, slots: list[_Slot], group: dict[str, Any]) -> None:
        lr, momentum = float(group["lr"]), float(group["momentum"])
        weight_decay, nesterov = float(group["weight_decay"]), group["nesterov"]
        works = [s.work for s in slots]
        grads = [s.grad for s in slots]
        if weight_decay != 0:
            grads = torch._foreach_add(grads, works, alpha=weight_decay)
        if momentum != 0:
            fresh = [i for i, s in enumerate(slots) if "momentum_buffer" not in s.state]
            for i in fresh:
                slot = slots[i]
                slot.state = self.state[slot.param]
                slot.state["momentum_buffer"] = self._fp32_state(slot.param, slot.local, grads[i])
            old = sorted(set(range(len(slots))) - set(fresh))
            if old:
                bufs = [local_shard(slots[i].state["momentum_buffer"]) for i in old]
                torch._foreach_mul_(bufs, momentum)
                torch._foreach_add_(bufs, [grads[i] for i in old], alpha=1.0)
            bufs = [local_shard(s.state["momentum_buffer"]) for s in slots]
            grads = torch._foreach_add(grads, bufs, alpha=momentum) if nesterov else bufs
        torch._foreach_add_(works, grads, alpha=-lr)


# ---------------------------------------------------------------- memory accounting
@dataclass(frozen=True)
class PersistentBytes:
    """Bytes this rank keeps between steps for its own parameter elements.

    Attributes:
        params: Local parameter elements (each rank's shard of each parameter, once).
        weights: Their storage: int8 data + fp32 scales for int8 weights, ``numel x
            element size`` for the others.
        grads: Their gradients (see :func:`persistent_bytes` for the dtype counted).
        states: Every tensor of the optimizer's state of these parameters (moments,
            scales, step counters), local shards only.
    """

    params: int
    weights: int
    grads: int
    states: int

    @property
    def total(self) -> int:
        """``weights + grads + states``."""
        return self.weights + self.grads + self.states

    @property
    def per_param(self) -> float:
        """``total / params`` (0.0 without parameters)."""
        return self.total / self.params if self.params else 0.0


def _tensor_bytes(tensor: torch.Tensor) -> int:
    local = local_shard(tensor)
    if hasattr(local, "__tensor_flatten__"):  # Int8Weight, or another library's subclass
        names, _ = local.__tensor_flatten__()
        return sum(_tensor_bytes(getattr(local, name)) for name in names)
    return local.numel() * local.element_size()


def persistent_bytes(
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    grad_dtype: torch.dtype | None = None,
) -> PersistentBytes:
    """Add up what this rank stores for its own parameters: weights, gradients, states.

    Counts storage bytes of each rank's local tensors (the DTensor shard of an FSDP2
    parameter; int8 data plus scales for an :class:`~fsdp_int8.Int8Weight`), each
    parameter once (tied weights too). Call it between steps, while FSDP2 parameters are
    sharded. Transient buffers (all-gathered weights, activations, the fp32 working
    copies of a step) are not persistent and not counted.

    Args:
        model: The model (sharded or not).
        optimizer: Its optimizer; ``None`` counts no state.
        grad_dtype: Count every gradient of a parameter that requires grad at this dtype
            (e.g. ``torch.bfloat16`` for the cost with bf16 gradients). ``None``: the
            existing gradient's dtype, or the parameter's dtype (the training dtype
            autograd and FSDP2 produce it in) when ``.grad`` is ``None`` (after
            ``zero_grad()``).
    """
    params = list({id(p): p for p in model.parameters()}.values())
    count = weights = grads = states = 0
    for param in params:
        local = local_shard(param)
        count += local.numel()
        weights += _tensor_bytes(param)
        if param.requires_grad:
            dtype = grad_dtype or (param.grad.dtype if param.grad is not None else param.dtype)
            grads += local.numel() * torch.empty((), dtype=dtype).element_size()
        if optimizer is not None and param in optimizer.state:
            for value in optimizer.state[param].values():
                if isinstance(value, torch.Tensor):
                    states += _tensor_bytes(value)
    return PersistentBytes(params=count, weights=weights, grads=grads, states=states)


def persistent_bytes_per_param(
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    grad_dtype: torch.dtype | None = None,
) -> float:
    """Persistent bytes per local parameter element: :func:`persistent_bytes`'s ``per_param``."""
    return persistent_bytes(model, optimizer, grad_dtype=grad_dtype).per_param
