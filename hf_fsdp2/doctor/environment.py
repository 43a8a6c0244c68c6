"""``hf-fsdp2 doctor``'s environment checks: package versions against the declared floors and the known upstream bugs
(``known_issues.json``, one entry per bug with its issue), CUDA / NCCL and the devices against the processes asked
for, and the debug variables set with what each costs."""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from importlib.metadata import PackageNotFoundError, requires, version
from importlib.resources import files
from typing import Any

from hf_fsdp2.compat import FLOORS, release
from hf_fsdp2.parallel.launch_config import Finding

PACKAGES = ("torch", "transformers", "accelerate", "peft", "datasets", "safetensors")

# name -> (level, what it costs); a value of "" matches any value, else the listed values (upper case).
_DEBUG_COSTS: dict[str, tuple[tuple[str, ...], str, str]] = {
    "CUDA_LAUNCH_BLOCKING": (("1",), "warning", "every CUDA kernel launch waits for its kernel: steps several times "
                             "slower, no overlap of compute and communication; for locating a CUDA error only"),
    "TORCH_NCCL_BLOCKING_WAIT": (("1",), "warning", "the host blocks on every collective: FSDP2's all-gathers no "
                                 "longer overlap compute"),
    "NCCL_BLOCKING_WAIT": (("1",), "warning", "the host blocks on every collective (older name of "
                           "TORCH_NCCL_BLOCKING_WAIT)"),
    "TORCH_DISTRIBUTED_DEBUG": (("DETAIL",), "warning", "DETAIL checks every collective's shapes across ranks with "
                                "extra collectives: slower steps (distributed_debug: detail sets it on purpose)"),
    "NCCL_DEBUG": (("TRACE",), "warning", "NCCL logs every collective call: slow and large logs (INFO logs only "
                   "setup, cheap)"),
    "TORCH_LOGS": (("",), "warning", "torch.compile logging: slower compiles and large logs"),
    "TORCHDYNAMO_VERBOSE": (("1",), "warning", "full dynamo stack traces: large logs"),
    "NCCL_P2P_DISABLE": (("1",), "warning", "GPU-to-GPU copies go through host memory: FSDP2's all-gathers and "
                         "reduce-scatters slow down"),
    "NCCL_SHM_DISABLE": (("1",), "warning", "no shared-memory transport within a node: slower collectives"),
    "PYTORCH_NO_CUDA_MEMORY_CACHING": (("1",), "warning", "the caching allocator is off: every allocation calls "
                                       "cudaMalloc, much slower"),
}  # fmt: skip
_CHEAP = "a debug aid with little cost"


def declared_floors() -> dict[str, str]:
    """package -> the oldest version ``hf_fsdp2`` declares (its installed metadata; the compat floors else)."""
    floors = {name: ".".join(map(str, floor)) for name, floor in FLOORS.items()}
    try:
        for line in requires("hf_fsdp2") or []:
            found = re.match(r"^([A-Za-z0-9_.-]+)\s*>=\s*([0-9][0-9.]*)", line)
            if found and ";" not in line:
                floors[found.group(1).lower().replace("_", "-")] = found.group(2)
    except PackageNotFoundError:
        pass
    return floors


def known_issues() -> list[dict[str, Any]]:
    """The known upstream bugs that bite FSDP2 users (``known_issues.json``)."""
    return list(json.loads(files("hf_fsdp2.doctor").joinpath("known_issues.json").read_text()))


def _installed(name: str) -> str | None:
    try:
        return version(name)
    except PackageNotFoundError:
        return None


def version_findings(installed: Mapping[str, str | None] | None = None) -> list[Finding]:
    """Each package against its declared floor, then every known bug whose affected versions are installed."""
    from packaging.specifiers import SpecifierSet
    from packaging.version import Version

    have = {name: _installed(name) for name in PACKAGES} if installed is None else dict(installed)
    floors = declared_floors()
    out = []
    for name in PACKAGES:
        found, floor = have.get(name), floors.get(name)
        if found is None:
            out.append(
                Finding(
                    level="error",
                    check=name,
                    value="not installed",
                    message="hf_fsdp2 needs it",
                    fix=f"pip install '{name}>={floor}'",
                )
            )
        elif floor and release(found) < release(floor):
            out.append(
                Finding(
                    level="error",
                    check=name,
                    value=found,
                    message=f"older than {floor}, the oldest release hf_fsdp2 declares",
                    fix=f"pip install '{name}>={floor}'",
                )
            )
        else:
            out.append(
                Finding(level="ok", check=name, value=found, message=f">= {floor}" if floor else "installed")
            )
    for issue in known_issues():
        found = have.get(issue["package"])
        if found is None:
            continue
        plain = ".".join(
            map(str, release(found))
        )  # a local label (+cu130) or dev build counts as its release
        if Version(plain) in SpecifierSet(issue["affected"]):
            out.append(
                Finding(
                    level="warning",
                    check=f"{issue['package']} known bug",
                    value=found,
                    message=f"{issue['what']} ({issue['url']})",
                    fix=issue["fix"],
                )
            )
    return out


