"""docs/api.md documents every public name of every public module with the signature the code has.

The public modules are ``fsdp_int8`` and every child module or subpackage of ``fsdp_int8``
and of ``fsdp_int8.integrations`` whose name does not start with ``_``, found by walking
the packages (a new module is checked without editing this file). Each must declare an
``__all__``: those are the public names. (Deeper modules, such as the files of
``fsdp_int8.checkpoint``, are re-exported by their package, whose ``__all__`` is enough.)

docs/api.md has one ``## `` section per public module, its heading ending with the
module's name in backticks, and one ``### `name` `` section per public object, inside the
section of a module that exports it: a name that several modules export (the same object)
has one section. For a function or class, the first ``python`` block of that section
declares it, and its parameters (names, kinds, annotations, defaults) and return
annotation must match ``inspect.signature``; a dataclass's fields must match
``dataclasses.fields``. Methods and nested classes declared in a class block are checked
the same way, and so is every method with a section of its own (``#### `Class.method` ``).
Every documented name must be public, and the page must not send users into a private
(``_``) module.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib
import inspect
import pkgutil
import re
from pathlib import Path
from types import ModuleType

import pytest
import torch

import fsdp_int8
import fsdp_int8.integrations

API_MD = Path(__file__).resolve().parents[1] / "docs" / "api.md"


def _public_children(package: ModuleType) -> list[str]:
    return [
        f"{package.__name__}.{info.name}"
        for info in pkgutil.iter_modules(package.__path__)
        if not info.name.startswith("_")
    ]


MODULES: list[ModuleType] = [fsdp_int8] + [
    importlib.import_module(name)
    for name in sorted(_public_children(fsdp_int8) + _public_children(fsdp_int8.integrations))
]
PUBLIC: list[tuple[ModuleType, str]] = [
    (module, name) for module in MODULES for name in vars(module).get("__all__", ())
]
NAMES: list[str] = list(dict.fromkeys(name for _, name in PUBLIC))  # each name once, in module order


def _object(name: str) -> object:
    return getattr(next(module for module, n in PUBLIC if n == name), name)


def _exporters(name: str) -> list[str]:
    return [module.__name__ for module, n in PUBLIC if n == name]


# ---------------------------------------------------------------------------- the page
def _outline() -> list[tuple[int, str, str]]:
    """``(level, title, text)`` of each heading of docs/api.md in order; ``text`` runs to the
    next heading of any level. ``#`` lines inside code fences are not headings."""
    headings: list[tuple[int, str, list[str]]] = [(0, "", [])]
    fenced = False
    for line in API_MD.read_text().splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
        match = None if fenced else re.match(r"(#{1,6}) (.*)$", line)
        if match:
            headings.append((len(match.group(1)), match.group(2), []))
        else:
            headings[-1][2].append(line)
    return [(level, title, "\n".join(lines)) for level, title, lines in headings[1:]]


def _named(title: str) -> str | None:
    """``name`` of a heading ``` `name` ... ```, else ``None``."""
    match = re.match(r"`([^`]+)`", title)
    return match.group(1) if match else None


def _module_named(title: str) -> str | None:
    """The module a ``##`` heading ``... `fsdp_int8.x` `` documents, else ``None``."""
    match = re.search(r"`(fsdp_int8(?:\.\w+)*)`$", title)
    return match.group(1) if match else None


def _sections(level: int = 3) -> dict[str, str]:
    """``{name: text}`` of the ``` `name` ``` headings of ``level``."""
    return {_named(title): text for lvl, title, text in _outline() if lvl == level and _named(title)}


def _placements() -> dict[str, list[str | None]]:
    """For each ``### `name` `` heading, the module of each ``##`` section holding one."""
    module, found = None, {}
    for level, title, _ in _outline():
        if level <= 2:
            module = _module_named(title) if level == 2 else None
        elif level == 3 and _named(title):
            found.setdefault(_named(title), []).append(module)
    return found


def _python_block(section: str) -> ast.Module | None:
    """The section's first ``python`` block, parsed; a bare signature (a method's section
    shows no body) gets one."""
    match = re.search(r"```python\n(.*?)```", section, flags=re.S)
    if not match:
        return None
    source = match.group(1).rstrip()
    try:
        return ast.parse(source)
    except SyntaxError:  # a bare `def f(...) -> T`
        return ast.parse(source + ": ...")


# ---------------------------------------------------------------------------- comparing
def _namespace() -> dict:
    """What documented defaults are evaluated in: torch and every public name."""
    return {"torch": torch, "inf": float("inf"), **{name: _object(name) for name in NAMES}}


def _norm(annotation: object) -> str | None:
    """An annotation as normalised source text (the modules use postponed annotations)."""
    if annotation is inspect.Parameter.empty or annotation is None:
        return None
    text = annotation if isinstance(annotation, str) else inspect.formatannotation(annotation)
    node = ast.parse(text, mode="eval").body
    if isinstance(node, ast.Constant) and isinstance(node.value, str):  # a quoted forward reference
        node = ast.parse(node.value, mode="eval").body
    return ast.unparse(node)


