"""2-rank gloo tests of the FSDP2 path on CPU: real sharding, the mixed-precision policy, AC,
regional compile, rank-0-only loading, and the consolidated export (plain and tied embeddings)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from support.launch import python, torchrun
from support.tiny import make_tiny_llama_dir

WORKER = Path(__file__).parent / "workers" / "fsdp_worker.py"

RELOAD = r"""
import sys, json, torch
from transformers import AutoModelForCausalLM, AutoTokenizer
out, export = sys.argv[1], sys.argv[2]
model = AutoModelForCausalLM.from_pretrained(export, dtype=torch.float32)
tok = AutoTokenizer.from_pretrained(export)
trained = torch.load(f"{out}/trained_fp32.pt")
sd = model.state_dict()
diff = max(float((sd[k] - trained[k].to(torch.bfloat16).float()).abs().max()) for k in trained)
ids = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True)
print(json.dumps({
    "hf_fsdp2_imported": any(m.startswith("hf_fsdp2") for m in sys.modules),
    "max_diff_vs_bf16_trained": diff,
    "tied": model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr(),
    "chat_ids": len(ids if isinstance(ids, list) else ids["input_ids"]),
}))
"""


def _run(tmp: Path, model: Path, *flags: str) -> tuple[dict, dict]:
    torchrun(WORKER, ["--model", str(model), "--out", str(tmp), *flags], nproc=2)
    r0 = json.loads((tmp / "rank0.json").read_text())
    r1 = json.loads((tmp / "rank1.json").read_text())
    return r0, r1


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("models")
    return {
        "untied": make_tiny_llama_dir(root / "untied", seed=1),
        "tied": make_tiny_llama_dir(root / "tied", seed=2, tie_word_embeddings=True),
    }


def test_each_rank_holds_half_of_every_parameter_and_reduces_in_fp32(models, tmp_path: Path):
    r0, r1 = _run(tmp_path, models["untied"], "--ac")
    for r in (r0, r1):
        assert r["optimizer_holds_model_params"]
        assert r["distributed_type"] == "DistributedType.FSDP"
        assert r["world"] == 2
        assert r["model_class"] == "FSDPLlamaForCausalLM"
        # Explicit policy: bf16 compute, fp32 gradient reduction (accelerate's default would be bf16).
        assert r["policy"] == {"param": "torch.bfloat16", "reduce": "torch.float32"}
        assert r["logits_dtype"] == "torch.bfloat16"
        assert r["grads_dtensor"] and r["grad_dtypes"] == ["torch.float32"]
        assert len(r["params"]) > 10
        for name, p in r["params"].items():
            assert p["dtensor"], name
            assert p["dtype"] == "torch.float32", name  # fp32 master weights
            # dim-0 sharding: ceil(rows / 2) rows on rank 0, the rest on rank 1.
            assert abs(p["local"] - p["global"] / 2) <= p["global"] / p["local"] if p["local"] else False, (
                name
            )
    for name in r0["params"]:
        assert r0["params"][name]["local"] + r1["params"][name]["local"] == r0["params"][name]["global"]
    assert r0["grad_norm"] == pytest.approx(r1["grad_norm"])
    assert r0["max_init_diff"] == 0.0
    assert r0["export_equal"] and r0["export_dtypes"] == ["torch.bfloat16"]
    assert r0["export_files"] == ["model.safetensors"]
    proc = python("-c", [RELOAD, str(tmp_path), str(tmp_path / "export")])
    reload = json.loads(proc.stdout.strip().splitlines()[-1])
    assert reload["hf_fsdp2_imported"] is False
    assert reload["max_diff_vs_bf16_trained"] == 0.0
    assert reload["tied"] is False
    assert reload["chat_ids"] > 3


def test_tied_embeddings_compile_and_rank0_loading_round_trip(models, tmp_path: Path):
    r0, r1 = _run(
        tmp_path,
        models["tied"],
        "--compile",
        "--ram_efficient",
        "--export_dtype",
        "float32",
        "--max_shard_bytes",
        "100000",
    )
    # Rank 1 read no weights (its parameters were on meta), yet after prepare its shards came from
    # rank 0 and the gathered model equals the checkpoint.
    assert r0["meta_params_before_prepare"] == 0
    assert r1["meta_params_before_prepare"] == len(r1["params"])
    # ...and its optimizer steps the sharded parameters themselves (not tensors matched by a data_ptr of 0).
    assert r0["optimizer_holds_model_params"] and r1["optimizer_holds_model_params"]
    assert r0["max_init_diff"] == 0.0
    assert "lm_head.weight" not in r0["export_keys"]
    assert "model.embed_tokens.weight" in r0["export_keys"]
    assert r0["export_equal"] and r0["export_dtypes"] == ["torch.float32"]
    # A 100 kB shard limit splits the model into several files plus an index (a larger tensor gets its own).
    assert len(r0["export_files"]) > 2
    index = json.loads((tmp_path / "export" / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(r0["export_keys"])
    assert set(index["weight_map"].values()) == set(r0["export_files"])
    proc = python("-c", [RELOAD, str(tmp_path), str(tmp_path / "export")])
    reload = json.loads(proc.stdout.strip().splitlines()[-1])
    assert reload["tied"] is True
    assert reload["hf_fsdp2_imported"] is False


def test_rank0_loading_trains_exactly_like_loading_everywhere(models, tmp_path: Path):
    from support.launch import SFT
    from support.tiny import write_chat_jsonl

    from hf_fsdp2.observe.logs import read_metrics

    data = write_chat_jsonl(tmp_path / "chat.jsonl", 16, seed=1)
    losses = {}
    for flag in ("false", "true"):
        out = tmp_path / flag
        torchrun(
            SFT,
            [
                "--model_name_or_path",
                str(models["untied"]),
                "--dataset_name",
                str(data),
                "--output_dir",
                str(out),
                "--max_steps",
                "3",
                "--per_device_train_batch_size",
                "2",
                "--learning_rate",
                "3e-3",
                "--mixed_precision",
                "no",
                "--fsdp_cpu_ram_efficient_loading",
                flag,
                "--export_verify",
                "false",
            ],
        )
        losses[flag] = [r["loss"] for r in read_metrics(out / "metrics.jsonl")]
    assert losses["true"] == losses["false"]
