"""What :class:`~fsdp_int8.Int8AdamW` and :class:`~fsdp_int8.Int8SGD` share: a step over
each rank's local tensors in bounded chunks, with one dequantization and one
requantization per int8 weight and step; states placed like their parameters; state-dict
loading that keeps each state's dtype.

A subclass checks its hyperparameters (``_check_group``), makes a parameter's initial
state (``_init_state``) and runs its fp32 update over a chunk (``_update``).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch
from torch.distributed.tensor import DTensor
from torch.optim.optimizer import Optimizer

from fsdp_int8._dist import local_shard
from fsdp_int8._weight.ops.views import contiguous_strides
from fsdp_int8._weight.tensor import Int8Weight
from fsdp_int8.guard import check_finite_gradients
from fsdp_int8.optim._checks import check_floating

# The update of a chunk of parameters runs on fp32 copies (dequantized weights, moments,
# the denominator): at most this many elements at a time (one parameter at least), so the
# step's transient memory stays ~16 bytes x 2^24 = 256 MiB instead of growing into an fp32
# copy of the whole model. On CPU one parameter at a time: torch runs CPU ``_foreach_`` ops
# as a loop of single ops anyway, and one parameter's copies, freed before the next
# parameter's are made, reuse the same memory instead of faulting fresh pages in every step
# (docs/performance.md, "Kernel choices", has the measurement).
_CHUNK_ELEMENTS = 1 << 24
_CHUNK_ELEMENTS_CPU = 0

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


def _chunks(params: list[torch.Tensor], limit: int) -> Iterator[list[torch.Tensor]]:
    """Consecutive parameters, at most ``limit`` local elements per chunk (one at least)."""
    chunk: list[torch.Tensor] = []
    total = 0
    for param in params:
        size = local_shard(param).numel()
        if chunk and total + size > limit:
            yield chunk
            chunk, total = [], 0
        chunk.append(param)
        total += size
    if chunk:
        yield chunk


class _KeepAsLoaded:
    """Hides a state tensor from ``Optimizer.load_state_dict``'s cast (see there)."""

    __slots__ = ("tensor",)

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor


@dataclass
class Slot:
    """One parameter during a step: its local tensors and fp32 working copies."""

    param: torch.Tensor  # as the optimizer holds it (DTensor or plain)
    local: torch.Tensor  # this rank's tensor: an Int8Weight or a plain tensor
    state: dict
    work: torch.Tensor  # fp32 values updated in place (the local tensor itself if fp32)
    grad: torch.Tensor  # fp32, read only


class FusedInt8Optimizer(Optimizer):
    """Parameter handling shared by :class:`~fsdp_int8.Int8AdamW` and :class:`~fsdp_int8.Int8SGD`."""

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a parameter group, as ``torch.optim.Optimizer`` does, then check its
        parameters (real floating tensors) and hyperparameters."""
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        check_floating(group["params"], type(self).__name__)
        self._check_group(group)

    def _check_group(self, group: dict[str, Any]) -> None:  # pragma: no cover - overridden
        """Raise if a parameter group's hyperparameters are invalid."""
        raise NotImplementedError

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Perform one optimization step; returns ``closure()``'s loss if given."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        check_finite_gradients(self)  # before anything changes: a refused step changes nothing
        for group in self.param_groups:
            with_grad = [p for p in group["params"] if p.grad is not None]
            by_device: dict[torch.device, list[torch.Tensor]] = defaultdict(list)
            for param in with_grad:
                by_device[local_shard(param).device].append(param)
            for device, params in by_device.items():
                limit = _CHUNK_ELEMENTS_CPU if device.type == "cpu" else _CHUNK_ELEMENTS
                for chunk in _chunks(params, limit):
                    slots = [self._slot(param, group) for param in chunk]
                    self._update(slots, group)
                    self._write_back(slots, skip_int8=float(group["lr"]) == 0.0)
        return loss

    def _slot(self, param: torch.Tensor, group: dict[str, Any]) -> Slot:
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
        return Slot(param, local, state, work, local_grad.float())

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
                if not skip_int8:
                    slot.local.assign_(slot.work, stochastic=slot.local.stochastic_rounding, step_update=True)
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
