"""docs/reference.md is generated from the docstrings and current; each public name and
argument is described there; docs/api.md's table holds the top-level names.

The public modules are ``fsdp_int8`` and every child module or subpackage of ``fsdp_int8``
and of ``fsdp_int8.integrations`` whose name does not start with ``_`` (found by walking
the packages, so a new module is checked without editing this file).
"""

from __future__ import annotations

import importlib.util
import inspect
import re
from pathlib import Path

import pytest

import fsdp_int8

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("generate_reference", ROOT / "docs" / "generate_reference.py")
generator = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(generator)

MODULES = generator.public_modules()
PUBLIC = [(module, name) for module in MODULES for name in vars(module).get("__all__", ())]
DOCUMENTED = [
    (module, name, getattr(module, name))
    for module in MODULES
    for name in generator.placements(MODULES)[module.__name__]
]


def test_reference_page_is_generated_from_the_current_docstrings():
    page = generator.PAGE.read_text() if generator.PAGE.exists() else ""
    assert page == generator.generate(), "docs/reference.md is stale: run python docs/generate_reference.py"


@pytest.mark.parametrize("module", MODULES, ids=[m.__name__ for m in MODULES])
def test_public_module_declares_all(module):
    assert "__all__" in vars(module), (
        f"{module.__name__} is public (its name has no leading _) but has no __all__: "
        "declare its public names (__all__ = [] for none), or make it private"
    )


def test_a_name_exported_twice_is_one_object():
    objects: dict[str, set[int]] = {}
    for module, name in PUBLIC:
        objects.setdefault(name, set()).add(id(getattr(module, name)))
    clashes = [name for name, ids in objects.items() if len(ids) > 1]
    assert not clashes, f"different public objects share a name (the reference has one section per name): {clashes}"


def test_every_public_name_is_placed_once():
    placed = [name for _, name, _ in DOCUMENTED]
    assert sorted(placed) == sorted({name for _, name in PUBLIC}), "a public name has no section, or two"


def _parameters(obj: object) -> list[str]:
    """The parameters a caller passes: no ``self``/``cls``, no ``*args``/``**kwargs``."""
    try:
        signature = inspect.signature(obj)
    except (TypeError, ValueError):
        return []
    return [
        p.name for p in signature.parameters.values()
        if p.name not in ("self", "cls") and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
    ]


def _section_entries(doc: str, section: str) -> list[str]:
    """The ``name`` of each ``    name: text`` entry of a Google-style section."""
    match = re.search(rf"^{section}:\n((?:(?: .*)?\n)*)", doc + "\n", re.M)
    return re.findall(r"^    ([*\w]+)(?: \([^)]*\))?:", match.group(1), re.M) if match else []


def _own_constructor(cls: type) -> bool:
    """Whether this package defines ``cls``'s constructor (an inherited one, such as
    ``unittest.TestCase``'s, is described where it is defined)."""
    for klass in cls.__mro__:
        if "__init__" in vars(klass) or "__new__" in vars(klass):
            return klass.__module__.startswith("fsdp_int8")
    return False


def _callables() -> list[tuple[str, object]]:
    """Each public function, and each public class whose constructor this package defines."""
    return [
        (name, obj) for _, name, obj in DOCUMENTED
        if inspect.isfunction(obj) or (inspect.isclass(obj) and _own_constructor(obj))
    ]


@pytest.mark.parametrize("name, obj", _callables(), ids=[n for n, _ in _callables()])
def test_docstring_describes_each_argument_and_no_other(name, obj):
    doc = inspect.getdoc(obj) or ""
    assert doc.strip(), f"{name} has no docstring"
    described = _section_entries(doc, "Args") + _section_entries(doc, "Attributes")
    if inspect.isclass(obj) and not described:
        init_doc = inspect.getdoc(vars(obj).get("__init__")) if "__init__" in vars(obj) else ""
        described = _section_entries(init_doc or "", "Args")
    parameters = _parameters(obj)
    missing = [p for p in parameters if p not in described]
    assert not missing, f"{name}: its docstring's Args (or Attributes) does not describe {missing}"
    if inspect.isfunction(obj):  # a class's Attributes may describe more than its constructor takes
        taken = list(inspect.signature(obj).parameters)  # *args and **kwargs may be described too
        unknown = [d for d in _section_entries(doc, "Args") if d.lstrip("*") not in taken]
        assert not unknown, f"{name}: its docstring describes {unknown}, which it does not take"


def test_api_page_lists_exactly_the_top_level_names():
    text = (ROOT / "docs" / "api.md").read_text()
    listed = set(re.findall(r"\[`(\w+)`\]\(reference\.md#", text))
    assert listed == set(fsdp_int8.__all__), (
        f"docs/api.md's table of top-level names differs from fsdp_int8.__all__: "
        f"missing {set(fsdp_int8.__all__) - listed}, extra {listed - set(fsdp_int8.__all__)}"
    )


def test_reference_does_not_link_into_private_modules():
    page = generator.PAGE.read_text()
    private = sorted(set(re.findall(r"\]\([^)]*fsdp_int8/_(?!_)\w*", page)))
    assert not private, f"docs/reference.md links into private modules: {private}"


def test_google_sections_and_literal_blocks_become_markdown():
    doc = inspect.cleandoc(
        """Summary with :func:`~fsdp_int8.quant.absmax_quantize`.

        Run::

            y = f(x)

        Args:
            x: The input,
                over two lines.
            scale (float): Its scale.

        Raises:
            ValueError: when ``x`` is empty.
        """
    )
    assert generator.render_docstring(doc) == [
        "Summary with `absmax_quantize`.",
        "",
        "Run:",
        "",
        "```python",
        "y = f(x)",
        "```",
        "",
        "**Args:**",
        "",
        "- `x`: The input,",
        "  over two lines.",
        "- `scale (float)`: Its scale.",
        "",
        "**Raises:**",
        "",
        "- `ValueError`: when ``x`` is empty.",
    ]
