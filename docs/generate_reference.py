"""Write docs/reference.md, the API reference, from the public modules' docstrings.

    python docs/generate_reference.py           # rewrite docs/reference.md
    python docs/generate_reference.py --check   # exit 1 if docs/reference.md is stale

The public modules are ``fsdp_int8`` and each child module or subpackage of ``fsdp_int8``
and ``fsdp_int8.integrations`` whose name does not start with ``_``; each declares its
public names in ``__all__``. A name exported by several modules is documented once, under
the first public module (in page order) other than the top level. Per name: the signature
from ``inspect.signature`` and the docstring, whose Google-style sections (``Args:``,
``Returns:``, ``Raises:``, ``Attributes:``, ``Example:``) and ``::`` literal blocks become
markdown. A class also shows each public method, property and nested class it defines
that has a docstring. Constants and type aliases take their text from the ``#:`` comment
lines above their assignment.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import pkgutil
import re
import sys
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "reference.md"
WIDTH = 88  # a signature longer than this wraps, parameters filling lines of this width
SECTIONS = ("Args", "Returns", "Raises", "Attributes", "Example", "Yields")
LISTED = ("Args", "Raises", "Attributes")  # sections whose entries are `name: text`
# Methods that torch calls, not users: their class docstring says what they do.
PROTOCOL = frozenset({"fsdp_pre_all_gather", "fsdp_post_all_gather"})
# Page order: the order of a training script (configure, convert, shard, optimize, save),
# then measuring, building blocks, adapters and tests; a module not listed comes last.
ORDER = (
    "fsdp_int8", "fsdp_int8.config", "fsdp_int8.weight", "fsdp_int8.convert", "fsdp_int8.sharding",
    "fsdp_int8.parallel", "fsdp_int8.optim", "fsdp_int8.guard", "fsdp_int8.checkpoint",
    "fsdp_int8.gradients", "fsdp_int8.collectives", "fsdp_int8.memory", "fsdp_int8.hardware",
    "fsdp_int8.quant", "fsdp_int8.integrations",
)

HEADER = """\
# API reference

