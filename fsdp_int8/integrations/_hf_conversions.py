"""fsdp_int8's int8 entries through transformers' weight conversions.

transformers 5 loads some checkpoints through conversions (``transformers.conversion_mapping``):
a mixture-of-experts checkpoint holds one 2-D weight per expert and projection
(``mlp.experts.{e}.gate_proj.weight``, ``up_proj``, ``down_proj``), which loading stacks
along the experts and concatenates along the output features into the model's 3-D
parameters (``mlp.experts.gate_up_proj`` ``[E, 2 * I, H]``, ``down_proj``), and which
``save_pretrained`` splits again. fsdp_int8 writes an expert weight's int8 rows flat per
expert (``[E, out * in]``, scales ``[E, out]``), so those ops act on the rows as on the
weight itself: the folder holds the family's own per-expert entries, each int8
``[out * in]`` with ``<entry>_scale`` ``[out]`` beside it, like a dense int8 layer.

The scales follow the rows through copies of the model's converters for ``_scale``
entries. Loading, transformers makes them itself (``HfQuantizer.update_weight_conversions``:
for a converter into ``<param>`` whose module has a ``<param>_scale`` parameter, which the
quantizer registers while loading); saving, :func:`add_scale_conversions` gives the model
the same copies. Internal: the public side is :mod:`fsdp_int8.integrations.hf_quantizer`.
"""

from __future__ import annotations

import re
from typing import Any

import torch
import torch.nn as nn

from fsdp_int8._dist import local_shard
from fsdp_int8._weight.load_checks import SCALE_SUFFIX, Int8LoadError, as_rows, check_rows, refusal
from fsdp_int8._weight.tensor import Int8Weight

__all__ = ["add_scale_conversions", "check_tied_copy", "checked_rows", "int8_layers_in_checkpoint"]

_REWRITE = "The folder is damaged or was written by another tool: save it again with save_pretrained"

Headers = dict[str, tuple[str, list[int], str]]  # entry -> (safetensors dtype, shape, file)


def _read_headers(files: list[str]) -> Headers:
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


def _scale_entries(headers: Headers) -> list[str]:
    """The checkpoint's row-scale entries: ``<layer>.weight_scale``, and ``<name>_scale``
    beside int8 rows ``<name>`` (a fused experts weight ``gate_up_proj``)."""
    found = []
    for key in headers:
        rows_key = key.removesuffix(SCALE_SUFFIX)
        rows = headers.get(rows_key)
        if rows_key != key and (rows_key.endswith(".weight") or (rows is not None and rows[0] == "I8")):
            found.append(key)
    return found


def _unpaired_entries(headers: Headers) -> None:
    """Refuse int8 rows without row scales, row scales without int8 rows, and scales that
    are not one per row, naming the entry and its file."""
    scales = _scale_entries(headers)
    for key in scales:
        rows_key = key.removesuffix(SCALE_SUFFIX)
        (dtype, shape, file), rows = headers[key], headers.get(rows_key)
        if rows is None or rows[0] != "I8":
            found = "no entry" if rows is None else f"{rows[0]} values"
            raise refusal(rows_key, file, f"the checkpoint holds row scales {key} but {found}, not int8 rows", _REWRITE)
        if dtype != "F32" or not _scales_fit(rows[1], shape):
            raise refusal(
                rows_key, file, f"its int8 rows {rows[1]} need fp32 row scales, one per row, "
                f"{key} holds {dtype} {shape}", _REWRITE,
            )
    for key, (dtype, _, file) in headers.items():
        if dtype == "I8" and key + SCALE_SUFFIX not in headers:
            missing = f"it holds int8 rows but no row scales ({key + SCALE_SUFFIX} is missing)"
            raise refusal(key, file, missing, _REWRITE)


