"""Which scenario functions each world size's spawn runs, in which order."""

from __future__ import annotations

import dataclasses
from typing import Sequence

from fsdp_int8.testing._spec import OP_SCENARIOS


@dataclasses.dataclass(frozen=True)
class Step:
    """One scenario function run in every rank of a spawn; it reports ``keys``.

    ``function`` names an entry of ``_rank.FUNCTIONS``; a step travels to the ranks
    pickled, so it carries names, not callables.
    """

    function: str
    keys: tuple[str, ...]
    kwargs: dict = dataclasses.field(default_factory=dict)


def plan(
    world_size: int, *, first_multi: bool, selected: set[str], dcp_from: str | None,
    dcp_to: str, dcp_world_sizes: int,
) -> list[Step]:
    """The steps of one world size's spawn, cheapest and safest first; the deliberate
    rank-asymmetric failure last (it ends the spawn)."""
    ops = tuple(k for k in OP_SCENARIOS if k in selected)
    candidates = [Step("ops", ops, {"only": ops})] if ops else []
    if world_size == 1:
        candidates.append(Step("parity", ("world_size_1",), {"kind": "world_size_1"}))
    else:
        candidates += [
            Step("wire_bytes", ("wire_bytes",)),
            Step("parity", ("parity_reshard",), {"kind": "reshard"}),
            Step("parity", ("parity_no_reshard",), {"kind": "no_reshard"}),
        ]
        if first_multi:
            candidates += [
                Step("bf16_mixed_precision", ("bf16_mixed_precision",)),
                Step("meta_init", ("meta_init",)),
            ]
        if world_size >= 4 and world_size % 2 == 0:
            candidates.append(Step("parity", ("hsdp",), {"kind": "hsdp"}))
        candidates += [
            Step("parity", ("uneven_shards",), {"kind": "uneven"}),
            Step("parity", ("empty_shards",), {"kind": "empty"}),
        ]
    if dcp_world_sizes >= 2:
        candidates.append(Step("dcp", ("dcp_reshard",), {"load_from": dcp_from, "save_to": dcp_to}))
    if world_size >= 2 and first_multi:
        candidates.append(Step("asymmetric_failure", ("asymmetric_failure",)))
    return [s for s in candidates if set(s.keys) & selected]


def not_planned_reason(key: str, world_sizes: Sequence[int]) -> str:
    """Why no world size in ``world_sizes`` runs scenario ``key``."""
    sizes = tuple(world_sizes)
    if key == "world_size_1":
        return f"world size 1 is not in world_sizes={sizes}"
    if key == "hsdp":
        return f"needs an even world size >= 4 for a 2-D mesh; world_sizes={sizes}"
    if key == "dcp_reshard":
        return f"needs two world sizes (save at one, load at the other); world_sizes={sizes}"
    return f"needs a world size >= 2; world_sizes={sizes}"
