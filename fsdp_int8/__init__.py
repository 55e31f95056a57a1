"""fsdp_int8: INT8 quantized training for PyTorch FSDP2.

Linear weights live as int8 with one fp32 absmax scale per output row; optimizer updates
are written back with stochastic rounding; FSDP2 all-gathers the int8 bytes.
"""

import torch

from fsdp_int8._reduce_scatter import QuantizedReduceScatter, enable_quantized_reduce_scatter
from fsdp_int8.checkpoint import (
    CheckpointError,
    CheckpointInfo,
    export_full_state_dict,
    latest_checkpoint,
    load_checkpoint,
    load_full_state_dict,
    save_checkpoint,
)
from fsdp_int8.comm import CollectiveCounter, CollectiveRecord, count_collectives
from fsdp_int8.config import Int8MatmulConfig, Int8TrainingConfig
from fsdp_int8.convert import init_int8_weights_, quantize_
from fsdp_int8.fsdp import find_blocks, shard_model
from fsdp_int8.linear import int8_weight_linear
from fsdp_int8.memory import PersistentBytes, persistent_bytes
from fsdp_int8.optim import Int8AdamW, Int8SGD
from fsdp_int8.weight import Int8Weight, _rebuild_int8_weight

__version__ = "0.1.0"

__all__ = [
    "Int8TrainingConfig",
    "Int8MatmulConfig",
    "Int8Weight",
    "quantize_",
    "init_int8_weights_",
    "shard_model",
    "find_blocks",
    "save_checkpoint",
    "load_checkpoint",
    "latest_checkpoint",
    "export_full_state_dict",
    "load_full_state_dict",
    "CheckpointError",
    "CheckpointInfo",
    "enable_quantized_reduce_scatter",
    "QuantizedReduceScatter",
    "count_collectives",
    "CollectiveCounter",
    "CollectiveRecord",
    "int8_weight_linear",
    "Int8AdamW",
    "Int8SGD",
    "PersistentBytes",
    "persistent_bytes",
    "__version__",
]

# torch.load(weights_only=True) rebuilds Int8Weights through these two names only.
torch.serialization.add_safe_globals([Int8Weight, _rebuild_int8_weight])

