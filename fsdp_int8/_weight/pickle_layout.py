"""What a pickled ``Int8Weight`` holds (``torch.save`` of a weight or a whole model).

Layout 4, written: ``(int_data, scale, dtype, fields, requires_grad, is_param)``, where
``fields`` maps the weight's metadata (``Int8WeightMeta``) to plain values by name, an
``Int8MatmulConfig`` as a dict, the tensor-parallel placement left out (it is this
process's, not the weight's); ``unsharded_rows`` under the key ``full_rows``, as every
layout 4 pickle holds it. Layouts 1 to 3, read
(fsdp_int8 0.1.0 wrote them): positional, ``(int_data, scale, dtype, row_len, full_rows,
stochastic, requires_grad[,
is_param[, int8_matmul[, compiled]]])``, the matmul config as its first 3 fields plus the
compiled flag (1), its first 3 fields (2) or a dict (3). A matmul config without any int8
GEMM (how earlier layouts said "keep the gathered weight int8") reads as ``int8_matmul=None``
with ``int8_gathered_weights=True``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from fsdp_int8.config import Int8MatmulConfig

__all__ = ["pickled_fields", "read", "recorded_int8_matmul"]

_PICKLED_ROWS = "full_rows"  # the key of Int8WeightMeta.unsharded_rows in a pickle


def recorded_int8_matmul(value: Any) -> tuple[Int8MatmulConfig | None, bool]:
    """A recorded int8 matmul choice (``Int8MatmulConfig``, its fields as a dict, or ``None``)
    as ``(int8_matmul, int8_gathered_weights)``; files' all-GEMMs-off config reads as
    ``(None, True)``. Only files go through this: such a config given in code is refused."""
    if value is None:
        return None, False
    if isinstance(value, Int8MatmulConfig):  # unpickled: its fields as the file held them
        value = {field.name: getattr(value, field.name) for field in dataclasses.fields(value) if hasattr(value, field.name)}
    flags = {name: bool(flag) for name, flag in dict(value).items()}
    if not (flags.get("output") or flags.get("grad_input") or flags.get("grad_weight")):
        return None, True
    return Int8MatmulConfig(**flags), False


def pickled_fields(fields: dict[str, Any], *, exclude: tuple[str, ...]) -> dict[str, Any]:
    """Layout 4's ``fields``: ``fields`` but ``exclude``, the matmul config as a dict."""
    out = {name: value for name, value in fields.items() if name not in exclude}
    out[_PICKLED_ROWS] = out.pop("unsharded_rows")
    if out.get("int8_matmul") is not None:
        out["int8_matmul"] = dataclasses.asdict(out["int8_matmul"])
    return out


def read(fields: Any, rest: tuple) -> tuple[dict[str, Any], bool, bool]:
    """``(constructor fields, requires_grad, is_param)`` of a pickle's arguments after
    ``dtype``: ``fields`` is layout 4's dict, or an older layout's ``row_len``."""
    if isinstance(fields, dict):
        requires_grad, is_param = rest
        fields = dict(fields)
        fields["unsharded_rows"] = fields.pop(_PICKLED_ROWS)
    else:
        unsharded_rows, stochastic, requires_grad, *more = rest
        is_param, int8_matmul, compiled = (*more, *(False, None, False)[len(more):])
        if isinstance(int8_matmul, (tuple, list)):
            *int8_matmul, compiled = int8_matmul if len(int8_matmul) == 4 else (*int8_matmul, compiled)
            int8_matmul = dict(zip(("output", "grad_input", "grad_weight"), int8_matmul))
        fields = dict(row_len=fields, unsharded_rows=unsharded_rows, stochastic_rounding=stochastic,
                      int8_matmul=int8_matmul, compiled=bool(compiled))
    fields["int8_matmul"], gathered = recorded_int8_matmul(fields.get("int8_matmul"))
    fields["int8_gathered_weights"] = fields.get("int8_gathered_weights", False) or gathered
    return fields, bool(requires_grad), bool(is_param)
