"""bench/same_losses.py's comparison on synthetic metrics files: bit-equal passes, any other value fails.

The tool itself (two trees, two 2-rank runs per path) takes minutes and is run by hand (scripts/same_losses.sh);
here also which paths it has and how it checks that each side imports its own tree.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def tool() -> ModuleType:
    spec = importlib.util.spec_from_file_location("bench_same_losses", REPO / "bench" / "same_losses.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up while being defined
    spec.loader.exec_module(module)
    return module


def _records(**changes: Any) -> list[dict[str, Any]]:
    """Three logged steps as a recipe writes them (timings included); ``changes`` = {field_step: value}."""
    rows = [
        {
            "step": s,
            "loss": 10.375885337911626 - s / 7,
            "lr": 0.001,
            "grad_norm": 2.162515878677368 / s,
            "target_tokens": 93 + s,
            "padding_efficiency": 0.34572490706319703,
            "tokens_per_s": 137.5 * s,
            "step_time_s": 1.95 + s,
            "host_rss_gib": 0.57,
            "epoch": 0,
        }
        for s in (1, 2, 3)
    ]
    for key, value in changes.items():
        name, step = key.rsplit("_", 1)
        rows[int(step) - 1][name] = value
    return rows


def _write(path: Path, rows: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_identical_files_pass_though_timings_differ(tool: ModuleType, tmp_path: Path) -> None:
    ref = _write(tmp_path / "ref.jsonl", _records())
    new = _write(tmp_path / "new.jsonl", _records(step_time_s_2=9.0, tokens_per_s_1=1.0, host_rss_gib_3=2.0))
    result = tool.compare_files("plain", ref, new)
    assert result.identical, result.differences
    assert result.steps == 3 and result.max_diff["loss"] == 0.0 and result.max_diff["grad_norm"] == 0.0
    assert (
        "step_time_s" not in result.max_diff and "target_tokens" in result.max_diff
    )  # timings never compared
    assert "| plain | 3 | 0 | 0 |" in tool.table([result]) and "| yes |" in tool.table([result])


def test_a_loss_one_ulp_apart_fails(tool: ModuleType, tmp_path: Path) -> None:
    import math

    want = _records()[1]["loss"]
    ref = _write(tmp_path / "ref.jsonl", _records())
    new = _write(tmp_path / "new.jsonl", _records(loss_2=math.nextafter(want, math.inf)))
    result = tool.compare_files("lora", ref, new)
    assert not result.identical
    assert result.differences == [f"step 2: loss ref {want!r} new {math.nextafter(want, math.inf)!r}"]
    assert result.max_diff["loss"] == math.ulp(want)
    assert "| NO |" in tool.table([result])


@pytest.mark.parametrize(
    "changes, expected",
    [
        ({"grad_norm_3": 0.7208}, "step 3: grad_norm"),
        ({"target_tokens_1": 95}, "step 1: target_tokens"),  # any other numeric field both log
        ({"loss_1": "nan"}, "step 1: loss ref"),  # a diverged side
        ({"rewards/margins_2": 0.5}, None),  # a field one side logs only: named, not a difference
    ],
)
def test_other_fields(tool: ModuleType, changes: dict[str, Any], expected: str | None) -> None:
    result = tool.compare_records("dpo", _records(), _records(**changes))
    if expected is None:
        assert result.identical and result.only_one_side == ["rewards/margins"]
    else:
        assert not result.identical and result.differences[0].startswith(expected), result.differences


def test_nan_on_both_sides_is_the_same(tool: ModuleType) -> None:
    assert tool.compare_records("plain", _records(loss_3="nan"), _records(loss_3="nan")).identical


def test_missing_steps_or_loss_fail(tool: ModuleType) -> None:
    short = tool.compare_records("packed", _records(), _records()[:2])
    assert not short.identical and "logged steps differ" in short.differences[0]
    no_loss = [{k: v for k, v in r.items() if k != "loss"} for r in _records()]
    missing = tool.compare_records("packed", _records(), no_loss)
    assert not missing.identical and "'loss' missing" in missing.differences[0]
    assert not tool.compare_records("packed", [], []).identical


def test_exported_weights_compared_bitwise(tool: ModuleType, tmp_path: Path) -> None:
    import torch
    from safetensors.torch import save_file

    weights = {"w": torch.arange(6, dtype=torch.float32).reshape(2, 3) / 7}
    for side in ("ref", "new", "moved"):
        (tmp_path / side).mkdir()
    save_file(weights, str(tmp_path / "ref" / "model.safetensors"))
    save_file({"w": weights["w"].clone()}, str(tmp_path / "new" / "model.safetensors"))
    moved = weights["w"].clone()
    moved[1, 2] = torch.nextafter(moved[1, 2], torch.tensor(10.0))
    save_file({"w": moved}, str(tmp_path / "moved" / "model.safetensors"))
    same = tool.compare_records("plain", _records(), _records())
    tool.compare_exports(same, tmp_path / "ref", tmp_path / "new")
    assert same.identical and same.weights == "yes"
    differ = tool.compare_records("plain", _records(), _records())
    tool.compare_exports(differ, tmp_path / "ref", tmp_path / "moved")
    assert not differ.identical and differ.weights == "NO" and "model.safetensors: w" in differ.differences[0]


def test_every_recipe_and_preference_loss_has_a_path(tool: ModuleType) -> None:
    """The proof covers each recipe of recipes/ and the DPO variants (a recipe added without a path fails here)."""
    recipes = {f.stem for f in (REPO / "recipes").glob("*.py") if f.stem != "__init__"}
    assert {recipe for recipe, _, _ in tool.PATHS.values()} == recipes
    dpo = [settings for recipe, _, settings in tool.PATHS.values() if recipe == "dpo"]
    assert {s["loss_type"] for s in dpo} >= {"sigmoid", "ipo", "simpo", "orpo"}
    assert any(s.get("precompute_ref_log_probs") for s in dpo) and any(s.get("use_peft") for s in dpo)
    grpo = tool.PATHS["grpo"][2]
    assert 2 <= grpo["num_generations"] <= 4 and grpo["max_completion_length"] <= 8
    assert set(grpo["reward_funcs"]) <= {"exact_match", "format"}


def _tree(root: Path, sft_import: str) -> Path:
    """A minimal tree: an empty hf_fsdp2 package and recipes whose dpo.py imports sft's ``run`` as given."""
    (root / "hf_fsdp2").mkdir(parents=True)
    (root / "hf_fsdp2" / "__init__.py").write_text("")
    (root / "recipes").mkdir()
    (root / "recipes" / "__init__.py").write_text("")
    (root / "recipes" / "sft.py").write_text('"""SFT."""\n\ndef run() -> None:\n    pass\n')
    (root / "recipes" / "dpo.py").write_text(f'"""DPO: see recipes/sft.py."""\n\n{sft_import}\n')
    return root


