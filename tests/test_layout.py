"""The package's layout matches docs/design.md's module map, checked from the code.

Every module and subpackage of ``fsdp_int8`` has a row in the map; the row's "imports"
column names exactly the package's own modules it imports (at any depth: an import inside
a function counts), and each of them has a row above it, so imports go one way.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "fsdp_int8"


def _walk_imports(tree: ast.AST):
    """Every ``Import`` / ``ImportFrom`` node of ``tree`` at any depth, except those under
    ``if TYPE_CHECKING:`` (annotations only: they import nothing when the code runs)."""
    children = list(ast.iter_child_nodes(tree))
    while children:
        node = children.pop(0)
        if isinstance(node, ast.If) and ast.unparse(node.test) in ("TYPE_CHECKING", "typing.TYPE_CHECKING"):
            children[:0] = node.orelse
            continue
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        children[:0] = list(ast.iter_child_nodes(node))


def _unit(path: Path) -> str:
    """The map's name of the module or subpackage ``path`` belongs to."""
    parts = path.relative_to(PACKAGE).parts
    return parts[0][: -len(".py")] if len(parts) == 1 else parts[0]


def _imported_units() -> dict[str, set[str]]:
    found: dict[str, set[str]] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        if path == PACKAGE / "__init__.py":
            continue
        unit = _unit(path)
        targets = found.setdefault(unit, set())
        for node in _walk_imports(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "fsdp_int8":
                parts = node.module.split(".")
                names = [parts[1]] if len(parts) > 1 else [a.name for a in node.names]
            elif isinstance(node, ast.Import):
                names = [a.name.split(".")[1] for a in node.names if a.name.startswith("fsdp_int8.")]
            else:
                continue
            targets.update(n for n in names if n != unit)
    return found


def _module_map() -> list[tuple[str, set[str]]]:
    """``(unit, listed imports)`` of each row of docs/design.md's module map, in order."""
    text = (ROOT / "docs" / "design.md").read_text()
    section = text.split("## Module map", 1)[1].split("\n## ", 1)[0]
    rows = []
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        match = re.fullmatch(r"`([\w]+)(?:\.py|/)`", cells[0]) if len(cells) == 3 else None
        if match:
            rows.append((match.group(1), set(re.findall(r"`(\w+)`", cells[2])) - {"count_collectives"}))
    return rows


def test_every_module_has_a_row_once():
    units = [unit for unit, _ in _module_map()]
    assert len(units) == len(set(units)), "a module is listed twice"
    assert set(units) == set(_imported_units()), (
        f"rows without a module: {set(units) - set(_imported_units())}; "
        f"modules without a row: {set(_imported_units()) - set(units)}"
    )


def test_each_row_lists_exactly_what_its_module_imports_and_only_from_above():
    actual = _imported_units()
    seen: set[str] = set()
    problems = []
    for unit, listed in _module_map():
        if listed != actual.get(unit, set()):
            problems.append(f"{unit}: listed {sorted(listed)}, imports {sorted(actual.get(unit, set()))}")
        below = listed - seen
        if below:
            problems.append(f"{unit} imports {sorted(below)}, which the map lists below it")
        seen.add(unit)
    assert not problems, "docs/design.md's module map does not match the code:\n" + "\n".join(problems)


# ------------------------------------------------------------------ the issue-25 limits
MAX_PUBLIC_NAMES = 12  # what a user needs to train; everything else in its subpackage
MAX_MODULE_LINES = 400  # one concern a module: a longer one is two


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _module_imports() -> dict[str, set[str]]:
    """``module -> the package's modules it imports``, at any depth of its code.

    ``from a.b import c`` is an import of the module ``a.b.c`` when there is one, else of
    ``a.b``; ``import a.b`` of ``a.b``. Parents a Python import initialises on the way
    (``a`` for ``a.b``) are not counted: they are what makes ``a.b`` reachable, not a use.
    """
    modules = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        targets = graph.setdefault(name, set())
        package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
        for node in _walk_imports(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets.update(a.name for a in node.names if a.name in modules)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative: resolved against this module's package
                    base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else []))
                if not base.startswith("fsdp_int8"):
                    continue
                for alias in node.names:
                    child = f"{base}.{alias.name}"
                    targets.add(child if child in modules else base)
        targets.discard(name)
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle through each strongly connected component of more than one module."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:  # Tarjan's algorithm (the package is small: recursion is fine)
        index[node] = low[node] = len(index)
        stack.append(node)
        for target in graph.get(node, ()):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_the_top_level_api_is_at_most_twelve_names():
    import fsdp_int8

    assert len(fsdp_int8.__all__) <= MAX_PUBLIC_NAMES, fsdp_int8.__all__
    assert all(hasattr(fsdp_int8, name) for name in fsdp_int8.__all__)


def test_no_module_is_longer_than_the_limit():
    lengths = {p.relative_to(ROOT).as_posix(): len(p.read_text().splitlines()) for p in PACKAGE.rglob("*.py")}
    too_long = {path: lines for path, lines in lengths.items() if lines > MAX_MODULE_LINES}
    assert not too_long, f"modules over {MAX_MODULE_LINES} lines: {too_long}"


def test_no_import_cycle_at_any_depth():
    cycles = _cycles(_module_imports())
    assert not cycles, f"modules that import each other (directly or through others): {cycles}"


def test_the_cycle_finder_finds_a_cycle():
    """The check above is only as good as this: a two-module and a three-module cycle."""
    assert _cycles({"a": {"b"}, "b": {"a"}, "c": {"a"}}) == [["a", "b"]]
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_type_checking_imports_are_not_counted():
    tree = ast.parse("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import a\nelse:\n    import b\nimport c\n")
    assert [n.names[0].name for n in _walk_imports(tree) if isinstance(n, ast.Import)] == ["b", "c"]


