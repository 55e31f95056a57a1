"""Optional helpers for frameworks; each submodule imports its framework, this package none.

``import fsdp_int8`` never imports them: import the one you need, e.g.
``from fsdp_int8.integrations.hf import Int8Trainer``.
"""
