"""scripts/offline_bundle.sh: the offline install bundle for an air-gapped node, end to end on CPU.

The slow test plays both machines on this one. The "node" is a fresh virtual environment (no pip of its own)
that has only torch and the binary data stack: this machine's CPU torch, pyarrow and pandas and their dependencies
(filelock, sympy, numpy, ...), linked from the test environment into one folder that a .pth file puts on the venv's
path, as a node's preinstalled torch sits outside what pip installs. Installing it instead (`pip install torch==2.13.0`) takes torch from local disk
(/opt/wheels) but, with PIP_NO_INDEX=1, fails on torch's own dependencies, which come from an index; it also
took 165 s of this test's time on a loaded 2-core machine. The bundle is built by the script for this Python
with the node's `pip freeze` as --have, so it holds everything but those: with pyarrow and pandas ~113 MiB for
Python 3.11 (pyarrow alone 52 MiB; unpacked by the build and both installs: 15 s more of this test), so
--max-mib 256 here; the reference node has pyarrow, pandas and
transformers already, and its bundle is ~2 MiB. Every install from the bundle runs with PIP_NO_INDEX=1, no pip
configuration file (PIP_CONFIG_FILE=/dev/null) and no PIP_FIND_LINKS: only the bundle is visible, so a package
missing from it fails the install (checked: the bundle less multiprocess is refused) or the imports (the
--target variant installs without dependency checks). Both documented ways are run, with --no-compile (the
byte-compilation of ~45 packages is not what is tested): the read-only-python variant (`--no-deps --target DIR
-r requirements.txt` + PYTHONPATH: every bundled package imported and a JSON dataset loaded) and the install
(`--no-index --find-links BUNDLE hf_fsdp2`) followed by a 2-process, 2-step SFT run of a tiny random Llama whose
tokenizer the test saves (the node has no wordllama), its export written and verified. torch is the same
files before and after each.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from types import ModuleType

import pytest
from support.launch import REPO
from support.tiny import make_tiny_llama_dir, write_chat_jsonl

SCRIPT = REPO / "scripts" / "offline_bundle.sh"


def _module() -> ModuleType:
    spec = importlib.util.spec_from_file_location("offline_bundle", REPO / "scripts" / "offline_bundle.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["offline_bundle"] = module  # dataclasses resolve the module's annotations through sys.modules
    spec.loader.exec_module(module)
    return module


ob = _module()


# ---------------------------------------------------------------- fast: arguments, --have, markers, size


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--python-version", "312"], "--python-version '312': expected MAJOR.MINOR"),
        (["--platform", "win_amd64"], "--platform 'win_amd64': expected a Linux tag"),
        (["--have", "/nonexistent/freeze.txt"], "python3 -m pip freeze > FILE"),
        (["--max-mib", "0"], "--max-mib 0: must be positive"),
        (["--extra", "liger kernel!"], "--extra 'liger kernel!': not a requirement"),
    ],
)
def test_bad_arguments_are_refused_with_the_fix(argv: list[str], message: str, capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        ob.parse_args(argv)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_arguments_default_to_this_python_the_64_mib_limit_and_liger() -> None:
    args = ob.parse_args([])
    assert args.python_version == f"{sys.version_info.major}.{sys.version_info.minor}"
    assert (
        args.max_mib == 64
        and args.extra == ["liger-kernel", "torchao"]
        and args.dest == REPO / "offline_bundle"
    )
    assert ob.parse_args(["--extra", "none"]).extra == []


def test_have_reads_a_pip_freeze() -> None:
    have = ob.parse_have(
        "# comment\n-e git+https://x/y.git#egg=z\ntorch==2.11.0+cu130\nPyYAML==6.0.2\nfoo @ file:///w/foo.whl\nbar\n"
    )
    assert {k: str(v) if v else None for k, v in have.items()} == {
        "torch": "2.11.0+cu130",
        "pyyaml": "6.0.2",
        "foo": None,
        "bar": None,
    }
    with pytest.raises(ValueError, match="cannot read the line 'not a freeze line'"):
        ob.parse_have("not a freeze line\n")


def test_markers_are_evaluated_for_the_target_not_this_machine() -> None:
    from packaging.markers import Marker

    env = ob.target_environment("3.12", "manylinux_2_28_x86_64")
    assert not Marker('python_version < "3.11"').evaluate(env)
    assert Marker('python_version >= "3.12"').evaluate(env)  # false on this 3.11 builder
    assert Marker('platform_machine == "x86_64"').evaluate(env)
    assert not Marker('sys_platform == "win32"').evaluate(env)
    assert ob.target_environment("3.10", "manylinux_2_28_aarch64")["platform_machine"] == "aarch64"
    tags = ob.platform_tags("manylinux_2_28_x86_64")
    assert (
        tags[0] == "manylinux_2_28_x86_64"
        and "manylinux_2_17_x86_64" in tags
        and "manylinux2014_x86_64" in tags
    )
    assert "manylinux_2_29_x86_64" not in tags


def test_what_the_node_has_or_must_keep_is_never_downloaded(tmp_path: Path) -> None:
    """No pip call is made: torch/triton/nvidia-*/cuda-* are left out, and the node's satisfying versions kept."""
    from packaging.requirements import Requirement
    from packaging.version import Version

    roots = [
        Requirement(r) for r in ("torch>=2.0", "triton", "nvidia-nccl-cu13", "cuda-bindings", "pandas>=2")
    ]
    roots.append(Requirement('tomli; python_version < "3.11"'))
    plan = ob.resolve(roots, {"pandas": Version("3.1.1")}, tmp_path, "3.12", "manylinux_2_28_x86_64")
    assert plan.bundle == {} and plan.kept == {"pandas": Version("3.1.1")} and not any(tmp_path.iterdir())