def _doc_return(node: ast.FunctionDef) -> str | None:
    """A documented return annotation, normalised as :func:`_norm` does the code's."""
    return None if node.returns is None else _norm(ast.unparse(node.returns))


def _doc_params(node: ast.FunctionDef) -> list[tuple[str, object, str | None, str | None]]:
    """``(name, kind, annotation, default source)`` of a documented ``def``."""
    args = node.args
    out = []
    positional = args.posonlyargs + args.args
    defaults = [None] * (len(positional) - len(args.defaults)) + list(args.defaults)
    for arg, default in zip(positional, defaults):
        kind = "POSITIONAL_ONLY" if arg in args.posonlyargs else "POSITIONAL_OR_KEYWORD"
        out.append((arg.arg, kind, arg.annotation, default))
    if args.vararg:
        out.append((args.vararg.arg, "VAR_POSITIONAL", args.vararg.annotation, None))
    for arg, default in zip(args.kwonlyargs, args.kw_defaults):
        out.append((arg.arg, "KEYWORD_ONLY", arg.annotation, default))
    if args.kwarg:
        out.append((args.kwarg.arg, "VAR_KEYWORD", args.kwarg.annotation, None))
    return [
        (name, kind, None if ann is None else ast.unparse(ann), None if d is None else ast.unparse(d))
        for name, kind, ann, d in out
    ]


def _compare(where: str, documented: list, signature: inspect.Signature) -> list[str]:
    problems = []
    actual = list(signature.parameters.values())
    if [d[0] for d in documented] != [p.name for p in actual]:
        return [f"{where}: parameters {[d[0] for d in documented]} documented, code has {[p.name for p in actual]}"]
    for (name, kind, annotation, default), param in zip(documented, actual):
        if kind != param.kind.name:
            problems.append(f"{where}: {name} documented {kind}, code {param.kind.name}")
        if annotation != _norm(param.annotation) and not (annotation is None and name in ("self", "cls")):
            problems.append(f"{where}: {name} annotated {annotation!r}, code {_norm(param.annotation)!r}")
        if (default is None) != (param.default is inspect.Parameter.empty):
            problems.append(f"{where}: {name} default {default!r} documented, code {param.default!r}")
        elif default is not None and eval(default, _namespace()) != param.default:
            problems.append(f"{where}: {name} default {default} documented, code {param.default!r}")
    return problems


def _signature_problems(where: str, node: ast.FunctionDef, function, *, check_return: bool = True) -> list[str]:
    """How a documented ``def`` differs from ``function``'s parameters and return annotation."""
    signature = inspect.signature(function)
    problems = _compare(where, _doc_params(node), signature)
    documented, actual = _doc_return(node), _norm(signature.return_annotation)
    if check_return and documented != actual:
        problems.append(f"{where}: returns {documented!r} documented, code {actual!r}")
    return problems


def _method_problems(where: str, node: ast.FunctionDef, owner: type, method_name: str) -> list[str]:
    """How a documented method (plain, static, class method or property) differs from the code's."""
    code = inspect.getattr_static(owner, method_name, None)
    if code is None:
        return [f"{where}: documented, but {owner.__name__} has no such method"]
    function = code.__func__ if isinstance(code, (staticmethod, classmethod)) else code
    function = function.fget if isinstance(function, property) else function
    return _signature_problems(where, node, function, check_return=not isinstance(code, property))


def _own_constructor(cls: type) -> bool:
    """Whether ``cls`` (or a base in this package) defines its constructor's signature."""
    for klass in cls.__mro__:
        if "__new__" in vars(klass) or "__init__" in vars(klass):
            return klass.__module__.startswith("fsdp_int8") and klass is not object
    return False


def _field_problems(name: str, cls: type, node: ast.ClassDef) -> list[str]:
    """How a documented dataclass's fields differ from ``dataclasses.fields``."""
    problems = []
    documented = [
        (n.target.id, ast.unparse(n.annotation), None if n.value is None else ast.unparse(n.value))
        for n in node.body if isinstance(n, ast.AnnAssign)
    ]
    fields = dataclasses.fields(cls)
    if [d[0] for d in documented] != [f.name for f in fields]:
        problems.append(f"{name}: fields {[d[0] for d in documented]} documented, code has {[f.name for f in fields]}")
    for (field_name, annotation, default), field in zip(documented, fields):
        if annotation != _norm(field.type):
            problems.append(f"{name}.{field_name}: annotated {annotation!r}, code {field.type!r}")
        if field.default_factory is not dataclasses.MISSING:
            expected = f"dataclasses.field(default_factory={field.default_factory.__name__})"
            if default != expected:
                problems.append(f"{name}.{field_name}: default {default!r} documented, code {expected!r}")
        elif (default is None) != (field.default is dataclasses.MISSING) or (
            default is not None and eval(default, _namespace()) != field.default
        ):
            problems.append(f"{name}.{field_name}: default {default!r} documented, code {field.default!r}")
    return problems


