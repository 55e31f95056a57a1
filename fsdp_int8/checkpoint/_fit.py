"""Does a checkpoint fit a model and its optimizer? Entry by entry, both ways, from the
checkpoint's index alone (nothing is read or changed): which entries to read, which of
ours it lacks, which of its entries nothing here takes, and which shapes disagree."""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from fsdp_int8.checkpoint.errors import CheckpointError, listing

STATE = "optimizer.state."  # + "<fqn>.<name>"
GROUPS = "optimizer.param_groups."  # + "<index>.<name>"


@dataclass
class Fit:
    """The outcome of comparing entries. ``read`` holds keys as dcp stores them; the others
    name model entries by their state-dict key and optimizer entries by their stored key
    (``optimizer.state.<fqn>.<name>``)."""

    read: list[str] = field(default_factory=list)  # in both, same shape: to read
    missing: list[str] = field(default_factory=list)  # ours, not in the checkpoint
    unexpected: list[str] = field(default_factory=list)  # the checkpoint's, not ours
    mismatched: list[str] = field(default_factory=list)  # in both, other shapes: a sentence each
    notes: list[str] = field(default_factory=list)  # why entries are missing or unexpected

    def add(self, other: "Fit") -> None:
        """Append ``other``'s entries to this one's."""
        for name in ("read", "missing", "unexpected", "mismatched", "notes"):
            getattr(self, name).extend(getattr(other, name))


def _shape_problem(key: str, meta: Any, value: Any, ours: str) -> str | None:
    if isinstance(value, torch.Tensor) and hasattr(meta, "size") and tuple(meta.size) != tuple(value.shape):
        return f"{key}: checkpoint has shape {tuple(meta.size)}, {ours} {tuple(value.shape)}"
    return None


def model_prefix(stored: dict[str, Any], model_keys: list[str], has_manifest: bool) -> str:
    """``"model."`` for our layout; ``""`` for ``dcp.save(get_model_state_dict(model))``.

    Without a manifest, whichever reading finds more of the model's keys: a model whose
    own keys start with ``model.`` (Hugging Face's) is not mistaken for our layout.
    """
    if has_manifest:
        return "model."
    ours = sum(f"model.{key}" in stored for key in model_keys)
    plain = sum(key in stored for key in model_keys)
    return "model." if ours > plain else ""


def model_fit(stored: dict[str, Any], model_state: dict[str, Any], prefix: str) -> Fit:
    """The model's tensor entries against the checkpoint's model entries, both ways."""
    fit = Fit()
    ours = {key for key, value in model_state.items() if isinstance(value, torch.Tensor)}
    for key in sorted(ours):
        meta = stored.get(prefix + key)
        if meta is None:
            fit.missing.append(key)
        elif problem := _shape_problem(key, meta, model_state[key], "model"):
            fit.mismatched.append(problem)
        else:
            fit.read.append(prefix + key)
    theirs = [k[len(prefix):] for k in stored if k.startswith(prefix)]
    fit.unexpected = sorted(k for k in theirs if k not in ours)
    return fit


def _names_by_param(keys: Any) -> dict[str, set[str]]:
    """``{fqn: {state names}}`` from ``optimizer.state.<fqn>.<name>`` keys."""
    by_param: dict[str, set[str]] = {}
    for key in keys:
        if key.startswith(STATE):
            fqn, name = key[len(STATE):].rsplit(".", 1)
            by_param.setdefault(fqn, set()).add(name)
    return by_param


def optimizer_fit(stored: dict[str, Any], ours: dict[str, Any], params: set[str]) -> Fit:
    """The optimizer's state entries (flat, ``ours``) against the checkpoint's, for the
    parameters ``params`` whose weights are read. A parameter's state is read whole or
    not at all: the checkpoint must hold exactly the state names this optimizer keeps
    (another optimizer, or other settings such as ``state_bits``, keep others)."""
    fit = Fit()
    needed, saved = _names_by_param(ours), _names_by_param(stored)
    if saved and not needed:
        fit.notes.append(
            "this optimizer has no state to load into (never stepped, but its parameters hold "
            "gradients, so torch did not create it): call optimizer.zero_grad(set_to_none=True) first"
        )
    for fqn in sorted(needed.keys() | saved.keys()):
        keys_needed = sorted(f"{STATE}{fqn}.{name}" for name in needed.get(fqn, ()))
        keys_saved = sorted(f"{STATE}{fqn}.{name}" for name in saved.get(fqn, ()))
        if fqn in params and needed.get(fqn) == saved.get(fqn):
            for key in keys_needed:
                if problem := _shape_problem(key, stored[key], ours[key], "optimizer"):
                    fit.mismatched.append(problem)
                else:
                    fit.read.append(key)
            continue
        fit.missing += [k for k in keys_needed if k not in stored]
        fit.unexpected += [k for k in keys_saved if k not in ours]
        if fqn in params and needed.get(fqn) and saved.get(fqn):
            fit.notes.append(
                f"optimizer state of {fqn}: the checkpoint holds {sorted(saved[fqn])}, this "
                f"optimizer keeps {sorted(needed[fqn])} (saved by another optimizer, or with "
                "other settings such as Int8AdamW's state_bits)"
            )
    return fit


def stored_groups(stored: dict[str, Any]) -> dict[int, list[str]]:
    """The checkpoint's optimizer parameter groups: ``{index: [its keys]}``."""
    groups: dict[int, list[str]] = {}
    for key in stored:
        if key.startswith(GROUPS):
            index, name = key[len(GROUPS):].split(".", 1)
            groups.setdefault(int(index), []).append(name)
    return groups


# Integer module attributes that change what a model computes while leaving every tensor
# shape as it is: head counts and sizes (a [dim, dim] projection splits into 4 heads of 16
# or 8 of 8 alike), grouped-query repeats and routed experts per token. Matched against
# each attribute's name; a checkpoint records them and a load compares them.
_SHAPE_ATTRIBUTE_WORDS = ("head", "n_rep", "key_value_groups", "kv_groups", "top_k", "experts_per_tok")


def shape_attributes(model: torch.nn.Module) -> dict[str, int]:
    """``{"<module>.<attribute>": value}`` for the integer attributes of ``model``'s
    modules that say how its tensors are split (heads, top-k): what the tensor shapes of a
    checkpoint cannot show."""
    found = {}
    for name, module in model.named_modules():
        for attribute, value in vars(module).items():
            if type(value) is int and not attribute.startswith("_") and any(
                word in attribute for word in _SHAPE_ATTRIBUTE_WORDS
            ):
                found[f"{name}.{attribute}" if name else attribute] = value
    return found


def refuse_other_splits(path: Path, saved: dict[str, int], model: torch.nn.Module, strict: bool) -> None:
    """Refuse (``strict``) or warn about a model whose :func:`shape_attributes` differ from
    those checkpoint ``path``'s manifest records (``saved``): the tensors' shapes fit
    either way, so only the manifest can tell. Attributes only one side has are skipped."""
    ours = shape_attributes(model)
    problems = [f"{key}: {saved[key]} in the checkpoint, {ours[key]} in this model"
                for key in sorted(saved.keys() & ours.keys()) if saved[key] != ours[key]]
    if not problems:
        return
    text = (f"checkpoint {path} was saved by a model that splits its tensors otherwise (same shapes, "
            f"other heads or top-k): {listing(problems)}")
    if strict:
        raise CheckpointError(text + ". Build the model as it was saved (strict=False loads it anyway, with a warning)")
    warnings.warn(text + "; loaded anyway (strict=False)", stacklevel=3)
