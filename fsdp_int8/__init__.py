"""fsdp_int8: INT8 quantized training for PyTorch FSDP2.

Linear weights live as int8 with one fp32 absmax scale per output row; optimizer updates
are written back with stochastic rounding; FSDP2 all-gathers the int8 bytes.

The names below are what training needs: configure, quantize or shard, optimize, save
and load (docs/api.md says why these). Everything else public lives in a subpackage
with its own ``__all__``: :mod:`fsdp_int8.checkpoint` (latest checkpoint, full state
dicts, errors), :mod:`fsdp_int8.sharding` (block discovery), :mod:`fsdp_int8.gradients`
(the int8 gradient reduce-scatter), :mod:`fsdp_int8.guard` (the finite-gradient check),
:mod:`fsdp_int8.collectives` and :mod:`fsdp_int8.memory` (measuring bytes),
:mod:`fsdp_int8.hardware` (which kernels are fast here), :mod:`fsdp_int8.quant` (the
quantizer), :mod:`fsdp_int8.testing` and :mod:`fsdp_int8.integrations`. Modules whose
name starts with ``_`` are internal.
"""

# The op table, F.linear and F.embedding register themselves when imported: importing the
# package loads the whole table (so Int8Weight.supported_ops() is complete).
import fsdp_int8._weight.embedding  # noqa: F401  (registration side effects)
import fsdp_int8._weight.linear  # noqa: F401
import fsdp_int8._weight.ops  # noqa: F401
from fsdp_int8 import integrations  # noqa: F401  (quantize_'s hook for transformers models; imports no framework)
from fsdp_int8._version import __version__
from fsdp_int8.checkpoint import export_full_state_dict, load_checkpoint, save_checkpoint
from fsdp_int8.config import Int8MatmulConfig, Int8TrainingConfig
from fsdp_int8.convert import init_int8_weights_, quantize_
from fsdp_int8.optim import Int8AdamW, Int8SGD
from fsdp_int8.sharding import shard_model
from fsdp_int8.weight import Int8Weight

__all__ = [
    # configuration
    "Int8TrainingConfig",
    "Int8MatmulConfig",
    # the weight and model conversion
    "Int8Weight",
    "quantize_",
    "init_int8_weights_",
    "shard_model",
    # optimizers
    "Int8AdamW",
    "Int8SGD",
    # checkpoints
    "save_checkpoint",
    "load_checkpoint",
    "export_full_state_dict",
    "__version__",
]
