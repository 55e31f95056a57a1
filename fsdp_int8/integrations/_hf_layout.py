"""The safetensors layout of fsdp_int8's transformers quantizer, and reading it back.

An ``Int8Weight`` entry ``<module>.weight`` of a state dict is written as two tensors:
``<module>.weight`` (``int8``, its ``[out, in]`` rows flattened to ``[out * in]``) and
``<module>.weight_scale`` (``float32``, ``[out]``), with
``weight = int8.view(out, in) * scale[:, None]``. The rows are flat (format version 2) so
that a loader that does not know fsdp_int8's method refuses them at its shape check
instead of loading int8 values as floats; version 1 folders (``[out, in]`` rows) still
read. A mixture-of-experts weight ``<experts>.gate_up_proj`` (``[E, out, in]``) is flat per
expert: ``[E, out * in]`` int8 with ``[E, out]`` scales (``<experts>.gate_up_proj_scale``),
which transformers' own weight conversions split into the model family's per-expert
entries (:mod:`._hf_conversions`). :func:`unpaired` finds, from safetensors headers alone
(:func:`read_headers`, or :func:`headers_of` tensors), the int8 entries that lack their
scales or whose scales are not one per row. Internal: the public side is
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
from fsdp_int8._weight.tensor import Int8Weight, Int8WeightMeta

__all__ = [
    "QUANT_METHOD",
    "SCALE_SUFFIX",
    "is_int8",
    "int8_parameter_names",
    "flat_rows",
    "int8_safetensors_state_dict",
    "state_dict_from_int8_safetensors",
    "add_load_hooks",
    "save_pretrained_argument",
    "tied_and_fp32_modules",
    "without_tied_copies",
    "Headers",
    "read_headers",
    "headers_of",
    "scale_entries",
    "unpaired",
]

#: The ``quant_method`` that ``config.json``'s ``quantization_config`` records for fsdp_int8 folders.
QUANT_METHOD = "fsdp_int8"


def int8_parameter_names(module: nn.Module) -> tuple[str, ...]:
    """Names of ``module``'s own int8 parameters (``Int8Weight``, or a shard of one): a
    layer's ``weight``, an experts module's 3-D weights (``gate_up_proj``, ``down_proj``)."""
    return tuple(
        name for name, param in module._parameters.items()
        if param is not None and isinstance(local_shard(param), Int8Weight)
    )


def is_int8(module: nn.Module) -> bool:
    """Whether any of ``module``'s own parameters is an ``Int8Weight`` (or a shard of one)."""
    return bool(int8_parameter_names(module))


def flat_rows(weight: Int8Weight) -> tuple[torch.Tensor, torch.Tensor]:
    """``weight``'s int8 rows flattened per leading index, and its scales: ``[out * in]``
    and ``[out]`` for a layer, ``[E, out * in]`` and ``[E, out]`` for experts."""
    int_rows, scale = weight.read_rows()
    return int_rows.reshape(*weight.shape[:-2], -1), scale.reshape(weight.shape[:-1])


def int8_safetensors_state_dict(state_dict: Mapping[str, Any]) -> dict[str, Any]:
    """``state_dict`` with each ``Int8Weight`` entry split into what safetensors can write.

    Entry ``key`` becomes ``key`` (its int8 rows ``[out, in]`` flattened to ``[out * in]``;
    experts ``[E, out, in]`` to ``[E, out * in]``) and ``key + SCALE_SUFFIX`` (fp32,
    ``[out]`` / ``[E, out]``), with ``weight = int8.view(out, in) * scale[:, None]``. Other
    entries are kept as they are. The int8 rows and scales are views of the weight's own
    storage (no copy).

    Args:
        state_dict: A state dict of a quantized model (``model.state_dict()``), unsharded.

    Raises:
        RuntimeError: a sharded (DTensor) int8 entry: gather the full state dict on every
            rank first.

    Example::

        safetensors.torch.save_file(int8_safetensors_state_dict(model.state_dict()), file)
    """
    out: dict[str, Any] = {}
    sharded = []
    for key, value in state_dict.items():
        if isinstance(value, DTensor) and isinstance(local_shard(value), Int8Weight):
            sharded.append(key)
        elif isinstance(value, Int8Weight):
            out[key], out[key + SCALE_SUFFIX] = flat_rows(value)
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


def _is_scale_key(key: str, tensors: Mapping[str, Any]) -> bool:
    """Whether ``key`` holds the row scales of an int8 entry: ``<layer>.weight_scale``, or
    ``<name>_scale`` beside int8 rows ``<name>`` (an experts module's ``gate_up_proj``)."""
    rows_key = key.removesuffix(SCALE_SUFFIX)
    if rows_key == key:
        return False
    rows = tensors.get(rows_key)
    return rows_key.rsplit(".", 1)[-1] == "weight" or (isinstance(rows, torch.Tensor) and rows.dtype == torch.int8)


