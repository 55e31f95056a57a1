"""transformers knows the ``fsdp_int8`` quantization method from ``import fsdp_int8`` on.

``from_pretrained`` of an int8 folder looks its ``quant_method`` up in two dicts of
``transformers.quantizers.auto``. Importing transformers (1-2 s) at ``import fsdp_int8``
would tax every process that never loads a folder, and importing
:mod:`fsdp_int8.integrations.hf_quantizer` while transformers is still importing itself
would meet half-initialised modules. So only placeholders go in, the moment
``transformers.quantizers.auto`` exists (at once if it is imported already, else right
after its own import finishes, through a one-shot import hook). The first use of a
placeholder (transformers instantiating the config or the quantizer, well after its
imports) imports ``hf_quantizer``, which registers the real classes over them.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import sys
from types import ModuleType
from typing import Any

from fsdp_int8.integrations._hf_layout import QUANT_METHOD

_AUTO = "transformers.quantizers.auto"
# map in transformers.quantizers.auto -> the class of hf_quantizer it holds for the method
_ENTRIES = {
    "AUTO_QUANTIZATION_CONFIG_MAPPING": "Int8TrainingHfConfig",
    "AUTO_QUANTIZER_MAPPING": "Int8TrainingHfQuantizer",
}


class PendingClass:
    """Holds a class of :mod:`fsdp_int8.integrations.hf_quantizer` in a transformers map
    until transformers first uses it; then imports the module and passes the call on."""

    # hf_quantizer replaces an entry of this class by its own (a class attribute, so that
    # reading it resolves nothing)
    stands_in_for_fsdp_int8 = True

    def __init__(self, class_name: str) -> None:
        self._class_name = class_name

    def resolve(self) -> type:
        from fsdp_int8.integrations import hf_quantizer  # registers the real classes

        return getattr(hf_quantizer, self._class_name)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.resolve()(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):  # copy, pickle and introspection probes: no import
            raise AttributeError(name)
        return getattr(self.resolve(), name)

    def __repr__(self) -> str:
        return f"<fsdp_int8.integrations.hf_quantizer.{self._class_name}, imported on first use>"


def _add_placeholders(auto: ModuleType) -> None:
    for map_name, class_name in _ENTRIES.items():
        getattr(auto, map_name).setdefault(QUANT_METHOD, PendingClass(class_name))


class _AfterAutoImport(importlib.abc.MetaPathFinder):
    """Adds the placeholders right after ``transformers.quantizers.auto`` executes, then
    leaves ``sys.meta_path``."""

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if fullname != _AUTO:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(fullname)  # what the remaining finders say
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        execute = spec.loader.exec_module

        def exec_module(module: ModuleType) -> None:
            execute(module)
            _add_placeholders(module)

        spec.loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


def register_on_import() -> None:
    """Make the method known to transformers in this process, without importing it."""
    auto = sys.modules.get(_AUTO)
    if auto is not None:
        _add_placeholders(auto)
    elif importlib.util.find_spec("transformers") is not None and not any(
        isinstance(finder, _AfterAutoImport) for finder in sys.meta_path
    ):
        sys.meta_path.insert(0, _AfterAutoImport())
