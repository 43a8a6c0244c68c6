"""Build an offline install bundle: wheels of what an air-gapped node lacks, for a chosen Python and platform.

Run through scripts/offline_bundle.sh (its header gives the install commands). On a connected machine this:

1. walks the dependency closure of the roots (hf_fsdp2's runtime dependencies from pyproject.toml, plus
   ``--extra`` packages: liger-kernel and torchao by default), evaluating each wheel's ``Requires-Dist`` markers for the
   target (Python ``--python-version`` on Linux ``--platform``), skipping torch, triton, nvidia-* and cuda-*
   (the node keeps its own CUDA stack) and whatever ``--have`` (the node's ``pip freeze``) already satisfies;
2. pins each package to the version installed in the builder's environment (this checkout's .venv, where the
   test suite passes) when that version satisfies every requirement on it, else to the newest that does;
3. downloads one wheel per package with ``pip download --no-deps --only-binary=:all:``, a pure-Python wheel
   first (``py3-none-any`` runs anywhere) and a platform wheel only where no pure one exists;
4. builds the hf_fsdp2 wheel (``pip wheel --no-deps``), writes ``requirements.txt`` (exact pins of every
   wheel, with ``--no-index --find-links .`` so ``-r`` needs no other flag) and fails if the folder is
   larger than ``--max-mib`` (64 by default: what can be copied to the node next to the checkout).
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from email.parser import Parser
from importlib import metadata
from pathlib import Path

import tomllib
from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name, parse_wheel_filename
from packaging.version import InvalidVersion, Version

REPO = Path(__file__).resolve().parents[1]
# The node keeps its own CUDA stack: a torch wheel alone is GBs, and a second one would shadow the node's.
EXCLUDED = re.compile(r"^(torch|triton|pytorch-triton.*|nvidia-.*|cuda-.*)$")
DEFAULT_EXTRAS = ("liger-kernel", "torchao")  # the GPU check runs Liger and QLoRA (load_in_4bit)
DEFAULT_PLATFORM = "manylinux_2_28_x86_64"  # pip also accepts every older manylinux tag for it
MIB = 1024 * 1024
MARKER = ".hf_fsdp2_offline_bundle"


@dataclass
class Plan:
    """What the walk decided: pins to bundle, and what the node keeps (name -> its version)."""

    bundle: dict[str, Version] = field(default_factory=dict)
    kept: dict[str, Version | None] = field(default_factory=dict)
    wheels: dict[str, Path] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)


def parse_have(text: str) -> dict[str, Version | None]:
    """Name -> version of a ``pip freeze`` (``name==version``, ``name @ url`` and bare names: any version).

    Editable lines (``-e ...``), options and comments are ignored."""
    have: dict[str, Version | None] = {}
    for raw in text.splitlines():
        line = raw.split("#", 1)[0].strip()
        if not line or line.startswith("-"):
            continue
        if " @ " in line:
            have[canonicalize_name(line.split(" @ ", 1)[0])] = None
            continue
        name, _, version = line.partition("==")
        if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*", name.strip()):
            raise ValueError(f"--have: cannot read the line {raw!r}; expected `name==version` (pip freeze)")
        try:
            have[canonicalize_name(name)] = Version(version.strip()) if version else None
        except InvalidVersion as err:
            raise ValueError(
                f"--have: {raw!r} has an invalid version ({err}); expected `name==version`"
            ) from err
    return have


def target_environment(python_version: str, platform: str) -> dict[str, str]:
    """PEP 508 marker values of the target interpreter (CPython on Linux), not of the builder."""
    env: dict[str, str] = {k: str(v) for k, v in default_environment().items()}
    machine = "aarch64" if platform.endswith("aarch64") else "x86_64"  # the two parse_args accepts
    env.update(
        python_version=python_version,
        python_full_version=f"{python_version}.0",
        sys_platform="linux",
        platform_system="Linux",
        os_name="posix",
        platform_machine=machine,
        implementation_name="cpython",
        platform_python_implementation="CPython",
    )
    return env


def project_requirements(pyproject: Path) -> list[Requirement]:
    """The runtime dependencies declared in pyproject.toml (no extras)."""
    data = tomllib.loads(pyproject.read_text())
    return [Requirement(r) for r in data["project"]["dependencies"]]


def wheel_requirements(wheel: Path) -> list[Requirement]:
    """``Requires-Dist`` of a wheel's METADATA."""
    with zipfile.ZipFile(wheel) as zf:
        name = next(n for n in zf.namelist() if n.endswith(".dist-info/METADATA"))
        meta = Parser().parsestr(zf.read(name).decode())
    return [Requirement(r) for r in meta.get_all("Requires-Dist") or []]