Generated from the docstrings by `python docs/generate_reference.py`; do not edit by hand
(`tests/test_api_reference.py` fails when this page is stale). [api.md](api.md) lists the
top-level names and what changed between versions.
"""


# ---------------------------------------------------------------------------- what is public
def public_modules() -> list[ModuleType]:
    """``fsdp_int8``, then its public children and those of ``fsdp_int8.integrations``, in
    page order."""
    if str(ROOT) not in sys.path:  # run as a script from a checkout without installing
        sys.path.insert(0, str(ROOT))
    import fsdp_int8
    import fsdp_int8.integrations

    def children(package: ModuleType) -> list[str]:
        return [
            f"{package.__name__}.{info.name}"
            for info in pkgutil.iter_modules(package.__path__)
            if not info.name.startswith("_")
        ]

    names = sorted(children(fsdp_int8) + children(fsdp_int8.integrations))
    names.sort(key=lambda name: ORDER.index(name) if name in ORDER else len(ORDER))
    return [fsdp_int8] + [importlib.import_module(name) for name in names]


def placements(modules: list[ModuleType]) -> dict[str, list[str]]:
    """``{module name: names documented in its section}``: each object once, under the first
    module other than ``fsdp_int8`` that exports it (the top level only holds what no other
    module exports, such as ``__version__``)."""
    placed: dict[str, list[str]] = {module.__name__: [] for module in modules}
    seen: set[int] = set()
    for module in modules[1:] + modules[:1]:
        for name in module.__all__:
            key = id(getattr(module, name)) if not isinstance(getattr(module, name), (str, int, float)) else id(name)
            if key in seen:
                continue
            seen.add(key)
            placed[module.__name__].append(name)
    return placed


# ---------------------------------------------------------------------------- docstrings
_PAGE = re.compile(r"(?<![\w/\[(])docs/(\w+)\.md")  # a page of docs/, linked from this one
_ROLE = re.compile(r":(?:func|class|meth|data|attr|mod|exc|obj):`~?([^`]+)`")


def _inline(text: str) -> str:
    """Sphinx roles to code spans (``~a.b`` shows ``b``); ``docs/x.md`` outside code to a link."""

    def code(match: re.Match) -> str:
        target = match.group(1)
        shown = target.rsplit(".", 1)[-1] if match.group(0).split("`")[1].startswith("~") else target
        return f"`{shown}`"

    parts = re.split(r"(``[^`]*``|`[^`]*`)", _ROLE.sub(code, text))
    return "".join(part if part.startswith("`") else _PAGE.sub(r"[docs/\1.md](\1.md)", part) for part in parts)


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip()) if line.strip() else 10**6


def _literal(lines: list[str], start: int) -> tuple[list[str], int]:
    """The indented block from ``start`` (blank lines inside kept), as a python fence, and
    the index after it."""
    base = None
    end = start
    while end < len(lines) and (not lines[end].strip() or _indent(lines[end]) > 0 and (base is None or _indent(lines[end]) >= base)):
        if lines[end].strip() and base is None:
            base = _indent(lines[end])
        end += 1
    while end > start and not lines[end - 1].strip():
        end -= 1
    block = [line[base:] if line.strip() else "" for line in lines[start:end]]
    while block and not block[0]:
        block.pop(0)
    return [f"```{_language(block)}", *block, "```"], end


def _language(block: list[str]) -> str:
    """``python`` for a block that parses as Python (or is a session), else no language."""
    if any(line.startswith(">>>") for line in block):
        return "python"
    try:
        ast.parse("\n".join(block))
    except SyntaxError:
        return ""
    return "python"


def _section(name: str, body: list[str]) -> list[str]:
    """One Google-style section (its lines without the ``Name:`` line) as markdown."""
    out = [f"**{name}:**", ""]
    body = [line[4:] if line.startswith("    ") else line.lstrip() for line in body]
    if name == "Example":
        text = [line for line in body]
        while text and not text[-1].strip():
            text.pop()
        if any(line.startswith(">>>") for line in text) or not any(l.rstrip().endswith(".") for l in text):
            return out + ["```python", *text, "```"]
    if name not in LISTED:
        return out + _paragraphs(body)
    entry = re.compile(r"^([*\w.]+(?: \([^)]*\))?):(?: (.*))?$")
    for line in body:
        match = entry.match(line) if line and not line.startswith(" ") else None
        if match:
            out.append(f"- `{match.group(1)}`: {_inline(match.group(2) or '')}".rstrip())
        elif line.strip():
            out.append("  " + _inline(line.strip()))
    return out


def _paragraphs(lines: list[str]) -> list[str]:
    """Prose with ``::`` literal blocks turned into python fences."""
    out: list[str] = []
    i = 0
    while i < len(lines):
        line = lines[i]
        if line.rstrip().endswith("::") and i + 1 < len(lines):
            text = line.rstrip()[:-2].rstrip()
            if text:
                out.append(_inline(text) + ":")
            block, i = _literal(lines, i + 1)
            out += ["", *block, ""]
            continue
        out.append(_inline(line))
        i += 1
    return out


def render_docstring(doc: str | None) -> list[str]:
    """A cleaned docstring as markdown lines."""
    if not doc:
        return []
    lines = doc.splitlines()
    out: list[str] = []
    prose: list[str] = []
    i = 0
    while i < len(lines):
        header = re.match(rf"^({'|'.join(SECTIONS)}):$", lines[i])
        if not header:
            prose.append(lines[i])
            i += 1
            continue
        out += _paragraphs(prose)
        prose = []
        end = i + 1
        while end < len(lines) and (not lines[end].strip() or lines[end].startswith(" ")):
            end += 1
        body = lines[i + 1 : end]
        while body and not body[-1].strip():
            body.pop()
        if out and out[-1]:
            out.append("")
        out += _section(header.group(1), body) + [""]
        i = end
    out += _paragraphs(prose)
    while out and not out[-1].strip():
        out.pop()
    collapsed: list[str] = []
    for line in out:  # no runs of blank lines
        if line.strip() or (collapsed and collapsed[-1].strip()):
            collapsed.append(line.rstrip())
    return collapsed


# ---------------------------------------------------------------------------- signatures
def _annotation(annotation: object) -> str:
    """An annotation as the code spells it (the modules postpone annotations: strings)."""
    if not isinstance(annotation, str):
        return inspect.formatannotation(annotation)
    quoted = len(annotation) > 1 and annotation[0] == annotation[-1] and annotation[0] in "'\""
    return annotation[1:-1] if quoted else annotation  # a forward reference written in quotes


def _default(value: object, where: str) -> str:
    if type(value).__name__ == "_HAS_DEFAULT_FACTORY_CLASS":  # a dataclass field's default_factory
        return "<factory>"
    text = repr(value)
    if " at 0x" in text:
        raise ValueError(f"{where}: the default {text} has no stable text; give it a readable repr")
    return text


def _signature(keyword: str, name: str, obj: object, where: str) -> str:
    """``def name(...) -> T`` / ``class name(...)`` with the code's annotations and defaults."""
    try:
        signature = inspect.signature(obj)
    except (TypeError, ValueError):
        return f"{keyword} {name}"
    params = []
    for param in signature.parameters.values():
        text = param.name
        if param.kind is param.VAR_POSITIONAL:
            text = "*" + text
        elif param.kind is param.VAR_KEYWORD:
            text = "**" + text
        if param.annotation is not param.empty:
            text += f": {_annotation(param.annotation)}"
        if param.default is not param.empty:
            default = _default(param.default, f"{where}({param.name})")
            text += f" = {default}" if param.annotation is not param.empty else f"={default}"
        params.append((param, text))
    parts: list[str] = []
    for index, (param, text) in enumerate(params):
        previous = params[index - 1][0].kind if index else None
        if param.kind is param.KEYWORD_ONLY and previous not in (param.KEYWORD_ONLY, param.VAR_POSITIONAL):
            parts.append("*")
        if previous is param.POSITIONAL_ONLY and param.kind is not param.POSITIONAL_ONLY:
            parts.append("/")
        parts.append(text)
    if params and params[-1][0].kind is inspect.Parameter.POSITIONAL_ONLY:
        parts.append("/")
    returns = ""
    if keyword == "def" and signature.return_annotation is not signature.empty:
        returns = f" -> {_annotation(signature.return_annotation)}"
    one_line = f"{keyword} {name}({', '.join(parts)}){returns}"
    if len(one_line) <= WIDTH:
        return one_line
    lines = [f"{keyword} {name}("]
    for index, part in enumerate(parts):
        piece = part + ("," if index < len(parts) - 1 else "")
        if len(lines) > 1 and len(lines[-1]) + 1 + len(piece) <= WIDTH:
            lines[-1] += " " + piece
        else:
            lines.append("    " + piece)
    lines.append(f"){returns}")
    return "\n".join(lines)


