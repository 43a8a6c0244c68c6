"""Training methods, one package each (its config section, data, objective and step, evaluator and start-up checks),
and the registry that recipes, ``hf-fsdp2 train``, doctor, the memory plan and the model card ask instead of comparing
recipe names.

Adding a method: a package whose ``__init__`` defines ``METHOD = Method(...)`` (:class:`~hf_fsdp2.run.method.Method`)
and one line in :data:`~hf_fsdp2.run.registry.BUILTIN`; a method outside this package calls :func:`register` and
then runs like any other (``run(parse_method_config(method, argv), method)``). ``python -m hf_fsdp2.methods NAME
--config r.yaml`` runs one (what ``hf-fsdp2 train NAME`` launches on every rank). The registry itself lives in
:mod:`hf_fsdp2.run.registry` (the loop's capability check reads it); its functions are imported here for recipes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import fields
from typing import TYPE_CHECKING

from hf_fsdp2.run.registry import BUILTIN, get_method, method_names, register

__all__ = ["BUILTIN", "get_method", "method_names", "parse_method_config", "register"]

if TYPE_CHECKING:
    from hf_fsdp2.config import Config
    from hf_fsdp2.run.method import Method


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
