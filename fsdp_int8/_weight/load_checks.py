"""Whether int8 weights arriving from outside hold what an ``Int8Weight`` may hold.

fsdp_int8's own checkpoints are checksummed and refuse NaN when saved, but int8 weights
also arrive through files no checksum of ours covers (a Hugging Face folder written by
any tool, a ``torch.load``ed state dict, a dcp folder written elsewhere). Every load path
runs the one check here before anything is copied into a model:

* row scales are finite and non-negative (``NaN`` makes every output NaN; a negative
  scale silently flips its row);
* int8 values lie in the symmetric range -127..127: ``-128`` is refused, not clamped.
  The quantizer never writes it, the int8 GEMMs bound their int32 sums by ``127 * 127``,
  and negating a row must not overflow; clamping would change the weight silently. A
  file converted from torchao (whose int8 weights may hold -128) is clamped by the user,
  knowingly (the error says how);
* shapes fit: ``[rows, row_len]`` int8 data with ``[rows]`` fp32 scales, and the shape
  of the layer it loads into;
* int8 rows come with their scales and scales with their int8 rows.

The cost is one pass over the int8 bytes (an ``amin`` reduction) plus one over the scales.

:class:`CheckInt8Entries` is the ``load_state_dict`` pre-hook of a quantized model: the
first hooked module a load reaches checks every int8 layer below it, before any of them
is copied, so a refused load leaves those layers as they were.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch
import torch.nn as nn

from fsdp_int8._dist import local_shard
from fsdp_int8._weight.tensor import Int8Weight

__all__ = [
    "Int8LoadError", "SCALE_SUFFIX", "as_rows", "check_rows", "check_weight", "check_entry", "CheckInt8Entries",
    "add_check_hook", "refusal", "trusted",
]

#: The fp32 row scales of the int8 weight saved under ``key`` are saved under ``key + SCALE_SUFFIX``
#: (``<layer>.weight_scale``) in the safetensors layout of :mod:`fsdp_int8.integrations.hf_quantizer`.
SCALE_SUFFIX = "_scale"
INT8_MIN_ALLOWED = -127
_trusted_depth = 0  # > 0 while a caller loads entries it has checked itself


class Int8LoadError(ValueError):
    """An int8 weight arriving from outside, refused before anything is copied into the model.

    Raised by ``from_pretrained`` of an int8 folder, ``load_state_dict`` of a quantized model
    (Hugging Face ``weight`` + ``weight_scale`` entries or ``Int8Weight`` values:
    ``torch.load``ed dicts, ``Trainer``'s resume, accelerate's and Lightning's loaders) and
    :func:`fsdp_int8.integrations.hf_quantizer.state_dict_from_int8_safetensors`;
    ``load_checkpoint`` raises ``CheckpointError`` with the same text. Refused: row scales
    that are NaN, infinite or negative; int8 values of -128 (outside the symmetric range
    -127..127; never clamped silently); shapes that do not fit the layer or each other;
    int8 rows without their scales, scales without int8 rows. The message names the
    state-dict key, the file when known, what is wrong (how many values, the first bad row)
    and what to do. A subclass of ``ValueError``.
    docs/checkpoints.md, "What is checked on the way in".
    """


@contextlib.contextmanager
def trusted() -> Iterator[None]:
    """Loads inside this block skip the ``load_state_dict`` check: their caller checked
    the same entries already (``load_checkpoint``), so the bytes are read once."""
    global _trusted_depth
    _trusted_depth += 1
    try:
        yield
    finally:
        _trusted_depth -= 1


def _where(key: str, source: str | None) -> str:
    return f"{key} (in {source})" if source else key


def refusal(key: str, source: str | None, problem: str, fix: str) -> Int8LoadError:
    """The error refusing int8 weight ``key`` (of file ``source``, if known): ``problem``, then ``fix``."""
    return Int8LoadError(f"refusing to load int8 weight {_where(key, source)}: {problem}. {fix}")


_DAMAGED = (  # says what is wrong with the entry, not who wrote it (the folder may say fsdp_int8 did)
    "The entry is not a valid int8 weight (the file is damaged or was edited after saving): write it "
    "again from the model that trained it, or load full-precision weights (they are rounded to int8 on load)"
)


def check_rows(
    key: str, int_rows: torch.Tensor, scale: torch.Tensor, *, source: str | None = None,
    shape: tuple[int, ...] | None = None,
) -> None:
    """Raise :class:`Int8LoadError` unless ``int_rows`` (int8, ``[rows, row_len]`` or
    regrouped ``[*lead, row_len]``) with ``scale`` (fp32, one per row) is a valid int8
    weight, of ``shape`` if given. ``key`` and ``source`` (a file) name it in the error."""
    if int_rows.dtype != torch.int8 or scale.dtype != torch.float32:
        raise refusal(
            key, source, f"needs int8 rows and fp32 row scales, got {int_rows.dtype} and {scale.dtype}", _DAMAGED
        )
    if shape is not None and tuple(int_rows.shape) != tuple(shape):
        raise refusal(
            key, source, f"its int8 rows have shape {tuple(int_rows.shape)}, the layer's weight {tuple(shape)}",
            "Load a checkpoint of this model's architecture",
        )
    lead = tuple(int_rows.shape[:-1]) if int_rows.dim() >= 2 else None
    if lead is None or tuple(scale.shape) != lead:
        raise refusal(
            key, source,
            f"{tuple(int_rows.shape)} int8 rows need {lead} row scales, got {tuple(scale.shape)}", _DAMAGED,
        )
    if int_rows.is_meta or int_rows.numel() == 0:
        return
    int_rows, scale = int_rows.detach(), scale.detach().reshape(-1)
    lowest, highest = torch.aminmax(scale)  # one pass; NaN propagates into both
    if not (bool(lowest >= 0) and bool(highest < float("inf"))):
        bad = ~(torch.isfinite(scale) & (scale >= 0))
        first = int(bad.nonzero()[0, 0])
        raise refusal(
            key, source,
            f"{int(bad.sum())} of {scale.numel()} row scales are NaN, infinite or negative (first: row "
            f"{first}, {float(scale[first])}); a NaN scale makes every output NaN, a negative one flips its row",
            _DAMAGED,
        )
    # the one pass over the int8 bytes (amin: torch's CPU kernel for it reads faster than min's)
    if int(int_rows.amin()) < INT8_MIN_ALLOWED:
        rows = int_rows.reshape(-1, int_rows.shape[-1])
        low = rows == -128
        first = int(low.any(dim=1).nonzero()[0, 0])
        raise refusal(
            key, source,
            f"{int(low.sum())} int8 value(s) are -128 (first in row {first}), outside the symmetric range "
            "-127..127 fsdp_int8 keeps (int8 matmuls and row negation rely on it)",
            "int8 weights converted from torchao can hold -128: clamp them before loading "
            "(int_rows.clamp_(min=-127), a change of one step, scale, in those values), or load "
            "full-precision weights",
        )


def as_rows(data: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """A checkpoint's int8 entry as rows of its scales: flat rows (format version 2,
    ``[*lead, rows * in]`` with ``[*lead, rows]`` scales: ``[rows * in]`` for a linear
    layer, ``[experts, out * in]`` for MoE experts) viewed as ``[*lead, rows, in]``;
    ``[rows, in]`` rows (version 1) and anything that does not divide into the scales' rows
    (refused by the checks after this) as they are."""
    fits = (
        data.dim() == scale.dim() >= 1 and data.shape[:-1] == scale.shape[:-1]
        and scale.shape[-1] > 0 and data.shape[-1] % scale.shape[-1] == 0
    )
    return data.reshape(*scale.shape, data.shape[-1] // scale.shape[-1]) if fits else data


def check_weight(key: str, value: torch.Tensor, *, source: str | None = None,
                 shape: tuple[int, ...] | None = None) -> None:
    """:func:`check_rows` of an ``Int8Weight`` or of this rank's shard of one (a DTensor)."""
    if shape is not None and tuple(value.shape) != tuple(shape):
        raise refusal(
            key, source, f"it has shape {tuple(value.shape)}, the layer's weight {tuple(shape)}",
            "Load a checkpoint of this model's architecture",
        )
    check_rows(key, *local_shard(value).read_rows(), source=source)


