"""The interpreter verification reloads exports in (hf_fsdp2/export/reload_process.py): a new one per reload by
default; inside ``shared_reload_process`` one for all, whatever the script, replaced when it dies."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest

from hf_fsdp2.export import reload_process
from hf_fsdp2.export.reload_process import run_reload, shared_reload_process

# Writes its interpreter's pid, whether hf_fsdp2 was ever imported there, and a value left by an earlier request.
WHO = r"""
import json, os, sys
leftover = globals().get("left_here")
left_here = 1
with open(sys.argv[2], "w") as f:
    json.dump({"pid": os.getpid(), "hf_fsdp2": any(m.startswith("hf_fsdp2") for m in sys.modules),
               "leftover": leftover, "env": os.environ.get("RELOAD_TEST")}, f)
"""
FAILS = "raise ValueError('the folder has no config.json')"


def _file(tmp: Path, text: str, name: str) -> Path:
    """The script ``text`` as a file (reloads run script files: hf_fsdp2/export/reload_scripts/)."""
    script = tmp / f"{name}.py"
    script.write_text(text)
    return script


def _who(tmp: Path, name: str, env: dict[str, str] | None = None) -> dict:
    out = tmp / f"{name}.json"
    error = run_reload(
        _file(tmp, WHO, "who"), tmp / "unused.pt", out, env if env is not None else dict(os.environ)
    )
    assert error is None, error
    return json.loads(out.read_text())


@pytest.fixture
def no_outer_block(monkeypatch: pytest.MonkeyPatch) -> None:
    """conftest's session block shares one interpreter for the whole run: these tests start from none."""
    monkeypatch.setattr(reload_process, "_shared", None)


def test_by_default_each_reload_gets_a_new_interpreter(tmp_path: Path, no_outer_block: None) -> None:
    a, b = _who(tmp_path, "a"), _who(tmp_path, "b")
    assert a["pid"] != b["pid"] and not a["hf_fsdp2"] and not b["hf_fsdp2"]


def test_in_a_block_reloads_share_one_interpreter_with_a_fresh_namespace(
    tmp_path: Path, no_outer_block
) -> None:
    with shared_reload_process():
        a, b = _who(tmp_path, "a"), _who(tmp_path, "b")
        with shared_reload_process():  # nested: the outer block's interpreter
            c = _who(tmp_path, "c")
        server = next(iter(reload_process._shared))  # type: ignore[union-attr]
    assert a["pid"] == b["pid"] == c["pid"] != os.getpid()
    assert b["leftover"] is None and c["leftover"] is None  # each request in a new namespace
    assert not any(r["hf_fsdp2"] for r in (a, b, c))
    assert server.poll() is not None  # ended with the block
    assert reload_process._shared is None


def test_a_failing_request_reports_its_error_and_the_next_one_runs(tmp_path: Path, no_outer_block) -> None:
    with shared_reload_process():
        first = _who(tmp_path, "first")
        error = run_reload(
            _file(tmp_path, FAILS, "fails"), tmp_path / "r.pt", tmp_path / "o.pt", dict(os.environ)
        )
        then = _who(tmp_path, "then")
    assert error is not None and "ValueError: the folder has no config.json" in error
    assert first["pid"] == then["pid"]


def test_an_interpreter_that_dies_is_reported_and_replaced(tmp_path: Path, no_outer_block) -> None:
    dies = "import os, signal\nos.kill(os.getpid(), signal.SIGKILL)"  # as the OOM killer would, mid-request
    with shared_reload_process():
        first = _who(tmp_path, "first")
        error = run_reload(
            _file(tmp_path, dies, "dies"), tmp_path / "r.pt", tmp_path / "o.pt", dict(os.environ)
        )
        second = _who(tmp_path, "second")
        os.kill(second["pid"], signal.SIGKILL)  # between requests: found dead, replaced before the next
        next(iter(reload_process._shared)).wait()  # type: ignore[union-attr]
        third = _who(tmp_path, "third")
    assert error is not None and "the reload process ended (status -9)" in error
    assert len({first["pid"], second["pid"], third["pid"]}) == 3


def test_each_request_runs_with_its_own_environment(tmp_path: Path, no_outer_block) -> None:
    with shared_reload_process():
        a, b = _who(tmp_path, "a", dict(os.environ, RELOAD_TEST="one")), _who(tmp_path, "b")
    assert a["pid"] == b["pid"] and a["env"] == "one" and b["env"] is None


def test_the_scripts_prints_do_not_break_the_answers(tmp_path: Path, no_outer_block) -> None:
    chatty = "import sys\nprint('{\"ok\": false}')\nprint('noise', file=sys.stderr)\n" + WHO
    with shared_reload_process():
        error = run_reload(
            _file(tmp_path, chatty, "chatty"), tmp_path / "r.pt", tmp_path / "c.json", dict(os.environ)
        )
        after = _who(tmp_path, "after")
    assert error is None and json.loads((tmp_path / "c.json").read_text())["pid"] == after["pid"]


def test_the_reload_scripts_are_files_that_import_nothing_of_hf_fsdp2() -> None:
    """Run by path, a reload script imports no package above it; one that imported hf_fsdp2 itself would make every
    verification report "the reload imported hf_fsdp2" (or worse, load through it)."""
    import ast

    from hf_fsdp2.export import reload_scripts

    scripts = sorted(reload_scripts.HERE.glob("reload_*.py"))
    assert scripts == sorted([reload_scripts.EXPORT, reload_scripts.ADAPTER, reload_scripts.SERVER])
    for script in scripts:
        names = []
        for node in ast.walk(ast.parse(script.read_text())):
            if isinstance(node, ast.Import):
                names += [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                names.append("." * node.level + (node.module or ""))
        assert names and not [n for n in names if n.startswith(("hf_fsdp2", "."))], (script.name, names)
