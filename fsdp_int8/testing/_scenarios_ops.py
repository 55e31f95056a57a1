"""Op scenarios: each op FSDP2 and DCP send to a weight, checked on its own.

An op passes when it returns the right type, shape and values, or when it raises an
error that names the op (a weight may leave an op unsupported, as long as it says so).
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.distributed as dist

from fsdp_int8.testing._harness import Ctx, Wrong, describe, row_scale
from fsdp_int8.testing._spec import FAILED, NOT_APPLICABLE, PASSED


def _same_type(result: Any, weight: torch.Tensor, what: str) -> None:
    if not isinstance(result, type(weight)):
        raise Wrong(f"{what} returned {type(result).__name__}, not {type(weight).__name__}")


def _same_values(ctx: Ctx, result: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    if tuple(result.shape) != tuple(expected.shape):
        raise Wrong(f"{what} has shape {tuple(result.shape)}, expected {tuple(expected.shape)}")
    if not torch.equal(ctx.values(result), expected):
        raise Wrong(f"{what} holds other values")


def _within_rounding(ctx: Ctx, result: torch.Tensor, target: torch.Tensor, what: str) -> None:
    got = ctx.values(result)
    allowed = (ctx.spec.rounding_step * 1.001 + 1e-6) * row_scale(target)
    if got.shape != target.shape or not bool(((got - target).abs() <= allowed).all()):
        raise Wrong(f"{what} is more than one rounding step from the float values")


def _op_view(ctx: Ctx, w: torch.Tensor, v: torch.Tensor) -> None:
    flat = w.view(-1)
    _same_type(flat, w, "view(-1)")
    _same_values(ctx, flat, v.view(-1), "view(-1)")


def _op_as_strided(ctx: Ctx, w: torch.Tensor, v: torch.Tensor) -> None:
    out = torch.as_strided(w, w.shape, (w.shape[1], 1), 0)
    _same_type(out, w, "as_strided")
    _same_values(ctx, out, v, "as_strided")


def _op_split(ctx: Ctx, w: torch.Tensor, v: torch.Tensor) -> None:
    for what, pieces, sizes in (("split(4)", torch.split(w, 4), (4, 2)),
                                ("chunk(4)", torch.chunk(w, 4), (2, 2, 2))):
        if [p.shape[0] for p in pieces] != list(sizes):
            raise Wrong(f"{what} gave pieces of {[tuple(p.shape) for p in pieces]} rows")
        start = 0
        for piece in pieces:
            _same_type(piece, w, what)
            _same_values(ctx, piece, v[start: start + piece.shape[0]], f"a piece of {what}")
            start += piece.shape[0]


def _op_new_zeros(ctx: Ctx, w: torch.Tensor, v: torch.Tensor) -> None:
    zeros = w.new_zeros((8, w.shape[1]))
    _same_type(zeros, w, "new_zeros")
    _same_values(ctx, zeros, torch.zeros(8, w.shape[1], device=w.device), "new_zeros")


def _op_copy(ctx: Ctx, w: torch.Tensor, v: torch.Tensor) -> None:
    target = ctx.spec.from_float(torch.zeros(w.shape, device=w.device))
    target.copy_(w)
    _same_values(ctx, target, v, "copy_ from the subclass")
    floats = torch.randn(w.shape, generator=torch.Generator().manual_seed(4)).to(w.device)
    target.copy_(floats)
    _within_rounding(ctx, target, floats, "copy_ from a float tensor")


def _op_slice(ctx: Ctx, w: torch.Tensor, v: torch.Tensor) -> None:
    part = w[2:5]
    _same_type(part, w, "slice")
    _same_values(ctx, part, v[2:5], "w[2:5]")
    empty = w[6:6]
    _same_type(empty, w, "an empty slice")
    _same_values(ctx, empty, v[6:6], "w[6:6]")
    padded = ctx.spec.from_float(torch.zeros(8, w.shape[1], device=w.device))
    padded[0:6].copy_(w)  # FSDP2 writes each shard into its padded buffer this way
    expected = torch.cat([v, torch.zeros(2, w.shape[1], device=w.device)])
    _same_values(ctx, padded, expected, "a buffer written through its slice [0:6] (not a view?)")


def _op_pin_memory(ctx: Ctx, w: torch.Tensor, v: torch.Tensor) -> tuple[str, str] | None:
    if not (hasattr(torch, "accelerator") and torch.accelerator.is_available()):
        return (NOT_APPLICABLE, "pin_memory needs an accelerator; there is none")
    cpu = ctx.spec.from_float(torch.randn(6, 8, generator=torch.Generator().manual_seed(3)))
    pinned = cpu.pin_memory()
    _same_type(pinned, cpu, "pin_memory")
    if not pinned.is_pinned():
        raise Wrong("pin_memory returned a tensor that is not pinned")
    _same_values(ctx, pinned, ctx.values(cpu), "pin_memory")
    return None


def _op_cat(ctx: Ctx, w: torch.Tensor, v: torch.Tensor) -> None:
    base = torch.randn(6, 8, generator=torch.Generator().manual_seed(3)).to(w.device)
    top, bottom = ctx.spec.from_float(base[:2]), ctx.spec.from_float(base[2:])
    joined = torch.cat([top, bottom])
    _same_values(ctx, joined, torch.cat([ctx.values(top), ctx.values(bottom)]), "cat")


def _op_broadcast(ctx: Ctx, w: torch.Tensor, v: torch.Tensor) -> None:
    def floats(seed: int) -> torch.Tensor:
        return torch.randn(6, 8, generator=torch.Generator().manual_seed(seed)).to(w.device)

    mine = ctx.spec.from_float(floats(50 + ctx.rank))
    root = ctx.values(ctx.spec.from_float(floats(50)))  # what rank 0 holds
    dist.broadcast(mine, group=ctx.group, group_src=0)
    _within_rounding(ctx, mine, root, "the broadcast tensor")


# Report key -> (the names an error about the op may use, the check).
_OPS: dict[str, tuple[tuple[str, ...], Callable[..., Any]]] = {
    "op:view(-1)": (("view",), _op_view),
    "op:as_strided": (("as_strided",), _op_as_strided),
    "op:split/chunk": (("split", "chunk"), _op_split),
    "op:new_zeros": (("new_zeros",), _op_new_zeros),
    "op:copy_": (("copy_",), _op_copy),
    "op:pin_memory": (("pin_memory",), _op_pin_memory),
    "op:slice": (("slice", "narrow"), _op_slice),
    "op:cat": (("cat",), _op_cat),
    "op:broadcast": (("broadcast",), _op_broadcast),
}


def ops(ctx: Ctx, only: tuple[str, ...]) -> dict[str, tuple[str, str]]:
    """Each op: correct, or an error that names it (both pass); anything else fails."""
    base = torch.randn(6, 8, generator=torch.Generator().manual_seed(3)).to(ctx.device)
    weight = ctx.spec.from_float(base)
    values = ctx.values(weight)
    results = {}
    for key in only:
        names, check = _OPS[key]
        try:
            outcome = check(ctx, weight, values)
            results[key] = outcome or (PASSED, "correct")
        except Wrong as wrong:
            results[key] = (FAILED, f"wrong result: {wrong}")
        except Exception as error:  # noqa: BLE001 - judging the error is the point
            text = str(error)
            if any(name in text for name in names):
                results[key] = (PASSED, f"unsupported, with a clear error: {describe(error)}")
            else:
                results[key] = (FAILED, f"an error that does not name the op: {describe(error)}")
    return results
