"""The version floors (hf_fsdp2/compat.py): refused below, accepted at and above, and one table for
pyproject.toml, scripts/setup.sh and docs/compatibility.md; ruff and mypy pinned exactly."""

from __future__ import annotations

import re
from importlib.metadata import version
from pathlib import Path

import pytest

from hf_fsdp2 import compat
from hf_fsdp2.compat import FLOORS, VersionError, check_versions, release

REPO = Path(__file__).resolve().parents[2]


def _floor(name: str) -> str:
    return ".".join(map(str, FLOORS[name]))


def test_release_numbers_ignore_local_labels_and_dev_suffixes() -> None:
    assert release("2.11.0+cu130") == (2, 11, 0)
    assert release("2.13.0a0+git1234abc") == (2, 13, 0)
    assert release("5.17.0.dev0") == (5, 17, 0)
    assert release(" 1.15 ") == (1, 15)
    with pytest.raises(ValueError, match="'nightly'"):
        release("nightly")


def test_the_floor_itself_and_newer_pass() -> None:
    at_floor = {"torch": "2.11.0+cu130", "transformers": "5.17.0", "accelerate": "1.15.0"}
    assert {name: release(v)[:2] for name, v in at_floor.items()} == FLOORS  # this test tracks the table
    check_versions(at_floor)
    check_versions({"torch": "2.13.0+cpu", "transformers": "5.24.0", "accelerate": "1.16.0rc1"})
    check_versions()  # this environment


def test_below_the_floor_or_absent_is_refused_with_each_package_and_the_fix() -> None:
    with pytest.raises(VersionError) as err:
        check_versions({"torch": "2.10.1+cu128", "transformers": "5.17.0", "accelerate": None})
    text = str(err.value)
    assert "torch 2.10.1+cu128 is older than 2.11" in text
    assert "accelerate is not installed (need accelerate>=1.15)" in text
    assert "transformers" not in text.split(". Install")[0]  # only the packages below their floor
    assert "pip install 'torch>=2.11' 'transformers>=5.17' 'accelerate>=1.15'" in text
    with pytest.raises(VersionError, match="transformers 5.16.1 is older than 5.17"):
        check_versions({"torch": "2.11.0", "transformers": "5.16.1", "accelerate": "1.15.0"})


def test_a_session_checks_the_versions_before_any_work(monkeypatch: pytest.MonkeyPatch) -> None:
    from hf_fsdp2.run.session import Session

    monkeypatch.setattr(
        compat,
        "installed_versions",
        lambda: {"torch": "2.9.0", "transformers": "5.17.0", "accelerate": "1.15.0"},
    )
    # The config is never read: the check comes first (a None config would fail on its first attribute).
    with pytest.raises(VersionError, match="torch 2.9.0 is older than 2.11"):
        Session.start(None)  # type: ignore[arg-type]


def _pyproject() -> dict:
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+ (requires-python allows 3.10)
    return tomllib.loads((REPO / "pyproject.toml").read_text())


def test_pyproject_declares_the_same_floors() -> None:
    deps = _pyproject()["project"]["dependencies"]
    for name in FLOORS:
        assert f"{name}>={_floor(name)}" in deps, (name, deps)


def test_setup_script_installs_the_floor_on_a_gpu_machine_and_the_docs_name_it() -> None:
    script = (REPO / "scripts" / "setup.sh").read_text()
    assert f'TORCH_SPEC="torch>={_floor("torch")}"' in script
    docs = (REPO / "docs" / "compatibility.md").read_text()
    for name in FLOORS:
        assert f"`{name}>={_floor(name)}`" in docs, name


@pytest.mark.parametrize("tool", ["ruff", "mypy"])
def test_lint_tools_are_pinned_exactly_to_what_is_installed(tool: str) -> None:
    dev = _pyproject()["project"]["optional-dependencies"]["dev"]
    pins = [spec for spec in dev if re.match(rf"{tool}\b", spec)]
    assert len(pins) == 1 and re.fullmatch(rf"{tool}==[\d.]+", pins[0]), pins
    assert pins[0] == f"{tool}=={version(tool)}", "pyproject.toml's pin and the installed tool differ"
