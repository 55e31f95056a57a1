"""Optional adapters for training frameworks.

The package exports nothing: each adapter is a submodule that imports its framework, so
none is imported from here (nor by ``import fsdp_int8``): import the one you need, e.g.
``from fsdp_int8.integrations.hf import Int8Trainer``,
``from fsdp_int8.integrations.torchtitan import Int8LinearConverter`` or
``from fsdp_int8.integrations.lightning import Int8RoundingCheckpoint``. Install the
pinned framework versions with ``pip install "fsdp_int8[hf]"`` (or ``[lightning]``,
``[torchtitan]``). What works with each framework, and why: docs/integrations.md; one
runnable script each in ``examples/``.

One adapter acts without being imported: a transformers model that
:func:`fsdp_int8.quantize_` (or ``shard_model``) quantizes gets fsdp_int8's Hugging Face
quantizer (:mod:`fsdp_int8.integrations.hf_quantizer`), so that ``save_pretrained``,
``Trainer`` checkpoints and ``from_pretrained`` keep the int8 rows and scales; and
``from_pretrained`` of an int8 folder finds the ``fsdp_int8`` method after ``import
fsdp_int8`` alone (:mod:`fsdp_int8.integrations._hf_method`). Only a model of a
transformers class, or transformers loading a folder of ours, imports the adapter.
"""

from __future__ import annotations

import sys

import torch.nn as nn

from fsdp_int8 import convert
from fsdp_int8.config import Int8TrainingConfig
from fsdp_int8.integrations import _hf_method

__all__: list[str] = []  # the adapters are the submodules hf, hf_quantizer, hf_loss, lightning, torchtitan


def _after_quantize(model: nn.Module, config: Int8TrainingConfig) -> None:
    """``quantize_``'s hook: a transformers model gets the int8 quantizer, and the chunked
    causal-LM loss where ``config.loss_chunk_tokens`` asks for it."""
    transformers = sys.modules.get("transformers")  # a transformers model means it is imported
    if transformers is None or not isinstance(model, transformers.PreTrainedModel):
        return
    from fsdp_int8.integrations import hf_loss, hf_quantizer

    hf_quantizer.attach_after_quantize(model, config)
    if config.loss_chunk_tokens is not None:
        hf_loss.use_chunked_loss(model, config.loss_chunk_tokens)


if _after_quantize not in convert.AFTER_QUANTIZE:
    convert.AFTER_QUANTIZE.append(_after_quantize)

_hf_method.register_on_import()