def cuda_findings(asked_per_node: int | None, *, use_cpu: bool | None = None) -> list[Finding]:
    """CUDA and NCCL availability and versions; the GPUs of this node against the processes asked per node."""
    import torch

    out = []
    if not torch.cuda.is_available():
        level = "warning" if use_cpu is False else "ok"
        note = "the accelerate config asks for GPUs (use_cpu: false): " if use_cpu is False else ""
        out.append(
            Finding(
                level=level,
                check="cuda",
                value="not available",
                message=note + "every process runs on CPU with gloo (tests, the "
                f"demo); torch {torch.__version__}",
                fix="a CUDA build of torch on a GPU node" if note else "",
            )
        )
        return out
    devices = torch.cuda.device_count()
    names = sorted({torch.cuda.get_device_name(i) for i in range(devices)})
    out.append(
        Finding(
            level="ok",
            check="cuda",
            value=f"{torch.version.cuda}",
            message=f"{devices} GPU(s): {', '.join(names)}",
        )
    )
    try:
        nccl = ".".join(map(str, torch.cuda.nccl.version()))
        out.append(Finding(level="ok", check="nccl", value=nccl, message="the collectives' backend"))
    except (AttributeError, RuntimeError) as err:
        out.append(
            Finding(
                level="error",
                check="nccl",
                value="unavailable",
                message=f"torch.cuda.nccl: {err}",
                fix="a torch build with NCCL",
            )
        )
    if asked_per_node is not None and asked_per_node > devices:
        out.append(
            Finding(
                level="error",
                check="processes",
                value=f"{asked_per_node} per node, {devices} GPUs",
                message="processes would share GPUs (out of memory, or NCCL refusing duplicate devices)",
                fix=f"--num_processes {devices} per node",
            )
        )
    elif asked_per_node is not None and asked_per_node < devices:
        out.append(
            Finding(
                level="warning",
                check="processes",
                value=f"{asked_per_node} per node, {devices} GPUs",
                message=f"{devices - asked_per_node} GPU(s) idle",
                fix=f"--num_processes {devices} per node",
            )
        )
    elif asked_per_node is not None:
        out.append(
            Finding(level="ok", check="processes", value=f"{asked_per_node} per node", message="one per GPU")
        )
    return out


def debug_findings(environ: Mapping[str, str], machines: int = 1) -> list[Finding]:
    """Every ``NCCL_*`` / ``TORCH_*`` / CUDA debug variable set, with what it costs (``NCCL_IB_DISABLE`` only costs
    across ``machines``: within a node NCCL goes over NVLink, PCIe P2P or shared memory)."""
    out = []
    if environ.get("NCCL_IB_DISABLE") == "1":
        ib = "collectives between nodes go over TCP sockets, not InfiniBand"
        out.append(
            Finding(
                level="warning",
                check="NCCL_IB_DISABLE",
                value="1",
                message=ib,
                fix="unset it for multi-node runs",
            )
            if machines > 1
            else Finding(
                level="ok",
                check="NCCL_IB_DISABLE",
                value="1",
                message="one node: NCCL uses NVLink / PCIe P2P / shared memory",
            )
        )
    for name in sorted(environ):
        if name == "NCCL_IB_DISABLE" and environ[name] == "1":
            continue
        if not (name.startswith(("NCCL_", "TORCH_", "TORCHDYNAMO_")) or name in _DEBUG_COSTS):
            continue
        value = environ[name]
        values, level, cost = _DEBUG_COSTS.get(name, ((), "ok", _CHEAP))
        costly = bool(values) and ("" in values or value.upper() in values)
        if costly:
            out.append(
                Finding(
                    level=level, check=name, value=value, message=cost, fix=f"unset {name} for training runs"
                )
            )
        else:
            out.append(
                Finding(
                    level="ok",
                    check=name,
                    value=value,
                    message=_CHEAP if name not in _DEBUG_COSTS else "set, at a cheap value",
                )
            )
    return out
