"""Rows of several documents under flash kernels: what reaches the kernel keeps every document apart.

transformers' flash path finds packed documents in ``position_ids`` only when the batch has one row
(``_is_packed_sequence``); a batch of several packed rows would run the plain causal kernel on each row, every
document attending to the documents before it. The batches the SFT (``packing``) and continued pre-training
builders make for a flash kernel, and the context-parallel flash branch, are run here through transformers' own
flash code with a stand-in for flash-attn (tests/support/fake_flash.py) that records what it receives: a varlen
call whose boundaries are exactly the batch's documents, never a plain call, and per-token losses equal to each
document run alone (float64, sdpa). The families whose layers ask the kernel for more (OLMo 3's and EXAONE 4's
sliding windows, gpt-oss's windows and attention sinks) are run so too, each layer's window and sinks checked in the
kernel's calls; Llama 4's chunked attention has no flash path in transformers and is refused by name.
"""

from __future__ import annotations

import copy
import json
import random
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from conftest import CHATML_SPECIAL_TOKENS, CHATML_TEMPLATE, build_llama2_test_tokenizer
from support.fake_flash import StandInFlash
from support.families import family_config
from support.numerics import assert_same_maths
from support.tiny import WORDS, write_chat_jsonl
from transformers import (
    AutoModelForCausalLM,
    GptOssForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

from hf_fsdp2.attention_layout import check_loaded_attention, choose_attention_layout
from hf_fsdp2.config import ConfigError
from hf_fsdp2.labels import IGNORE_INDEX
from hf_fsdp2.methods import parse_method_config
from hf_fsdp2.methods.cpt.data import build_cpt_data
from hf_fsdp2.methods.sft.data import build_sft_data
from hf_fsdp2.parallel.all_to_all import enable_context_parallel, shard_sequence
from hf_fsdp2.train.loss import LossPlan, causal_lm_loss

FLASH = "flash_attention_2"


def tiny_config(vocab_size: int) -> LlamaConfig:
    return LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
    )


def flash_model(config: LlamaConfig) -> LlamaForCausalLM:
    """The tiny Llama in float64, built with sdpa and then run through transformers' flash path."""
    torch.manual_seed(0)
    model = LlamaForCausalLM._from_config(config, attn_implementation="sdpa", dtype=torch.float32).double()
    model.config._attn_implementation = FLASH
    return model.eval()


def documents(positions: torch.Tensor) -> list[tuple[int, int]]:
    """``(start, end)`` of every document over the rows laid end to end (a restart of the positions, or a row)."""
    width = positions.shape[1]
    spans = []
    for r, row in enumerate(positions.tolist()):
        starts = [i for i in range(width) if i == 0 or row[i] != row[i - 1] + 1]
        spans += [(r * width + a, r * width + b) for a, b in zip(starts, [*starts[1:], width], strict=True)]
    return spans


