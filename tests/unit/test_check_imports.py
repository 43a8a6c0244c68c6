"""scripts/check_imports.py finds cycles between packages and between files, lazy imports included."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "check_imports.py"


@pytest.fixture(scope="module")
def check():
    spec = importlib.util.spec_from_file_location("check_imports", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["check_imports"] = module
    spec.loader.exec_module(module)
    return module


def make_package(root: Path, files: dict[str, str]) -> Path:
    pkg = root / "pkg"
    for name, text in files.items():
        path = pkg / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return pkg


def test_the_project_has_no_cycle(check, capsys):
    assert check.main() == 0
    assert "no import cycle between files" in capsys.readouterr().out


def test_a_cycle_between_two_files_of_one_package_is_found(check, tmp_path, capsys):
    pkg = make_package(
        tmp_path,
        {
            "__init__.py": "",
            "sub/__init__.py": "from pkg.sub.a import f\n",
            "sub/a.py": "from pkg.sub.b import g\ndef f(): return g()\n",
            # lazy, inside a function: still a cycle for a reader
            "sub/b.py": "def g():\n    from pkg.sub.a import f\n    return f\n",
        },
    )
    assert check.cycles(check.package_edges(pkg)) == []  # one package: the package graph cannot see it
    assert check.main(pkg) == 1
    err = capsys.readouterr().err
    assert "import cycle between files: pkg.sub.a -> pkg.sub.b -> pkg.sub.a" in err


def test_relative_imports_and_names_resolve_to_their_files(check, tmp_path):
    pkg = make_package(
        tmp_path,
        {
            "__init__.py": "from pkg.low import x\n",
            "low.py": "x = 1\n",
            "mid/__init__.py": "",
            "mid/m.py": "from ..low import x\nfrom . import n\nfrom .n import y\n",
            "mid/n.py": "y = 2\n",
        },
    )
    graph = check.file_edges(pkg)
    assert graph["pkg.mid.m"] == {"pkg.low", "pkg.mid.n"}
    assert "pkg" not in graph.get("pkg.low", set())
    assert check.cycles(graph) == []


def test_a_cycle_between_packages_is_found(check, tmp_path, capsys):
    pkg = make_package(
        tmp_path,
        {
            "__init__.py": "",
            "a/__init__.py": "",
            "a/one.py": "from pkg.b.two import t\n",
            "b/__init__.py": "",
            "b/two.py": "t = 1\n",
            "b/three.py": "from pkg.a import one\n",
        },
    )
    assert check.main(pkg) == 1
    assert "import cycle between packages: a -> b -> a" in capsys.readouterr().err
