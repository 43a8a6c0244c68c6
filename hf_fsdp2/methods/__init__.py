"""Training methods, one package each (its config section, data, objective and step, evaluator and start-up checks),
and the registry that recipes, ``hf-fsdp2 train``, doctor, the memory plan and the model card ask instead of comparing
recipe names.

Adding a method: a package whose ``__init__`` defines ``METHOD = Method(...)`` (:class:`~hf_fsdp2.trainer.method.Method`)
and one line in :data:`BUILTIN`; a method outside this package calls :func:`register` and then runs like any other
(``run(parse_method_config(method, argv), method)``). ``python -m hf_fsdp2.methods NAME --config r.yaml`` runs one
(what ``hf-fsdp2 train NAME`` launches on every rank).
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from dataclasses import fields
from typing import TYPE_CHECKING

from hf_fsdp2.config import ConfigError

if TYPE_CHECKING:
    from hf_fsdp2.config import Config
    from hf_fsdp2.trainer.method import Method

BUILTIN: dict[str, str] = {
    "sft": "hf_fsdp2.methods.sft",
    "cpt": "hf_fsdp2.methods.cpt",
    "dpo": "hf_fsdp2.methods.dpo",
    "kto": "hf_fsdp2.methods.kto",
    "rm": "hf_fsdp2.methods.rm",
    "grpo": "hf_fsdp2.methods.grpo",
}
"""Name -> the package that defines ``METHOD`` (imported on first use: listing the names imports nothing)."""

_REGISTERED: dict[str, Method] = {}


def method_names() -> list[str]:
    """Every method's name: the built-in ones, then those registered in this process."""
    return [*BUILTIN, *(name for name in _REGISTERED if name not in BUILTIN)]


def register(method: Method) -> Method:
    """Make ``method`` known by its name in this process (a method defined outside this package).

    Raises:
        ValueError: the name is a built-in method's, or another method registered under it.
    """
    if method.name in BUILTIN:
        raise ValueError(f"method {method.name!r} is built in ({BUILTIN[method.name]}); choose another name")
    known = _REGISTERED.get(method.name)
    if known is not None and known is not method:
        raise ValueError(f"another method is already registered as {method.name!r}; choose another name")
    _REGISTERED[method.name] = method
    return method


def get_method(name: str) -> Method:
    """The method called ``name``.

    Raises:
        ConfigError: no such method, naming the known ones.
    """
    if name in _REGISTERED:
        return _REGISTERED[name]
    if name not in BUILTIN:
        raise ConfigError(f"unknown recipe {name!r}: one of {', '.join(method_names())}")
    method: Method = importlib.import_module(BUILTIN[name]).METHOD
    return method


def _keys_elsewhere(method: Method) -> dict[str, str]:
    """Each key of another method's section that ``method`` does not take -> the methods that take it."""
    own = {f.name for f in fields(method.section)} if method.section is not None else set()
    where: dict[str, list[str]] = {}
    for name in method_names():
        other = get_method(name)
        if other is method or other.section is None:
            continue
        for f in fields(other.section):
            if f.name not in own:
                where.setdefault(f.name, []).append(name)
    return {key: " and ".join(names) for key, names in where.items()}


def parse_method_config(method: Method | str, argv: Sequence[str] | None = None) -> Config:
    """``[--config recipe.yaml] [--key value ...]`` parsed for ``method``: the shared sections plus its own, with its
    defaults for shared keys; a key of another method is refused naming that method.

    Raises:
        ConfigError: unknown keys or values that cannot work, with the key, value and fix.
    """
    from hf_fsdp2.config import parse_config

    m = get_method(method) if isinstance(method, str) else method
    return parse_config(
        argv, section=m.section, defaults=m.defaults, elsewhere=_keys_elsewhere(m), recipe=m.name
    )