def per_token_losses(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(
        logits[:, :-1].transpose(1, 2), labels[:, 1:], ignore_index=IGNORE_INDEX, reduction="none"
    )


def check_documents_apart(
    model: PreTrainedModel,
    batch: dict[str, torch.Tensor],
    flash: StandInFlash,
    *,
    reference: str = "sdpa",
) -> int:
    """Run ``batch`` as the training step does; the stand-in must get every document apart and the losses must be
    each document's alone (run with ``reference`` attention). Returns how many documents the batch held."""
    assert "attention_mask" not in batch
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    kernel = model.config._attn_implementation
    flash.calls.clear()
    with (
        torch.no_grad(),
        flash.installed(also=(kernel,) if kernel not in (FLASH, "flash_attention_3") else ()),
    ):
        logits = model(**inputs, use_cache=False).logits
        summed = causal_lm_loss(model, inputs, batch["labels"], LossPlan()).ce_sum
    spans = documents(batch["position_ids"])
    bounds = (*(a for a, _ in spans), batch["input_ids"].numel())
    layers = model.config.num_hidden_layers
    assert flash.kinds() == {"varlen"}, (
        f"a plain flash call over rows of several documents: {flash.calls[:2]}"
    )
    assert [c.cu_seqlens for c in flash.calls] == [bounds] * (2 * layers), "every document, every layer"
    assert {c.max_seqlen for c in flash.calls} == {max(b - a for a, b in spans)}
    # Each document alone (sdpa, the same weights): the same per-token losses, the same summed loss.
    ids, labels = batch["input_ids"].reshape(-1), batch["labels"].reshape(-1)
    got = per_token_losses(logits.reshape(1, -1, logits.shape[-1]), labels[None])[0]
    model.config._attn_implementation = reference
    total = torch.zeros((), dtype=torch.float64)
    try:
        with torch.no_grad():
            for a, b in spans:
                alone = per_token_losses(model(input_ids=ids[None, a:b]).logits, labels[None, a:b])[0]
                assert_same_maths(
                    got[a : b - 1], alone, terms=model.config.vocab_size, name=f"tokens {a}:{b}"
                )
                if a > 0:  # the last token of the previous document predicts nothing
                    assert got[a - 1] == 0
                total += alone.sum()
    finally:
        model.config._attn_implementation = kernel
    assert_same_maths(summed.double(), total, terms=model.config.vocab_size * len(spans), name="summed loss")
    return len(spans)


def session(recipe: str, argv: list[str], model_config: LlamaConfig, tmp_path: Path) -> SimpleNamespace:
    """What the data builders read of a run: its config, model config, device and data ranks (one process)."""
    cfg = parse_method_config(
        recipe,
        [
            "--model_name_or_path",
            "tiny",
            "--output_dir",
            str(tmp_path / "run"),
            "--attn_implementation",
            FLASH,
            *argv,
        ],
    )
    return SimpleNamespace(
        cfg=cfg, model_config=model_config, device=torch.device("cpu"), data_world=1, data_rank=0
    )


def run_tokenizer(tokenizer: PreTrainedTokenizerBase) -> PreTrainedTokenizerBase:
    """The tokenizer as a run loads it (hf_fsdp2.model.load_tokenizer): EOS as pad when it has no pad token."""
    tokenizer = copy.deepcopy(tokenizer)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def first_batches(stream: Any, n: int) -> list[dict[str, torch.Tensor]]:
    batches = iter(stream)
    return [next(batches) for _ in range(n)]


def test_transformers_flash_path_finds_packed_documents_only_in_a_one_row_batch() -> None:
    """The premise: two packed rows reach the plain kernel (documents attend across), the same rows laid end to end
    reach the varlen kernel with every boundary."""
    model = flash_model(tiny_config(61))
    positions = torch.tensor([[0, 1, 2, 0, 1, 2, 3, 4], [0, 1, 0, 1, 2, 3, 4, 5]])
    ids = torch.randint(0, 61, (2, 8), generator=torch.Generator().manual_seed(0))
    flash = StandInFlash()
    with torch.no_grad(), flash.installed():
        model(input_ids=ids, position_ids=positions, use_cache=False)
        assert flash.kinds() == {"rows"}
        flash.calls.clear()
        model(input_ids=ids.reshape(1, -1), position_ids=positions.reshape(1, -1), use_cache=False)
    assert {c.cu_seqlens for c in flash.calls} == {(0, 3, 8, 10, 16)}


@pytest.mark.parametrize("batch_size", [2, 3])
def test_packed_sft_rows_reach_the_flash_kernel_apart(
    batch_size: int, chatml_tokenizer: PreTrainedTokenizerBase, tmp_path: Path
) -> None:
    data_file = write_chat_jsonl(tmp_path / "chat.jsonl", 40, seed=5)
    config = tiny_config(len(chatml_tokenizer))
    run = session(
        "sft",
        [
            "--dataset_name",
            str(data_file),
            "--packing",
            "true",
            "--max_length",
            "96",
            "--per_device_train_batch_size",
            str(batch_size),
        ],
        config,
        tmp_path,
    )
    data = build_sft_data(run, run_tokenizer(chatml_tokenizer))  # type: ignore[arg-type]
    model = flash_model(config)
    flash = StandInFlash()
    for batch in first_batches(data.stream, 2):
        held = check_documents_apart(model, batch, flash)
        assert held > batch_size  # several packed rows of several examples each, of different lengths


# What transformers 5.25 loads gpt-oss with when asked for flash_attention_2/3: the first flash kernel its class lists
# (``_compatible_flash_implementations``), kernels-community's vllm-flash-attn3, which takes the attention sinks.
GPT_OSS_FLASH = "kernels-community/vllm-flash-attn3"


def family_flash_model(family: str, tokenizer: PreTrainedTokenizerBase) -> tuple[PreTrainedModel, str]:
    """The tiny ``family`` model (tests/support/families.py) in float64 on its flash path, loaded as a run loads it
    where transformers replaces the flash kernel (gpt-oss), and the attention its documents are checked alone with.
    gpt-oss's sinks get distinct values per head and layer (initialised near 0 they would hardly move a softmax)."""
    config = family_config(family, tokenizer)
    cls = AutoModelForCausalLM._model_mapping[type(config)]
    torch.manual_seed(0)
    if getattr(cls, "_compatible_flash_implementations", None):
        with StandInFlash().installed(also=tuple(cls._compatible_flash_implementations[:1])):
            model = cls._from_config(config, attn_implementation=FLASH, experts_implementation="batched_mm")
    else:
        model = cls._from_config(config, attn_implementation="sdpa", dtype=torch.float32)
        model.config._attn_implementation = FLASH
    model = model.double().eval()
    for i, layer in enumerate(model.model.layers):
        sinks = getattr(layer.self_attn, "sinks", None)
        if sinks is not None:
            sinks.data = torch.linspace(-1.0, 2.0, sinks.numel(), dtype=torch.float64) + i
    return model, ("sdpa" if cls._supports_sdpa else "eager")


@pytest.fixture(scope="module")
def small_chatml_tokenizer() -> PreTrainedTokenizerBase:
    """The families' tokenizer (the cut Llama-2 vocabulary, ChatML), EOS as pad as a run loads it: a small head."""
    tokenizer = build_llama2_test_tokenizer(CHATML_TEMPLATE, CHATML_SPECIAL_TOKENS, small=True)
    tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


@pytest.mark.parametrize("family", ["olmo3", "exaone4", "gpt_oss"])
def test_packed_rows_of_window_and_sink_families_reach_the_flash_kernel_apart(
    family: str, small_chatml_tokenizer: PreTrainedTokenizerBase, tmp_path: Path
) -> None:
    """OLMo 3 and EXAONE 4 (a sliding-window layer and a full one) and gpt-oss (the same, with attention sinks and
    experts): packed SFT rows on a flash kernel reach it as varlen calls with every document's boundaries, each layer
    asking its own window (8 tokens, shorter than the documents: flash-attn's inclusive (7, 7)) and gpt-oss's layers
    their own sinks, and each document's per-token losses are those it gives alone (sdpa; eager for gpt-oss, whose
    softmax takes the sinks). gpt-oss is loaded with flash_attention_2 as a run loads it: transformers runs it on
    the flash kernel its class names instead, which the run's build check keeps."""
    tokenizer = small_chatml_tokenizer
    model, reference = family_flash_model(family, tokenizer)
    loaded = model.config._attn_implementation
    assert loaded == (GPT_OSS_FLASH if family == "gpt_oss" else FLASH)
    check_loaded_attention(loaded, asked=FLASH, packing=True, padding_free=False, model_cls=type(model))
    data_file = write_chat_jsonl(tmp_path / "chat.jsonl", 30, seed=7)
    run = session(
        "sft",
        [
            "--dataset_name",
            str(data_file),
            "--packing",
            "true",
            "--max_length",
            "96",
            "--per_device_train_batch_size",
            "2",
        ],
        model.config,
        tmp_path,
    )
    batch = first_batches(build_sft_data(run, tokenizer).stream, 1)[0]  # type: ignore[arg-type]
    flash = StandInFlash()
    assert check_documents_apart(model, batch, flash, reference=reference) > 2
    window = model.config.sliding_window
    per_layer = [
        (window - 1, window - 1) if kind == "sliding_attention" else None for kind in model.config.layer_types
    ]
    assert set(per_layer) == {(7, 7), None}
    assert [c.window for c in flash.calls] == per_layer * 2, "each layer's own window, both forwards"
    sinks = [
        tuple(layer.self_attn.sinks.tolist()) if family == "gpt_oss" else None for layer in model.model.layers
    ]
    assert [c.sinks for c in flash.calls] == sinks * 2, "each layer's own sinks (gpt-oss), none elsewhere"


def test_llama4_text_chunked_attention_has_no_flash_path_and_is_refused_by_name(
    small_chatml_tokenizer: PreTrainedTokenizerBase,
) -> None:
    """Llama 4's chunked layers: transformers gives its text model no flash path (``_supports_flash_attn`` false;
    its chunk mask under a flash kernel raises for rows longer than the chunk), so a flash kernel is refused at
    start-up, before any weight is read, packed rows or not."""
    config = family_config("llama4_text", small_chatml_tokenizer)
    for kernel in ("flash_attention_2", "flash_attention_3"):
        for packing in (True, False):
            with pytest.raises(
                ConfigError, match=f"attn_implementation={kernel}: Llama4ForCausalLM does not support it"
            ):
                choose_attention_layout(
                    config,
                    device_type="cuda",
                    attn_implementation=kernel,
                    packing=packing,
                    installed=frozenset({kernel}),
                )


def test_rows_of_documents_on_a_kernel_that_is_not_the_flash_kernel_transformers_substitutes_are_refused() -> (
    None
):
    """The build check keeps only what keeps documents apart: gpt-oss's own flash kernel when a flash kernel was
    asked for; the same name on a class that does not list it, or after asking for another kernel, is refused."""
    check_loaded_attention(
        GPT_OSS_FLASH, asked=FLASH, packing=False, padding_free=True, model_cls=GptOssForCausalLM
    )
    for asked, cls in ((FLASH, LlamaForCausalLM), ("flex_attention", GptOssForCausalLM)):
        with pytest.raises(ConfigError, match=f"padding_free=True need .* the model runs '{GPT_OSS_FLASH}'"):
            check_loaded_attention(GPT_OSS_FLASH, asked=asked, packing=True, padding_free=True, model_cls=cls)
    check_loaded_attention("sdpa", asked="sdpa", packing=True, padding_free=False, model_cls=LlamaForCausalLM)
    check_loaded_attention(
        "whatever", asked="sdpa", packing=False, padding_free=False, model_cls=LlamaForCausalLM
    )


def write_corpus(path: Path, n: int, seed: int) -> Path:
    rng = random.Random(seed)
    with path.open("w") as fh:
        for _ in range(n):
            fh.write(json.dumps({"text": " ".join(rng.choices(WORDS, k=rng.randint(3, 40)))}) + "\n")
    return path


@pytest.mark.parametrize("corpus_layout", ["concat", "best_fit"])
def test_continued_pretraining_rows_reach_the_flash_kernel_apart(
    corpus_layout: str, llama2_tokenizer: PreTrainedTokenizerBase, tmp_path: Path
) -> None:
    corpus = write_corpus(tmp_path / "docs.jsonl", 60, seed=3)
    config = tiny_config(len(llama2_tokenizer))
    run = session(
        "cpt",
        [
            "--dataset_name",
            str(corpus),
            "--max_length",
            "64",
            "--corpus_layout",
            corpus_layout,
            "--per_device_train_batch_size",
            "2",
        ],
        config,
        tmp_path,
    )
    data = build_cpt_data(run, run_tokenizer(llama2_tokenizer))  # type: ignore[arg-type]
    model = flash_model(config)
    flash = StandInFlash()
    for batch in first_batches(data.stream, 2):
        assert check_documents_apart(model, batch, flash) > 2


def test_padding_free_false_over_rows_of_documents_under_flash_is_refused_by_name() -> None:
    with pytest.raises(
        ConfigError, match="padding_free=false with rows of several documents.*flash_attention_2"
    ):
        choose_attention_layout(
            tiny_config(61),
            device_type="cuda",
            attn_implementation=FLASH,
            packing=True,
            padding_free=False,
            installed=frozenset({FLASH}),
        )
    # One sequence per row (no packing): rows kept, each its own sequence under the plain kernel.
    kept = choose_attention_layout(
        tiny_config(61),
        device_type="cuda",
        attn_implementation=FLASH,
        padding_free=False,
        installed=frozenset({FLASH}),
    )
    assert not kept.padding_free


@pytest.fixture
def one_rank_group(tmp_path: Path) -> Iterator[Any]:
    """A world-1 gloo group: the all-to-all runs (each rank holds the whole sequence)."""
    owned = not dist.is_initialized()
    if owned:
        dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    yield dist.group.WORLD
    if owned:
        dist.destroy_process_group()


def test_the_context_parallel_flash_branch_hands_the_kernel_every_document_of_every_row(
    one_rank_group: Any,
) -> None:
    """Two rows of documents of different lengths (as packing without padding_free, or a caller's own rows): the
    all-to-all's flash branch gives the kernel the boundaries of every document of both rows, and loads flash-attn
    by the wrapped kernel's name (not the all-to-all interface's). The parts of cp > 1 are checked on 4 processes
    (tests/distributed/test_context_parallel.py)."""
    config = tiny_config(61)
    model = flash_model(config)
    line = enable_context_parallel(model, one_rank_group, 1)
    assert f"around the {FLASH} kernel" in line
    ids = torch.randint(3, 61, (2, 16), generator=torch.Generator().manual_seed(1))
    positions = torch.stack(
        [torch.cat([torch.arange(n) for n in lengths]) for lengths in ([5, 7, 4], [9, 3, 4])]
    )
    labels = ids.clone()
    labels[positions == 0] = IGNORE_INDEX
    part = shard_sequence({"input_ids": ids, "labels": labels, "position_ids": positions}, 1, 0)
    flash = StandInFlash()
    with torch.no_grad(), flash.installed():
        inputs = {k: v for k, v in part.items() if k != "labels"}
        summed = causal_lm_loss(model, inputs, part["labels"], LossPlan()).ce_sum
    assert set(flash.names) == {FLASH}
    assert flash.kinds() == {"varlen"}
    assert {c.cu_seqlens for c in flash.calls} == {(0, 5, 12, 16, 25, 28, 32)}
    assert {c.max_seqlen for c in flash.calls} == {9}
    reference = flash_model(config)
    reference.config._attn_implementation = "sdpa"  # sdpa's block-diagonal mask from the positions
    with torch.no_grad():
        want = causal_lm_loss(
            reference, {"input_ids": ids, "position_ids": positions}, labels, LossPlan()
        ).ce_sum
    assert_same_maths(summed.double(), want.double(), terms=61 * 6, name="summed loss")
