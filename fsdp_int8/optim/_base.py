"""What :class:`~fsdp_int8.Int8AdamW` and :class:`~fsdp_int8.Int8SGD` share: a step over
each rank's local tensors in bounded chunks, with one dequantization and one
requantization per int8 weight and step; states placed like their parameters; state-dict
loading that keeps each state's dtype.

A subclass checks its hyperparameters (``_check_group``), makes a parameter's initial
state (``_init_state``) and runs its fp32 update over a chunk (``_update``).
"""

from __future__ import annotations

import contextlib
from collections import defaultdict
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch
from torch.distributed.tensor import DTensor
from torch.optim.optimizer import Optimizer

from fsdp_int8._dist import local_shard
from fsdp_int8._quant.generators import update_stream
from fsdp_int8._weight.ops.views import contiguous_strides
from fsdp_int8._weight.end_of_step import ORDER, EndOfStep
from fsdp_int8._weight.tensor import Int8Weight
from fsdp_int8._weight.update_checks import VERDICTS
from fsdp_int8.optim._checks import check_floating
from fsdp_int8.optim._grad_dtype import GradientCast, check_grad_dtype
from fsdp_int8.optim._in_backward import InBackward, check_max_grad_norm
from fsdp_int8.optim._seeds import StepSeeds

# The update of a chunk of parameters runs on fp32 copies (dequantized weights, moments,
# the denominator): at most this many elements at a time (one parameter at least), so the
# step's transient memory stays ~16 bytes x 2^24 = 256 MiB instead of growing into an fp32
# copy of the whole model. On CPU one parameter at a time: torch runs CPU ``_foreach_`` ops
# as a loop of single ops anyway, and one parameter's copies, freed before the next
# parameter's are made, reuse the same memory instead of faulting fresh pages in every step
# (docs/performance.md, "Kernel choices", has the measurement).
_CHUNK_ELEMENTS = 1 << 24
_CHUNK_ELEMENTS_CPU = 0
# A parameter larger than this is updated in pieces of whole dim-0 rows (at most this
# many elements, one row at least): the step's fp32 copies never grow with the largest
# parameter (an embedding of a large vocabulary), so its transient memory stays below
# ~20 bytes x this (20 MiB on CPU, 320 MiB on GPUs, where fewer, larger kernels pay).
_PIECE_ELEMENTS = 1 << 24
_PIECE_ELEMENTS_CPU = 1 << 20

# 32-bit state entries: always fp32 (also when loaded from a torch.optim checkpoint of a
# bf16 model, whose states are bf16).
_FP32_STATES = ("exp_avg", "exp_avg_sq", "momentum_buffer")


def _split_dim(placement: Any) -> int | None:
    """The dim a placement splits (``Shard``, and FSDP2's ``_StridedShard`` of a tensor
    parallel split, which is no ``Shard``); ``None`` for one that splits nothing, -1 for a
    placement of unknown kind."""
    if placement.is_replicate() or placement.is_partial():
        return None
    dim = getattr(placement, "dim", None)
    return dim if isinstance(dim, int) else -1


def keeps_whole_rows(param: torch.Tensor) -> bool:
    """Whether each rank's local tensor holds whole dim-0 rows (Shard(0) / Replicate)."""
    return column_parts(param) == 1


def column_parts(param: torch.Tensor) -> int | None:
    """Into how many pieces the ranks split each dim-0 row of ``param``: 1 for whole rows
    (Shard(0) / Replicate placements), the product of the mesh sizes that shard its last
    dim (tensor parallelism's rowwise ``Shard(1)`` of a weight), ``None`` for any other
    split (a middle dim, or a row's elements on a dim that is not the last)."""
    if not isinstance(param, DTensor):
        return 1
    parts = 1
    for size, placement in zip(param.device_mesh.shape, param.placements):
        dim = _split_dim(placement)
        if dim is None or dim == 0:
            continue
        if param.dim() < 2 or dim != param.dim() - 1:  # a negative dim: unknown placement
            return None
        parts *= size
    return parts


