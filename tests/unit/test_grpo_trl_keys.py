"""docs/grpo.md's key tables are complete and true against TRL 1.16's ``GRPOConfig``: every key the
GRPO recipe shares with it has TRL's default or a row in "Defaults that differ from TRL's" naming both defaults
(and no row is stale); every ``GrpoArgs`` key TRL lacks is named in "Keys side by side"; every GRPO key of TRL's the
recipe lacks is named there too, and the recipe refuses it by name (never ignored)."""

from __future__ import annotations

import ast
import dataclasses
import re
from pathlib import Path
from typing import Any

import pytest

from hf_fsdp2.config import ConfigError
from hf_fsdp2.methods import parse_method_config
from hf_fsdp2.methods.grpo.config import GrpoArgs

DOC = Path(__file__).resolve().parents[2] / "docs" / "grpo.md"
GIVEN = {
    "model_name_or_path": "m",
    "dataset_name": "d.jsonl",
    "output_dir": "/tmp/o",
}  # required: not defaults


def _default(f: dataclasses.Field[Any]) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return dataclasses.MISSING


def _section() -> str:
    text = DOC.read_text()
    start = text.index("## Keys side by side")
    return text[start : text.index("\n## ", start + 1)]


def _differ_rows() -> dict[str, tuple[Any, Any, str]]:
    """The "Defaults that differ" table: key -> (TRL's default, the recipe's, why), the defaults as Python literals."""
    text = _section()
    table = text[text.index("### Defaults that differ from TRL's") :]
    rows: dict[str, tuple[Any, Any, str]] = {}
    for line in table.splitlines():
        m = re.fullmatch(r"\| `(\w+)` \| `([^`]+)` \| `([^`]+)` \| (.+) \|", line)
        if m:
            rows[m[1]] = (ast.literal_eval(m[2]), ast.literal_eval(m[3]), m[4].strip())
    return rows


def _trl() -> tuple[dict[str, Any], set[str]]:
    from transformers import TrainingArguments
    from trl import GRPOConfig

    base = {f.name for f in dataclasses.fields(TrainingArguments)}
    return {f.name: _default(f) for f in dataclasses.fields(GRPOConfig)}, base


def _recipe_defaults() -> dict[str, Any]:
    argv = [part for key, value in GIVEN.items() for part in (f"--{key}", value)]
    flat = parse_method_config("grpo", argv).to_flat_dict()
    return {k: v for k, v in flat.items() if k not in GIVEN}


def test_every_shared_key_has_trls_default_or_a_true_row_in_the_table() -> None:
    trl, _ = _trl()
    ours = _recipe_defaults()
    differ = {k: (trl[k], v) for k, v in ours.items() if k in trl and trl[k] != v}
    rows = _differ_rows()
    missing = sorted(set(differ) - set(rows))
    assert not missing, (
        "shared keys whose default differs from TRL's, not in docs/grpo.md's table: "
        + ", ".join(f"{k} (TRL {differ[k][0]!r}, here {differ[k][1]!r})" for k in missing)
    )
    stale = sorted(set(rows) - set(differ))
    assert not stale, (
        f"rows of docs/grpo.md's table whose key no longer differs from TRL's (or is no key): {stale}"
    )
    for key, (theirs, mine, why) in rows.items():
        assert (theirs, mine) == differ[key], (key, (theirs, mine), differ[key])
        assert len(why) > 20, (key, why)  # a reason, not a placeholder
    assert {"disable_dropout", "max_completion_length", "vllm_mode"} <= set(rows)  # GrpoArgs' own


def test_every_grpo_key_trl_lacks_is_named_beside_the_table() -> None:
    trl, _ = _trl()
    text = _section()
    own = [f.name for f in dataclasses.fields(GrpoArgs) if f.name not in trl]
    assert "rollout_batch_size" in own and "reward_funcs" in own
    unnamed = [k for k in own if f"`{k}`" not in text]
    assert not unnamed, f"GrpoArgs keys TRL has not, not named in docs/grpo.md 'Keys side by side': {unnamed}"


def test_every_trl_grpo_key_the_recipe_lacks_is_named_and_refused() -> None:
    trl, base = _trl()
    ours = _recipe_defaults()
    lacking = [k for k in trl if k not in base and k not in ours and k not in GIVEN]
    assert "entropy_coef" in lacking and "vllm_max_model_length" in lacking
    text = _section()
    unnamed = [k for k in lacking if f"`{k}`" not in text]
    assert not unnamed, f"TRL GRPOConfig keys the recipe lacks, not named in docs/grpo.md: {unnamed}"
    argv = [part for key, value in GIVEN.items() for part in (f"--{key}", value)]
    for key in lacking:
        with pytest.raises(ConfigError, match=f"unknown config key '{key}'"):
            parse_method_config("grpo", [*argv, f"--{key}", "1"])
