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
        for node in ast.walk(ast.parse(path.read_text())):
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
