"""The op table of ``Int8Weight``: which handler runs each aten op, kept apart from the tensor.

:mod:`fsdp_int8._weight.ops` fills it (one module per role) and :mod:`fsdp_int8._weight.linear` adds
``F.linear``; ``Int8Weight.__torch_dispatch__`` / ``__torch_function__`` only look up
here. An op with no rule raises ``NotImplementedError`` naming itself: an unknown op must
never run on the int8 bytes as if they were floats.
"""

from __future__ import annotations

from typing import Any, Callable, Union

import torch

from fsdp_int8._weight import end_of_step

OpKey = Union[torch._ops.OpOverload, torch._ops.OpOverloadPacket]
Handler = Callable[..., Any]

# aten op (overload or whole packet) -> handler(func, *args, **kwargs)
_OPS: dict[OpKey, Handler] = {}
# ops refused with a reason (they would separate rows from their scales)
_REFUSED: dict[OpKey, str] = {}
# torch-level functions handled above dispatch (F.linear)
_FUNCTIONS: dict[Callable, Handler] = {}
# op namespace -> handler of its ops that have no rule (collectives: refusing one on one
# rank would leave the others waiting in it)
_NAMESPACE_FALLBACK: dict[str, Handler] = {}

_TAKEN = "Int8Weight already has a rule for {key}"


def _add_rules(table: dict, keys: tuple, rule: Any, taken: str, *others: dict) -> None:
    """``table[key] = rule`` for each key; a key that ``table`` or ``others`` already holds
    raises ``ValueError(taken.format(key=key))`` (two rules for one key would make the
    table depend on import order)."""
    for key in keys:
        if key in table or any(key in other for other in others):
            raise ValueError(taken.format(key=key))
        table[key] = rule


def _registers(table: dict, keys: tuple, taken: str, *others: dict) -> Callable[[Handler], Handler]:
    """A decorator adding its handler to ``table`` under each of ``keys``."""

    def register(handler: Handler) -> Handler:
        _add_rules(table, keys, handler, taken, *others)
        return handler

    return register


def implements(*ops: OpKey) -> Callable[[Handler], Handler]:
    """Register the handler of aten ops (overloads, or whole packets such as ``aten._foreach_add_``).

    Raises:
        ValueError: if an op already has a rule.
    """
    return _registers(_OPS, ops, _TAKEN, _REFUSED)


def refuses(*packets: OpKey, reason: str) -> None:
    """Refuse aten ops with ``reason`` (in the ``NotImplementedError`` they raise)."""
    _add_rules(_REFUSED, packets, reason, _TAKEN, _OPS)


def falls_back_in(*namespaces: str) -> Callable[[Handler], Handler]:
    """Register the handler of the ops of ``namespaces`` that have no rule of their own."""
    return _registers(_NAMESPACE_FALLBACK, namespaces, "Int8Weight already has a fallback for {key}")


def implements_function(*functions: Callable) -> Callable[[Handler], Handler]:
    """Register the handler of torch-level functions (``F.linear``), seen before dispatch."""
    return _registers(_FUNCTIONS, functions, "Int8Weight already handles {key.__name__}")


def supported_ops() -> list[str]:
    """Names of the aten ops and torch functions with a handler, sorted."""
    names = [str(op) for op in _OPS]
    names += [f"{f.__module__}.{f.__name__}" for f in _FUNCTIONS]
    return sorted(names)


def function_handler(func: Callable) -> Handler | None:
    """The handler of a torch-level function, or ``None`` (then it dispatches as usual)."""
    return _FUNCTIONS.get(func)


def dispatch(func: torch._ops.OpOverload, args: tuple, kwargs: dict) -> Any:
    """Run ``func``'s rule on an ``Int8Weight`` (or raise saying why there is none)."""
    end_of_step.flush_if_holding(args)  # an update waiting for its step lands first
    handler = _OPS.get(func) or _OPS.get(func.overloadpacket)
    if handler is not None:
        if torch.is_inference_mode_enabled() and func.is_view and not args[0].is_inference():
            # A view of a normal tensor must be a normal tensor (torch then shares the
            # base's version counter); made under inference mode, ours would not be.
            with torch.inference_mode(False):
                return handler(func, *args, **kwargs)
        return handler(func, *args, **kwargs)
    reason = _REFUSED.get(func) or _REFUSED.get(func.overloadpacket)
    if reason is not None:
        raise NotImplementedError(f"Int8Weight does not support {func}: {reason}")
    fallback = _NAMESPACE_FALLBACK.get(func.namespace)
    if fallback is not None:
        return fallback(func, *args, **kwargs)
    raise NotImplementedError(
        f"Int8Weight does not support {func} (int8 data + fp32 row scales). Call "
        ".dequantize() to work on a plain tensor; to initialise int8 weights with a "
        "multi-step initialiser (nn.init.orthogonal_, a model's own init), run it through "
        "fsdp_int8.init_int8_weights_(model, init_fn). If FSDP2, an optimizer or a "
        "checkpoint API sent this op, please report it. Expert weights [E, out, in] compute "
        "through fsdp_int8.weight.int8_grouped_mm(x, w, offs) or F.linear(x, w[e])."
    )