def int8_layers_in_checkpoint(model: nn.Module, files: list[str] | None) -> dict[str, str] | None:
    """Names of the model's modules the safetensors ``files`` hold int8 rows with scales
    for (a layer, an experts module), each with a file holding them (``None``: no
    safetensors to read, so the config's rule decides).

    Entries are mapped to the model's parameters as transformers loads them: renamed, and
    per-expert entries converted into the experts' 3-D parameters. Only the headers are
    read; int8 rows without scales and scales without int8 rows are refused here.
    """
    if not files or not all(str(f).endswith(".safetensors") for f in files):
        return None
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightConverter, WeightRenaming, rename_source_key

    headers = _read_headers([str(f) for f in files])
    _unpaired_entries(headers)
    conversions = get_model_conversion_mapping(model)
    renamings = [t for t in conversions if isinstance(t, WeightRenaming)]
    converters = [t for t in conversions if isinstance(t, WeightConverter)]
    expected = model.state_dict()
    names: dict[str, str] = {}
    for key in _scale_entries(headers):
        rows_key = key.removesuffix(SCALE_SUFFIX)
        target, _ = rename_source_key(rows_key, renamings, converters, model.base_model_prefix, expected)
        if target not in expected or "." not in target:
            raise ValueError(
                f"the checkpoint holds int8 rows with scales for {rows_key}, which loads into no weight "
                f"of {type(model).__name__}: load it into the architecture that saved it"
            )
        names[target.rsplit(".", 1)[0]] = headers[key][2]
    return names


def _moves_across_rows(op: Any, dims: int) -> bool:
    """Whether conversion ``op`` of a ``dims``-D int8 parameter moves values across the
    rows fsdp_int8 flattens: anything but stacking or splitting along the experts (dim 0),
    and concatenating or chunking along a dimension before the input features."""
    from transformers.core_model_loading import Chunk, Concatenate, MergeModulelist, Split, SplitModulelist

    dim = getattr(op, "dim", None)
    if isinstance(op, (MergeModulelist, SplitModulelist)):
        return dim != 0
    return not isinstance(op, (Chunk, Concatenate, Split)) or not isinstance(dim, int) or not 0 <= dim <= dims - 2


def add_scale_conversions(model: nn.Module) -> None:
    """Make ``save_pretrained`` split the scales of converted int8 parameters as it splits
    their rows: each converter into an int8 parameter ``<p>`` (from entries ``<...>.weight``)
    gets a copy for ``<p>_scale`` (from ``<...>.weight_scale``), as transformers makes on
    load. ``save_pretrained`` reverts ``model._weight_conversions`` (set by
    ``from_pretrained``), else the model's mapping without its prefix changes: the copies
    go there. A model without converters into int8 parameters is left as it is.

    Raises:
        ValueError: a converter into an int8 parameter that would move int8 values across
            rows, or whose entries are not ``.weight`` ones (no scale copy loads those).
    """
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import PrefixChange, WeightConverter

    conversions = getattr(model, "_weight_conversions", None)
    if conversions is None:
        mapping = get_model_conversion_mapping(model, add_legacy=False)
        conversions = [t for t in mapping if not isinstance(t, PrefixChange)]
    int8 = {name: p.dim() for name, p in model.named_parameters() if isinstance(local_shard(p), Int8Weight)}
    known = {tuple(t._original_source_patterns) for t in conversions}
    added = []
    for converter in conversions:
        if not isinstance(converter, WeightConverter):
            continue
        sources, targets = converter._original_source_patterns, converter._original_target_patterns
        hit = [n for n in int8 if any(re.search(f"{t}$", n) for t in targets)]
        if not hit:
            continue
        if not all(s.endswith(".weight") for s in sources) or any(
            _moves_across_rows(op, int8[hit[0]]) for op in converter.operations
        ):
            raise ValueError(
                f"cannot save int8 {hit[0]} in {type(model).__name__}'s checkpoint layout: transformers "
                f"converts {sources} into it with {converter.operations}, which fsdp_int8's int8 rows and "
                "scales do not follow. Save the model's own layout, model.save_pretrained(path, "
                "save_original_format=False) (from_pretrained loads it), or full precision: "
                "model.save_pretrained(path, state_dict=fsdp_int8.export_full_state_dict(model))"
            )
        scaled = [s + SCALE_SUFFIX for s in sources]
        if tuple(scaled) not in known:
            known.add(tuple(scaled))
            scale_targets = [t + SCALE_SUFFIX for t in targets]
            added.append(converter.copy(scaled, scale_targets, operations=list(converter.operations)))
    if added:
        model._weight_conversions = [*conversions, *added]


