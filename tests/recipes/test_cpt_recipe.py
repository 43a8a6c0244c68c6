"""The continued-pre-training recipe end to end on 2 gloo ranks: a corpus of long documents, nothing truncated,
a verified export; a streamed corpus resumed with bit-identical losses; clear errors on bad documents."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
from support.launch import REPO, accelerate_launch, torchrun
from support.tiny import WORDS, make_tiny_llama_dir

from hf_fsdp2.observe.logs import read_metrics

CPT = REPO / "recipes" / "cpt.py"


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("cpt")
    rng = random.Random(0)
    docs = root / "docs.jsonl"
    # Documents of 1 to 120 words: many longer than a 32-token row.
    docs.write_text(
        "".join(
            json.dumps({"text": " ".join(rng.choices(WORDS, k=rng.randint(1, 120)))}) + "\n"
            for _ in range(40)
        )
    )
    return make_tiny_llama_dir(root / "model", seed=2), docs


def _cpt(model: Path, data: Path, out: Path, *extra: str, check: bool = True, accelerate: bool = False):  # type: ignore[no-untyped-def]
    args = [
        "--model_name_or_path",
        str(model),
        "--dataset_name",
        str(data),
        "--output_dir",
        str(out),
        "--per_device_train_batch_size",
        "2",
        "--max_length",
        "32",
        "--logging_steps",
        "1",
        "--mixed_precision",
        "no",
        *extra,
    ]
    if accelerate:  # the launcher users run: accelerate's environment for the config, ranks forked (served)
        return accelerate_launch("accelerate_configs/fsdp2_cpu.yaml", CPT, args, check=check, served=True)
    return torchrun(CPT, args, nproc=2, check=check)


def test_cpt_trains_every_token_and_exports(corpus, tmp_path: Path) -> None:
    model, docs = corpus
    # save_steps 0: the end-of-run checkpoint (the default cadence's) nothing here reads.
    proc = _cpt(
        model,
        docs,
        tmp_path / "run",
        "--num_train_epochs",
        "1",
        "--eval_split_fraction",
        "0.1",
        "--save_steps",
        "0",
        accelerate=True,
    )
    log = proc.stdout + proc.stderr
    assert "corpus: 36 documents (0 empty skipped)" in log and "cut into pieces" in log
    assert "eval corpus: 4 documents" in log  # held out whole, before the training rows are cut
    rows = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert rows[-1]["padding_efficiency"] > 0.9  # full rows
    assert 0 < rows[-1]["eval_loss"] < 20 and rows[-1]["eval_tokens"] > 0
    assert "export verified" in log and (tmp_path / "run" / "model.safetensors").is_file()


def test_streamed_corpus_resumes_with_identical_losses(corpus, tmp_path: Path) -> None:
    model, docs = corpus
    full = tmp_path / "full"
    _cpt(
        model,
        docs,
        full,
        "--streaming",
        "true",
        "--max_steps",
        "8",
        "--save_steps",
        "4",
        "--export_verify",
        "false",
    )
    resumed = tmp_path / "resumed"
    resumed.mkdir()
    (resumed / "checkpoint-4").symlink_to(full / "checkpoint-4", target_is_directory=True)
    (resumed / "latest").write_text("4\n")
    _cpt(
        model,
        docs,
        resumed,
        "--streaming",
        "true",
        "--max_steps",
        "8",
        "--save_steps",
        "0",
        "--export_verify",
        "false",
        "--resume_from_checkpoint",
        "latest",
    )
    want = {r["step"]: r["loss"] for r in read_metrics(full / "metrics.jsonl")}
    got = {r["step"]: r["loss"] for r in read_metrics(resumed / "metrics.jsonl")}
    assert [got[s] for s in (5, 6, 7, 8)] == [want[s] for s in (5, 6, 7, 8)]  # bit for bit


def test_documents_without_text_are_named_or_skipped(corpus, tmp_path: Path) -> None:
    model, docs = corpus
    bad = tmp_path / "bad.jsonl"
    bad.write_text(docs.read_text() + json.dumps({"text": "   "}) + "\n")
    proc = _cpt(model, bad, tmp_path / "err", "--max_steps", "1", check=False)
    assert proc.returncode != 0 and "record 40: a document with no text" in proc.stderr
    proc = _cpt(
        model,
        bad,
        tmp_path / "skip",
        "--max_steps",
        "1",
        "--on_bad_record",
        "skip",
        "--export_verify",
        "false",
        "--save_steps",
        "0",
    )
    assert "corpus: 40 documents (1 empty skipped)" in proc.stdout + proc.stderr
    no_column = tmp_path / "other.jsonl"
    no_column.write_text(json.dumps({"body": "alpha"}) + "\n")
    proc = _cpt(model, no_column, tmp_path / "col", "--max_steps", "1", check=False)
    assert "reads the 'text' column, which it lacks (columns: ['body'])" in proc.stderr
