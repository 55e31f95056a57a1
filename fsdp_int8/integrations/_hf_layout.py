"""The safetensors layout of fsdp_int8's transformers quantizer, and reading it back.

An ``Int8Weight`` entry ``<module>.weight`` of a state dict is written as two tensors:
``<module>.weight`` (``int8``, its ``[out, in]`` rows flattened to ``[out * in]``) and
``<module>.weight_scale`` (``float32``, ``[out]``), with
``weight = int8.view(out, in) * scale[:, None]``. The rows are flat (format version 2) so
that a loader that does not know fsdp_int8's method refuses them at its shape check
instead of loading int8 values as floats; version 1 folders (``[out, in]`` rows) still
read. Internal: the public side is
:mod:`fsdp_int8.integrations.hf_quantizer`.
"""

from __future__ import annotations

import sys
from typing import Any, Mapping

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

from fsdp_int8._dist import local_shard
from fsdp_int8._weight.load_checks import SCALE_SUFFIX, as_rows, check_rows, refusal
from fsdp_int8._weight.tensor import Int8Weight

__all__ = [
    "QUANT_METHOD",
    "SCALE_SUFFIX",
    "is_int8",
    "int8_safetensors_state_dict",
    "state_dict_from_int8_safetensors",
    "add_load_hooks",
    "state_dict_given_to_save_pretrained",
    "tied_and_fp32_modules",
    "int8_layers_in_checkpoint",
]

QUANT_METHOD = "fsdp_int8"  # config.json's quantization_config.quant_method of these folders


def is_int8(module: nn.Module) -> bool:
    """Whether ``module``'s own ``weight`` is an ``Int8Weight`` (or a shard of one)."""
    weight = module._parameters.get("weight")
    return weight is not None and isinstance(local_shard(weight), Int8Weight)


def int8_safetensors_state_dict(state_dict: Mapping[str, Any]) -> dict[str, Any]:
    """``state_dict`` with each ``Int8Weight`` entry ``key`` split into ``key`` (its int8
    rows ``[out, in]``, flattened to ``[out * in]``) and ``key + "_scale"`` (fp32,
    ``[out]``): what safetensors can write.

    Other entries are kept as they are. The int8 rows and scales are views of the weight's
    own storage (no copy). Raises ``RuntimeError`` for a sharded (DTensor) int8 weight: a
    sharded model's full state dict has to be gathered on every rank first.
    """
    out: dict[str, Any] = {}
    sharded = []
    for key, value in state_dict.items():
        if isinstance(value, DTensor) and isinstance(local_shard(value), Int8Weight):
            sharded.append(key)
        elif isinstance(value, Int8Weight):
            int_rows, scale = value.read_rows()
            out[key] = int_rows.reshape(-1)
            out[key + SCALE_SUFFIX] = scale
        else:
            out[key] = value
    if sharded:
        raise RuntimeError(
            f"cannot write sharded int8 weights ({', '.join(sharded[:3])}{' ...' if len(sharded) > 3 else ''}): "
            "a sharded model's full state dict has to be gathered on every rank first. Call "
            "model.save_pretrained(path, state_dict=accelerator.get_state_dict(model)) on every rank "
            "(or state_dict=torch.distributed.checkpoint.state_dict.get_model_state_dict(model, "
            "options=StateDictOptions(full_state_dict=True, cpu_offload=True)))."
        )
    return out