def state_dict_from_int8_safetensors(
    tensors: Mapping[str, torch.Tensor], *, dtype: torch.dtype = torch.float32, source: str | None = None
) -> dict[str, Any]:
    """The inverse of :func:`int8_safetensors_state_dict`, for models that are not
    transformers models (those load the pair themselves).

    Each ``key`` (int8 rows) + ``key + SCALE_SUFFIX`` (fp32 row scales) pair of ``tensors``
    becomes one ``Int8Weight`` entry ``key``, which ``load_state_dict`` of a quantized model
    copies byte for byte. Other entries are kept as they are. Every pair is checked first
    (scales finite and non-negative, int8 values in -127..127, shapes).

    Args:
        tensors: What the file holds (``safetensors.torch.load_file``).
        dtype: Outer (compute) dtype of the ``Int8Weight`` entries.
        source: The file's name, for the errors.

    Raises:
        Int8LoadError: naming the entry and ``source``: an invalid pair, int8 rows without
            scales, or scales without int8 rows.

    Example::

        model.load_state_dict(state_dict_from_int8_safetensors(load_file(file), source=file))
    """
    rewrite = "Write the file again with int8_safetensors_state_dict"
    out: dict[str, Any] = {}
    for key, value in tensors.items():
        if _is_scale_key(key, tensors):  # row scales: with their rows
            rows_key = key.removesuffix(SCALE_SUFFIX)
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
        out[key] = Int8Weight(value, scale, Int8WeightMeta(row_len=value.shape[-1]), dtype=dtype)
    return out


class _LoadInt8Entries:
    """``load_state_dict`` pre-hook of a module with int8 parameters: for each, a
    ``<name>`` (int8) + ``<name>_scale`` pair in the state dict (``weight`` +
    ``weight_scale`` of a layer) becomes one ``Int8Weight``, which then loads like any other.

    A picklable object, not a closure: modules holding it still deep-copy and pickle.
    """

    def __call__(self, module: nn.Module, state_dict: dict, prefix: str, *args: Any) -> None:
        for name in int8_parameter_names(module):
            self._join(module, state_dict, prefix, name)

    @staticmethod
    def _join(module: nn.Module, state_dict: dict, prefix: str, name: str) -> None:
        key = prefix + name
        scale, data, weight = state_dict.get(key + SCALE_SUFFIX), state_dict.get(key), module._parameters[name]
        if scale is None or data is None or isinstance(data, Int8Weight) or isinstance(weight, DTensor):
            return  # not this hook's layout: load_state_dict reports the keys as it would
        local = local_shard(weight)
        data = as_rows(data, scale)
        if data.dtype != torch.int8 or scale.dtype != torch.float32 or scale.shape != data.shape[:-1]:
            raise ValueError(
                f"{key}: an int8 checkpoint entry needs int8 rows and fp32 row scales, "
                f"got {data.dtype} {tuple(data.shape)} and {scale.dtype} {tuple(scale.shape)}"
            )
        del state_dict[key + SCALE_SUFFIX]
        state_dict[key] = local.with_tensors(data.to(local.device), scale.to(local.device))


# a pickled transformers model with int8 layers holds this hook: weights_only loads rebuild it
torch.serialization.add_safe_globals([_LoadInt8Entries])


def add_load_hooks(model: nn.Module) -> None:
    """Give every module of ``model`` with int8 parameters the pre-hook that loads their
    ``<name>`` + ``<name>_scale`` pairs (once: a repeated call adds it only to new ones)."""
    for module in model.modules():
        # torch keeps each hook wrapped (its `hook` attribute): look through the wrapper
        hooks = [getattr(h, "hook", h) for h in module._load_state_dict_pre_hooks.values()]
        if is_int8(module) and not any(isinstance(h, _LoadInt8Entries) for h in hooks):
            module.register_load_state_dict_pre_hook(_LoadInt8Entries())


def save_pretrained_argument(name: str, default: Any = None) -> Any:
    """Argument ``name`` of the ``save_pretrained`` call asking us (``default`` for any
    other caller).

    transformers 5.23's ``save_pretrained`` replaces its ``state_dict`` argument by what
    ``get_state_dict_and_metadata(model)`` returns (every quantizer's), yet the argument is
    the only full state dict of a sharded model (``Trainer.save_model`` under FSDP gathers
    it on every rank and passes it on rank 0); ``save_original_format`` says whether it
    reverts the model's weight conversions. Both are still bound in the caller's frame, so
    read them there: the frame two calls up (0: here, 1: ``get_state_dict_and_metadata``).
    """
    frame = sys._getframe(2)
    try:
        code = frame.f_code
        if code.co_name != "save_pretrained" or name not in code.co_varnames:
            return default
        return frame.f_locals.get(name, default)
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


