"""Links into the pages of docs/ and the dated logs of benchmarks/results/, from any page,
docstring or comment of the repository: each names a file that exists and, with
``#anchor``, a heading of it (GitHub's anchors) or an ``<a id>`` in it."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TARGETS = tuple(
    str(p.relative_to(ROOT)) for p in [*sorted((ROOT / "docs").glob("*.md")), *sorted((ROOT / "benchmarks" / "results").glob("*.md"))]
)
LINK = re.compile(r"\]\(([^)\s#]*)(#[^)\s]*)?\)")  # markdown links: (path#anchor)
CODE = re.compile(r"```.*?```", re.S)


def _anchor(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation but '-' and '_' dropped, spaces to '-'."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    text = CODE.sub("", path.read_text())
    headings = {_anchor(m.group(1)) for m in re.finditer(r"^#+\s+(.*)$", text, re.M)}
    return headings | set(re.findall(r'<a id="([^"]+)"></a>', text))


def _pages() -> list[Path]:
    return [*ROOT.glob("*.md"), *ROOT.glob("docs/*.md"), *ROOT.glob("benchmarks/results/*.md")]


def test_the_anchor_rule_matches_github():
    assert _anchor("Gloo's reduce-scatter copy") == "gloos-reduce-scatter-copy"
    assert _anchor("Round 2: all three GEMMs in int8") == "round-2-all-three-gemms-in-int8"


def test_every_link_into_the_guides_and_the_results_resolves():
    problems = []
    for page in _pages():
        text = CODE.sub("", page.read_text())
        for match in LINK.finditer(text):
            path, anchor = match.group(1), (match.group(2) or "")[1:]
            if path.startswith(("http:", "https:")):
                continue
            target = (page.parent / path).resolve() if path else page
            if not target.is_relative_to(ROOT) or str(target.relative_to(ROOT)) not in TARGETS:
                continue
            if not target.exists():
                problems.append(f"{page.relative_to(ROOT)}: {match.group(0)}: no such file")
            elif anchor and anchor not in _anchors(target):
                problems.append(f"{page.relative_to(ROOT)}: {match.group(0)}: no heading #{anchor}")
    assert not problems, "\n".join(problems)


def test_code_that_names_a_section_of_the_guides_finds_it():
    # comments and docstrings cite sections by title: docs/performance.md, "Kernel choices"
    cited = re.compile(r"docs/(memory|performance)\.md, \"([^\"]+)\"")
    problems = []
    for path in [*ROOT.glob("fsdp_int8/**/*.py"), *ROOT.glob("launch/*.py"), *ROOT.glob("benchmarks/*.py")]:
        for page, title in cited.findall(path.read_text()):
            if _anchor(title) not in _anchors(ROOT / "docs" / f"{page}.md"):
                problems.append(f"{path.relative_to(ROOT)}: docs/{page}.md has no section {title!r}")
    assert not problems, "\n".join(problems)