def platform_tags(platform: str) -> list[str]:
    """``platform`` and the older tags a node that runs it also runs: pip takes --platform literally."""
    match = re.fullmatch(r"manylinux_2_(\d+)_(\w+)", platform)
    if match is None:
        return [platform]
    glibc, arch = int(match.group(1)), match.group(2)
    tags = [f"manylinux_2_{minor}_{arch}" for minor in range(glibc, 4, -1)]
    legacy = {17: "manylinux2014", 12: "manylinux2010", 5: "manylinux1"}
    return tags + [f"{name}_{arch}" for minor, name in legacy.items() if minor <= glibc]


def _pip_download(
    specs: list[str], dest: Path, python_version: str, platform: str, pure: bool
) -> dict[str, Path]:
    """Wheels of ``specs`` into ``dest`` (name -> wheel) in one pip call; raises with pip's words if any has none.

    ``pure``: only ``py3-none-any``-style wheels; else the platform's, pure ones accepted where there is no other
    (pip ranks a platform wheel first)."""
    if pure:
        tags = ["--implementation", "py", "--abi", "none", "--platform", "any"]
    else:
        abi = "cp" + python_version.replace(".", "")
        tags = ["--implementation", "cp", "--abi", abi, "--abi", "abi3", "--abi", "none"]
        tags += [arg for tag in platform_tags(platform) for arg in ("--platform", tag)]
    with tempfile.TemporaryDirectory(dir=dest) as tmp:
        cmd = [
            sys.executable,
            "-m",
            "pip",
            "download",
            "-q",
            "--no-deps",
            "--only-binary=:all:",
            "--python-version",
            python_version,
            *tags,
            "-d",
            tmp,
            *specs,
        ]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            errors = [line for line in proc.stderr.splitlines() if not line.startswith("WARNING: Location")]
            raise RuntimeError("\n".join(errors[-6:]))
        return {
            canonicalize_name(parse_wheel_filename(w.name)[0]): Path(shutil.move(str(w), dest / w.name))
            for w in Path(tmp).glob("*.whl")
        }


def download(
    specs: dict[str, str], dest: Path, python_version: str, platform: str, jobs: int
) -> dict[str, Path]:
    """One wheel per package (name -> spec) into ``dest``: a platform wheel only where no pure one exists.

    One pip call for all, then a pure-only try for each platform wheel it chose (pip ranks those first): a
    pure wheel of the same version runs on any node. Per-package calls are made only to name a failure."""
    if not specs:
        return {}
    try:
        got = _pip_download(list(specs.values()), dest, python_version, platform, pure=False)
    except RuntimeError:
        failed = []
        for spec in specs.values():
            try:
                _pip_download([spec], dest, python_version, platform, pure=False)
            except RuntimeError as err:
                failed.append(f"{spec}: {err}")
        raise RuntimeError(
            f"no wheel for Python {python_version} on {platform} of:\n"
            + "\n".join(failed)
            + "\nFix: pin a version that has one (--extra 'name==version'), or pass another --platform."
        ) from None

    def pure(name: str) -> tuple[str, Path | None]:
        version = parse_wheel_filename(got[name].name)[1]
        try:
            return name, _pip_download([f"{name}=={version}"], dest, python_version, platform, pure=True)[
                name
            ]
        except RuntimeError:
            return name, None

    binary = [n for n, w in got.items() if not w.name.endswith("-none-any.whl")]
    with ThreadPoolExecutor(max_workers=jobs) as pool:
        for name, wheel in pool.map(pure, binary):
            if wheel is not None:
                got[name].unlink()
                got[name] = wheel
    return got