def test_the_size_limit_fails_the_build(tmp_path: Path) -> None:
    (tmp_path / "big.whl").write_bytes(b"\0" * (2 * ob.MIB))
    assert ob.check_size(tmp_path, 3) == pytest.approx(2.0)
    with pytest.raises(RuntimeError, match=r"is 2.0 MiB, over the limit of 1 MiB; fix: pass the node's"):
        ob.check_size(tmp_path, 1)


def test_a_folder_it_did_not_make_is_not_replaced(tmp_path: Path, capsys) -> None:
    (tmp_path / "precious.txt").write_text("x")
    assert ob.main(["--dest", str(tmp_path)]) == 2
    assert "was not made by this script" in capsys.readouterr().err and (tmp_path / "precious.txt").exists()


# ---------------------------------------------------------------- slow: build, install offline, train


def _offline_env(**extra: str) -> dict[str, str]:
    """The node: no index, no pip configuration, nothing but what the command names."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("PIP_") and k not in ("PYTHONPATH", "VIRTUAL_ENV")
    }
    env.update(
        PIP_NO_INDEX="1",
        PIP_CONFIG_FILE=os.devnull,
        PIP_DISABLE_PIP_VERSION_CHECK="1",
        HF_HUB_OFFLINE="1",
        HF_DATASETS_OFFLINE="1",
        OMP_NUM_THREADS="1",
        TOKENIZERS_PARALLELISM="false",
        **extra,
    )
    return env


def _run(
    cmd: list[str], env: dict[str, str], cwd: Path, timeout: int = 300
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout)


def _pip(venv: Path, *args: str) -> list[str]:
    """pip acting on ``venv`` (which has no pip of its own: only torch)."""
    return [sys.executable, "-m", "pip", "--python", str(venv / "bin" / "python"), *args]


def _torch_state(venv: Path, env: dict[str, str]) -> tuple[str, str]:
    """torch's version and the file it is imported from (a second torch installed by pip would shadow it)."""
    proc = _run(
        [str(venv / "bin" / "python"), "-c", "import torch; print(torch.__version__, torch.__file__)"],
        env,
        venv,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    version, where = proc.stdout.split()
    return version, where


# What the node has besides torch: the binary data stack (~80 MiB of wheels: pyarrow alone 52), as the reference
# node has it; a bundle that repeats it adds unpacking time to the build and to both installs, not another case.
NODE_HAS = ("pyarrow", "pandas")


def _node_with_only_torch(root: Path) -> Path:
    """A venv without pip that sees torch and its dependencies (linked from the test environment) and nothing else."""
    from importlib import metadata

    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    venv, shelf = root / "node", root / "node-torch"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    shelf.mkdir()
    seen: set[str] = set()
    queue = ["torch", *NODE_HAS]
    while queue:
        name = canonicalize_name(queue.pop())
        if name in seen:
            continue
        seen.add(name)
        dist = metadata.distribution(name)
        for top in {
            f.parts[0] for f in dist.files or [] if f.parts[0] != ".." and f.parts[0] != "__pycache__"
        }:
            if not top.endswith(".pth"):
                (shelf / top).symlink_to(str(dist.locate_file(top)))
        queue += [
            r.name
            for r in map(Requirement, dist.requires or [])
            if r.marker is None or r.marker.evaluate({"extra": ""})
        ]
    site = _run(
        [str(venv / "bin" / "python"), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        _offline_env(),
        root,
    ).stdout.strip()
    Path(site, "node_torch.pth").write_text(f"{shelf}\n")
    return venv


# Everything the recipes import (datasets with its dill/multiprocess/fsspec/pyarrow stack, peft, accelerate),
# a JSON dataset loaded through datasets, and where hf_fsdp2 comes from.
IMPORTS = """
import sys, datasets, dill, multiprocess, peft, accelerate, transformers, hf_fsdp2, hf_fsdp2.run.loop
import hf_fsdp2.methods.sft, hf_fsdp2.methods.dpo, hf_fsdp2.methods.cpt
print(datasets.load_dataset("json", data_files=sys.argv[1])["train"].num_rows, hf_fsdp2.__file__)
"""


def _train(cmd: list[str], env: dict[str, str], cwd: Path, model: Path, data: Path) -> str:
    recipe = cwd / "recipe.yaml"
    recipe.write_text(
        f"model_name_or_path: {model}\ndataset_name: {data}\noutput_dir: {cwd / 'run'}\nmax_steps: 2\n"
        "per_device_train_batch_size: 2\nmax_length: 64\nlearning_rate: 1.0e-3\nmixed_precision: 'no'\n"
        "logging_steps: 1\nwarmup_steps: 0\n"
    )
    proc = _run([*cmd, "train", "--config", str(recipe)], env, cwd, timeout=400)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-6000:]
    assert "world size 2 on cpu" in log and "export verified" in log, log[-4000:]
    assert (cwd / "run" / "model.safetensors").is_file() and (cwd / "run" / "tokenizer.json").is_file()
    return log


@pytest.mark.slow
def test_the_bundle_installs_offline_beside_the_nodes_torch_and_trains(tmp_path: Path) -> None:
    import torch

    t0 = time.monotonic()
    venv = _node_with_only_torch(tmp_path)
    env = _offline_env()
    before = _torch_state(venv, env)
    assert before[0] == torch.__version__
    freeze = _run(_pip(venv, "freeze"), env, tmp_path)
    assert freeze.returncode == 0 and f"torch=={torch.__version__}" in freeze.stdout, freeze.stderr[-2000:]
    assert "transformers" not in freeze.stdout and "datasets" not in freeze.stdout, freeze.stdout
    (tmp_path / "node-freeze.txt").write_text(freeze.stdout)
    t_node = time.monotonic()

    bundle = tmp_path / "bundle"
    build = _run(
        [
            "bash",
            str(SCRIPT),
            "--dest",
            str(bundle),
            "--have",
            str(tmp_path / "node-freeze.txt"),
            "--max-mib",
            "256",
        ],
        {**os.environ, "PYTHON": sys.executable},
        REPO,
        timeout=600,
    )
    assert build.returncode == 0, build.stdout[-3000:] + build.stderr[-3000:]
    assert "MiB (limit 256 MiB)" in build.stdout and "the node keeps filelock==" in build.stdout
    pins = [line for line in (bundle / "requirements.txt").read_text().splitlines() if "==" in line]
    names = {p.split("==")[0] for p in pins}
    assert {
        "datasets",
        "dill",
        "multiprocess",
        "liger-kernel",
        "torchao",
        "hf_fsdp2",
        "transformers",
        "accelerate",
    } <= names
    assert not {n for n in names if ob.EXCLUDED.match(n)} and "filelock" not in names, names
    assert not {"pyarrow", "pandas", "numpy"} & names, names  # the node's, kept through --have
    assert len(list(bundle.glob("*.whl"))) == len(pins)
    t_build = time.monotonic()

    # Nothing but the bundle is visible: less one wheel, the install is refused and names what is missing.
    partial = tmp_path / "partial"
    shutil.copytree(bundle, partial, ignore=shutil.ignore_patterns("multiprocess-*"))
    refused = _run(
        _pip(venv, "install", "--dry-run", "--no-index", "--find-links", str(partial), "hf_fsdp2"),
        env,
        tmp_path,
    )
    assert refused.returncode != 0 and "multiprocess" in refused.stderr, (
        refused.stdout + refused.stderr[-2000:]
    )

    model = make_tiny_llama_dir(tmp_path / "model", seed=3)
    data = write_chat_jsonl(tmp_path / "chat.jsonl", 16, seed=5)

    # (b) read-only python: the exact pins unpacked into a folder on PYTHONPATH; nothing installed in the venv.
    site = tmp_path / "offline_site"
    target = _run(
        _pip(
            venv,
            "install",
            "-q",
            "--no-compile",
            "--no-index",
            "--no-deps",
            "--target",
            str(site),
            "-r",
            str(bundle / "requirements.txt"),
        ),
        env,
        tmp_path,
    )
    assert target.returncode == 0, target.stderr[-3000:]
    check = _run(
        [str(venv / "bin" / "python"), "-c", IMPORTS, str(data)], _offline_env(PYTHONPATH=str(site)), tmp_path
    )
    assert check.returncode == 0, check.stderr[-3000:]
    assert check.stdout.split()[-2:] == ["16", str(site / "hf_fsdp2" / "__init__.py")], check.stdout
    assert _torch_state(venv, env) == before
    t_target = time.monotonic()

    # (a) the README's install: pip keeps the node's torch (no torch in the bundle; it satisfies the floor).
    install = _run(
        _pip(venv, "install", "--no-compile", "--no-index", "--find-links", str(bundle), "hf_fsdp2"),
        env,
        tmp_path,
    )
    assert install.returncode == 0, install.stdout[-2000:] + install.stderr[-3000:]
    installed = install.stdout.split("Successfully installed")[-1].split()
    assert any(n.startswith("datasets-") for n in installed), install.stdout[-2000:]
    assert not [n for n in installed if n.startswith("torch-")] and "Uninstalling torch" not in install.stdout
    assert _torch_state(venv, env) == before
    run_a = tmp_path / "a"
    run_a.mkdir()
    _train([str(venv / "bin" / "hf-fsdp2")], env, run_a, model, data)
    t_end = time.monotonic()
    print(
        f"node venv {t_node - t0:.0f} s, bundle {t_build - t_node:.0f} s, --target variant + imports "
        f"{t_target - t_build:.0f} s, install + run {t_end - t_target:.0f} s"
    )