def _check_class(name: str, cls: type, node: ast.ClassDef) -> list[str]:
    problems = []
    methods = {n.name: n for n in node.body if isinstance(n, ast.FunctionDef)}
    constructor = methods.pop("__init__", None) or methods.pop("__new__", None)
    if dataclasses.is_dataclass(cls):
        problems += _field_problems(name, cls, node)
    elif _own_constructor(cls):
        if constructor is None:
            return [f"{name}: document its constructor (def __init__ / __new__) in the python block"]
        documented = _doc_params(constructor)[1:]  # without self / cls
        problems += _compare(name, documented, inspect.signature(cls))
    for method_name, method in methods.items():
        problems += _method_problems(f"{name}.{method_name}", method, cls, method_name)
    for nested in (n for n in node.body if isinstance(n, ast.ClassDef)):
        inner = inspect.getattr_static(cls, nested.name, None)
        if not inspect.isclass(inner):
            problems.append(f"{name}.{nested.name}: documented, but {name} has no such class")
        else:
            problems += _check_class(f"{name}.{nested.name}", inner, nested)
    return problems


# ---------------------------------------------------------------------------- the tests
@pytest.mark.parametrize("module", MODULES, ids=[m.__name__ for m in MODULES])
def test_public_module_declares_all_and_has_a_section(module):
    assert "__all__" in vars(module), (
        f"{module.__name__} is public (its name has no leading _) but has no __all__: "
        "declare its public names (__all__ = [] for none), or make it private"
    )
    documented = {_module_named(title) for level, title, _ in _outline() if level == 2}
    assert module.__name__ in documented, f"docs/api.md has no '## ... `{module.__name__}`' section"


def test_a_name_exported_twice_is_one_object():
    clashes = [
        f"{name}: {', '.join(_exporters(name))}"
        for name in NAMES
        if len({id(getattr(module, n)) for module, n in PUBLIC if n == name}) > 1
    ]
    assert not clashes, f"different public objects share a name (one section each is impossible): {clashes}"


@pytest.mark.parametrize("name", NAMES)
def test_public_name_is_documented_with_its_signature(name):
    placed = _placements().get(name)
    assert placed, f"docs/api.md has no '### `{name}`' section"
    assert len(placed) == 1, f"docs/api.md has {len(placed)} '### `{name}`' sections, under {placed}"
    assert placed[0] in _exporters(name), (
        f"docs/api.md: '### `{name}`' is in the section of {placed[0]}, which does not export "
        f"it; move it under one of {_exporters(name)}"
    )
    obj = _object(name)
    if not (inspect.isfunction(obj) or inspect.isclass(obj)):
        return  # a type alias or a constant: the section is enough
    block = _python_block(_sections()[name])
    assert block is not None, f"docs/api.md: the section of {name} has no python block"
    node = next(
        (n for n in block.body if isinstance(n, (ast.FunctionDef, ast.ClassDef)) and n.name == name), None
    )
    assert node is not None, f"docs/api.md: the python block of {name} does not declare it"
    if inspect.isclass(obj):
        problems = _check_class(name, obj, node)
    else:
        problems = _signature_problems(name, node, obj)
    assert not problems, "docs/api.md does not match the code:\n" + "\n".join(problems)


def test_every_documented_name_is_public():
    stale = [name for name in _sections() if name.isidentifier() and name not in NAMES]
    assert not stale, f"docs/api.md documents names that are not public: {stale}"


def test_no_link_into_a_private_module():
    private = sorted(set(re.findall(r"fsdp_int8[./]_(?!_)\w*", API_MD.read_text())))
    assert not private, f"docs/api.md sends users into private modules: {private}"


METHOD_SECTIONS = sorted(_sections(4))


def test_there_are_method_sections_to_check():
    assert "Int8Weight.from_float" in METHOD_SECTIONS  # the parse below would check nothing otherwise


@pytest.mark.parametrize("qualified", METHOD_SECTIONS)
def test_method_sections_declare_the_signature_the_code_has(qualified):
    owner_name, method_name = qualified.split(".", 1)
    assert owner_name in NAMES, f"docs/api.md: '#### `{qualified}`' names no public class"
    block = _python_block(_sections(4)[qualified])
    assert block is not None, f"docs/api.md: the section of {qualified} has no python block"
    node = next((n for n in block.body if isinstance(n, ast.FunctionDef) and n.name == method_name), None)
    assert node is not None, f"docs/api.md: the python block of {qualified} does not declare it"
    problems = _method_problems(qualified, node, _object(owner_name), method_name)
    assert not problems, "docs/api.md does not match the code:\n" + "\n".join(problems)
