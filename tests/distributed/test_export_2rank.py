"""2-rank gloo tests of the gather-free export: every rank writes its shards, ranks assemble the
files, verification reads them back; compared with the full state dict gathered for the test only.
Also: sharded output with an index, tied embeddings, checkpoint names that differ from module names,
a corrupted file caught by verification, and `hf-fsdp2 export` of a real 2-rank checkpoint."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from support.launch import python, torchrun
from support.tiny import make_tiny_llama_dir
from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

from hf_fsdp2.model import load_tokenizer

WORKER = Path(__file__).parent / "workers" / "export_worker.py"

RELOAD = r"""
import sys, json, torch
from transformers import AutoModelForCausalLM, AutoTokenizer
folder, reference = sys.argv[1], sys.argv[2]
model = AutoModelForCausalLM.from_pretrained(folder)
tok = AutoTokenizer.from_pretrained(folder)
ref = torch.load(reference)
sd = model.state_dict()
ids = tok.apply_chat_template([{"role": "user", "content": "alpha bravo"}], add_generation_prompt=True,
                              return_tensors="pt", return_dict=True)["input_ids"]
with torch.no_grad():
    logits = model(ids).logits
head, emb = model.get_output_embeddings(), model.get_input_embeddings()
print(json.dumps({
    "hf_fsdp2_imported": any(m.startswith("hf_fsdp2") for m in sys.modules),
    "dtype": str(model.dtype),
    "equal": sorted(k for k in ref if torch.equal(sd[k], ref[k].to(sd[k].dtype))),
    "keys": sorted(sd),
    "tied": head.weight.data_ptr() == emb.weight.data_ptr(),
    "finite": bool(torch.isfinite(logits).all()),
}))
"""


def exported(folder: Path) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for f in sorted(folder.glob("model*.safetensors")):
        tensors.update(load_file(str(f)))
    return tensors


def reload(folder: Path, reference: Path) -> dict:
    return json.loads(python("-c", [RELOAD, str(folder), str(reference)]).stdout.strip().splitlines()[-1])


def run_worker(out: Path, model: Path, *flags: str) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    torchrun(WORKER, ["--model", str(model), "--out", str(out), *flags], nproc=2)
    return json.loads((out / "report.json").read_text())


@pytest.fixture(scope="module")
def untied_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    root = tmp_path_factory.mktemp("untied")
    model = make_tiny_llama_dir(root / "model", seed=1)
    out = root / "out"
    return out, run_worker(out, model, "--ac", "--corrupt", "--checkpoint")


def test_two_rank_export_equals_the_full_state_dict_exactly_and_loads_fresh(untied_run) -> None:
    out, report = untied_run
    assert report["files"] == ["model.safetensors"] and report["dtype"] == "bfloat16"
    assert report["verify_ok"], report["verify"]
    reference = torch.load(out / "reference.pt")  # gathered by the worker, cast to bf16
    on_disk = exported(out / "export")
    assert set(on_disk) == set(reference) and report["tensors_checked"] == len(reference)
    for key, want in reference.items():
        assert on_disk[key].dtype == want.dtype == torch.bfloat16
        assert torch.equal(on_disk[key], want), key
    fresh = reload(out / "export", out / "reference.pt")
    assert fresh["hf_fsdp2_imported"] is False and fresh["dtype"] == "torch.bfloat16"
    assert fresh["equal"] == sorted(reference) and fresh["finite"] and fresh["tied"] is False
    assert (out / "export" / "README.md").is_file()
    assert not (out / "export" / ".export-incomplete").exists()


def test_two_rank_verification_catches_a_corrupted_file(untied_run) -> None:
    _, report = untied_run
    caught = report["corruption_caught"]
    assert caught, "verify_export accepted a corrupted file"
    assert f"{report['corrupted']}: the bytes on disk differ" in caught


def test_offline_cli_export_of_a_two_rank_checkpoint_equals_the_live_export(untied_run) -> None:
    out, _ = untied_run
    checkpoint = out / "run" / "checkpoint-1"
    assert (checkpoint / ".metadata").is_file() and len(list(checkpoint.glob("*.distcp"))) == 2
    target = out / "offline"
    proc = python("-m", ["hf_fsdp2.cli", "export", str(checkpoint), str(target), "--dtype", "bfloat16"])
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary["files"] == ["model.safetensors"] and summary["verified"].startswith("verified")
    live, offline = exported(out / "export"), exported(target)
    assert set(live) == set(offline)
    for key in live:
        assert torch.equal(live[key], offline[key]), key
    card = (target / "README.md").read_text()
    assert "library_name: transformers" in card and "| loss | 2.5 |" in card
    assert "datasets:\n- tiny/chat" in card
    for name in ("config.json", "generation_config.json", "tokenizer.json", "chat_template.jinja"):
        assert (target / name).is_file(), name
    # Into the same, now non-empty, folder: refused unless --overwrite.
    again = python("-m", ["hf_fsdp2.cli", "export", str(checkpoint), str(target)], check=False)
    assert again.returncode == 2 and "is not empty" in again.stderr and "--overwrite" in again.stderr
    python("-m", ["hf_fsdp2.cli", "export", str(checkpoint), str(target), "--overwrite", "--no-verify"])


def test_sharded_tied_export_in_fp32_round_trips(tmp_path: Path) -> None:
    model = make_tiny_llama_dir(tmp_path / "model", seed=2, tie_word_embeddings=True)
    out = tmp_path / "out"
    report = run_worker(out, model, "--dtype", "float32", "--max_shard_bytes", "100000")
    assert report["verify_ok"], report["verify"]
    n = len(report["files"])
    assert n > 2 and report["files"][-1] == f"model-{n:05d}-of-{n:05d}.safetensors"
    index = json.loads((out / "export" / "model.safetensors.index.json").read_text())
    on_disk = exported(out / "export")
    assert set(index["weight_map"]) == set(on_disk) and set(index["weight_map"].values()) == set(
        report["files"]
    )
    assert index["metadata"]["total_size"] == sum(t.numel() * 4 for t in on_disk.values())
    assert "lm_head.weight" not in on_disk  # tied: written once, as the embedding
    reference = torch.load(out / "reference.pt")
    for key, tensor in on_disk.items():
        assert tensor.dtype == torch.float32 and torch.equal(tensor, reference[key]), key
    fresh = reload(out / "export", out / "reference.pt")
    assert fresh["tied"] is True and fresh["equal"] == sorted(reference) and fresh["dtype"] == "torch.float32"


def test_checkpoint_names_that_differ_from_module_names_round_trip(tmp_path: Path) -> None:
    tokenizer = load_tokenizer(str(make_tiny_llama_dir(tmp_path / "tok", seed=3)))
    config = GPTNeoXConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        bos_token_id=1,
        eos_token_id=2,
    )
    torch.manual_seed(4)
    model = tmp_path / "neox"
    GPTNeoXForCausalLM(config).save_pretrained(model)
    tokenizer.save_pretrained(model)
    out = tmp_path / "out"
    report = run_worker(out, model, "--max_shard_bytes", "200000")
    assert report["verify_ok"], report["verify"]
    on_disk = exported(out / "export")
    reference = torch.load(out / "reference.pt")  # module names: lm_head.weight
    assert "embed_out.weight" in on_disk and "lm_head.weight" not in on_disk
    assert torch.equal(on_disk["embed_out.weight"], reference["lm_head.weight"])
    fresh = reload(out / "export", out / "reference.pt")
    assert fresh["equal"] == sorted(reference)  # transformers maps embed_out back to lm_head