def _comment_doc(name: str) -> tuple[str | None, str | None]:
    """``(doc, value source)`` of a module-level ``NAME = ...`` in the package's sources with
    ``#:`` lines above it."""
    for path in sorted((ROOT / "fsdp_int8").rglob("*.py")):
        source = path.read_text()
        lines = source.splitlines()
        for node in ast.parse(source).body:
            targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) else []
            if not any(isinstance(t, ast.Name) and t.id == name for t in targets) or node.value is None:
                continue
            doc, row = [], node.lineno - 2
            while row >= 0 and lines[row].lstrip().startswith("#:"):
                doc.insert(0, lines[row].lstrip()[2:].strip())
                row -= 1
            if doc:
                return "\n".join(doc), ast.get_source_segment(source, node.value)
    return None, None


# ---------------------------------------------------------------------------- the page
def _is_documented_member(value: object) -> bool:
    target = value.__func__ if isinstance(value, (staticmethod, classmethod)) else value
    target = target.fget if isinstance(target, property) else target
    return (inspect.isfunction(target) or inspect.isclass(target)) and bool(inspect.getdoc(target))


def _defined_in(value: object, klass: type) -> bool:
    """Whether ``value`` was written in ``klass``'s body (not set on it at run time: torch's
    optimizers put a profiling wrapper of the base's ``step`` on each subclass they build)."""
    target = value.__func__ if isinstance(value, (staticmethod, classmethod)) else value
    target = target.fget if isinstance(target, property) else target
    return getattr(target, "__qualname__", "").rsplit(".", 1)[0] == klass.__qualname__


