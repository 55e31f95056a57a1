"""GPT-2's ``Conv1D`` with an int8 weight: :class:`Int8Conv1D`, and its state-dict layout.

``transformers.pytorch_utils.Conv1D`` stores its weight as ``[in, out]`` and computes
``addmm(bias, x, weight)``. Its output features are the *columns* of that weight, while an
``Int8Weight`` keeps one scale per *row*; FSDP2 shards dim 0 too. So a quantized Conv1D
holds the transpose, ``[out, in]``, with one scale per output feature, and multiplies
with ``F.linear(x, W, b) = x @ W^T + b``: the product Conv1D computed from ``W^T``. As
far as the computation goes it *is* an ``nn.Linear``. ``quantize_`` turns each selected
Conv1D into an :class:`Int8Conv1D` in place (``__class__`` assignment, as ``fully_shard``
does): the module object, its name, hooks, ``nf`` / ``nx`` and its state-dict keys stay
GPT-2's, and every code path of ``nn.Linear`` with an ``Int8Weight`` (matmuls, sharding,
optimizers, checkpoints) applies unchanged.

The one difference left is the layout of plain tensors under the layer's ``weight`` key:

* an ``Int8Weight`` (the module's own ``state_dict()``, ``save_checkpoint``) is
  ``[out, in]``: int8 bytes and scales exact, sharded along dim 0 like the parameter;
* a plain tensor is GPT-2's ``[in, out]`` (every GPT-2 state dict, and
  ``export_full_state_dict``'s output): :meth:`Int8Conv1D._load_from_state_dict`
  transposes it;
* a plain ``DTensor`` is ``[out, in]``: torch's full-state-dict loading shards the values
  by the parameter's own placements before the module sees them, so
  ``load_full_state_dict`` transposes them first (:func:`.layouts.to_int8_layout`).

This module imports no framework: Conv1D is recognised by its name and attributes.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

from fsdp_int8._weight.tensor import Int8Weight

__all__ = [
    "Int8Conv1D", "why_not_convertible", "int8_conv1d_",
]


def why_not_convertible(module: nn.Module) -> str | None:
    """Why a Conv1D cannot become an :class:`Int8Conv1D`, or ``None`` if it can."""
    weight = module._parameters.get("weight")
    if weight is None or weight.dim() != 2 or tuple(weight.shape) != (module.nx, module.nf):
        return f"its weight is not [nx, nf] = [{module.nx}, {module.nf}]"
    if not weight.is_floating_point():
        return f"its weight is {weight.dtype}, not floating"
    if "forward" in module.__dict__:
        # accelerate's hooks (device_map) replace forward on the instance with one bound to
        # Conv1D's addmm, which would multiply by the transposed weight.
        return "its forward is replaced on the instance (accelerate hooks?)"
    return None


class Int8Conv1D(nn.Linear):
    """A GPT-2 ``Conv1D`` whose weight is an ``[out, in]`` ``Int8Weight``: an ``nn.Linear``
    that reads GPT-2's ``[in, out]`` layout from plain state dicts.

    Made by ``quantize_`` from a Conv1D in place; it keeps that module's ``nf`` (out) and
    ``nx`` (in) attributes. ``state_dict()`` holds the ``[out, in]`` int8 weight under
    GPT-2's key; ``load_state_dict`` takes that, or a plain ``[in, out]`` tensor (a GPT-2
    state dict), which it transposes and rounds to nearest.
    """

    def layout_error(self, key: str, value: torch.Tensor) -> str | None:
        """Why the plain tensor ``value`` cannot load under this layer's weight ``key``:
        ``None`` if it is GPT-2's ``[in, out]`` (or of any other shape: torch's own size
        check names that)."""
        int8_layout = (self.out_features, self.in_features)
        if tuple(value.shape) != int8_layout or self.in_features == self.out_features:
            return None
        # Refused although it would fit: a square layer could not tell the two layouts
        # apart, so that no kind of layer guesses, plain tensors are always GPT-2's.
        return (
            f"{key}: a plain tensor under a Conv1D weight key must be GPT-2's layout "
            f"[in, out] = {[self.in_features, self.out_features]} (as export_full_state_dict "
            f"writes it); got [out, in] = {list(value.shape)}, the int8 module's own layout. "
            "Transpose it, or load the int8 state dict (model.state_dict()) instead"
        )

    def _load_from_state_dict(
        self, state_dict: dict[str, Any], prefix: str, local_metadata: dict, strict: bool,
        missing_keys: list[str], unexpected_keys: list[str], error_msgs: list[str],
    ) -> None:
        key = prefix + "weight"
        value = state_dict.get(key)
        if isinstance(value, torch.Tensor) and not isinstance(value, (Int8Weight, DTensor)):
            state_dict = dict(state_dict)  # the caller's dict stays as it was
            problem = self.layout_error(key, value)
            if problem is not None:
                del state_dict[key]
                error_msgs.append(problem)
            elif value.dim() == 2 and tuple(value.shape) == (self.in_features, self.out_features):
                # contiguous: the rows of an Int8Weight built from it (assign=True) must be
                state_dict[key] = value.t().contiguous()
        super()._load_from_state_dict(
            state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
        )


# A whole quantized GPT-2 pickles this module class: torch.load(weights_only=True) allows it.
torch.serialization.add_safe_globals([Int8Conv1D])


def int8_conv1d_(module: nn.Module, weight: nn.Parameter) -> Int8Conv1D:
    """Turn the Conv1D ``module`` into an :class:`Int8Conv1D` with ``weight`` (``[nf, nx]``),
    in place: the same object, so every reference, hook and parent still holds it."""
    out_features, in_features = weight.shape
    module.__class__ = Int8Conv1D
    module.in_features, module.out_features = in_features, out_features
    module.weight = weight
    if "bias" not in module._parameters:  # nn.Linear's forward reads self.bias
        module.register_parameter("bias", None)
    return module
