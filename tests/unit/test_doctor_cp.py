"""``hf-fsdp2 doctor`` and context parallel: the cp layout reported (cp_size, data-parallel ranks, head split, which
recipes support it) and each bad layout flagged before the run with the run's own checks (mesh against the world
size, heads that do not divide, a recipe that refuses, a MoE router loss, a kernel the all-to-all cannot wrap)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from support.tiny import make_tiny_llama_dir
from transformers import LlamaConfig, MixtralConfig

from hf_fsdp2.doctor import environment, run_doctor
from hf_fsdp2.doctor.layouts import capability_findings, context_parallel_findings
from hf_fsdp2.launch import packaged_accelerate_config
from hf_fsdp2.methods import get_method, parse_method_config

LLAMA = LlamaConfig(
    hidden_size=256,
    intermediate_size=512,
    num_attention_heads=8,
    num_key_value_heads=2,
    num_hidden_layers=2,
    vocab_size=1000,
)


def _cfg(tmp: Path, recipe: str = "sft", **overrides: object):  # type: ignore[no-untyped-def]
    argv = [
        "--model_name_or_path",
        str(tmp),
        "--dataset_name",
        "data.jsonl",
        "--output_dir",
        str(tmp / "run"),
        "--max_length",
        "1000",
    ]
    for key, value in overrides.items():
        argv += [f"--{key}", str(value)]
    return parse_method_config(recipe, argv)


def _found(tmp: Path, world: int, model=LLAMA, recipe: str = "sft", **overrides: object):  # type: ignore[no-untyped-def]
    cfg, method = _cfg(tmp, recipe, **overrides), get_method(recipe)
    # As the doctor reports them: the layouts the method refuses, then the context-parallel layout itself.
    found = capability_findings(cfg, method=method, world=world)
    return [f for f in found if f.level != "ok"] + context_parallel_findings(
        cfg, model, method=method, world=world
    )


def test_the_cp_layout_is_reported(tmp_path: Path) -> None:
    assert _found(tmp_path, 8) == []  # no context parallel asked: nothing to say
    (found,) = _found(tmp_path, 8, cp_size=4)
    assert found.level == "ok" and found.value == "cp_size 4 (all_to_all)"
    assert "each sequence over 4 ranks (250 of max_length 1000 tokens each)" in found.message
    assert "2 data-parallel ranks (world 8 / cp 4)" in found.message
    assert "parameters sharded over 8 ranks (dp_shard 2 x cp 4)" in found.message
    assert "2 query heads and 1 key/value heads per rank" in found.message and "repeated 2x" in found.message
    assert "sft, cpt, dpo support it; kto, rm, grpo refuse it" in found.message


@pytest.mark.parametrize(
    ("world", "model", "recipe", "overrides", "needle"),
    [
        (6, LLAMA, "sft", {"cp_size": 3}, "cp_size=3 does not divide the model's num_attention_heads=8"),
        (3, LLAMA, "sft", {"cp_size": 2}, "does not divide the world size 3"),
        (
            4,
            LLAMA,
            "sft",
            {"cp_size": 2, "cp_backend": "ring", "packing": "true"},
            "cp_backend=ring with packed rows",
        ),
        (
            4,
            LLAMA,
            "dpo",
            {"cp_size": 2, "cp_backend": "ring"},
            "cp_backend=ring is not supported by the dpo recipe",
        ),
        (4, LLAMA, "kto", {"cp_size": 2}, "cp_size=2 is not supported by the kto recipe"),
        (4, LLAMA, "kto", {"cp_size": 2}, "cp_size=2 is not supported by the kto recipe"),
        (
            4,
            LLAMA,
            "sft",
            {"cp_size": 2, "attn_implementation": "flex_attention"},
            "the all-to-all wraps sdpa, eager",
        ),
        (
            4,
            MixtralConfig(
                hidden_size=64,
                intermediate_size=64,
                num_attention_heads=4,
                num_key_value_heads=2,
                num_hidden_layers=1,
                vocab_size=100,
                output_router_logits=True,
            ),
            "sft",
            {"cp_size": 2},
            "the load-balancing loss is a product of per-expert fractions",
        ),
    ],
)
def test_a_bad_cp_layout_is_an_error(tmp_path: Path, world, model, recipe, overrides, needle) -> None:  # type: ignore[no-untyped-def]
    found = _found(tmp_path, world, model, recipe, **overrides)
    assert [f.level for f in found] == ["error"], found
    assert needle in found[0].message + " " + found[0].value + " " + (found[0].fix or ""), found[0]


def test_the_doctor_runs_the_cp_check_with_the_accelerate_configs_world(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(environment, "known_issues", lambda: [])
    model = tmp_path / "model"
    model.mkdir()
    model = make_tiny_llama_dir(model, seed=3)
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"q{i}", "completion": f" a{i}"}) + "\n" for i in range(8)))
    argv = [
        "--model_name_or_path",
        str(model),
        "--dataset_name",
        str(data),
        "--output_dir",
        str(tmp_path / "run"),
        "--max_length",
        "64",
        "--cp_size",
        "2",
    ]
    report = run_doctor(argv, packaged_accelerate_config("fsdp2_cpu.yaml"), environ={})  # 2 processes
    recipe = next(v for k, v in report.sections.items() if k.startswith("recipe"))
    cp = [f for f in recipe if f.check == "context parallel"]
    assert [f.level for f in cp] == ["ok"] and "1 data-parallel ranks (world 2 / cp 2)" in cp[0].message
    report = run_doctor([*argv, "--cp_size", "4"], packaged_accelerate_config("fsdp2_cpu.yaml"), environ={})
    recipe = next(v for k, v in report.sections.items() if k.startswith("recipe"))
    assert [f.level for f in recipe if f.check == "context parallel"] == ["error"]


def test_the_ring_backend_is_reported_with_what_it_needs(tmp_path: Path) -> None:
    (found,) = _found(
        tmp_path, 6, cp_size=3, cp_backend="ring"
    )  # 3 does not divide 8 heads: ring splits none
    assert found.level == "ok" and found.value == "cp_size 3 (ring)"
    assert (
        "ring attention: CUDA, SDPA, causal rows only" in found.message and "query heads" not in found.message
    )
