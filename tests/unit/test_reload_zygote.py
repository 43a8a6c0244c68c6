"""The launch server's reload zygote (tests/support/reload_zygote.py) answers as the product's fresh interpreter does
(hf_fsdp2/export/reload_process.py): the same findings, the same error for a failing script, a named end for one that
dies; each request in its own process with no hf_fsdp2 module; and it ends with the process that started it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from support import reload_zygote

from hf_fsdp2.export import reload_process

REPO = Path(__file__).resolve().parents[2]
WHO = r"""
import json, os, sys
print("noise on stdout"); print("noise on stderr", file=sys.stderr)
with open(sys.argv[2], "w") as f:
    json.dump({"pid": os.getpid(), "argv": sys.argv, "name": __name__, "env": os.environ.get("RELOAD_TEST"),
               "hf_fsdp2": any(m.startswith("hf_fsdp2") for m in sys.modules), "path0": sys.path[0]}, f)
"""
FAILS = "import json\nraise ValueError('the folder has no config.json')"
EXITS = "import sys\nsys.exit('no weights in the folder')"
DIES = "import os, signal\nos.kill(os.getpid(), signal.SIGKILL)"  # as the OOM killer would

# Starts the zygote and lives until its stdin closes (the zygote ends with it).
_PARENT = r"""
import sys
sys.path.insert(0, sys.argv[2])
import reload_zygote
print(reload_zygote.start(sys.argv[1]), flush=True)
sys.stdin.read()
"""


@pytest.fixture(scope="module")
def zygote(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, subprocess.Popen[str], int]]:
    path = str(tmp_path_factory.mktemp("zygote") / "reload.sock")
    parent = subprocess.Popen(
        [sys.executable, "-c", _PARENT, path, str(REPO / "tests" / "support")],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert parent.stdout is not None
    pid = int(parent.stdout.readline())
    yield path, parent, pid
    parent.kill()
    parent.wait()


def _file(tmp: Path, text: str) -> Path:
    """The script ``text`` as a file (reloads run script files: hf_fsdp2/export/reload_scripts/)."""
    script = tmp / "scripts" / f"script{abs(hash(text))}.py"
    script.parent.mkdir(exist_ok=True)
    script.write_text(text)
    return script


def _both(text: str, tmp: Path, path: str, env: dict[str, str]) -> tuple[str | None, str | None]:
    script = _file(tmp, text)
    monkey = reload_process._shared
    reload_process._shared = None  # conftest's session block shares one interpreter: compare with a fresh one
    try:
        fresh = reload_process.run_reload(script, tmp / "req.pt", tmp / "fresh.json", env)
    finally:
        reload_process._shared = monkey
    return fresh, reload_zygote.run_reload(path, script, tmp / "req.pt", tmp / "forked.json", env)


def test_the_zygote_answers_as_a_fresh_interpreter(tmp_path: Path, zygote) -> None:
    path, _, zygote_pid = zygote
    env = dict(os.environ, RELOAD_TEST="one")
    assert _both(WHO, tmp_path, path, env) == (None, None)
    fresh = json.loads((tmp_path / "fresh.json").read_text())
    forked = json.loads((tmp_path / "forked.json").read_text())
    assert forked["pid"] not in (os.getpid(), zygote_pid)  # a process of its own
    assert forked["hf_fsdp2"] is False and fresh["hf_fsdp2"] is False
    script = str(_file(tmp_path, WHO))
    assert forked["argv"] == [script, str(tmp_path / "req.pt"), str(tmp_path / "forked.json")]
    assert fresh["argv"] == [script, str(tmp_path / "req.pt"), str(tmp_path / "fresh.json")]
    assert forked["name"] == fresh["name"] == "__main__"
    assert forked["path0"] == fresh["path0"] == str(tmp_path / "scripts")  # python script: its folder first
    assert forked["env"] == fresh["env"] == "one"
    second = reload_zygote.run_reload(
        path, _file(tmp_path, WHO), tmp_path / "r.pt", tmp_path / "again.json", dict(os.environ)
    )
    assert second is None
    again = json.loads((tmp_path / "again.json").read_text())
    assert again["pid"] != forked["pid"] and again["env"] is None  # a new process, its own environment

    for script in (FAILS, EXITS):
        fresh_error, forked_error = _both(script, tmp_path, path, dict(os.environ))
        assert fresh_error is not None and forked_error == fresh_error, (fresh_error, forked_error)
    fresh_error, forked_error = _both(DIES, tmp_path, path, dict(os.environ))
    assert fresh_error is not None and forked_error is not None
    assert "the reload process ended" in forked_error
    # Still serving after a child died.
    assert (
        reload_zygote.run_reload(
            path, _file(tmp_path, WHO), tmp_path / "r.pt", tmp_path / "last.json", dict(os.environ)
        )
        is None
    )


CODE = r"""
import json, os, sys
print(json.dumps({"argv": sys.argv, "path0": sys.path[0], "cwd": os.getcwd(), "env": os.environ.get("RELOAD_TEST"),
                  "hf_fsdp2": any(m.startswith("hf_fsdp2") for m in sys.modules), "name": __name__}))
print("to stderr", file=sys.stderr)
if sys.argv[1] == "exit":
    sys.exit(3)
if sys.argv[1] == "raise":
    raise ValueError("the folder has no config.json")
"""


@pytest.mark.parametrize("how", ["ok", "exit", "raise"])
def test_run_code_is_python_dash_c(tmp_path: Path, zygote, how: str) -> None:
    """A test's ``python -c code args`` (tests/support/launch.py's ``python("-c", ...)``) forked from the zygote: the
    same status, output, argv, working folder, environment and first path entry as a new interpreter's."""
    path, _, _ = zygote
    env = dict(os.environ, RELOAD_TEST=how)
    fresh = subprocess.run(
        [sys.executable, "-c", CODE, how, "x"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    out, err = tmp_path / "out", tmp_path / "err"
    status = reload_zygote.run_code(
        path, CODE, [how, "x"], env=env, cwd=str(tmp_path), stdout=str(out), stderr=str(err), timeout=120
    )
    assert status == fresh.returncode == {"ok": 0, "exit": 3, "raise": 1}[how]
    assert (
        json.loads(out.read_text())
        == json.loads(fresh.stdout)
        == {
            "argv": ["-c", how, "x"],
            "path0": "",
            "cwd": str(tmp_path),
            "env": how,
            "hf_fsdp2": False,
            "name": "__main__",
        }
    )
    assert err.read_text().startswith("to stderr\n")
    if how == "raise":  # the same traceback: from the code's own frame on
        assert err.read_text().splitlines()[1:] == fresh.stderr.splitlines()[1:], (
            err.read_text(),
            fresh.stderr,
        )


def test_the_zygote_ends_with_the_process_that_started_it(zygote) -> None:
    path, parent, zygote_pid = zygote
    assert parent.stdin is not None
    parent.stdin.close()
    parent.wait(timeout=30)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            os.kill(zygote_pid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.1)
    else:
        pytest.fail(f"the zygote {zygote_pid} outlived its parent")
    assert reload_zygote.run_reload(path, Path("who.py"), Path("r"), Path("o"), {}) is not None
