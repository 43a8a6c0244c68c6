"""The GPU checks (`bash scripts/gpu_check.sh`): skipped on a machine without CUDA.

Options (given by scripts/gpu_check.sh):

* ``--gpu-dry-run``: every check prepares its inputs and validates its commands (recipe configs parsed as the
  recipe parses them, launch lines by accelerate's own parser, bench flags by the bench's) without running
  them, on any machine;
* ``--gpu-report PATH``: one JSON summary of the session's checks: per check its name, ok, seconds (setup
  included: a fixture's run counts for the first check that uses it), its budget, key figures and the tail of
  its error; the interpreter and where the key packages came from (the node's, or the offline bundle's).

Budgets: each check carries ``@pytest.mark.budget(seconds)``, its expected time on one H200 (all together at
most 9 minutes). A check marked ``@pytest.mark.gpus(n)`` (n > 1) needs n GPUs and is skipped on one: its budget is
reported apart (``multi_gpu_budget_s``), outside the one-H200 total; so is a check marked
``@pytest.mark.needs_vllm`` (``needs_vllm_budget_s``): it runs with ``.venv-vllm``, which the lent GPU image lacks
(skipped there with the reason). The summary prints it beside the measured time and flags ``over_budget``; a check is stopped
and fails at :data:`OVER_BUDGET_FACTOR` times its budget (its subprocess timeouts are derived from it), since a
check that slow is stuck or on the wrong path (CPU kernels, recompiling), not merely slow.

This folder is a package (``__init__.py``) so that this conftest does not take the module name
``conftest`` from tests/conftest.py, which tests/support imports.
"""

from __future__ import annotations

import datetime as dt
import importlib.metadata
import importlib.util
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

HERE = Path(__file__).resolve().parent
NO_CUDA = (
    "needs a CUDA device: bash scripts/gpu_check.sh on a GPU machine (--dry-run checks the commands anywhere)"
)
OVER_BUDGET_FACTOR = 3.0
# One H200, every check: 9 of the 15 device minutes a session gets (the rest starts the machine).
TOTAL_BUDGET_S = 540
PACKAGES = ("torch", "transformers", "accelerate", "peft", "datasets", "liger_kernel", "hf_fsdp2")
_RESULTS: dict[str, dict[str, Any]] = {}
_STARTED = time.time()
_ROOT = [Path.cwd()]  # pytest's rootdir, to which report paths are relative


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("gpu checks (tests/gpu)")
    group.addoption(
        "--gpu-dry-run",
        action="store_true",
        help="prepare each GPU check and validate its commands without running them (any machine)",
    )
    group.addoption("--gpu-report", default=None, help="write the GPU checks' JSON summary to this path")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "gpu: a check of scripts/gpu_check.sh (tests/gpu; skipped without CUDA)"
    )
    config.addinivalue_line("markers", "budget(seconds): a GPU check's expected time on one H200")
    config.addinivalue_line("markers", "gpus(n): a GPU check that needs n CUDA devices (skipped with fewer)")
    config.addinivalue_line(
        "markers", "needs_vllm: a GPU check that runs vLLM from .venv-vllm (skipped without it; budget apart)"
    )
    _ROOT[0] = config.rootpath


def dry_run(config: pytest.Config) -> bool:
    # default: this conftest may be loaded after the command line was parsed (pytest tests)
    return bool(config.getoption("--gpu-dry-run", default=False))


def _ours(path: str | Path) -> bool:
    return (_ROOT[0] / path).resolve().is_relative_to(HERE)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if _ours(item.path):
            budget = budget_of(item)
            item.user_properties.append(("budget_s", budget))
            gpus = item.get_closest_marker("gpus")
            item.user_properties.append(("min_gpus", int(gpus.args[0]) if gpus else 1))
            item.user_properties.append(("needs_vllm", item.get_closest_marker("needs_vllm") is not None))
            # pytest-timeout's limit, so that a stuck check stops and the others still run
            item.add_marker(pytest.mark.timeout(OVER_BUDGET_FACTOR * budget + 30))
    if dry_run(config) or torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason=NO_CUDA)
    for item in items:
        if _ours(item.path):
            item.add_marker(skip)


@dataclass
class Check:
    """What a check test gets: whether this is a dry run, its folder, and the figures it reports."""

    dry: bool
    work: Path
    figures: dict[str, Any]
    budget_s: float = 60.0

    def timeout(self, share: float = 1.0) -> float:
        """The hard limit of a subprocess taking ``share`` of this check's budget: OVER_BUDGET_FACTOR times it."""
        return OVER_BUDGET_FACTOR * self.budget_s * share


def budget_of(item: pytest.Item) -> float:
    marker = item.get_closest_marker("budget")
    if marker is None:
        raise ValueError(f"{item.nodeid} has no @pytest.mark.budget(seconds): every GPU check needs one")
    return float(marker.args[0])


@pytest.fixture
def check(request: pytest.FixtureRequest, tmp_path: Path) -> Check:
    figures: dict[str, Any] = {}
    # The report of each phase carries this dict: figures set before a failure are reported with it.
    request.node.user_properties.append(("figures", figures))
    return Check(dry_run(request.config), tmp_path, figures, budget_of(request.node))