def like_param(param: torch.Tensor, local: torch.Tensor, global_shape: tuple[int, ...]) -> torch.Tensor:
    """``local`` as a state of ``param``: a DTensor placed like it (so DCP reshards it)."""
    if not isinstance(param, DTensor):
        return local
    return DTensor.from_local(
        local, param.device_mesh, param.placements, run_check=False,
        shape=torch.Size(global_shape), stride=contiguous_strides(global_shape),
    )


def _placement_text(tensor: torch.Tensor) -> str:
    """How an error message names a tensor's placement."""
    if isinstance(tensor, DTensor):
        return f"DTensor{tuple(tensor.placements)}"
    return "plain tensor"


def _chunks(pieces: list["Piece"], limit: int) -> Iterator[list["Piece"]]:
    """Consecutive pieces, at most ``limit`` local elements per chunk (one at least)."""
    chunk: list[Piece] = []
    total = 0
    for piece in pieces:
        size = piece.local.numel()
        if chunk and total + size > limit:
            yield chunk
            chunk, total = [], 0
        chunk.append(piece)
        total += size
    if chunk:
        yield chunk


def _row_ranges(local: torch.Tensor, limit: int) -> list[slice | None]:
    """``[None]`` (the whole tensor) if ``local`` has at most ``limit`` elements, else
    consecutive ranges of whole dim-0 rows of at most ``limit`` elements (one row at least)."""
    if local.numel() <= limit or local.dim() == 0 or local.shape[0] < 2:
        return [None]
    rows = max(1, limit // max(1, local.numel() // local.shape[0]))
    return [slice(start, min(start + rows, local.shape[0])) for start in range(0, local.shape[0], rows)]


def _written(piece: "Piece") -> list[torch.Tensor]:
    """The plain tensors an update of ``piece`` writes: its int8 rows and scales (or its
    values) and its state tensors but the 0-dim step counter."""
    local = piece.local
    tensors = [local.int_data, local.scale] if isinstance(local, Int8Weight) else [local]
    tensors += [local_shard(v) for v in piece.state.values() if isinstance(v, torch.Tensor) and v.dim()]
    return tensors


class _KeepAsLoaded:
    """Hides a state tensor from ``Optimizer.load_state_dict``'s cast (see there)."""

    __slots__ = ("tensor",)

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor


@dataclass
class Piece:
    """A parameter, or a range of its dim-0 rows, with its state and gradient (local)."""

    param: torch.Tensor  # as the optimizer holds it (DTensor or plain)
    local: torch.Tensor  # this rank's tensor or its rows: an Int8Weight or a plain tensor
    state: dict  # the parameter's state, its tensors cut to the same rows (scalars shared)
    grad: torch.Tensor  # the local gradient, same rows
    first: bool  # the parameter's first piece (counts the step)


@dataclass
class Slot:
    """One piece during a step: its local tensors and fp32 working copies."""

    param: torch.Tensor
    local: torch.Tensor
    state: dict
    work: torch.Tensor  # fp32 values updated in place (the local tensor itself if fp32)
    grad: torch.Tensor  # fp32, read only
    first: bool = True


class FusedInt8Optimizer(Optimizer):
    """Parameter handling shared by :class:`~fsdp_int8.Int8AdamW` and :class:`~fsdp_int8.Int8SGD`."""

    checks_finite_gradients = True  # its step checks (guard.CHECKS_OWN_GRADIENTS): no default guard

    def __init__(
        self, params: Any, defaults: dict[str, Any], *, step_in_backward: bool = False,
        step_elements: int | None = None, grad_dtype: torch.dtype | None = None,
        max_grad_norm: float | None = None,
    ) -> None:
        if not isinstance(step_in_backward, bool):
            raise TypeError(f"step_in_backward must be a bool, got {step_in_backward!r}")
        check_max_grad_norm(max_grad_norm, step_in_backward)
        if step_elements is not None and (
            isinstance(step_elements, bool) or not isinstance(step_elements, int) or step_elements < 1
        ):
            raise ValueError(f"step_elements must be a positive int or None, got {step_elements!r}")
        check_grad_dtype(grad_dtype, step_in_backward)
        self._step_elements = step_elements
        self._in_backward = InBackward(self, max_grad_norm) if step_in_backward else None
        # the work this optimizer's updates leave for the end of its step (the step inside
        # backward holds verdicts only: its tensor-parallel writes round at once)
        self._end_of_step = EndOfStep(kinds=(VERDICTS,) if step_in_backward else ORDER)
        self._grad_cast = GradientCast(type(self).__name__, grad_dtype) if grad_dtype is not None else None
        self._step_seeds = StepSeeds()
        super().__init__(params, defaults)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a parameter group, as ``torch.optim.Optimizer`` does, then check its
        parameters (real floating tensors) and hyperparameters."""
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        check_floating(group["params"], type(self).__name__)
        self._check_group(group)
        if self._in_backward is not None:
            self._in_backward.watch(group)
        if self._grad_cast is not None:
            self._grad_cast.watch(group["params"], len(self.param_groups) - 1)

    def _check_group(self, group: dict[str, Any]) -> None:  # pragma: no cover - overridden
        """Raise if a parameter group's hyperparameters are invalid."""
        raise NotImplementedError

    @property
    def grad_norm(self) -> float | None:
        """With ``step_in_backward=True`` and ``max_grad_norm``: the global gradient norm
        of the last completed step (before clipping), else ``None``."""
        return self._in_backward.grad_norm if self._in_backward is not None else None

    @property
    def max_grad_norm(self) -> float | None:
        """The norm the step inside backward clips to (``None``: no clipping)."""
        return self._in_backward._max_grad_norm if self._in_backward is not None else None

    @property
    def step_in_backward(self) -> bool:
        """Whether each parameter is updated inside backward, as soon as its gradient is
        final (see ``step_in_backward`` in the optimizer's docstring)."""
        return self._in_backward is not None

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Perform one optimization step; returns ``closure()``'s loss if given.

        With ``step_in_backward=True`` the parameters were updated during backward:
        this completes the step (parameters whose gradient arrived without the hook,
        the non-finite verdict, the end-of-step work)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self._in_backward is not None:
            self._in_backward.finish()
            return loss
        self._step_seeds.draw_checked(self)  # with the finite-gradient verdict: a refused step changes nothing
        with self._end_of_step.collecting():
            for group in self.param_groups:
                self.update_params([p for p in group["params"] if p.grad is not None], group)
        self.end_step()
        return loss

    def update_params(
        self, params: list[torch.Tensor], group: dict[str, Any], keep: torch.Tensor | None = None
    ) -> None:
        """Update ``params`` (of ``group``, each with a gradient) in chunks of bounded size.

        ``keep``: a 0-dim bool tensor on the device; where it is False every tensor the
        update writes (weights and states, not the CPU step counter) is put back as it
        was, decided on the device without reading ``keep`` (the step inside backward's
        verdict on an accelerator). Each chunk's tensors are copied first for that."""
        self._step_seeds.draw(self)
        by_device: dict[torch.device, list[torch.Tensor]] = defaultdict(list)
        for param in params:
            by_device[local_shard(param).device].append(param)
        for device, on_device in by_device.items():
            cpu = device.type == "cpu"
            piece_limit = self._step_elements or (_PIECE_ELEMENTS_CPU if cpu else _PIECE_ELEMENTS)
            chunk_limit = self._step_elements or (_CHUNK_ELEMENTS_CPU if cpu else _CHUNK_ELEMENTS)
            pieces = [piece for param in on_device for piece in self._pieces(param, group, piece_limit)]
            for chunk in _chunks(pieces, chunk_limit):
                before = [] if keep is None else [(t, t.clone()) for piece in chunk for t in _written(piece)]
                slots = [self._slot(piece) for piece in chunk]
                self._update(slots, group)
                self._write_back(slots, skip_int8=float(group["lr"]) == 0.0)
                del slots
                for tensor, old in before:
                    torch.where(keep, tensor, old, out=tensor)

    def end_step(self) -> None:
        """Forget this step's rounding seeds: the next update draws new ones."""
        self._step_seeds.forget()

    def _pieces(self, param: torch.Tensor, group: dict[str, Any], limit: int) -> list[Piece]:
        """Check ``param``'s gradient, make its state on the first step, and cut both into
        pieces of whole rows of at most ``limit`` elements."""
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
        pieces = []
        for index, rows in enumerate(_row_ranges(local, limit)):
            if rows is None:
                pieces.append(Piece(param, local, state, local_grad, True))
                continue
            # every state tensor but the scalars (the step counter) has the parameter's local rows first
            cut = {name: local_shard(value)[rows] if isinstance(value, torch.Tensor) and value.dim() else value
                   for name, value in state.items()}
            pieces.append(Piece(param, local[rows], cut, local_grad[rows], index == 0))
        return pieces

    def _slot(self, piece: Piece) -> Slot:
        local = piece.local
        if isinstance(local, Int8Weight):
            work = local.dequantize(torch.float32)  # one dequantization per step
        elif local.dtype == torch.float32:
            work = local  # updated in place, as torch.optim does
        else:
            work = local.float()
        return Slot(piece.param, local, piece.state, work, piece.grad.float(), piece.first)

    def _init_state(self, param: torch.Tensor, local: torch.Tensor,
                    group: dict[str, Any]) -> dict:  # pragma: no cover - overridden
        """The initial state of ``param`` (may be empty)."""
        raise NotImplementedError

    def _update(self, slots: list[Slot], group: dict[str, Any]) -> None:  # pragma: no cover
        """Update the slots' ``work`` tensors and states in place, in fp32."""
        raise NotImplementedError

    def _write_back(self, slots: list[Slot], *, skip_int8: bool) -> None:
        for slot in slots:
            if isinstance(slot.local, Int8Weight):
                # lr == 0 (warm-up from 0, or get_optimizer_state_dict's initialising step):
                # the fp32 values are exactly the old ones; requantizing could still move a
                # value by one step (recomputed scale, stochastic noise): leave it untouched.
                if skip_int8:
                    continue
                stream = self._step_seeds.stream(slot.param, slot.local.device)
                with update_stream(stream) if stream is not None else contextlib.nullcontext():
                    slot.local.assign_(slot.work, stochastic=slot.local.stochastic_rounding, optimizer_update=True)
            elif slot.work is not slot.local:
                slot.local.copy_(slot.work)

    def _fp32_state(self, param: torch.Tensor, local: torch.Tensor,
                    values: torch.Tensor | None = None) -> torch.Tensor:
        """An fp32 state like ``param`` (zeros, or a copy of ``values``)."""
        local_state = (
            torch.zeros(local.shape, dtype=torch.float32, device=local.device)
            if values is None else values.detach().clone()
        )
        return like_param(param, local_state, tuple(param.shape))

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state from :meth:`state_dict` (or from ``set_optimizer_state_dict``).

        Each state keeps its own dtype and is only moved to the parameter's device
        (``torch.optim`` would cast 8-bit moments to floats and fp32 scales of a bf16 model
        to bf16); 32-bit moments are made fp32. A ``torch.optim.AdamW`` state dict (the
        32-bit layout) loads into :class:`~fsdp_int8.Int8AdamW`, a bf16 model's too.
        Load-state-dict pre-hooks see the state tensors wrapped in an internal holder.

        Raises:
            ValueError: a group with ``amsgrad``, ``maximize`` or ``differentiable`` on, or
                a hyperparameter out of range.
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