def state_dict_from_int8_safetensors(
    tensors: Mapping[str, torch.Tensor], *, dtype: torch.dtype = torch.float32, source: str | None = None
) -> dict[str, Any]:
    """The inverse of :func:`int8_safetensors_state_dict`: each ``key`` (int8 rows) +
    ``key + "_scale"`` (fp32 row scales) pair of ``tensors`` becomes one ``Int8Weight``
    entry ``key`` (outer dtype ``dtype``), which ``load_state_dict`` of a quantized model
    copies byte for byte. Other entries are kept as they are.

    Every pair is checked first (scales finite and non-negative, int8 values in
    -127..127, shapes): ``source`` (the file's name) is named in the error.

    Raises:
        Int8LoadError: an invalid pair, int8 rows without scales, or scales without int8 rows.
    """
    rewrite = "Write the file again with int8_safetensors_state_dict"
    out: dict[str, Any] = {}
    for key, value in tensors.items():
        rows_key = key.removesuffix(SCALE_SUFFIX)
        if rows_key != key and rows_key.rsplit(".", 1)[-1] == "weight":  # row scales: with their rows
            if rows_key not in tensors:
                raise refusal(rows_key, source, f"the file holds row scales {key} but no int8 rows", rewrite)
            continue
        scale = tensors.get(key + SCALE_SUFFIX)
        if scale is None:
            if value.dtype == torch.int8:
                raise refusal(key, source, f"it holds int8 rows but no row scales {key + SCALE_SUFFIX}", rewrite)
            out[key] = value
            continue
        value = as_rows(value, scale)
        check_rows(key, value, scale, source=source)
        out[key] = Int8Weight(value, scale, dtype=dtype, row_len=value.shape[-1])
    return out


class _LoadInt8Entries:
    """``load_state_dict`` pre-hook of an int8 layer: a ``weight`` (int8) + ``weight_scale``
    pair in the state dict becomes one ``Int8Weight``, which then loads like any other.

    A picklable object, not a closure: modules holding it still deep-copy and pickle.
    """

    def __call__(self, module: nn.Module, state_dict: dict, prefix: str, *args: Any) -> None:
        scale = state_dict.get(prefix + "weight" + SCALE_SUFFIX)
        data = state_dict.get(prefix + "weight")
        weight = module._parameters.get("weight")
        if scale is None or data is None or isinstance(data, Int8Weight) or weight is None:
            return
        local = local_shard(weight)
        if not isinstance(local, Int8Weight) or isinstance(weight, DTensor):
            return  # not this hook's layout: load_state_dict reports the keys as it would
        data = as_rows(data, scale)
        if data.dtype != torch.int8 or scale.dtype != torch.float32 or scale.shape != data.shape[:1]:
            raise ValueError(
                f"{prefix}weight: an int8 checkpoint entry needs int8 rows and fp32 row scales, "
                f"got {data.dtype} {tuple(data.shape)} and {scale.dtype} {tuple(scale.shape)}"
            )
        del state_dict[prefix + "weight" + SCALE_SUFFIX]
        state_dict[prefix + "weight"] = local.derive(data.to(local.device), scale.to(local.device))


# a pickled transformers model with int8 layers holds this hook: weights_only loads rebuild it
torch.serialization.add_safe_globals([_LoadInt8Entries])


def add_load_hooks(model: nn.Module) -> None:
    """Give every int8 layer of ``model`` the pre-hook that loads a ``weight`` +
    ``weight_scale`` pair (once: a repeated call adds it only to new int8 layers)."""
    for module in model.modules():
        # torch keeps each hook wrapped (its `hook` attribute): look through the wrapper
        hooks = [getattr(h, "hook", h) for h in module._load_state_dict_pre_hooks.values()]
        if is_int8(module) and not any(isinstance(h, _LoadInt8Entries) for h in hooks):
            module.register_load_state_dict_pre_hook(_LoadInt8Entries())


def state_dict_given_to_save_pretrained() -> dict | None:
    """The ``state_dict`` argument of the ``save_pretrained`` call asking us, if any.

    transformers 5.23's ``save_pretrained`` replaces its ``state_dict`` argument by what
    ``get_state_dict_and_metadata(model)`` returns (every quantizer's), yet the argument is
    the only full state dict of a sharded model (``Trainer.save_model`` under FSDP gathers
    it on every rank and passes it on rank 0). It is still bound in the caller's frame,
    so read it there; any other caller gets ``None``.
    """
    frame = sys._getframe(2)  # 0: here, 1: get_state_dict_and_metadata, 2: its caller
    try:
        code = frame.f_code
        if code.co_name != "save_pretrained" or "state_dict" not in code.co_varnames:
            return None
        given = frame.f_locals.get("state_dict")
        return given if isinstance(given, Mapping) else None
    finally:
        del frame