def _same_values(a: Any, b: Any) -> bool:
    """Whether state-dict entries ``a`` and ``b`` hold the same bytes (int8 rows and scales
    of int8 weights, the values of plain tensors); sharded entries never compare equal."""
    if isinstance(a, DTensor) or isinstance(b, DTensor) or type(a) is not type(b):
        return False
    if isinstance(a, Int8Weight):
        return a.shape == b.shape and torch.equal(a.int_data, b.int_data) and torch.equal(a.scale, b.scale)
    return isinstance(a, torch.Tensor) and a.shape == b.shape and a.dtype == b.dtype and torch.equal(a, b)


def without_tied_copies(state_dict: Mapping[str, Any], model: nn.Module) -> dict[str, Any]:
    """``state_dict`` without the entries of ``model``'s tied weights (``{target: source}``
    in ``model.all_tied_weights_keys``, the target one parameter with its source) that
    repeat their source's bytes.

    A gathered full state dict (``get_model_state_dict(..., full_state_dict=True)``,
    ``accelerator.get_state_dict``, ``Trainer.save_model`` under FSDP) holds each end of a
    tie as its own tensor, which ``save_pretrained`` writes twice (it drops only entries
    sharing storage); without the copy the folder is one process's: the source alone. A
    copy whose bytes differ is kept.
    """
    out = dict(state_dict)
    for target, source in (getattr(model, "all_tied_weights_keys", None) or {}).items():
        if target not in out or source not in out or out[target] is out[source]:
            continue  # one tensor under both names: save_pretrained drops the target itself
        try:
            tied = model.get_parameter(target) is model.get_parameter(source)
        except AttributeError:  # not parameters of this model
            continue
        if tied and _same_values(out[target], out[source]):
            del out[target]
    return out


# ------------------------------------------------ the pairs, from safetensors headers

Headers = dict[str, tuple[str, list[int], str]]  # entry -> (safetensors dtype, shape, file)


def read_headers(files: list[str]) -> Headers:
    """Every entry's dtype, shape and file, from the safetensors headers alone."""
    from safetensors import safe_open

    headers: Headers = {}
    for file in files:
        with safe_open(file, framework="pt") as handle:
            for key in handle.keys():
                entry = handle.get_slice(key)
                headers[key] = (entry.get_dtype(), list(entry.get_shape()), str(file))
    return headers


def _scales_fit(rows: list[int], scales: list[int]) -> bool:
    """Whether ``scales`` hold one scale per row of ``rows``: ``[*lead, n * in]`` rows with
    ``[*lead, n]`` scales (format version 2), or ``[n, in]`` rows with ``[n]`` (version 1)."""
    if len(rows) == len(scales) + 1:
        return rows[:-1] == scales
    return len(rows) == len(scales) >= 1 and rows[:-1] == scales[:-1] and scales[-1] > 0 and rows[-1] % scales[-1] == 0


def scale_entries(headers: Headers) -> list[str]:
    """The checkpoint's row-scale entries: ``<layer>.weight_scale``, and ``<name>_scale``
    beside int8 rows ``<name>`` (a fused experts weight ``gate_up_proj``)."""
    found = []
    for key in headers:
        rows_key = key.removesuffix(SCALE_SUFFIX)
        rows = headers.get(rows_key)
        if rows_key != key and (rows_key.endswith(".weight") or (rows is not None and rows[0] == "I8")):
            found.append(key)
    return found


def unpaired(headers: Headers) -> list[tuple[str, str]]:
    """``(int8 entry, what is wrong)`` for int8 rows without row scales, row scales without
    int8 rows, and scales that are not one fp32 scale per row."""
    problems = []
    for key in scale_entries(headers):
        rows_key = key.removesuffix(SCALE_SUFFIX)
        (dtype, shape, _), rows = headers[key], headers.get(rows_key)
        if rows is None or rows[0] != "I8":
            found = "no entry" if rows is None else f"{rows[0]} values"
            problems.append((rows_key, f"the checkpoint holds row scales {key} but {found}, not int8 rows"))
        elif dtype != "F32" or not _scales_fit(rows[1], shape):
            problems.append((rows_key, f"its int8 rows {rows[1]} need fp32 row scales, one per row, "
                                       f"{key} holds {dtype} {shape}"))
    for key, (dtype, _, _) in headers.items():
        if dtype == "I8" and key + SCALE_SUFFIX not in headers:
            problems.append((key, f"it holds int8 rows but no row scales ({key + SCALE_SUFFIX} is missing)"))
    return problems


_SAFETENSORS_DTYPES = {torch.int8: "I8", torch.float32: "F32"}


def headers_of(state: Mapping[str, torch.Tensor]) -> Headers:
    """:func:`read_headers` of tensors in memory (no file)."""
    return {k: (_SAFETENSORS_DTYPES.get(v.dtype, str(v.dtype)), list(v.shape), "") for k, v in state.items()}