def _own_members(cls: type) -> dict[str, object]:
    """The members ``cls`` defines, and those it inherits from this package's private
    classes (which the reference does not show): what a user of ``cls`` can call."""
    members: dict[str, object] = {}
    for klass in cls.__mro__:
        private = klass.__name__.startswith("_") or any(p.startswith("_") for p in klass.__module__.split("."))
        if klass is not cls and not (klass.__module__.startswith("fsdp_int8") and private):
            continue
        for attr, value in vars(klass).items():
            if attr not in members and _defined_in(value, klass):
                members[attr] = value
    return members


def _members(cls: type, qualified: str) -> list[str]:
    """Sections of the public methods, properties and nested classes ``cls`` defines."""
    out: list[str] = []
    for attr, value in _own_members(cls).items():
        if attr.startswith("_") or attr in PROTOCOL or not _is_documented_member(value):
            continue
        name = f"{qualified}.{attr}"
        if isinstance(value, property):
            code = f"@property\ndef {attr}(self)"
            if value.fget.__annotations__.get("return") is not None:
                code += f" -> {_annotation(value.fget.__annotations__['return'])}"
            doc = inspect.getdoc(value.fget)
        elif inspect.isclass(value):
            code = _signature("class", attr, value, name)
            doc = inspect.getdoc(value)
        else:
            function = value.__func__ if isinstance(value, (staticmethod, classmethod)) else value
            decorator = "@staticmethod\n" if isinstance(value, staticmethod) else "@classmethod\n" if isinstance(value, classmethod) else ""
            code = decorator + _signature("def", attr, function, name)
            doc = inspect.getdoc(function)
        out += ["", f"#### `{name}`", "```python", code, "```", *render_docstring(doc)]
        if inspect.isclass(value):
            out += _members(value, name)
    return out


def _qualified(cls: type) -> str:
    return cls.__qualname__ if cls.__module__ == "builtins" else f"{cls.__module__}.{cls.__qualname__}"


def _entry(name: str, obj: object) -> list[str]:
    if inspect.isclass(obj):
        code = _signature("class", name, obj, name)
        doc = inspect.getdoc(obj)
        bases = [b for b in obj.__bases__ if b is not object]
        if bases and not code.startswith(f"class {name}("):
            code = f"class {name}({', '.join(_qualified(b) for b in bases)})"
        return ["", f"### `{name}`", "```python", code, "```", *render_docstring(doc), *_members(obj, name)]
    if inspect.isfunction(obj):
        code = _signature("def", name, obj, name)
        return ["", f"### `{name}`", "```python", code, "```", *render_docstring(inspect.getdoc(obj))]
    doc, value = _comment_doc(name)
    if doc is None and name != "__version__":
        raise ValueError(f"{name}: a public constant needs '#:' comment lines above its assignment")
    shown = repr(obj) if value is None or len(repr(obj)) <= WIDTH - len(name) - 3 else value
    if len(shown) > WIDTH * 4:
        shown = value or type(obj).__name__
    return ["", f"### `{name}`", "```python", f"{name} = {shown}", "```", *render_docstring(doc)]


def generate() -> str:
    """The text of docs/reference.md."""
    modules = public_modules()
    placed = placements(modules)
    lines = HEADER.splitlines()
    lines += ["", "| module | names |", "|---|---|"]
    for module in modules:
        names = ", ".join(f"[`{n}`](#{n.lower()})" for n in placed[module.__name__])
        lines.append(f"| [`{module.__name__}`](#{module.__name__.replace('.', '').lower()}) | {names} |")
    for module in modules:
        lines += ["", f"## `{module.__name__}`"]
        summary = render_docstring(inspect.getdoc(module))
        if summary:
            lines += [""] + summary
        for name in placed[module.__name__]:
            lines += _entry(name, getattr(module, name))
    return "\n".join(lines) + "\n"


def main(argv: list[str]) -> int:
    text = generate()
    if "--check" in argv:
        if not PAGE.exists() or PAGE.read_text() != text:
            print(f"{PAGE.relative_to(ROOT)} is stale: run python docs/generate_reference.py", file=sys.stderr)
            return 1
        return 0
    PAGE.write_text(text)
    print(f"wrote {PAGE.relative_to(ROOT)} ({len(text.splitlines())} lines)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