# ------------------------------------------------------------------ the issue-32 numbers
MAX_TOP_LEVEL_MODULES = 12  # ``ls fsdp_int8`` reads as the path; the rest lives in subpackages
OUTSIDE = ("launch", "benchmarks", "examples")  # code that uses the library as a user does
# The one file outside the library allowed its private parts, and why: the roofline traces
# a step on fake tensors and counts fsdp_int8's compiled kernels, so it swaps them (and the
# accelerator policy) for counting stand-ins while it traces. Nothing it patches is used
# as a user would use it.
PRIVATE_USE_ALLOWED = {"benchmarks/_roofline_trace.py"}


def _absolute_imports(path: Path) -> list[tuple[str, str | None]]:
    """``(module, imported name or None)`` of each import of ``fsdp_int8`` in ``path``,
    relative imports resolved against the file's package."""
    package = _module_name(path) if path.name == "__init__.py" else _module_name(path).rsplit(".", 1)[0]
    found = []
    for node in _walk_imports(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [(a.name, None) for a in node.names]
        else:
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
            found += [(base, a.name) for a in node.names]
    return [(m, n) for m, n in found if m == "fsdp_int8" or m.startswith("fsdp_int8.")]


def _is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _private_crossings(path: Path, own: str | None) -> list[str]:
    """Imports in ``path`` of a private module or name of a package other than ``own``.

    Code outside the library (``own=None``) may use no private part of it. Inside, the
    private modules and packages at the top of ``fsdp_int8`` (``_dist``, ``_weight``, ...)
    serve the whole library; a public subpackage's private parts are its own.
    """
    problems = []
    for module, name in _absolute_imports(path):
        parts = module.split(".")[1:] + ([name] if name else [])
        if own is None:
            if any(_is_private(p) for p in parts):
                problems.append(f"{path.relative_to(ROOT)}: {module}" + (f" import {name}" if name else ""))
        elif parts and not _is_private(parts[0]) and parts[0] != own and any(_is_private(p) for p in parts[1:]):
            problems.append(f"{path.relative_to(ROOT)}: {module}" + (f" import {name}" if name else ""))
    return problems


def test_the_package_top_level_holds_at_most_twelve_modules():
    modules = sorted(p.name for p in PACKAGE.glob("*.py") if p.name != "__init__.py")
    assert len(modules) <= MAX_TOP_LEVEL_MODULES, f"{len(modules)} modules at the top of fsdp_int8: {modules}"


def test_no_private_module_or_name_crosses_a_package_line():
    problems = []
    for directory in OUTSIDE:
        for path in sorted((ROOT / directory).rglob("*.py")):
            if str(path.relative_to(ROOT)) not in PRIVATE_USE_ALLOWED:
                problems += _private_crossings(path, None)
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE).parts
        own = parts[0] if len(parts) > 1 else path.stem
        problems += _private_crossings(path, own)
    assert not problems, "private parts used across package lines:\n" + "\n".join(problems)


def test_the_launcher_does_not_use_the_test_kit():
    users = [
        str(path.relative_to(ROOT))
        for path in sorted((ROOT / "launch").rglob("*.py"))
        if any(m == "fsdp_int8.testing" or m.startswith("fsdp_int8.testing.") or (m, n) == ("fsdp_int8", "testing")
               for m, n in _absolute_imports(path))
    ]
    assert not users, f"launch/ imports fsdp_int8.testing: {users}"


# The launcher's command-line code (its flags, their refusals, the hardware's answer to its
# "auto", its run folder): the benchmarks build their rows from the library, the registry
# (launch.precisions) and the builder (launch.build), never from these.
LAUNCHER_COMMAND_LINE = ("launch.train", "launch.compile_policy", "launch.hardware_choice", "launch.run_dir")


def _modules_imported(path: Path) -> set[str]:
    """Every module ``path`` imports, and ``module.name`` of each ``from module import name``."""
    found = set()
    for node in _walk_imports(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif node.module:
            found.update([node.module, *(f"{node.module}.{a.name}" for a in node.names)])
    return found


def test_the_benchmarks_do_not_use_the_launchers_command_line_code():
    users = {
        str(path.relative_to(ROOT)): sorted(_modules_imported(path) & set(LAUNCHER_COMMAND_LINE))
        for path in sorted((ROOT / "benchmarks").rglob("*.py"))
    }
    assert not {path: found for path, found in users.items() if found}, users
    assert _modules_imported(ROOT / "launch" / "train.py") >= {"launch.compile_policy", "launch.build"}  # the check sees them


def test_the_crossing_finder_finds_crossings(tmp_path, monkeypatch):
    """The two checks above are only as good as this."""
    monkeypatch.setattr(__import__(__name__), "ROOT", tmp_path)
    script = tmp_path / "script.py"
    script.write_text("from fsdp_int8.testing import run_distributed\nfrom fsdp_int8 import _dist\n"
                      "import fsdp_int8.checkpoint._files\n")
    assert _private_crossings(script, None) == [
        "script.py: fsdp_int8 import _dist", "script.py: fsdp_int8.checkpoint._files",
    ]
    (tmp_path / "fsdp_int8" / "integrations").mkdir(parents=True)
    module = tmp_path / "fsdp_int8" / "integrations" / "x.py"
    module.write_text("from fsdp_int8.checkpoint import _generator_states\nfrom fsdp_int8._dist import rank\n"
                      "from fsdp_int8.integrations._hf_layout import a\nfrom ..checkpoint._files import b\n")
    assert _private_crossings(module, "integrations") == [
        "fsdp_int8/integrations/x.py: fsdp_int8.checkpoint import _generator_states",
        "fsdp_int8/integrations/x.py: fsdp_int8.checkpoint._files import b",
    ]