def checked_rows(
    model: nn.Module, key: str, data: torch.Tensor, scale: torch.Tensor, *, shape: tuple[int, ...],
    source: str | None, files: list[str],
) -> torch.Tensor:
    """The rows (``[*lead, out, in]``, a view of ``data``) of the int8 parameter ``key``
    that ``from_pretrained`` loaded (``data``, flat per leading index, with ``scale``) from
    the checkpoint ``files`` (``source``: one holding it), once
    :func:`~fsdp_int8._weight.load_checks.check_rows` accepts them as an int8 weight of
    ``shape``. A refusal names the checkpoint entry at fault: an experts weight's own
    per-expert entry, not the parameter it loads into.

    Raises:
        Int8LoadError: the rows or scales are not a valid int8 weight of ``shape``.
    """
    rows = as_rows(data, scale)
    try:
        check_rows(key, rows, scale, source=source, shape=shape)
    except Int8LoadError as refused:
        raise _refusal_of_entry(model, key, data, scale, files, refused) from None
    return rows


def check_tied_copy(key: str, scale: torch.Tensor, weight: Int8Weight, source_key: str, file: str | None) -> None:
    """Accept the row scales ``scale`` that a checkpoint holds for int8 parameter ``key``
    when ``from_pretrained`` tied ``key`` to ``source_key`` (``weight``, made from that
    entry) if they are ``weight``'s own. A folder written from a gathered full state dict
    can hold both ends of a tie; transformers ties them when their int8 rows are equal,
    and this compares their scales.

    Raises:
        Int8LoadError: the scales differ, so the two entries are different weights.
    """
    if not torch.equal(scale.to(weight.scale.device, torch.float32).reshape(weight.scale.shape), weight.scale):
        raise refusal(
            key, file, f"it is tied to {source_key} and holds the same int8 rows with other row scales",
            "Load it with tie_word_embeddings=False to keep two weights, or save the folder again from the "
            "model that trained it",
        )


def _refusal_of_entry(
    model: nn.Module, key: str, rows: torch.Tensor, scale: torch.Tensor, files: list[str], error: Int8LoadError
) -> Int8LoadError:
    """The refusal of a loaded int8 parameter ``key`` (``rows`` flat per leading index,
    ``scale``), naming the checkpoint entry at fault and its file: the model's weight
    conversions are reverted on the pair (an experts weight becomes its per-expert entries)
    and each entry is checked. ``error`` (the refusal of ``key`` itself) where no single
    entry is at fault or the conversions cannot be reverted."""
    from transformers.core_model_loading import revert_weight_conversion

    try:
        entries = revert_weight_conversion(model, {key: rows, key + SCALE_SUFFIX: scale})
    except Exception:  # noqa: BLE001 (any failure: the refusal of the whole parameter stands)
        return error
    if len(entries) <= 2:
        return error  # not converted: the check of the parameter named the entry already
    located = _file_of_entries([e for e in entries if not e.endswith(SCALE_SUFFIX)], files)
    for entry, file in located.items():
        entry_scale = entries.get(entry + SCALE_SUFFIX)
        if entry_scale is None:
            return error
        try:
            check_rows(entry, as_rows(entries[entry], entry_scale), entry_scale, source=file)
        except Int8LoadError as refused:
            return refused
    return error


def _file_of_entries(entries: list[str], files: list[str]) -> dict[str, str | None]:
    """Each of ``entries`` with the safetensors file holding it (``None`` if none does)."""
    headers = _read_headers([str(f) for f in files])
    return {entry: headers.get(entry, (None, None, None))[2] for entry in entries}
