"""The optimizer step inside backward: each parameter is updated as soon as its gradient
is final, and the gradient is freed at once.

A post-accumulate-grad hook on every parameter runs the optimizer's own update of that
one parameter (the code ``step()`` runs after backward, with the same per-weight rounding
seeds), so weights and states equal stepping after backward bit for bit. FSDP2 calls a
sharded parameter's hooks right after its gradient is reduce-scattered (and all-reduced
under HSDP); it does not call them on micro-batches without gradient sync, which is how
gradient accumulation works here. ``optimizer.step()`` completes the step.

What cannot be done inside backward is refused, never skipped silently:

* a second gradient for a parameter before ``step()`` (accumulation without FSDP2's
  ``set_requires_gradient_sync(False)``, or a pipeline schedule's micro-batches);
* a plain (non-DTensor) parameter in a multi-process run: DDP and similar wrappers
  reduce gradients after autograd hands them over, so the hook would see this rank's
  gradient alone.

A non-finite gradient is never written: that parameter (weight and states) is left as
it was on every rank, and ``step()`` raises :class:`~fsdp_int8.guard.NonFiniteGradientError`
on every rank, saying that the other parameters were already updated. The verdict is the
parameter's, not a shard's: each hook all-reduces its gradient's squared norm (one scalar,
the same collective ``max_grad_norm`` reads), so a NaN that FSDP2's reduce-scatter puts
in one rank's rows makes every rank skip the parameter before any rank writes it.

Clipping by the global gradient norm of the same step is impossible inside backward (the
first parameters are updated before the last gradients exist). ``max_grad_norm`` clips
by an estimate of that norm made when each gradient arrives: the gradient is scaled by
``min(1, max_grad_norm / norm)``, with ``norm² = S · max(1, P / P_seen)``: ``S`` this
step's squared gradient norms so far (its own included), ``P`` the previous step's
squared global norm and ``P_seen`` the part of ``P`` that the parameters seen so far
carried. So the estimate assumes the rest of the step keeps the previous step's
proportions: it is exact whenever the gradient's shape over the parameters holds, a
spike raises it from the first parameter that carries one, and the last parameter is
clipped by the step's exact norm. The first step, with no previous one, uses ``S``
alone. The squared norm each hook all-reduces (replicated shards counted once) makes
every rank scale a parameter alike. ``step()`` keeps the step's norm
in each parameter group's ``"previous_grad_norm"`` and each parameter's squared norm in
its state's ``"previous_grad_norm_sq"``, so checkpoints resume the rule exactly.

Between its update and ``step()`` a parameter's ``.grad`` is an :class:`AppliedGradient`:
no storage, and any op on it raises. Code that reads gradients after backward
(``clip_grad_norm_``, Hugging Face Trainer's and accelerate's clipping, gradient-norm
logging) fails there, saying why, instead of finding no gradients and clipping nothing.
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.utils._pytree import tree_leaves

from fsdp_int8 import _dist
from fsdp_int8._dist import local_shard
from fsdp_int8.guard import NonFiniteGradientError
from fsdp_int8._weight import update_checks
from fsdp_int8._weight.update_checks import VERDICTS
from fsdp_int8.optim._hooks import watch_new

if TYPE_CHECKING:
    from fsdp_int8.optim._base import FusedInt8Optimizer


def check_hook_sees_reduced_gradient(param: torch.Tensor, who: str, name: str, way_out: str) -> None:
    """Raise if a post-accumulate-grad hook of ``param`` (``name``, watched by ``who``) runs
    before its gradient is reduced: a plain (non-DTensor) parameter in a multi-process run."""
    if isinstance(param, DTensor) or not _dist.is_distributed() or dist.get_world_size() <= 1:
        return
    raise RuntimeError(
        f"{who} got the gradient of a plain (non-DTensor) {name} in a "
        f"{dist.get_world_size()}-process run. Only FSDP2 (fully_shard / fsdp_int8.shard_model) "
        "and tensor parallelism hand a parameter its final gradient inside backward; DDP and "
        "similar wrappers reduce gradients after autograd hands them over, so the hook would act "
        f"on this rank's gradient alone. Shard the model with FSDP2, or {way_out}."
    )


def check_max_grad_norm(max_grad_norm: float | None, step_in_backward: bool) -> None:
    """Raise unless ``max_grad_norm`` is ``None`` or a positive number given with
    ``step_in_backward=True``."""
    if max_grad_norm is None:
        return
    if isinstance(max_grad_norm, bool) or not isinstance(max_grad_norm, (int, float)) or not max_grad_norm > 0:
        raise ValueError(f"max_grad_norm must be a positive number or None, got {max_grad_norm!r}")
    if not step_in_backward:
        raise ValueError(
            "max_grad_norm clips inside backward (step_in_backward=True), by the step's norm as estimated so far; "
            "stepping after backward, clip with torch.nn.utils.clip_grad_norm_ before optimizer.step()"
        )


class AppliedGradient(torch.Tensor):
    """Stands in for a gradient an optimizer applied inside backward and freed: the
    gradient's shape, dtype and device, no storage; any op on it raises ``RuntimeError``
    with ``reason``."""

    reason: str

    @staticmethod
    def __new__(cls, like: torch.Tensor, reason: str) -> AppliedGradient:
        gradient = torch.Tensor._make_wrapper_subclass(  # storage_size=0: memory trackers count nothing
            cls, like.shape, strides=like.stride(), dtype=like.dtype, device=like.device, storage_size=0
        )
        gradient.reason = reason
        return gradient

    __torch_function__ = torch._C._disabled_torch_function_impl

    def __repr__(self) -> str:  # type: ignore[override]
        return f"AppliedGradient(shape={tuple(self.shape)}, dtype={self.dtype})"

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN206
        reason = next(leaf.reason for leaf in tree_leaves((args, kwargs)) if isinstance(leaf, AppliedGradient))
        raise RuntimeError(f"{func} on a gradient already applied: {reason}")


def _applied_gradient(param: torch.Tensor, reason: str) -> torch.Tensor:
    """An :class:`AppliedGradient` that ``param.grad`` accepts (a DTensor for a DTensor)."""
    if isinstance(param, DTensor):
        return DTensor(AppliedGradient(local_shard(param), reason), param._spec, requires_grad=False)
    return AppliedGradient(param, reason)


def is_applied(grad: torch.Tensor | None) -> bool:
    """Whether ``grad`` stands for a gradient applied inside backward."""
    return grad is not None and isinstance(local_shard(grad), AppliedGradient)


class InBackward:
    """The in-backward state of one optimizer: hooks, who was updated, who was skipped."""

    def __init__(self, optimizer: FusedInt8Optimizer, max_grad_norm: float | None = None) -> None:
        self._optimizer_ref = weakref.ref(optimizer)  # the optimizer owns this, not the reverse
        self._max_grad_norm = max_grad_norm
        # max_grad_norm, as 0-dim float64 tensors on the collective device (no host reads):
        # this step's squared gradient norms so far (every rank's), the previous step's of
        # all parameters and of those seen so far, and each parameter's, kept at step()
        self._squares: torch.Tensor | None = None
        self._previous: torch.Tensor | None = None  # summed at this step's first hook
        self._previous_seen: torch.Tensor | None = None
        self._step_squares: dict[int, torch.Tensor] = {}
        self._group_index: dict[int, int] = {}  # id(param) -> its group's index (load_state_dict makes new groups)
        self._names: dict[int, str] = {}
        self._updated: set[int] = set()
        self._skipped: list[int] = []  # decided on the host (CPU)
        # decided on the device: (id(param), finite flag, whether its state was made this step)
        self._verdicts: list[tuple[int, torch.Tensor, bool]] = []

    @property
    def _optimizer(self) -> FusedInt8Optimizer:
        optimizer = self._optimizer_ref()
        assert optimizer is not None, "an optimizer's in-backward state outlived it"
        return optimizer

    def watch(self, group: dict[str, Any]) -> None:
        """Update ``group``'s parameters from their post-accumulate-grad hooks."""
        group_index = len(self._optimizer.param_groups) - 1
        for param in watch_new(self, self._names, group["params"], group_index, InBackward._on_gradient):
            self._group_index[id(param)] = group_index

    def name(self, param: torch.Tensor) -> str:
        return self._names[id(param)]

    @torch.no_grad()
    def _on_gradient(self, param: torch.Tensor) -> None:
        """Update ``param`` from its final gradient, then free the gradient."""
        optimizer = self._optimizer
        if id(param) in self._updated or id(param) in self._skipped:
            raise RuntimeError(
                f"{type(optimizer).__name__}(step_in_backward=True) got a second gradient for "
                f"{self.name(param)} before optimizer.step(): the first one was already applied. "
                "Accumulate gradients with FSDP2: model.set_requires_gradient_sync(False) on every "
                "micro-batch but the last (FSDP2 then hands each parameter its gradient once, "
                "after the last one); pipeline schedules, and accumulation without FSDP2, need "
                "step_in_backward=False."
            )
        check_hook_sees_reduced_gradient(
            param, f"{type(optimizer).__name__}(step_in_backward=True)", self.name(param),
            "use step_in_backward=False",
        )
        group = optimizer.param_groups[self._group_index[id(param)]]
        # one verdict on every rank: the squared norm is all-reduced, so a NaN in any rank's
        # shard makes it NaN everywhere, and no rank writes a parameter another rank skips
        squares = self._squared_norm(param)
        finite = torch.isfinite(squares)
        with optimizer._end_of_step.collecting(flush=False):  # verdicts wait for step()
            if not update_checks.defers(squares.device):  # the CPU: reading the verdict costs nothing
                if not bool(finite):
                    self._skipped.append(id(param))
                else:
                    if self._max_grad_norm is not None:
                        self._clip(param, squares, finite)
                    optimizer.update_params([param], group)
                    self._updated.add(id(param))
            else:  # an accelerator: decide on the device, no sync per parameter
                fresh = param not in optimizer.state
                grad = local_shard(param.grad)
                grad.masked_fill_(finite.logical_not().to(grad.device), 0.0)  # the update stays finite
                if self._max_grad_norm is not None:
                    self._clip(param, squares, finite)
                optimizer.update_params([param], group, keep=finite.to(local_shard(param).device))
                self._verdicts.append((id(param), finite, fresh))
                self._updated.add(id(param))
        param.grad = _applied_gradient(param, (
            f"{type(optimizer).__name__}(step_in_backward=True) applied the gradient of "
            f"{self.name(param)} inside backward and freed it; nothing can read it or add to it "
            "before optimizer.step(). Clipping or measuring the gradient norm after backward "
            "(clip_grad_norm_) cannot work that way: clip with the optimizer's max_grad_norm "
            "and read its grad_norm. Hugging Face Trainer: use "
            "fsdp_int8.integrations.hf.Int8Trainer, or put Int8SaveMixin first in your Trainer "
            "class (it leaves clipping to the optimizer and logs its grad_norm). Lightning: "
            "leave gradient_clip_val unset. To accumulate gradients, call "
            "model.set_requires_gradient_sync(False) on every micro-batch but the last (FSDP2). "
            "Or use step_in_backward=False"
        ))

    def _squared_norm(self, param: torch.Tensor) -> torch.Tensor:
        """The squared 2-norm of ``param``'s whole gradient, on every rank, as a 0-dim
        tensor on the collective device: this rank's share, all-reduced (one scalar; every
        rank runs the same hooks in the same order). NaN or Inf where any rank's shard
        holds one."""
        grad = param.grad
        copies = 1  # ranks holding the same values, counted once in the world's sum
        if isinstance(grad, DTensor):
            # replicated mesh dims, and the ranks outside the mesh (a tensor-parallel model's
            # meshes that hold the same replicated parameter; pipeline stages are refused)
            mesh = grad.device_mesh
            copies = dist.get_world_size() // mesh.size()
            for dim, placement in enumerate(grad.placements):
                copies *= mesh.size(dim) if placement.is_replicate() else 1
        # in float64, where the squares of any finite fp32 or bf16 gradient stay finite (MPS has none)
        wide = torch.float32 if grad.device.type == "mps" else torch.float64
        squares = torch.linalg.vector_norm(local_shard(grad), dtype=wide).square() / copies
        if isinstance(grad, DTensor) and _dist.is_distributed():
            # where the process group takes tensors: a gradient offloaded to the CPU (FSDP2's
            # CPUOffloadPolicy) is all-reduced on the accelerator under NCCL
            squares = squares.to(_dist.collective_device())
            with _dist.released_by_backend(squares):
                dist.all_reduce(squares)
        return squares

    def _clip(self, param: torch.Tensor, squares: torch.Tensor, finite: torch.Tensor) -> None:
        """Add ``squares`` (``param``'s squared gradient norm; nothing where not ``finite``)
        to the step's sum and scale the gradient by ``min(1, max_grad_norm / norm)``,
        ``norm`` the step's norm estimated from the sum so far and the previous step's
        proportions (the module docstring). All on the device: nothing is read back."""
        counted = torch.where(finite, squares, 0.0)
        self._squares = counted if self._squares is None else self._squares + counted
        self._step_squares[id(param)] = squares
        if self._previous is None:
            total = self._previous_total(squares.device)
            self._previous = torch.zeros((), dtype=torch.float64, device=squares.device) if total is None else total
        seen = torch.where(finite, self._previous_norm_sq(param, squares.device), 0.0)
        self._previous_seen = seen if self._previous_seen is None else self._previous_seen + seen
        # the estimate grows by the previous step's P / P_seen (at least 1) once both are known
        known = (self._previous > 0.0) & (self._previous_seen > 0.0)
        growth = torch.where(known, (self._previous / self._previous_seen).clamp(min=1.0), 1.0)
        norm = (self._squares * growth).sqrt()
        factor = torch.where(norm > self._max_grad_norm, self._max_grad_norm / (norm + 1e-6), 1.0)
        grad = local_shard(param.grad)
        grad.mul_(factor.to(grad.device))  # by exactly 1 where the norm is within the bound

    def _previous_norm_sq(self, param: torch.Tensor, device: torch.device) -> torch.Tensor:
        """``param``'s squared gradient norm at the previous step (0 without one), on ``device``."""
        value = self._optimizer.state.get(param, {}).get("previous_grad_norm_sq")
        if value is None:
            return torch.zeros((), dtype=torch.float64, device=device)
        return value.to(device=device, dtype=torch.float64)

    def _previous_total(self, device: torch.device) -> torch.Tensor | None:
        """The previous step's squared global norm: the sum of its parameters' (``None``
        where no parameter kept one)."""
        kept = [
            self._previous_norm_sq(p, device) for g in self._optimizer.param_groups for p in g["params"]
            if "previous_grad_norm_sq" in self._optimizer.state.get(p, {})
        ]
        return torch.stack(kept).sum() if kept else None

    @property
    def grad_norm(self) -> float | None:
        """The global gradient norm of the last completed step (``max_grad_norm`` only):
        read from the parameters' squared norms when asked (one host read)."""
        device = _dist.collective_device() if _dist.is_distributed() else torch.device("cpu")
        total = self._previous_total(device)
        return None if total is None else float(total.sqrt())

    def finish(self) -> None:
        """Complete the step: update parameters that hold a gradient the hooks did not see
        (set by hand), agree on the non-finite verdict across ranks (one read), read the
        updates' verdicts (one read on accelerators), reset."""
        optimizer = self._optimizer
        for group in optimizer.param_groups:
            for param in group["params"]:
                if is_applied(param.grad):
                    param.grad = None
                elif param.grad is not None:
                    self._on_gradient(param)
                    param.grad = None
        skipped = [self._names[i] for i in self._skipped]
        verdicts, self._verdicts = self._verdicts, []
        self._updated.clear()
        self._skipped.clear()
        optimizer.end_step()
        self._squares, self._previous, self._previous_seen = None, None, None
        step_squares, self._step_squares = self._step_squares, {}
        # one all-reduce and one read for the step: no rank skipped a parameter (each skip
        # verdict is already the same on every rank; the host's and the device's together)
        # and every update came out finite
        skip_flags = [torch.tensor(not skipped)] + [f for _, f, _ in verdicts]
        update_flags = [flag for flag, _ in optimizer._end_of_step.held(VERDICTS)]
        any_skipped = False
        if _dist.all_ranks_true(skip_flags + update_flags):
            optimizer._end_of_step.discard()  # every verdict held was read true just now
        else:  # something failed on some rank: find out what (more reads, on this path only)
            any_skipped = not _dist.all_ranks_true(skip_flags)
            if any_skipped:
                skipped += self._restore_counters(verdicts)
            optimizer._end_of_step.flush()  # raises where this rank's updates were not finite
        if self._max_grad_norm is not None and not any_skipped:
            for group in optimizer.param_groups:
                for param in group["params"]:
                    if id(param) in step_squares:
                        # a 0-d tensor, as torch keeps "step": checkpoints carry tensors
                        optimizer.state.setdefault(param, {})["previous_grad_norm_sq"] = step_squares[id(param)]
                    elif param in optimizer.state:  # no gradient this step: no part of its norm
                        optimizer.state[param].pop("previous_grad_norm_sq", None)
        if any_skipped:
            where = f" ({', '.join(skipped[:4])}{', ...' if len(skipped) > 4 else ''} here)" if skipped else ""
            raise NonFiniteGradientError(
                f"{type(optimizer).__name__}(step_in_backward=True): a gradient held NaN or Inf on "
                f"this or another rank{where}. Those parameters and their states were left "
                "unchanged; every other parameter was already updated inside backward (that "
                "cannot be undone). Skip this batch and go on, or lower the learning rate; "
                "use step_in_backward=False to refuse a whole step before anything changes."
            )

    def _restore_counters(self, verdicts: list[tuple[int, torch.Tensor, bool]]) -> list[str]:
        """After a step with a non-finite gradient: the parameters the device skipped (their
        weights and states were put back on the device) also get back their CPU step
        counter, or lose the state made this step. One more read; returns their names."""
        if not verdicts:
            return []
        finite = torch.stack([flag for _, flag, _ in verdicts]).tolist()
        params = {id(p): p for g in self._optimizer.param_groups for p in g["params"]}
        names = []
        for (key, _, fresh), ok in zip(verdicts, finite):
            if ok:
                continue
            names.append(self._names[key])
            state = self._optimizer.state
            param = params[key]
            if fresh:
                state.pop(param, None)
            elif isinstance(state.get(param, {}).get("step"), torch.Tensor):
                state[param]["step"] -= 1
        return names
