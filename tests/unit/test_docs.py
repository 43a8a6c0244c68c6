"""The README and the docs pages: every relative link resolves, the README stays short, no page is an orphan.

A link is ``[text](target)`` outside code; ``http(s)://`` and ``mailto:`` targets are not followed. A target's file
must exist (relative to the page that links it); a ``#fragment`` must name a heading of that file as GitHub spells
its anchors (lowercase, punctuation dropped, spaces as hyphens, ``-1``, ``-2`` for repeats). Headings and links
inside fenced code blocks and inline code spans do not count (a ``# comment`` in a bash block is no heading).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
README_MAX_LINES = 160
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md")), REPO / "bench" / "README.md"]

_FENCE = re.compile(r"^(```|~~~)")
_INLINE_CODE = re.compile(r"`+[^`]*`+")
_LINK = re.compile(r"(?<!!)\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")


def _prose_lines(text: str) -> list[tuple[int, str]]:
    """(line number, line) outside fenced code blocks."""
    lines, fenced = [], False
    for number, line in enumerate(text.splitlines(), 1):
        if _FENCE.match(line.lstrip()):
            fenced = not fenced
            continue
        if not fenced:
            lines.append((number, line))
    return lines


def github_anchor(heading: str) -> str:
    """The anchor GitHub gives a heading: markup dropped, lowercase, punctuation out, spaces as hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link in a heading keeps its text
    text = text.replace("`", "").strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    found = set()
    for _, line in _prose_lines(path.read_text(encoding="utf-8")):
        match = _HEADING.match(line)
        if not match:
            continue
        base = github_anchor(match.group(2))
        count = seen.get(base, 0)
        seen[base] = count + 1
        found.add(base if count == 0 else f"{base}-{count}")
    return found


def links(path: Path) -> list[tuple[int, str]]:
    """(line number, target) of every link outside code."""
    out = []
    for number, line in _prose_lines(path.read_text(encoding="utf-8")):
        for match in _LINK.finditer(_INLINE_CODE.sub("", line)):
            out.append((number, match.group(1)))
    return out


def broken_links(path: Path, root: Path = REPO) -> list[str]:
    """One line per link of ``path`` whose file or heading is missing, named relative to ``root``."""
    problems = []
    for number, target in links(path):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.IGNORECASE):  # http:, https:, mailto:
            continue
        file_part, _, fragment = target.partition("#")
        linked = (path.parent / file_part).resolve() if file_part else path
        where = f"{path.relative_to(root)}:{number}: {target}"
        if not linked.exists():
            problems.append(f"{where}: no file {linked}")
        elif fragment and linked.suffix == ".md" and fragment not in anchors(linked):
            problems.append(f"{where}: no heading with anchor #{fragment} in {linked.relative_to(root)}")
    return problems


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_every_relative_link_resolves(page: Path) -> None:
    assert broken_links(page) == []


def test_readme_stays_short() -> None:
    lines = (REPO / "README.md").read_text(encoding="utf-8").count("\n")
    assert lines < README_MAX_LINES, (
        f"README.md has {lines} lines (limit {README_MAX_LINES}): move the detail to the docs page of its topic"
    )


def test_every_docs_page_is_reachable_from_the_readme() -> None:
    reached, todo = set(), [REPO / "README.md"]
    while todo:
        page = todo.pop()
        if page in reached:
            continue
        reached.add(page)
        for _, target in links(page):
            file_part = target.partition("#")[0]
            if file_part and not re.match(r"^[a-z][a-z0-9+.-]*:", file_part, re.IGNORECASE):
                linked = (page.parent / file_part).resolve()
                if linked.suffix == ".md" and linked.exists():
                    todo.append(linked)
    orphans = [str(p.relative_to(REPO)) for p in PAGES if p.resolve() not in reached]
    assert orphans == [], f"no link from README.md leads to {orphans}: link each from the page of its topic"


def test_the_checker_finds_a_broken_file_and_a_broken_anchor(tmp_path: Path) -> None:
    (tmp_path / "other.md").write_text("# Other page\n\n## Keys and `commands`: 2.6 Rank-0 — a_b\n")
    page = tmp_path / "page.md"
    page.write_text(
        "[ok](other.md) [ok](other.md#keys-and-commands-26-rank-0--a_b) [web](https://example.com/x.md)\n"
        "`[code](missing.md)`\n```bash\n[fenced](missing.md)\n# not a heading\n```\n"
        "[gone](missing.md) [bad anchor](other.md#nope) [self](#not-here)\n"
    )
    found = [problem.split(": ")[1] for problem in broken_links(page, root=tmp_path)]
    assert found == ["missing.md", "other.md#nope", "#not-here"]
    assert anchors(tmp_path / "other.md") == {"other-page", "keys-and-commands-26-rank-0--a_b"}