def _installed(name: str) -> Version | None:
    try:
        return Version(metadata.version(name))
    except metadata.PackageNotFoundError:
        return None


def _wheel_version(wheel: Path) -> Version:
    return parse_wheel_filename(wheel.name)[1]


def resolve(
    roots: list[Requirement],
    have: dict[str, Version | None],
    dest: Path,
    python_version: str,
    platform: str,
    jobs: int = 8,
) -> Plan:
    """Walk the closure of ``roots`` for the target, downloading each bundled wheel into ``dest``.

    Breadth first, each level's wheels downloaded ``jobs`` at a time (each pip call mostly waits on the index)."""
    env = {**target_environment(python_version, platform), "extra": ""}
    plan = Plan()
    level: list[tuple[Requirement, str]] = [(r, "hf_fsdp2 or --extra") for r in roots]
    while level:
        pending: dict[str, tuple[str, list[tuple[Requirement, str]]]] = {}
        for req, wanted_by in level:
            if req.marker is not None and not req.marker.evaluate(env):
                continue
            name = canonicalize_name(req.name)
            if EXCLUDED.match(name) or name == "hf-fsdp2":
                continue
            if name in plan.bundle:
                _check_pin(name, plan.bundle[name], req, wanted_by)
                continue
            if name in pending:
                pending[name][1].append((req, wanted_by))
                continue
            if name in have:
                version = have[name]
                if version is None or req.specifier.contains(version, prereleases=True):
                    plan.kept[name] = version
                    continue
                plan.notes.append(
                    f"the node's {name}=={version} does not satisfy {req} ({wanted_by}): bundled"
                )
                plan.kept.pop(name, None)
            local = _installed(name)
            spec = (
                f"{name}=={local}"
                if local is not None and local in req.specifier
                else f"{name}{req.specifier}"
            )
            pending[name] = (spec, [(req, wanted_by)])
        got = download({n: spec for n, (spec, _) in pending.items()}, dest, python_version, platform, jobs)
        level = []
        for got_name, wheel in got.items():
            plan.bundle[got_name], plan.wheels[got_name] = _wheel_version(wheel), wheel
            for req, wanted_by in pending[got_name][1]:
                _check_pin(got_name, plan.bundle[got_name], req, wanted_by)
            level.extend((r, f"{got_name}=={plan.bundle[got_name]}") for r in wheel_requirements(wheel))
    return plan


def _check_pin(name: str, version: Version, req: Requirement, wanted_by: str) -> None:
    if not req.specifier.contains(version, prereleases=True):
        raise RuntimeError(
            f"{wanted_by} needs {req} but {name}=={version} is chosen for another package; "
            f"fix: pin a version of {name} that suits both with --extra"
        )


def build_project_wheel(dest: Path) -> Path:
    """The hf_fsdp2 wheel of this checkout (the builder's setuptools: no build isolation, no index)."""
    with tempfile.TemporaryDirectory(dir=dest) as tmp:
        cmd = [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            "-w",
            tmp,
            str(REPO),
        ]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"`{' '.join(cmd)}` failed:\n{proc.stderr[-2000:]}")
        wheel = next(Path(tmp).glob("hf_fsdp2-*.whl"))
        return Path(shutil.move(str(wheel), dest / wheel.name))


def folder_mib(path: Path) -> float:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) / MIB


def check_size(path: Path, max_mib: float) -> float:
    """The folder's size in MiB; raises if it is over ``max_mib``."""
    size = folder_mib(path)
    if size > max_mib:
        raise RuntimeError(
            f"the bundle {path} is {size:.1f} MiB, over the limit of {max_mib:g} MiB; fix: pass the node's "
            "`pip freeze` with --have so what it already has is left out, or drop --extra packages"
        )
    return size


