"""How mixtures of experts lay out their weights and routers, read from the modules alone
(transformers 5 and torchtitan): which parameters are experts, stored which way round,
and which modules route. :mod:`fsdp_int8.config` re-exports these: its rule asks them."""

from __future__ import annotations

import re

import torch.nn as nn

# The names transformers 5 and torchtitan give a MoE block's router (DBRX's ``router.layer``,
# Llama 4's ``router``, Mixtral's ``gate``, Hunyuan's ``gate.wg``, Doge's ``router_gate``,
# Qwen's ``shared_expert_gate``); ``gate_proj`` and ``gate_up_proj`` are expert weights.
_ROUTER_NAME = re.compile(r"(router|gate)|\w+_(router|gate)|router_\w+")
_DBRX_WEIGHTS = ("w1", "v1", "w2")  # DbrxExpertGLU's: gate, up, down


def expert_count(owner: object) -> int | None:
    """The int ``num_experts`` of ``owner`` (a module or its config), or LongCat-Flash's ``num_routed_experts``."""
    counts = [getattr(owner, name, None) for name in ("num_experts", "num_routed_experts")]
    return next((n for n in counts if isinstance(n, int) and not isinstance(n, bool)), None)


def counts_experts(owner: object) -> bool:
    return expert_count(owner) is not None


def stores_experts_transposed(module: nn.Module) -> bool:
    """Experts stored ``[E, in, out]``: transformers' ``is_transposed``, or gated experts
    without it (Llama 4) whose ``gate_up_proj`` ``[E, a, b]`` and ``down_proj`` ``[E, c, d]``
    chain only that way round (``b == 2c`` and ``a == d``). They become int8 over their
    transpose (:mod:`fsdp_int8._weight.transposed_experts`)."""
    gate_up, down = getattr(module, "gate_up_proj", None), getattr(module, "down_proj", None)
    if getattr(module, "is_transposed", False) or not all(isinstance(p, nn.Parameter) and p.dim() == 3
                                                           for p in (gate_up, down)):
        return bool(getattr(module, "is_transposed", False))
    (a, b), (c, d) = gate_up.shape[1:], down.shape[1:]
    return b == 2 * c and a == d


def dbrx_expert_names(module: nn.Module) -> tuple[str, ...]:
    """DBRX's experts (``DbrxExpertGLU``): an int ``moe_num_experts`` ``E`` and
    ``ffn_hidden_size`` ``F``, and 2-D ``w1``, ``v1``, ``w2`` ``[E * F, hidden]``, every
    expert's ``F`` rows in turn. ``w1`` and ``v1`` hold ``[F, hidden]`` (out, in) per expert;
    ``w2`` holds ``[F, hidden]`` read as (in, out), so it becomes int8 over each expert's
    transpose (:func:`transposed_expert_weights`). ``()`` for any other module."""
    experts, width = getattr(module, "moe_num_experts", None), getattr(module, "ffn_hidden_size", None)
    if not (isinstance(experts, int) and isinstance(width, int) and experts > 0 and width > 0):
        return ()
    w1, v1, w2 = params = [module._parameters.get(name) for name in _DBRX_WEIGHTS]
    if not all(isinstance(p, nn.Parameter) and p.dim() == 2 and p.is_floating_point() for p in params):
        return ()
    rows, hidden = w1.shape
    # w2 in the model's layout, or (int8) each expert's transpose
    fits = rows == experts * width and v1.shape == w1.shape and w2.shape in (w1.shape, (experts * hidden, width))
    return _DBRX_WEIGHTS if fits else ()


def transposed_expert_weights(module: nn.Module) -> dict[str, int]:
    """The expert weights of ``module`` that become int8 over their transpose, by name, each
    with the number of experts whose blocks of rows are transposed one by one: ``1`` for a
    3-D weight (:func:`stores_experts_transposed`: all of them, along the last two dims),
    ``E`` for DBRX's 2-D ``w2`` (:func:`dbrx_expert_names`)."""
    if dbrx_expert_names(module):
        return {"w2": module.moe_num_experts}
    return dict.fromkeys(expert_weight_names(module), 1) if stores_experts_transposed(module) else {}


def expert_features(module: nn.Module, name: str) -> tuple[int, int]:
    """``(out, in)`` features of each expert of ``module``'s expert weight ``name``, in the
    model's layout."""
    shape = module._parameters[name].shape
    if dbrx_expert_names(module):
        features = (module.ffn_hidden_size, shape[1])
        return features[::-1] if name == "w2" else features
    return (shape[2], shape[1]) if stores_experts_transposed(module) else (shape[1], shape[2])


def expert_weight_names(module: nn.Module) -> tuple[str, ...]:
    """Names of ``module``'s own expert weights, ``()`` if none: 3-D ones (``[E, out, in]``,
    or ``[E, in, out]`` where :func:`stores_experts_transposed`, ``E`` its
    :func:`expert_count` or its ``total_experts``, zero-compute ones included; not biases),
    or DBRX's 2-D ones (:func:`dbrx_expert_names`)."""
    if dbrx_expert_names(module):
        return _DBRX_WEIGHTS
    experts = expert_count(module)
    if experts is None or experts < 1:
        return ()
    counts = {experts, getattr(module, "total_experts", experts)}
    return tuple(
        name for name, param in module._parameters.items()
        if param is not None and param.dim() == 3 and param.shape[0] in counts and param.is_floating_point()
    )


def router_modules(model: nn.Module) -> set[int]:
    """``id`` of every module inside a router of ``model``: in a MoE block (a module that
    :func:`counts_experts`, or a child that does: ``E``), each child :data:`_ROUTER_NAME`
    matches, and each ``nn.Linear`` child with ``E`` outputs (one logit per expert)."""
    routers: set[int] = set()
    for block in model.modules():
        counts = [block] if counts_experts(block) else [c for c in block.children() if counts_experts(c)]
        if not counts:
            continue
        experts = expert_count(counts[0])
        for name, child in block.named_children():
            if _ROUTER_NAME.fullmatch(name):
                routers.update(id(m) for m in child.modules())
            elif isinstance(child, nn.Linear) and child.out_features == experts:
                routers.add(id(child))
    return routers