def check_entry(
    state_dict: dict[str, Any], prefix: str, weight: torch.Tensor, source: str | None = None, *, name: str = "weight",
) -> None:
    """Check what ``state_dict`` holds for the int8 parameter ``name`` of the layer at
    ``prefix`` (``weight``; an experts module's ``gate_up_proj``, ...), whose value is
    ``weight``: an ``Int8Weight`` (or a shard of one), an int8 ``weight`` + ``weight_scale``
    pair, or a floating weight (rounded to int8 on load: nothing to check)."""
    key = prefix + name
    value, scale = state_dict.get(key), state_dict.get(key + SCALE_SUFFIX)
    if value is None:
        if scale is not None:
            raise refusal(key, source, f"the state dict holds {key + SCALE_SUFFIX} but no int8 rows {key}", _DAMAGED)
        return  # a missing entry: load_state_dict reports it as for any layer
    if not isinstance(value, torch.Tensor):
        return
    if isinstance(local_shard(value), Int8Weight):
        check_weight(key, value, source=source, shape=tuple(weight.shape))
    elif value.dtype == torch.int8:
        if scale is None:
            raise refusal(
                key, source, f"it holds int8 rows but no row scales ({key + SCALE_SUFFIX} is missing)", _DAMAGED
            )
        check_rows(key, as_rows(value, scale), scale, source=source, shape=tuple(weight.shape))
    elif scale is not None:
        raise refusal(
            key, source, f"it holds {value.dtype} values beside row scales {key + SCALE_SUFFIX}, which belong "
            "to int8 rows", _DAMAGED,
        )