def _name(nodeid: str) -> str:
    return nodeid.split("::")[-1].removeprefix("test_")


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if not _ours(report.fspath):
        return
    entry = _RESULTS.setdefault(
        report.nodeid,
        {"name": _name(report.nodeid), "ok": None, "seconds": 0.0, "figures": {}, "error_tail": None},
    )
    entry["seconds"] = round(entry["seconds"] + report.duration, 2)
    for key, value in report.user_properties:
        if key == "figures" and isinstance(value, dict):
            entry["figures"].update(value)
        if key in ("budget_s", "min_gpus", "needs_vllm"):
            entry[key] = value
    if "budget_s" in entry:
        entry["over_budget"] = entry["seconds"] > entry["budget_s"]
    if report.skipped:
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        entry["skipped"] = str(reason).removeprefix("Skipped: ")
    elif report.failed:
        entry["ok"] = False
        crash = getattr(getattr(report.longrepr, "reprcrash", None), "message", "")
        text = f"[{report.when}] {crash[:1000]}\n...\n{report.longreprtext[-2500:]}"
        entry["error_tail"] = f"{entry['error_tail']}\n{text}" if entry["error_tail"] else text
    elif report.when == "call" and entry["ok"] is None:
        entry["ok"] = True


def _where(name: str) -> str | None:
    """``version (folder)`` of an importable package, None when it is not installed."""
    spec = importlib.util.find_spec(name)
    if spec is None:
        return None
    try:
        version = importlib.metadata.version(name.replace("_", "-"))
    except importlib.metadata.PackageNotFoundError:
        version = "checkout"
    origin = spec.origin or next(iter(spec.submodule_search_locations or []), "?")
    return f"{version} ({Path(origin).parent})"


def _device() -> dict[str, Any]:
    info: dict[str, Any] = {"torch": torch.__version__, "cuda": torch.version.cuda, "python": sys.executable}
    info["packages"] = {name: _where(name) for name in PACKAGES}
    if torch.cuda.is_available():
        info["device"] = torch.cuda.get_device_name(0)
        info["device_count"] = torch.cuda.device_count()
        info["memory_gib"] = round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1)
    else:
        info["device"] = "cpu (no CUDA device)"
    return info


def _on_one_gpu(entry: dict[str, Any]) -> bool:
    """Whether a check counts towards the one-H200 total: one GPU and nothing the lent image lacks."""
    return entry.get("min_gpus", 1) == 1 and not entry.get("needs_vllm")


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    path = session.config.getoption("--gpu-report", default=None)
    if not path:
        return
    checks = list(_RESULTS.values())
    report = {
        "dry_run": dry_run(session.config),
        "finished": dt.datetime.now().isoformat(timespec="seconds"),
        "wall_s": round(time.time() - _STARTED, 1),
        **_device(),
        "passed": sum(c["ok"] is True for c in checks),
        "failed": sum(c["ok"] is False for c in checks),
        "skipped": sum("skipped" in c and c["ok"] is None for c in checks),
        "budget_s": sum(c.get("budget_s", 0) for c in checks if _on_one_gpu(c)),
        "multi_gpu_budget_s": sum(c.get("budget_s", 0) for c in checks if c.get("min_gpus", 1) > 1),
        "needs_vllm_budget_s": sum(
            c.get("budget_s", 0) for c in checks if c.get("needs_vllm") and c.get("min_gpus", 1) == 1
        ),
        "total_budget_s": TOTAL_BUDGET_S,
        "over_budget": [c["name"] for c in checks if c.get("over_budget")],
        "checks": checks,
    }
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(report, indent=1, default=str))


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
    # Shown when the checks were asked for (the summary, a dry run, a GPU), not in a CPU run of the suite.
    asked = config.getoption("--gpu-report", default=None) or dry_run(config)
    if not _RESULTS or not (asked or any(e["ok"] is not None for e in _RESULTS.values())):
        return
    terminalreporter.section(
        "GPU checks" + (" (dry run: commands validated, nothing run)" if dry_run(config) else "")
    )
    for entry in _RESULTS.values():
        state = {True: "ok", False: "FAILED", None: "skipped"}[entry["ok"]]
        shown = {k: v for k, v in entry["figures"].items() if isinstance(v, int | float | bool)}
        figures = ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in shown.items())
        budget = entry.get("budget_s")
        timing = f"{entry['seconds']:7.1f} s / {budget:5.0f} s" if budget else f"{entry['seconds']:7.1f} s"
        flag = " OVER BUDGET" if entry.get("over_budget") and entry["ok"] is not None else ""
        terminalreporter.write_line(f"{entry['name']:<28} {state:<8} {timing}{flag}  {figures[:220]}")
    total = sum(e.get("budget_s", 0) for e in _RESULTS.values() if _on_one_gpu(e))
    terminalreporter.write_line(
        f"budgets: {total:.0f} s of {TOTAL_BUDGET_S} s (one H200); time / budget above"
    )
