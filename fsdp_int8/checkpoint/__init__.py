"""Checkpoints of (sharded) int8 models: bit-exact, reshardable, atomic, verified, resumable.

Layout of a checkpoint root (see docs/checkpoints.md)::

    root/
      latest                  name of the newest complete checkpoint (replaced atomically)
      step_00000100/          one complete checkpoint
        manifest.json         written last: step, write sequence, world size, mesh shape,
                              format, int8 keys, file sizes + sha256
        .metadata             torch.distributed.checkpoint's index
        __0_0.distcp ...      each rank's shards (int8 data + scales, optimizer states)
        rng/rank_00000.pt     each rank's stochastic-rounding and torch generator states
      .tmp-step_00000200-*/   a save in progress (or killed): never read, removed by the next save
      .old-step_00000100-*/   the old copy of a step being re-saved, until the new one is in place
                              (put back by the next save if a crash left the step without it)

A save writes everything into a temporary directory and renames it into place only when
every rank has finished and the manifest is on disk, so a process killed mid-save leaves
the previous checkpoint as ``latest``.

A load checks and reads everything into copies before it changes the model, optimizer
or generators: one that fails changes nothing.

Modules: :mod:`.save` and :mod:`.load` (the public functions), :mod:`.export` (plain
full-precision state dicts), :mod:`.dcp_checks` (int8 entries of a dcp folder checked
before an in-place load), :mod:`.errors`; privately ``_files`` (the layout, atomic
writes, the manifest, pruning by write order), ``_dcp`` (what goes through
torch.distributed.checkpoint), ``_fit`` (does a checkpoint fit the model and optimizer)
and ``_generator_states`` (the noise generators saved per rank and the layout rule for
restoring them: :func:`capture_generators` and :func:`restore_generators`, which every
integration's checkpoints use too). :class:`CpuCopyStager` stages int8 state dicts for
``dcp.async_save``, which its default stager cannot.
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
