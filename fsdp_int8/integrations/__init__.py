"""Optional adapters for training frameworks.

Each submodule imports its framework, so none is imported from here (nor by
``import fsdp_int8``): import the one you need, e.g.
``from fsdp_int8.integrations.hf import Int8Trainer``,
``from fsdp_int8.integrations.torchtitan import Int8LinearConverter`` or
``from fsdp_int8.integrations.lightning import Int8RoundingCheckpoint``.
"""

__all__: list[str] = []  # the adapters are the submodules hf, lightning, torchtitan
