"""fsdp_int8: INT8 quantized training for PyTorch FSDP2.

Linear weights live as int8 with one fp32 absmax scale per output row; optimizer updates
are written back with stochastic rounding; FSDP2 all-gathers the int8 bytes.

The public API is the names below; every other module is internal (the ``_``-prefixed
ones, and the internals of the public modules that are not re-exported here).
"""

# The op table and F.linear register themselves into Int8Weight when imported: importing
# the package loads the whole table (so Int8Weight.supported_ops() is complete).
from fsdp_int8 import _ops, linear  # noqa: F401  (registration side effects)
from fsdp_int8._version import __version__
from fsdp_int8.checkpoint import (
    CheckpointError,
    CheckpointInfo,
    export_full_state_dict,
    latest_checkpoint,
    load_checkpoint,
    load_full_state_dict,
    save_checkpoint,
)
from fsdp_int8.collectives import CollectiveCounter, CollectiveRecord, count_collectives
from fsdp_int8.config import Int8MatmulConfig, Int8TrainingConfig, ModuleFilter
from fsdp_int8.convert import init_int8_weights_, quantize_
from fsdp_int8.gradients import QuantizedReduceScatter, enable_quantized_reduce_scatter
from fsdp_int8.guard import NonFiniteGradientError, guard_finite_steps
from fsdp_int8.memory import PersistentBytes, persistent_bytes
from fsdp_int8.optim import Int8AdamW, Int8SGD
from fsdp_int8.sharding import BlockSpec, find_blocks, shard_model
from fsdp_int8.weight import Int8Weight


__all__ = [
    # configuration
    "Int8TrainingConfig",
    "Int8MatmulConfig",
    "ModuleFilter",
    # the weight and model conversion
    "Int8Weight",
    "quantize_",
    "init_int8_weights_",
    # sharding
    "shard_model",
    "find_blocks",
    "BlockSpec",
    # optimizers and memory
    "Int8AdamW",
    "Int8SGD",
    "guard_finite_steps",
    "NonFiniteGradientError",
    "PersistentBytes",
    "persistent_bytes",
    # checkpoints
    "save_checkpoint",
    "load_checkpoint",
    "latest_checkpoint",
    "export_full_state_dict",
    "load_full_state_dict",
    "CheckpointError",
    "CheckpointInfo",
    # communication
    "enable_quantized_reduce_scatter",
    "QuantizedReduceScatter",
    "count_collectives",
    "CollectiveCounter",
    "CollectiveRecord",
    "__version__",
]
