"""Checkpoints of (sharded) int8 models: bit-exact, reshardable, atomic, verified, resumable.

A save writes a temporary directory and renames it into place only once every rank has
finished and the manifest is on disk, so a process killed mid-save leaves the previous
checkpoint as ``latest``. A load checks and reads everything into copies before it
changes the model, optimizer or generators: one that fails changes nothing. The layout on
disk, atomicity and resume rules: docs/checkpoints.md. :func:`save_checkpoint`,
:func:`load_checkpoint` and :func:`export_full_state_dict` are also top-level names.

Modules: :mod:`.save` and :mod:`.load` (the public functions), :mod:`.export` (plain
full-precision state dicts), :mod:`.dcp_checks` (int8 entries of a dcp folder checked
before an in-place load), :mod:`.errors`; privately ``_files`` (the layout, atomic
writes, the manifest, pruning by write order), ``_dcp`` (what goes through
torch.distributed.checkpoint, and :class:`CpuCopyStager`), ``_fit`` (does a checkpoint
fit the model and optimizer) and ``_generator_states`` (:func:`capture_generators` and
:func:`restore_generators`, which every integration's checkpoints use too).
"""

from fsdp_int8.checkpoint.errors import CheckpointError
from fsdp_int8.checkpoint._dcp import CpuCopyStager
from fsdp_int8.checkpoint._generator_states import capture_generators, restore_generators
from fsdp_int8.checkpoint.export import export_full_state_dict, load_full_state_dict
from fsdp_int8.checkpoint.dcp_checks import check_int8_entries
from fsdp_int8.checkpoint.load import CheckpointInfo, latest_checkpoint, load_checkpoint
from fsdp_int8.checkpoint.save import save_checkpoint

__all__ = [
    "CheckpointError",
    "CheckpointInfo",
    "save_checkpoint",
    "load_checkpoint",
    "latest_checkpoint",
    "check_int8_entries",
    "export_full_state_dict",
    "load_full_state_dict",
    "capture_generators",
    "restore_generators",
    "CpuCopyStager",
]