def _int8_layers(module: nn.Module, prefix: str) -> Iterator[tuple[str, str, torch.Tensor]]:
    """``(state-dict prefix, parameter name, weight)`` of every int8 parameter under
    ``module`` (a layer's ``weight``, an experts module's 3-D weights)."""
    for name, sub in module.named_modules(prefix=prefix.rstrip(".")):
        for param_name, weight in sub._parameters.items():
            if weight is not None and isinstance(local_shard(weight), Int8Weight):
                yield (name + "." if name else ""), param_name, weight


class CheckInt8Entries:
    """``load_state_dict`` pre-hook of a quantized model and of each of its int8 layers.

    The first hooked module a load reaches (the one ``load_state_dict`` was called on, or
    the quantized model inside a wrapper) checks the entries of every int8 layer below it
    with :func:`check_entry` before any of them is copied. The hooks below it in the same
    load skip what it checked: a load is known by its ``error_msgs`` list, which
    ``load_state_dict`` makes anew for each call and hands to every hook. A picklable
    object, not a closure: modules holding it still deep-copy and pickle.
    """

    def __call__(
        self, module: nn.Module, state_dict: dict, prefix: str, local_metadata: dict, strict: bool,
        missing_keys: list, unexpected_keys: list, error_msgs: list,
    ) -> None:
        global _last_check
        if _trusted_depth:
            return
        load, checked = _last_check
        if load is error_msgs and any(prefix.startswith(done) for done in checked):
            return
        for layer_prefix, name, weight in _int8_layers(module, prefix):
            check_entry(state_dict, layer_prefix, weight, name=name)
        # the list itself is held and compared by identity: each later load brings a new one
        _last_check = (error_msgs, (*checked, prefix) if load is error_msgs else (prefix,))


# (the error_msgs list of the load that checked last, the prefixes it checked)
_last_check: tuple[list | None, tuple[str, ...]] = (None, ())


# A pickled quantized model holds this hook, in the _WrappedHook torch wraps every
# load_state_dict pre-hook in: torch.load(weights_only=True) may rebuild both.
torch.serialization.add_safe_globals([CheckInt8Entries, torch.nn.modules.module._WrappedHook])


def add_check_hook(module: nn.Module) -> None:
    """Give ``module`` the :class:`CheckInt8Entries` pre-hook, once."""
    hooks = [getattr(h, "hook", h) for h in module._load_state_dict_pre_hooks.values()]
    if not any(isinstance(h, CheckInt8Entries) for h in hooks):
        module.register_load_state_dict_pre_hook(CheckInt8Entries())