def tied_and_fp32_modules(model: nn.Module, keep_embeddings: bool = False) -> list[str]:
    """Layers that must stay in full precision: both ends of a tie (transformers ties them
    only after loading, so quantize_ cannot see the tie yet) and ``_keep_in_fp32_modules``.
    With ``keep_embeddings`` (int8 embeddings), a tie's embedding end is not listed: it is
    quantized, and the tie hands its int8 weight to the other end."""
    tied = getattr(model, "all_tied_weights_keys", None) or {}
    names = {key.rsplit(".", 1)[0] for pair in tied.items() for key in pair}
    if keep_embeddings:
        names = {n for n in names if not isinstance(model.get_submodule(n), nn.Embedding)}
    return sorted(names | set(getattr(model, "_keep_in_fp32_modules", None) or ()))


def _unpaired_entries(headers: dict[str, tuple[str, list[int], str]]) -> None:
    """Refuse int8 rows without row scales, row scales without int8 rows, and scales that
    are not one per row, in the checkpoint's entries (``key -> (safetensors dtype, shape,
    file)``), naming the layer and the file."""
    rewrite = "The folder is damaged or was written by another tool: save it again with save_pretrained"
    for key, (dtype, shape, file) in headers.items():
        rows_key = key.removesuffix(SCALE_SUFFIX)
        if rows_key != key and rows_key.endswith(".weight"):
            rows = headers.get(rows_key)
            if rows is None or rows[0] != "I8":
                found = "no entry" if rows is None else f"{rows[0]} values"
                raise refusal(rows_key, file, f"the checkpoint holds row scales {key} but {found}, not int8 rows", rewrite)
            flat = len(rows[1]) == 1 and len(shape) == 1 and shape[0] and rows[1][0] % shape[0] == 0
            if dtype != "F32" or (shape != rows[1][:1] and not flat):
                raise refusal(
                    rows_key, file, f"its int8 rows {rows[1]} need fp32 row scales, one per row, "
                    f"{key} holds {dtype} {shape}", rewrite,
                )
        if dtype == "I8" and key.endswith(".weight") and key + SCALE_SUFFIX not in headers:
            raise refusal(key, file, f"it holds int8 rows but no row scales ({key + SCALE_SUFFIX} is missing)", rewrite)


def int8_layers_in_checkpoint(model: nn.Module, files: list[str] | None) -> dict[str, str] | None:
    """Names of the model's layers the safetensors ``files`` hold scales for, each with its
    file (``None``: no safetensors to read, so the config's rule decides). Only the headers
    are read; int8 rows without scales and scales without int8 rows are refused here."""
    if not files or not all(str(f).endswith(".safetensors") for f in files):
        return None
    from safetensors import safe_open
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightRenaming, rename_source_key

    headers: dict[str, tuple[str, list[int], str]] = {}
    for file in files:
        with safe_open(file, framework="pt") as handle:
            for key in handle.keys():
                entry = handle.get_slice(key)
                headers[key] = (entry.get_dtype(), list(entry.get_shape()), str(file))
    _unpaired_entries(headers)
    keys = [k for k in headers if k.endswith(".weight" + SCALE_SUFFIX)]
    renamings = [t for t in get_model_conversion_mapping(model) if isinstance(t, WeightRenaming)]
    expected = model.state_dict()
    names: dict[str, str] = {}
    for key in keys:
        weight, _ = rename_source_key(key.removesuffix(SCALE_SUFFIX), renamings, [], model.base_model_prefix, expected)
        if weight not in expected or "." not in weight:
            raise ValueError(
                f"the checkpoint holds int8 rows with scales for {key.removesuffix(SCALE_SUFFIX)}, which is "
                f"not a layer's weight in {type(model).__name__} (a weight it converts on load?)"
            )
        names[weight.rsplit(".", 1)[0]] = headers[key][2]
    return names