def write_requirements(dest: Path, plan: Plan, project: Path | None, header: str) -> Path:
    pins = [f"{name}=={version}" for name, version in sorted(plan.bundle.items())]
    if project is not None:
        pins.append(f"hf_fsdp2=={_wheel_version(project)}")
    path = dest / "requirements.txt"
    # pip reads a relative --find-links in a requirements file relative to that file: `-r` needs no other flag.
    path.write_text(f"# {header}\n--no-index\n--find-links .\n" + "\n".join(pins) + "\n")
    return path


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="offline_bundle.sh", description=__doc__.split("\n\n")[0])
    parser.add_argument("--dest", type=Path, default=REPO / "offline_bundle", help="bundle folder (replaced)")
    parser.add_argument(
        "--python-version",
        default=f"{sys.version_info.major}.{sys.version_info.minor}",
        help="the node's Python, e.g. 3.12 (default: this Python's)",
    )
    parser.add_argument(
        "--platform", default=DEFAULT_PLATFORM, help=f"wheel platform tag (default {DEFAULT_PLATFORM})"
    )
    parser.add_argument("--have", type=Path, help="the node's `pip freeze`: what it has is left out")
    parser.add_argument(
        "--extra",
        action="append",
        default=None,
        help=f"another package to bundle, repeatable (default: {', '.join(DEFAULT_EXTRAS)}); "
        "`--extra none` for none",
    )
    parser.add_argument("--no-project", action="store_true", help="leave the hf_fsdp2 wheel out")
    parser.add_argument("--max-mib", type=float, default=64.0, help="fail above this size (default 64)")
    args = parser.parse_args(argv)
    if not re.fullmatch(r"3\.\d{1,2}", args.python_version):
        parser.error(f"--python-version {args.python_version!r}: expected MAJOR.MINOR such as 3.12")
    if not re.fullmatch(r"(manylinux\w+|linux)_(x86_64|aarch64)", args.platform):
        parser.error(f"--platform {args.platform!r}: expected a Linux tag such as {DEFAULT_PLATFORM}")
    if args.have is not None and not args.have.is_file():
        parser.error(
            f"--have {args.have}: no such file; write it on the node with `python3 -m pip freeze > FILE`"
        )
    if args.max_mib <= 0:
        parser.error(f"--max-mib {args.max_mib:g}: must be positive")
    extras = args.extra if args.extra is not None else list(DEFAULT_EXTRAS)
    args.extra = [] if extras == ["none"] else extras
    for spec in args.extra:
        try:
            Requirement(spec)
        except Exception as err:  # packaging's InvalidRequirement names the position
            parser.error(
                f"--extra {spec!r}: not a requirement ({err}); e.g. liger-kernel or 'liger-kernel==0.8.5'"
            )
    return args


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    have = parse_have(args.have.read_text()) if args.have is not None else {}
    dest: Path = args.dest.resolve()
    if dest.exists() and any(dest.iterdir()) and not (dest / MARKER).is_file():
        print(
            f"offline_bundle: {dest} exists and was not made by this script (no {MARKER}); it is replaced on "
            "each run, so pick another --dest",
            file=sys.stderr,
        )
        return 2
    shutil.rmtree(dest, ignore_errors=True)
    dest.mkdir(parents=True)
    (dest / MARKER).write_text("made by scripts/offline_bundle.sh; the folder is replaced on each run\n")
    roots = project_requirements(REPO / "pyproject.toml") + [Requirement(s) for s in args.extra]
    try:
        plan = resolve(roots, have, dest, args.python_version, args.platform)
        project = None if args.no_project else build_project_wheel(dest)
    except RuntimeError as err:
        print(f"offline_bundle: {err}", file=sys.stderr)
        return 1
    header = f"hf_fsdp2 offline bundle for Python {args.python_version} on {args.platform} (scripts/offline_bundle.sh)"
    write_requirements(dest, plan, project, header)
    for note in plan.notes:
        print(f"offline_bundle: {note}")
    if have:
        kept = ", ".join(f"{n}=={v}" if v else n for n, v in sorted(plan.kept.items()))
        print(f"offline_bundle: the node keeps {kept}")
    for wheel in sorted(dest.glob("*.whl")):
        print(f"  {wheel.name}  {wheel.stat().st_size / MIB:.2f} MiB")
    try:
        size = check_size(dest, args.max_mib)
    except RuntimeError as err:
        print(f"offline_bundle: {err}", file=sys.stderr)
        return 1
    count = len(list(dest.glob("*.whl")))
    print(f"offline_bundle: {dest}: {count} wheels, {size:.2f} MiB (limit {args.max_mib:g} MiB)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
