"""Optional adapters for training frameworks.

Each submodule imports its framework at import time, so none is imported from here (nor
from ``import fsdp_int8``): import the one you need, e.g.
``from fsdp_int8.integrations.torchtitan import Int8LinearConverter``.
"""
