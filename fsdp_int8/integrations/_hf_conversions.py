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

The scales follow the rows: :func:`int8_conversions` gives each converter into an int8
parameter ops that act on the rows as on the weight (``[*lead, out, in]``, flattened again
after each op) and, where its patterns leave ``<entry>_scale`` alone (they end on a name
boundary), a copy for the scales; each renaming of an int8 parameter's full name gets a
copy for its scales too (GraniteMoE's ``input_linear.weight`` -> ``experts.gate_up_proj``).
A ``Transpose`` that transformers applies only to a checkpoint of the other shape
(``check_dims``, Qwen3-VL-MoE) leaves the int8 rows in the model's own order. Loading,
the quantizer's ``update_weight_conversions`` uses it; saving, :func:`add_scale_conversions`
gives the model the same conversions and runs them on meta tensors first, so a layout in
which some int8 rows and their scales would not pair up is refused before anything is
written. Internal: the public side is :mod:`fsdp_int8.integrations.hf_quantizer`.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn
from transformers.core_model_loading import ConversionOps
from transformers.quantizers.quantizers_utils import get_module_from_name

from fsdp_int8._dist import local_shard
from fsdp_int8._weight.layouts import in_other_layout, stored_transposed
from fsdp_int8._weight.load_checks import SCALE_SUFFIX, Int8LoadError, as_rows, check_rows, refusal
from fsdp_int8._weight.tensor import Int8Weight
from fsdp_int8.integrations._hf_layout import Headers, headers_of, read_headers, scale_entries, unpaired

__all__ = [
    "QuantizeOnLoad", "add_scale_conversions", "check_tied_copy", "checked_rows", "int8_conversions",
    "int8_layers_in_checkpoint",
]

# read only for a folder whose config.json records fsdp_int8: say what is inconsistent, not who wrote it
_REWRITE = (
    "The folder's config.json says fsdp_int8 wrote it, and fsdp_int8 writes every int8 entry with its row "
    "scales beside it: a weight conversion renamed or reshaped one of the pair and not the other (fsdp_int8 "
    "did so for GraniteMoE before it carried the scales through renamings), or the files were edited. Save the "
    "trained model again with save_pretrained (or save_original_format=False), or load a full-precision export"
)


def _unpaired_entries(headers: Headers) -> None:
    """Refuse the first of :func:`~._hf_layout.unpaired`'s problems, naming the entry and its file."""
    for key, problem in unpaired(headers)[:1]:
        file = (headers.get(key) or headers[key + SCALE_SUFFIX])[2]
        raise refusal(key, file, problem, _REWRITE)


def int8_layers_in_checkpoint(model: nn.Module, files: list[str] | None) -> dict[str, str] | None:
    """Names of the model's modules the safetensors ``files`` hold int8 rows with scales
    for (a layer, an experts module), each with a file holding them (``None``: no
    safetensors to read, so the config's rule decides).

    Entries are mapped to the model's parameters as transformers loads them: renamed,
    per-expert entries converted into the experts' 3-D parameters, a fused entry into each
    of the weights it is split into. Only the headers are read; int8 rows without scales
    and scales without int8 rows are refused here.
    """
    if not files or not all(str(f).endswith(".safetensors") for f in files):
        return None
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightConverter, WeightRenaming, rename_source_key

    headers = read_headers([str(f) for f in files])
    _unpaired_entries(headers)
    conversions = get_model_conversion_mapping(model)
    renamings = [t for t in conversions if isinstance(t, WeightRenaming)]
    converters = [t for t in conversions if isinstance(t, WeightConverter)]
    expected = model.state_dict()
    by_source = {pattern: t for t in converters for pattern in t.source_patterns}
    names: dict[str, str] = {}
    for key in scale_entries(headers):
        rows_key = key.removesuffix(SCALE_SUFFIX)
        target, source = rename_source_key(rows_key, renamings, converters, model.base_model_prefix, expected)
        first, *more = by_source[source].target_patterns if source is not None else [target]
        for target in [target] + [target.replace(first, t) for t in more]:  # a split: each part
            if target not in expected or "." not in target:
                raise ValueError(
                    f"the checkpoint holds int8 rows with scales for {rows_key}, which loads into no weight "
                    f"of {type(model).__name__}: load it into the architecture that saved it"
                )
            names[target.rsplit(".", 1)[0]] = headers[key][2]
    return names


class QuantizeOnLoad(ConversionOps):
    """Rounds each full-precision weight of an int8 parameter to nearest as it is read
    (the quantizer's ``get_quantize_ops``)."""

    def __init__(self, hf_quantizer: Any) -> None:
        self.hf_quantizer = hf_quantizer

    def convert(self, input_dict: dict[str, Any], model: nn.Module | None = None, **kwargs: Any) -> dict[str, Any]:
        out = {}
        for key, values in input_dict.items():
            value = values[0] if isinstance(values, list) else values
            module, name = get_module_from_name(model, key)
            target = module._parameters[name]  # the meta Int8Weight quantize_ put there
            if name in stored_transposed(module):  # GPT-2's [in, out] on disk, [out, in] int8; experts likewise
                value = in_other_layout(value, module, name)
            rows = Int8Weight.from_float(value.to(target.dtype), compiled=target.compiled)
            out[key] = target.with_tensors(rows.int_data, rows.scale)  # the target's metadata
        return out


class _OnRows(ConversionOps):
    """A conversion op of an int8 parameter, given each int8 tensor (rows flat per leading
    index, ``[*lead, n * row_len]``) as its rows ``[*lead, n, row_len]`` and flattening
    the int8 tensors it returns again; scales and full-precision weights as they are."""

    def __init__(self, op: ConversionOps, row_len: int) -> None:
        self.op, self.row_len = op, row_len
        self.supports_many_to_many = op.supports_many_to_many

    def __repr__(self) -> str:
        return repr(self.op)

    def _each(self, value: Any, change: Any) -> Any:
        if isinstance(value, (list, tuple)):
            return [self._each(v, change) for v in value]
        return change(value) if isinstance(value, torch.Tensor) and value.dtype == torch.int8 else value

    def convert(self, input_dict: dict[str, Any], **kwargs: Any) -> dict[str, Any]:
        rows = {k: self._each(v, lambda t: t.unflatten(-1, (-1, self.row_len))) for k, v in input_dict.items()}
        return {k: self._each(v, lambda t: t.flatten(-2)) for k, v in self.op.convert(rows, **kwargs).items()}

    @property
    def reverse_op(self) -> ConversionOps:
        return _OnRows(self.op.reverse_op, self.row_len)


class _Int8AsIs(ConversionOps):
    """A ``Transpose`` that transformers applies only to a checkpoint of the other shape
    (``check_dims``): int8 rows, which fsdp_int8 writes in the model's own order, pass as
    they are (every tensor, for the copy converting their scales)."""

    def __init__(self, op: ConversionOps, every_tensor: bool = False) -> None:
        self.op, self.every_tensor = op, every_tensor

    def __repr__(self) -> str:
        return repr(self.op)

    def convert(self, input_dict: dict[str, Any], source_patterns: list[str], target_patterns: list[str],
                **kwargs: Any) -> dict[str, Any]:
        value = next(iter(input_dict.values()))
        tensor = value[0] if isinstance(value, list) else value
        if self.every_tensor or tensor.dtype == torch.int8:
            return {self.op.get_target_pattern(input_dict, source_patterns, target_patterns): tensor}
        return self.op.convert(input_dict, source_patterns=source_patterns, target_patterns=target_patterns, **kwargs)

    @property
    def reverse_op(self) -> ConversionOps:
        return _Int8AsIs(self.op.reverse_op, self.every_tensor)


def _on_int8(op: Any, dims: int, row_len: int, loading: bool) -> ConversionOps | None:
    """``op`` of a converter into ``dims``-D int8 parameters with rows of ``row_len``,
    made to act on their rows (:class:`_OnRows`, :class:`_Int8AsIs`), or ``None`` if it
    would move int8 values across rows: anything but stacking or splitting along the experts
    (dim 0), concatenating, chunking, splitting or interleaving along a dimension before the
    input features (Ernie-VL's fused text and vision experts: both), permuting a 2-D weight's
    rows for RoPE, or a ``check_dims`` transpose."""
    from transformers.core_model_loading import (
        Chunk, Concatenate, ErnieFuseAndSplitTextVisionExperts, ErnieSplitAndDecoupleTextVisionExperts, Interleave,
        MergeModulelist, PermuteForRope, Split, SplitModulelist, Transpose,
    )

    if isinstance(op, (_OnRows, _Int8AsIs)):
        return op
    dim = getattr(op, "dim", None)
    if isinstance(op, Transpose) and op.check_dims:
        return _Int8AsIs(op)
    if isinstance(op, Split) and loading:
        return op  # sized by the (flat) int8 parameters it loads into: it splits the flat rows right
    if isinstance(op, (MergeModulelist, SplitModulelist)):
        return _OnRows(op, row_len) if dim == 0 else None
    if isinstance(op, (ErnieFuseAndSplitTextVisionExperts, ErnieSplitAndDecoupleTextVisionExperts)):
        return _OnRows(op, row_len) if op.stack_dim == 0 and 0 <= op.concat_dim <= dims - 2 else None
    if isinstance(op, (Chunk, Concatenate, Split, Interleave)):
        return _OnRows(op, row_len) if isinstance(dim, int) and 0 <= dim <= dims - 2 else None
    return _OnRows(op, row_len) if isinstance(op, PermuteForRope) and dims == 2 else None


def _reversed(transform: Any) -> Any:
    """The transform that ``save_pretrained`` applies for ``transform`` (``None``: none)."""
    try:
        return transform.reverse_transform()
    except Exception:  # noqa: BLE001 (an op without a reverse: transformers cannot save it either)
        return None


def int8_conversions(
    conversions: list[Any], int8: dict[str, tuple[int, ...]], *, model_name: str, loading: bool
) -> list[Any]:
    """``conversions`` (transformers' weight conversions of a model, in loading direction)
    made to carry the int8 parameters ``int8`` (name -> shape ``[*lead, out, in]``) with
    their ``<name>_scale`` entries: a converter into int8 parameters acts on their rows
    (:func:`_on_int8`) and, where its patterns leave the scales alone, is followed by a copy
    for them; so is a renaming of an int8 parameter's full name.

    Raises:
        ValueError: (not ``loading``) a converter into an int8 parameter that would move int8
            values across rows; loading, such a converter is left as it is (it loads only
            checkpoints that hold no int8 rows for it).
    """
    from transformers.core_model_loading import WeightConverter, WeightRenaming

    known = {(type(t), tuple(t._original_source_patterns), tuple(t._original_target_patterns)) for t in conversions}
    out = []
    for transform in conversions:
        back = _reversed(transform)
        hit = [n for n in int8 if back is not None and back._scoped_match(n) is not None]
        copy = None
        if hit and isinstance(transform, WeightConverter):
            sources, targets = transform._original_source_patterns, transform._original_target_patterns
            shapes = {(len(int8[n]), int8[n][-1]) for n in hit}
            ops = [_on_int8(op, *next(iter(shapes)), loading) for op in transform.operations]
            if len(shapes) > 1 or None in ops:
                if loading:
                    out.append(transform)
                    continue
                raise ValueError(
                    f"cannot save int8 {hit[0]} in {model_name}'s checkpoint layout: transformers converts "
                    f"{sources} into it with {transform.operations}, which fsdp_int8's int8 rows and scales do "
                    "not follow. Save the model's own layout, model.save_pretrained(path, save_original_format=False) "
                    "(from_pretrained loads it), or full precision: "
                    "model.save_pretrained(path, state_dict=fsdp_int8.export_full_state_dict(model))"
                )
            transform = transform.copy(sources, targets, operations=ops)
            if all(back._scoped_match(n + SCALE_SUFFIX) is None for n in hit):
                copy = transform.copy(
                    [s + SCALE_SUFFIX for s in sources], [t + SCALE_SUFFIX for t in targets],
                    operations=[_Int8AsIs(op.op, True) if isinstance(op, _Int8AsIs) else op for op in ops],
                )
        elif (hit and type(transform) is WeightRenaming
              and all(back._scoped_match(n + SCALE_SUFFIX) is None for n in hit)):
            copy = transform.copy([s + SCALE_SUFFIX for s in transform._original_source_patterns],
                                  [t + SCALE_SUFFIX for t in transform._original_target_patterns])
            back_copy = _reversed(copy)
            if back_copy is None or any(
                back_copy.rename_source_key(n + SCALE_SUFFIX)[0] != back.rename_source_key(n)[0] + SCALE_SUFFIX
                for n in hit
            ):
                copy = None  # not a rename of the name's end: the check of the pairs refuses what it leaves apart
        out.append(transform)
        if copy is not None:
            key = (type(copy), tuple(copy._original_source_patterns), tuple(copy._original_target_patterns))
            if key not in known:
                known.add(key)
                out.append(copy)
    return out


def add_scale_conversions(model: nn.Module, state: dict[str, Any]) -> None:
    """Make ``save_pretrained`` convert the int8 rows and scales of ``state`` (what it
    writes, :func:`~._hf_layout.int8_safetensors_state_dict`) together, as transformers
    loads them (:func:`int8_conversions`), and check that they still pair up after the
    conversions (run on meta tensors) before anything is written. ``save_pretrained``
    reverts ``model._weight_conversions`` (set by ``from_pretrained``), else the model's
    mapping without its prefix changes: the conversions go there. A model without
    conversions of int8 parameters is left as it is.

    Raises:
        ValueError: a converter into an int8 parameter that would move int8 values across
            rows, or conversions that would part int8 rows from their scales; the message
            names the entry and the layouts that save it.
    """
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import PrefixChange, revert_weight_conversion

    conversions = getattr(model, "_weight_conversions", None)
    if conversions is None:
        mapping = get_model_conversion_mapping(model, add_legacy=False)
        conversions = [t for t in mapping if not isinstance(t, PrefixChange)]
    int8 = {name: tuple(p.shape) for name, p in model.named_parameters() if isinstance(local_shard(p), Int8Weight)}
    if not conversions or not int8:
        return
    name = type(model).__name__
    converted = int8_conversions(conversions, int8, model_name=name, loading=False)
    if any(a is not b for a, b in zip(converted, conversions)) or len(converted) != len(conversions):
        model._weight_conversions = converted
    meta = {k: torch.empty(v.shape, dtype=v.dtype, device="meta") for k, v in state.items()
            if isinstance(v, torch.Tensor)}
    fix = ("Save the model's own layout, model.save_pretrained(path, save_original_format=False) (from_pretrained "
           "loads it), or full precision: "
           "model.save_pretrained(path, state_dict=fsdp_int8.export_full_state_dict(model))")
    try:
        problems = unpaired(headers_of(revert_weight_conversion(model, meta)))
    except Exception as error:  # noqa: BLE001 (refused here, before anything is written)
        raise ValueError(
            f"cannot save int8 {name} in its checkpoint layout: transformers' weight conversions fail on (meta "
            f"copies of) the entries it would write: {error!r}. {fix}"
        ) from error
    before = unpaired(headers_of(meta))
    for key, problem in [p for p in problems if p not in before][:1]:
        raise ValueError(
            f"cannot save int8 {key} in {name}'s checkpoint layout: after transformers' weight conversions "
            f"{problem}. {fix}"
        )


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
    headers = read_headers([str(f) for f in files])
    return {entry: headers.get(entry, (None, None, None))[2] for entry in entries}
