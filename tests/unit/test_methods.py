"""The method registry: every built-in method is a package the registry finds (no recipe-name comparisons elsewhere),
and a method defined outside the package registers with one call and runs end to end like a built-in one."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml
from support.launch import REPO, torchrun
from support.runs import write_recipe
from support.tiny import make_tiny_llama_dir, write_chat_jsonl

from hf_fsdp2.config import ConfigError
from hf_fsdp2.methods import BUILTIN, get_method, method_names, parse_method_config, register
from hf_fsdp2.observe.logs import read_metrics
from hf_fsdp2.run.method import Method, Objective

TOY = REPO / "tests" / "data" / "toy_method" / "toy_recipe.py"


def test_each_builtin_method_is_a_package_whose_method_carries_its_name() -> None:
    assert method_names() == ["sft", "cpt", "dpo", "kto", "rm", "grpo"]
    for name, module in BUILTIN.items():
        method = get_method(name)
        assert method.name == name and module == f"hf_fsdp2.methods.{name}"
        assert (REPO / "recipes" / f"{name}.py").is_file()  # a checkout's script for it
    with pytest.raises(ConfigError, match="unknown recipe 'ppo': one of sft, cpt, dpo, kto, rm, grpo"):
        get_method("ppo")


def test_no_module_outside_the_registry_compares_a_recipe_name() -> None:
    """Asking the registry replaces ``recipe == "grpo"``-style branches: none is left in the library."""
    pattern = re.compile(r"""recipe\s*(==|!=|in)\s*[("']""")
    found = [
        f"{path.relative_to(REPO)}:{i}"
        for path in (REPO / "hf_fsdp2").rglob("*.py")
        for i, line in enumerate(path.read_text().splitlines(), 1)
        if pattern.search(line)
    ]
    assert found == []


def test_register_refuses_a_builtin_name_and_a_second_method_of_the_same_name() -> None:
    fake = Method(
        name="sft", title="x", build_data=lambda s, t: None, objective=lambda c: Objective(lambda *a: None)
    )  # type: ignore[arg-type, return-value]
    with pytest.raises(ValueError, match="method 'sft' is built in"):
        register(fake)
    with pytest.raises(ValueError, match="batch_rows='rows'"):
        Method(name="x", title="x", build_data=fake.build_data, objective=fake.objective, batch_rows="rows")


def test_a_method_registered_from_outside_the_package_trains_and_exports(tmp_path: Path) -> None:
    model = make_tiny_llama_dir(tmp_path / "model")
    data = write_chat_jsonl(tmp_path / "chat.jsonl", 16)
    recipe = write_recipe(tmp_path / "toy.yaml", model, data, tmp_path / "run", max_steps=2, toy_weight=2.5)
    torchrun(TOY, ["--config", str(recipe)], nproc=2)
    rows = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2] and all(r["toy/weight"] == 2.5 for r in rows)
    assert yaml.safe_load((tmp_path / "run" / "hf_fsdp2_config.yaml").read_text())["toy_weight"] == 2.5
    card = (tmp_path / "run" / "README.md").read_text()
    assert "(a toy method registered from outside, FSDP2 on 2 ranks)" in card
    assert json.loads((tmp_path / "run" / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]


def test_the_toy_methods_key_is_its_own(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util
    import sys

    import hf_fsdp2.run.registry

    # Registered into this test's own registry and module table: the other tests of this process see the built-ins.
    monkeypatch.setattr(hf_fsdp2.run.registry, "_REGISTERED", {})
    spec = importlib.util.spec_from_file_location("toy_recipe", TOY)
    assert spec is not None and spec.loader is not None
    toy = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "toy_recipe", toy)
    spec.loader.exec_module(toy)
    argv = ["--model_name_or_path", "m", "--dataset_name", "d.jsonl", "--output_dir", "o"]
    assert parse_method_config("toy", [*argv, "--toy_weight", "3"]).method.toy_weight == 3.0
    with pytest.raises(ConfigError, match="toy_weight=-1.0 must be > 0"):
        parse_method_config(toy.TOY, [*argv, "--toy_weight=-1"])
    with pytest.raises(
        ConfigError, match="'toy_weight' in the command line is a key of the toy recipe, not of the sft"
    ):
        parse_method_config("sft", [*argv, "--toy_weight", "3"])


def test_a_registered_methods_capabilities_reach_the_run_and_doctor_refusals(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Which recipes run a layout is read from the registry (a method registered from outside is listed), and doctor
    reports the run's own refusal word for word: one check, one message."""
    import hf_fsdp2.run.registry
    from hf_fsdp2.config import parse_config
    from hf_fsdp2.config.plans import MeshPlan
    from hf_fsdp2.doctor.layouts import capability_findings
    from hf_fsdp2.run.method import Capabilities
    from hf_fsdp2.run.registry import check_capabilities

    monkeypatch.setattr(hf_fsdp2.run.registry, "_REGISTERED", {})
    register(
        Method(
            name="toy_tp",
            title="x",
            build_data=lambda s, t: None,  # type: ignore[arg-type, return-value]
            objective=lambda c: Objective(lambda *a: None),  # type: ignore[arg-type, return-value]
            capabilities=Capabilities(tensor_parallel=True),
        )
    )
    argv = ["--model_name_or_path", "m", "--dataset_name", "d", "--output_dir", "o", "--tp_size", "2"]
    cfg = parse_config(argv)
    check_capabilities(get_method("toy_tp"), cfg, MeshPlan(tp=2))
    with pytest.raises(ConfigError) as refused:
        check_capabilities(get_method("dpo"), cfg, MeshPlan(tp=2))
    assert "tp_size=2 is not supported by the dpo recipe" in str(refused.value)
    assert "tensor parallel runs with the sft, cpt and toy_tp recipes" in str(refused.value)
    found = capability_findings(cfg, method=get_method("dpo"), world=4)
    assert [(f.check, f.level, f.message) for f in found] == [("layouts", "error", str(refused.value))]
