"""The oldest torch, transformers and accelerate this toolkit runs on, checked before any work.

``pyproject.toml`` declares the same floors and pip enforces them on a resolved install. This check covers the
installs that skip resolution (``pip install --no-deps``, an offline bundle beside a GPU node's own torch),
where an older torch would otherwise fail deep inside FSDP2 or DCP with an error that names neither the
package nor the fix. docs/compatibility.md gives the floors, which API sets each, and the suite runs that
prove them; tests/unit/test_compat.py keeps this table, pyproject.toml and scripts/setup.sh equal.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from importlib.metadata import PackageNotFoundError, version

# (major, minor): the oldest release the unit and distributed suites passed on (docs/compatibility.md).
FLOORS: dict[str, tuple[int, int]] = {"torch": (2, 11), "transformers": (5, 17), "accelerate": (1, 15)}


class VersionError(RuntimeError):
    """An installed package is older than the floor this toolkit is tested on, or absent."""


def release(text: str) -> tuple[int, ...]:
    """The release numbers of a version string: ``"2.11.0+cu130"`` -> ``(2, 11, 0)``.

    Local labels (``+cu130``), pre-releases and dev builds (``2.13.0a0+git1234``, ``5.17.0.dev0``) keep their
    release numbers: a nightly of the floor release counts as the floor.

    Raises:
        ValueError: ``text`` does not start with a number.
    """
    found = re.match(r"\d+(?:\.\d+)*", text.strip())
    if found is None:
        raise ValueError(f"version {text!r} does not start with release numbers such as 2.11.0")
    return tuple(int(part) for part in found.group(0).split("."))


def installed_versions(names: tuple[str, ...] = tuple(FLOORS)) -> dict[str, str | None]:
    """Each package's installed version from its metadata (None when it is not installed)."""
    found: dict[str, str | None] = {}
    for name in names:
        try:
            found[name] = version(name)
        except PackageNotFoundError:
            found[name] = None
    return found


def check_versions(installed: Mapping[str, str | None] | None = None) -> None:
    """Refuse a torch, transformers or accelerate older than :data:`FLOORS`, naming each one and the fix.

    Args:
        installed: package -> version (None: absent); default: what is installed in this environment.

    Raises:
        VersionError: one or more packages below their floor or absent.
    """
    found = installed_versions() if installed is None else installed
    problems = []
    for name, floor in FLOORS.items():
        want = ".".join(map(str, floor))
        have = found.get(name)
        if have is None:
            problems.append(f"{name} is not installed (need {name}>={want})")
        elif release(have)[:2] < floor:
            problems.append(f"{name} {have} is older than {want}, the oldest release hf_fsdp2 is tested on")
    if problems:
        specs = " ".join(f"'{name}>={'.'.join(map(str, floor))}'" for name, floor in FLOORS.items())
        raise VersionError(
            "; ".join(problems) + f". Install newer releases (a GPU node's CUDA torch that is new enough is "
            f"kept): pip install {specs}; docs/compatibility.md gives the floors and why"
        )


# transformers 5.25 turns hub kernels on by default in ``from_pretrained`` (``use_kernels=None`` -> True when the
# ``kernels`` package, now one of its dependencies, imports): layers are swapped for kernels fetched from the hub and
# re-kernelized at every ``train()`` / ``eval()`` on CUDA (on the fake CUDA device of tests/support it asks
# torch.cuda for a capability and fails). The toolkit's numbers (the export's verification against the live model,
# the GPU checks' bounds), compile and offline runs assume the model's own modules, so every model is loaded with
# ``use_kernels=False``; transformers from 5.17 (the floor) to 5.24 accept the argument and default it to False.
NO_HUB_KERNELS: dict[str, bool] = {"use_kernels": False}
