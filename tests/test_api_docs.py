"""docs/api.md documents every public name with the signature the code has.

Each public name of ``fsdp_int8`` and ``fsdp_int8.testing`` has a ``### `name` `` section;
for a function or class, the first ``python`` block of that section declares it, and its
parameters (names, kinds, annotations, defaults) and return annotation must match
``inspect.signature``. Methods declared in a class block are checked the same way, and so
is every method with a section of its own (``#### `Class.method` ``).
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import re
from pathlib import Path

import pytest
import torch

import fsdp_int8
import fsdp_int8.testing

API_MD = Path(__file__).resolve().parents[1] / "docs" / "api.md"
PUBLIC = [(fsdp_int8, name) for name in fsdp_int8.__all__] + [
    (fsdp_int8.testing, name) for name in fsdp_int8.testing.__all__
]


def _sections(level: str = "{2,3}") -> dict[str, str]:
    """``{name: text}`` of the ``` `name` ``` headings of ``level`` (a regex count of ``#``),
    each up to the next heading of that level or above."""
    text = API_MD.read_text()
    parts = re.split(rf"^#{level} `([^`]+)`[^\n]*$", text, flags=re.M)
    return {parts[i]: re.split(r"^#{1,3} ", parts[i + 1], flags=re.M)[0] for i in range(1, len(parts), 2)}


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


def _signature_problems(where: str, node: ast.FunctionDef, function, *, check_return: bool = True) -> list[str]:
    """How a documented ``def`` differs from ``function``'s parameters and return annotation."""
    signature = inspect.signature(function)
    problems = _compare(where, _doc_params(node), signature)
    documented, actual = _doc_return(node), _norm(signature.return_annotation)
    if check_return and documented != actual:
        problems.append(f"{where}: returns {documented!r} documented, code {actual!r}")
    return problems


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


def _namespace() -> dict:
    return {"torch": torch, "inf": float("inf"), **{n: getattr(fsdp_int8, n) for n in fsdp_int8.__all__}}


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


def _own_constructor(cls: type) -> bool:
    """Whether ``cls`` (or a base in this package) defines its constructor's signature."""
    for klass in cls.__mro__:
        if "__new__" in vars(klass) or "__init__" in vars(klass):
            return klass.__module__.startswith("fsdp_int8") and klass is not object
    return False


def _check_class(name: str, cls: type, node: ast.ClassDef) -> list[str]:
    problems = []
    methods = {n.name: n for n in node.body if isinstance(n, ast.FunctionDef)}
    constructor = methods.pop("__init__", None) or methods.pop("__new__", None)
    if dataclasses.is_dataclass(cls):
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
    elif _own_constructor(cls):
        if constructor is None:
            return [f"{name}: document its constructor (def __init__ / __new__) in the python block"]
        documented = _doc_params(constructor)[1:]  # without self / cls
        problems += _compare(name, documented, inspect.signature(cls))
    for method_name, method in methods.items():
        code = inspect.getattr_static(cls, method_name, None)
        if code is None:
            problems.append(f"{name}.{method_name}: documented, but the class has no such method")
            continue
        function = code.__func__ if isinstance(code, (staticmethod, classmethod)) else code
        function = function.fget if isinstance(function, property) else function
        problems += _signature_problems(f"{name}.{method_name}", method, function,
                                        check_return=not isinstance(code, property))
    return problems


@pytest.mark.parametrize("module, name", PUBLIC, ids=[n for _, n in PUBLIC])
def test_public_name_is_documented_with_its_signature(module, name):
    sections = _sections()
    assert name in sections, f"docs/api.md has no '### `{name}`' section"
    obj = getattr(module, name)
    if not (inspect.isfunction(obj) or inspect.isclass(obj)):
        return  # a type alias or a constant: the section is enough
    block = _python_block(sections[name])
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
    public = {name for _, name in PUBLIC}
    stale = [name for name in _sections() if name.isidentifier() and name not in public]
    assert not stale, f"docs/api.md documents names that are not public: {stale}"


def _method_sections() -> dict[str, str]:
    return _sections("{4}")


METHOD_SECTIONS = sorted(_method_sections())


def test_there_are_method_sections_to_check():
    assert "Int8Weight.from_float" in METHOD_SECTIONS  # the parse below would check nothing otherwise


@pytest.mark.parametrize("qualified", METHOD_SECTIONS)
def test_method_sections_declare_the_signature_the_code_has(qualified):
    owner_name, method_name = qualified.split(".", 1)
    owner = {name: getattr(module, name) for module, name in PUBLIC}.get(owner_name)
    assert owner is not None, f"docs/api.md: '#### `{qualified}`' names no public class"
    code = inspect.getattr_static(owner, method_name, None)
    assert code is not None, f"docs/api.md documents {qualified}, which the class does not have"
    function = code.__func__ if isinstance(code, (staticmethod, classmethod)) else code
    block = _python_block(_method_sections()[qualified])
    assert block is not None, f"docs/api.md: the section of {qualified} has no python block"
    node = next((n for n in block.body if isinstance(n, ast.FunctionDef) and n.name == method_name), None)
    assert node is not None, f"docs/api.md: the python block of {qualified} does not declare it"
    problems = _signature_problems(qualified, node, function)
    assert not problems, "docs/api.md does not match the code:\n" + "\n".join(problems)
