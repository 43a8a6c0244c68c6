"""The test folders have no __init__.py, so pytest imports each test module by its basename: two files with one name
in different folders cannot be collected in one run ("import file mismatch"). A subset run can miss that; this
cannot."""

from __future__ import annotations

from collections import defaultdict

from support.launch import REPO


def test_no_two_test_modules_share_a_basename() -> None:
    seen: dict[str, list[str]] = defaultdict(list)
    for path in sorted((REPO / "tests").rglob("test_*.py")):
        if "__pycache__" not in path.parts:
            seen[path.name].append(str(path.relative_to(REPO)))
    clashes = {name: paths for name, paths in seen.items() if len(paths) > 1}
    assert not clashes, f"rename one of each: {clashes}"
    assert len(seen) > 50  # the walk found the suite
