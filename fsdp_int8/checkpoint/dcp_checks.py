"""``check_int8_entries``: a dcp folder's int8 weights checked before a load writes them in place."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from fsdp_int8._weight.load_checks import Int8LoadError
from fsdp_int8.checkpoint import _dcp
from fsdp_int8.checkpoint.errors import listing

__all__ = ["check_int8_entries"]


def check_int8_entries(checkpoint_id: str | os.PathLike, state_dict: dict[str, Any]) -> None:
    """Check the int8 weights a dcp folder holds for ``state_dict`` before loading it in place.

    ``dcp.load(state_dict, checkpoint_id=...)`` writes into the tensors it is given, the
    model's own when they come from ``get_model_state_dict`` or a framework's checkpointer
    (torchtitan's ``Int8CheckpointManager`` calls this first): a bad entry found after it
    would already be written. This reads the folder's entries for ``state_dict``'s int8
    weights into copies (this rank's shards: once more than the load reads them) and
    checks them as every other load path does (scales finite and >= 0, values in
    -127..127).

    Call on every rank with the same keys: it is collective, and every rank raises when
    any rank's shard is refused. Entries the folder does not hold are left to the load.

    Args:
        checkpoint_id: The dcp folder, as given to ``dcp.load``.
        state_dict: The state dict the load will write into; the entries of its int8
            weights are checked.

    Raises:
        Int8LoadError: naming each refused entry (with its rank), the folder and the fix.
    """
    path = Path(checkpoint_id)
    refused = _dcp.refused_int8_entries_in(path, state_dict)
    if refused:
        raise Int8LoadError(f"checkpoint {path} holds invalid int8 weights, nothing was loaded: {listing(refused)}")