def test_a_tree_with_the_recipes_alias_links_and_probes_it(tool: ModuleType, tmp_path: Path) -> None:
    tree = _tree(tmp_path / "tree", "from hf_fsdp2.recipes.sft import run")
    assert tool.recipes_alias(tree)
    assert tool.probed_modules(tree) == ["hf_fsdp2", "hf_fsdp2.recipes.dpo", "hf_fsdp2.recipes.sft"]
    tool.link_package_dirs(tree)
    assert (tree / "hf_fsdp2" / "recipes").resolve() == (tree / "recipes").resolve()
    found = tool.package_files(tree, tmp_path)
    assert found == {
        "hf_fsdp2": (tree / "hf_fsdp2" / "__init__.py").resolve(),
        "hf_fsdp2.recipes.dpo": (tree / "recipes" / "dpo.py").resolve(),
        "hf_fsdp2.recipes.sft": (tree / "recipes" / "sft.py").resolve(),
    }


def test_a_tree_without_the_alias_gets_none_but_hf_fsdp2_is_still_checked(
    tool: ModuleType, tmp_path: Path
) -> None:
    """After the restructure the recipes import the library; only hf_fsdp2 must come from the tree."""
    tree = _tree(tmp_path / "tree", "from hf_fsdp2.run.loop import run  # not hf_fsdp2.recipes")
    assert not tool.recipes_alias(tree)
    assert tool.probed_modules(tree) == ["hf_fsdp2"]
    tool.link_package_dirs(tree)
    assert not (tree / "hf_fsdp2" / "recipes").exists()
    assert tool.package_files(tree, tmp_path) == {"hf_fsdp2": (tree / "hf_fsdp2" / "__init__.py").resolve()}
    (tree / "hf_fsdp2" / "__init__.py").unlink()  # no package in the tree: found elsewhere or not at all
    (tree / "hf_fsdp2").rmdir()
    with pytest.raises(tool.SameLossesError, match="hf_fsdp2"):
        tool.package_files(tree, tmp_path)
