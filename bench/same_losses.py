"""The proof of a refactor: the same short runs at a git ref and now log bit-identical losses.

    bash scripts/same_losses.sh 77cd9fa                 # ref 77cd9fa vs the working tree (uncommitted edits too)
    bash scripts/same_losses.sh HEAD~20 HEAD            # two refs, both exported
    python bench/same_losses.py HEAD~5 --paths plain,dpo,grpo --keep /tmp/same

The tree at REF is exported with ``git archive`` into a temporary folder; each run uses this virtualenv's
python with ``PYTHONPATH`` set to its tree, from a neutral working folder, so ``import hf_fsdp2`` finds that
tree's copy before the editable install, and runs that tree's ``recipes/<name>.py``. A tree whose recipes import
each other as ``hf_fsdp2.recipes`` (setup.py's alias of recipes/, before the restructure: recipes/dpo.py imports
``run`` from ``hf_fsdp2.recipes.sft``) gets ``hf_fsdp2/recipes`` linked to its ``recipes`` (the editable install
would otherwise map that name to its own checkout); a tree whose recipes import only the library needs no alias
and gets none. Checked before any run: each side's ``hf_fsdp2``, ``hf_fsdp2.accelerate_configs`` and, where the
alias is used, every ``hf_fsdp2.recipes.<name>`` resolve inside that side's tree (printed), and the two sides'
``hf_fsdp2.__file__`` differ. Both sides run the same fixture, built once here without hf_fsdp2: a 2-layer,
64-wide random-init Llama with the Llama-2 tokenizer of ``wordllama`` and ChatML, 32 chat records, 32 preference
pairs, 24 text documents, 32 unpaired labelled completions and 32 prompts with an answer. Paths (2 gloo ranks
on CPU, ``torchrun``, fp32, seed 0, 3 optimizer steps of 2 micro-batches of 2 per rank, no checkpoint, export
unverified):

* ``plain``          recipes/sft.py;
* ``lora``           recipes/sft.py with ``use_peft`` (r 4, the default dropout: the RNG stream is part of the proof);
* ``packed``         recipes/sft.py with ``packing``;
* ``cpt``            recipes/cpt.py (documents concatenated and cut into rows of 64 tokens);
* ``dpo``            recipes/dpo.py (sigmoid, beta 0.1, the frozen sharded reference);
* ``dpo_precompute`` the same with ``precompute_ref_log_probs`` (one reference pass before training);
* ``dpo_lora``       the same with LoRA (the reference: the base with the adapter disabled);
* ``ipo``            recipes/dpo.py with ``loss_type: ipo``;
* ``simpo``          recipes/dpo.py with ``loss_type: simpo`` (beta 2, gamma 0.5, ``cpo_alpha`` 1: the NLL term too);
* ``orpo``           recipes/dpo.py with ``loss_type: orpo`` (reference-free);
* ``kto``            recipes/kto.py (unpaired, labels 60/40, undesirable_weight 1.5, the KL estimate);
* ``rm``             recipes/rm.py (a reward model with a new score head on the preference pairs);
* ``grpo``           recipes/grpo.py (4 sampled completions of 8 tokens per prompt, seeded per rank and step;
  exact_match and format rewards; loss_type grpo with beta 0.04: the KL to a frozen reference).

Each step's record in ``<output_dir>/metrics.jsonl`` is compared field by field with ``==`` (the JSON floats are
Python's shortest round-trip repr, so equal text is equal bits): ``loss`` and ``grad_norm`` always, and every
other numeric field both sides log except timings and memory (``is_timing``); the exported ``*.safetensors``
of the two runs must hold equal tensors too. Exit status: 0 when every path is identical, 1 when any value
differs, 2 when nothing differs but a path cannot run on a side (its error's last lines are printed: a config
key the older tree does not know names itself there; the other paths still run).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
METRICS_FILE = (
    "metrics.jsonl"  # hf_fsdp2/observe/logs.py METRICS_FILE (not imported: the tool must not need it)
)
REQUIRED = ("loss", "grad_norm")
# Fields that measure the machine, not the numerics: never compared (with any *_s, *_gib or *per_s* field).
NOT_NUMERICS = ("mfu", "tflops_per_device", "recompiles")
COMMON: dict[str, Any] = {
    "max_steps": 3,
    "per_device_train_batch_size": 2,
    "gradient_accumulation_steps": 2,
    "max_length": 64,
    "mixed_precision": "no",
    "learning_rate": 1e-3,
    "lr_scheduler_type": "constant",
    "logging_steps": 1,
    "seed": 0,
    "save_steps": 0,
    "export_verify": False,
    "overwrite_output_dir": True,
}
# GRPO's format reward (a full match of the stripped completion): "holds an x, y, z or q". The fixture's random model
# samples 8 tokens of the whole vocabulary, which match it 58% of the time (37 of 64 measured), so that groups'
# rewards differ and the advantages are not all zero (exact_match against a random word is always 0).
FORMAT_PATTERN = ".*[xyzq].*"
# path -> (recipe, data file of the fixture, settings on top of COMMON)
PATHS: dict[str, tuple[str, str, dict[str, Any]]] = {
    "plain": ("sft", "chat.jsonl", {}),
    "lora": ("sft", "chat.jsonl", {"use_peft": True, "lora_r": 4, "lora_alpha": 8}),
    "packed": ("sft", "chat.jsonl", {"packing": True}),
    "cpt": ("cpt", "corpus.jsonl", {"text_column": "text", "text_unit": "document", "corpus_layout": "concat"}),
    "dpo": ("dpo", "pairs.jsonl", {"beta": 0.1, "loss_type": "sigmoid", "learning_rate": 1e-2}),
    "dpo_precompute": ("dpo", "pairs.jsonl", {"beta": 0.1, "loss_type": "sigmoid", "learning_rate": 1e-2,
                                              "precompute_ref_log_probs": True}),
    "dpo_lora": ("dpo", "pairs.jsonl", {"beta": 0.1, "loss_type": "sigmoid", "learning_rate": 1e-2,
                                        "use_peft": True, "lora_r": 4, "lora_alpha": 8}),
    "ipo": ("dpo", "pairs.jsonl", {"beta": 0.1, "loss_type": "ipo", "learning_rate": 1e-2}),
    "simpo": ("dpo", "pairs.jsonl", {"beta": 2.0, "loss_type": "simpo", "simpo_gamma": 0.5, "cpo_alpha": 1.0,
                                     "learning_rate": 1e-2}),
    "orpo": ("dpo", "pairs.jsonl", {"beta": 0.1, "loss_type": "orpo", "learning_rate": 1e-2}),
    "kto": ("kto", "unpaired.jsonl", {"beta": 0.1, "loss_type": "kto", "desirable_weight": 1.0,
                                      "undesirable_weight": 1.5, "learning_rate": 1e-2}),
    "rm": ("rm", "pairs.jsonl", {"learning_rate": 1e-2}),
    "grpo": ("grpo", "prompts.jsonl", {
        "reward_funcs": ["exact_match", "format"], "reward_weights": [1.0, 0.5], "reward_reference_column": "answer",
        "reward_format_pattern": FORMAT_PATTERN, "num_generations": 4, "max_completion_length": 8,
        "temperature": 1.0, "loss_type": "grpo", "beta": 0.04, "learning_rate": 1e-2}),
}  # fmt: skip
WORDS = [
    "alpha",
    "bravo",
    "charlie",
    "delta",
    "echo",
    "foxtrot",
    "golf",
    "hotel",
    "india",
    "juliet",
    "kilo",
    "lima",
    "mike",
    "november",
    "oscar",
    "papa",
]
CHATML_TEMPLATE = (  # bench/data_bench.py's: the library finds the assistant spans itself
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


class SameLossesError(Exception):
    """A side cannot be prepared or run; the message names what and the fix."""


# ---------------------------------------------------------------------------------------------- comparison
@dataclass
class PathResult:
    """One path's comparison: the steps, the largest difference per field, and what did not match."""

    path: str
    steps: int
    max_diff: dict[str, float] = field(default_factory=dict)
    differences: list[str] = field(default_factory=list)
    only_one_side: list[str] = field(default_factory=list)
    weights: str = "-"  # the exported safetensors: "yes" equal bits, "NO", "-" not compared

    @property
    def identical(self) -> bool:
        return not self.differences


def compared_fields(ref: dict[str, Any], new: dict[str, Any]) -> list[str]:
    """``loss``, ``grad_norm``, then every other field both records hold that is a number and no timing."""
    shared = [k for k in ref if k in new and k not in REQUIRED and k != "step"]
    numeric = [
        k
        for k in shared
        if not is_timing(k)
        and isinstance(ref[k], (int, float, str))
        and not isinstance(ref[k], bool)
        and _number(ref[k]) is not None
    ]
    return [*REQUIRED, *numeric]


def is_timing(key: str) -> bool:
    """A field of speed, time or memory (it varies run to run on the same code)."""
    return key in NOT_NUMERICS or key.endswith(("_s", "_gib")) or "per_s" in key or key.startswith("compile")


def _number(value: Any) -> float | None:
    """A logged number (NaN/inf are logged as the strings 'nan', 'inf', '-inf'), or None."""
    if isinstance(value, bool):
        return None
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, str) and value in ("nan", "inf", "-inf"):
        return float(value)
    return None


def _same(a: Any, b: Any) -> bool:
    """Bit-equal logged values: equal numbers (NaN equals NaN: both runs diverged alike), or equal text."""
    x, y = _number(a), _number(b)
    if x is None or y is None:
        return bool(a == b)
    return x == y or (math.isnan(x) and math.isnan(y))


def compare_records(path: str, ref: list[dict[str, Any]], new: list[dict[str, Any]]) -> PathResult:
    """Compare two runs' metrics records step by step; any unequal value, step or missing field is a difference."""
    result = PathResult(path=path, steps=min(len(ref), len(new)))
    ref_steps, new_steps = [r.get("step") for r in ref], [r.get("step") for r in new]
    if not ref or not new:
        result.differences.append(f"no logged step (ref {len(ref)} records, new {len(new)})")
    if ref_steps != new_steps:
        result.differences.append(f"logged steps differ: ref {ref_steps}, new {new_steps}")
    only: set[str] = set()
    for r, n in zip(ref, new, strict=False):
        for key in REQUIRED:
            if key not in r or key not in n:
                result.differences.append(
                    f"step {r.get('step')}: {key!r} missing (ref {key in r}, new {key in n})"
                )
        only |= {k for k in r.keys() ^ n.keys() if not is_timing(k)}
        for key in compared_fields(r, n):
            if key not in r or key not in n:
                continue
            x, y = _number(r[key]), _number(n[key])
            if x is not None and y is not None and not (math.isnan(x) or math.isnan(y)):
                diff = abs(x - y)
                result.max_diff[key] = max(result.max_diff.get(key, 0.0), diff)
            if not _same(r[key], n[key]):
                result.differences.append(f"step {r.get('step')}: {key} ref {r[key]!r} new {n[key]!r}")
    result.only_one_side = sorted(only)
    return result


def compare_exports(result: PathResult, ref_run: Path, new_run: Path) -> None:
    """Add to ``result`` whether the two runs exported the same tensors (``*.safetensors`` of the run folders)."""
    from safetensors.torch import load_file

    ref_files = sorted(p.name for p in ref_run.glob("*.safetensors"))
    new_files = sorted(p.name for p in new_run.glob("*.safetensors"))
    if not ref_files and not new_files:
        return
    if ref_files != new_files:
        result.weights = "NO"
        result.differences.append(f"exported files differ: ref {ref_files}, new {new_files}")
        return
    unequal = []
    for name in ref_files:
        ref, new = load_file(ref_run / name), load_file(new_run / name)
        if ref.keys() != new.keys():
            unequal.append(f"{name}: tensor names differ ({sorted(ref.keys() ^ new.keys())[:4]})")
            continue
        unequal += [
            f"{name}: {key} max abs diff {(ref[key].double() - new[key].double()).abs().max().item():.3g}"
            for key in sorted(ref)
            if ref[key].dtype != new[key].dtype
            or ref[key].shape != new[key].shape
            or not ref[key].equal(new[key])
        ]
    result.weights = "NO" if unequal else "yes"
    result.differences += [f"exported weights: {line}" for line in unequal]


def read_records(path: Path) -> list[dict[str, Any]]:
    """The records of a metrics.jsonl file, in order."""
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def compare_files(path: str, ref_file: Path, new_file: Path) -> PathResult:
    """``compare_records`` of two metrics.jsonl files."""
    return compare_records(path, read_records(ref_file), read_records(new_file))


def table(results: list[PathResult]) -> str:
    """The Markdown table: path | steps | max |diff| of loss, grad_norm, other fields | identical."""
    lines = [
        "| path | steps | max abs diff loss | max abs diff grad_norm | other fields compared, max abs diff | exported weights "
        "equal | identical |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in results:
        others = {k: v for k, v in r.max_diff.items() if k not in REQUIRED}
        worst = max(others.items(), key=lambda kv: kv[1]) if others else ("", 0.0)
        other = f"{len(others)}, max {worst[1]:.3g}" + (f" ({worst[0]})" if worst[1] else "")
        lines.append(
            f"| {r.path} | {r.steps} | {r.max_diff.get('loss', float('nan')):.3g} | "
            f"{r.max_diff.get('grad_norm', float('nan')):.3g} | {other} | {r.weights} | {'yes' if r.identical else 'NO'} |"
        )
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------- the trees
def resolve(ref: str) -> str:
    """The commit ``ref`` names in this repository."""
    proc = subprocess.run(
        ["git", "rev-parse", "--verify", "--quiet", f"{ref}^{{commit}}"],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    if proc.returncode != 0:
        raise SameLossesError(
            f"{ref!r} names no commit of {REPO}; give a commit, tag or branch (git log --oneline)"
        )
    return proc.stdout.strip()


def export_tree(commit: str, dest: Path) -> Path:
    """The files of ``commit`` (``git archive``) in ``dest``; nothing in the repository's .git changes."""
    dest.mkdir(parents=True)
    archive = subprocess.Popen(["git", "archive", "--format=tar", commit], cwd=REPO, stdout=subprocess.PIPE)
    untar = subprocess.run(
        ["tar", "-x", "-C", str(dest)], stdin=archive.stdout, capture_output=True, text=True
    )
    if archive.wait() != 0 or untar.returncode != 0:
        raise SameLossesError(f"git archive {commit} | tar -x -C {dest} failed: {untar.stderr.strip()}")
    for needed in ("hf_fsdp2/__init__.py", "recipes/sft.py"):
        if not (dest / needed).is_file():
            raise SameLossesError(
                f"the tree of {commit} has no {needed}: not an hf_fsdp2 tree this tool can run"
            )
    link_package_dirs(dest)
    return dest


def run_env(tree: Path) -> dict[str, str]:
    """This environment with ``PYTHONPATH`` = ``tree`` only (before the editable install's finder)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(
        PYTHONPATH=str(tree),
        OMP_NUM_THREADS="1",
        HF_HUB_OFFLINE="1",
        TOKENIZERS_PARALLELISM="false",
        PYTHONHASHSEED="0",
        HF_FSDP2_OFFLINE="1",
    )
    return env


# Modules whose files must come from the tree under test, each with the file the tree must hold for it to be probed:
# the package, and the accelerate configs setup.py installs as hf_fsdp2.accelerate_configs. The recipes are probed
# as hf_fsdp2.recipes.<name> only in a tree whose recipes import each other by that alias (``recipes_alias``).
PROBED = {"hf_fsdp2": "hf_fsdp2/__init__.py", "hf_fsdp2.accelerate_configs": "accelerate_configs/__init__.py"}
# ``from hf_fsdp2.recipes.sft import run`` / ``import hf_fsdp2.recipes...``: a line of code, not of a docstring.
ALIAS_IMPORT = re.compile(r"^(?:from|import)\s+hf_fsdp2\.recipes\b", re.MULTILINE)


def recipes_alias(tree: Path) -> bool:
    """Whether ``tree``'s recipes import ``hf_fsdp2.recipes`` (setup.py's package_dir alias of recipes/).

    A tree before the restructure does (recipes/dpo.py imports ``run`` from ``hf_fsdp2.recipes.sft``): the alias
    must then resolve inside that tree, or the run would mix the editable install's recipes with the tree's. A tree
    whose recipes import only the library has no such need: nothing is linked or probed for it.
    """
    return any(ALIAS_IMPORT.search(f.read_text()) for f in sorted((tree / "recipes").glob("*.py")))


def probed_modules(tree: Path) -> list[str]:
    """The modules ``package_files`` looks up for ``tree``: ``hf_fsdp2``, the other ``PROBED`` ones whose file it
    holds, and with ``recipes_alias`` every recipe as ``hf_fsdp2.recipes.<name>`` (a recipe the tree lacks: its
    path is refused by run_path, by name)."""
    names = [
        "hf_fsdp2",
        *(name for name, file in PROBED.items() if name != "hf_fsdp2" and (tree / file).is_file()),
    ]
    if recipes_alias(tree):
        names += [
            f"hf_fsdp2.recipes.{f.stem}"
            for f in sorted((tree / "recipes").glob("*.py"))
            if f.stem != "__init__"
        ]
    return names


PROBE = (
    "import importlib.util, sys\n"
    "for name in sys.argv[1:]:\n"
    "    try:\n"
    "        spec = importlib.util.find_spec(name)\n"
    "    except ModuleNotFoundError:\n"
    "        spec = None\n"
    "    origin = spec and (spec.origin or list(spec.submodule_search_locations or [''])[0])\n"
    "    print(name, origin or '-')\n"
)


def link_package_dirs(tree: Path) -> None:
    """In an exported tree, ``hf_fsdp2/recipes`` -> ``recipes`` (where ``recipes_alias``) and accelerate_configs, as
    setup.py installs them.

    Without the link, ``from hf_fsdp2.recipes.sft import run`` (recipes/dpo.py before the restructure) falls through
    to the editable install's mapping and runs the working tree's sft.py inside the exported tree's run.
    """
    for name in ("recipes", "accelerate_configs") if recipes_alias(tree) else ("accelerate_configs",):
        if (tree / name).is_dir() and not (tree / "hf_fsdp2" / name).exists():
            (tree / "hf_fsdp2" / name).symlink_to(Path("..") / name, target_is_directory=True)


def package_files(tree: Path, cwd: Path) -> dict[str, Path]:
    """Where ``probed_modules(tree)`` resolve with ``run_env(tree)`` from ``cwd``; every one found must be in ``tree``
    (``hf_fsdp2`` must be found)."""
    proc = subprocess.run(
        [sys.executable, "-c", PROBE, *probed_modules(tree)],
        cwd=cwd,
        env=run_env(tree),
        capture_output=True,
        text=True,
        timeout=120,
    )
    if proc.returncode != 0:
        raise SameLossesError(f"looking up hf_fsdp2 failed with PYTHONPATH={tree}:\n{proc.stderr[-2000:]}")
    found = {name: Path(origin) for name, origin in (line.split(" ", 1) for line in proc.stdout.splitlines())}
    found = {name: path.resolve() for name, path in found.items() if str(path) != "-"}
    if "hf_fsdp2" not in found:
        raise SameLossesError(f"with PYTHONPATH={tree}, hf_fsdp2 cannot be found: {proc.stdout.strip()}")
    outside = {name: path for name, path in found.items() if not path.is_relative_to(tree.resolve())}
    if outside:
        raise SameLossesError(
            f"with PYTHONPATH={tree}, these modules come from elsewhere: "
            + ", ".join(f"{name} -> {path}" for name, path in outside.items())
            + "; an install that precedes PYTHONPATH or maps these names would hide the tree (reinstall with pip -e "
            "from this checkout)"
        )
    return found


# ---------------------------------------------------------------------------------------------- the fixture
def build_fixture(root: Path) -> Path:
    """A tiny random-init Llama (seed 0) with a real tokenizer and each recipe's data (the module docstring)."""
    import importlib.util

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    spec = importlib.util.find_spec("wordllama")
    if spec is None or spec.origin is None:
        raise SameLossesError(
            "the fixture needs the Llama-2 tokenizer of the PyPI package wordllama: pip install wordllama"
        )
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_file=str(Path(spec.origin).parent / "tokenizers" / "l2_supercat_tokenizer_config.json"),
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
    )
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tokenizer.chat_template = CHATML_TEMPLATE
    tokenizer.pad_token = tokenizer.eos_token
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(0)
    model_dir = root / "model"
    LlamaForCausalLM(config).save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    rng = random.Random(0)

    def words(lo: int, hi: int) -> str:
        return " ".join(rng.choices(WORDS, k=rng.randint(lo, hi)))

    with (root / "chat.jsonl").open("w") as chat, (root / "pairs.jsonl").open("w") as pairs:
        for _ in range(32):
            messages = [
                {"role": "user", "content": words(1, 12)},
                {"role": "assistant", "content": words(1, 12)},
            ]
            chat.write(json.dumps({"messages": messages}) + "\n")
            chosen, rejected = words(1, 8), words(1, 8)
            while rejected == chosen:
                rejected = words(1, 8)
            pairs.write(
                json.dumps({"prompt": words(2, 8), "chosen": " " + chosen, "rejected": " " + rejected}) + "\n"
            )
    # The other recipes' data from a second stream, so that the chat records and pairs above stay as they were.
    rng = random.Random(1)
    with (root / "corpus.jsonl").open("w") as corpus:  # documents of 1 to 120 words: many span rows of 64
        for _ in range(24):
            corpus.write(json.dumps({"text": words(1, 120)}) + "\n")
    with (root / "unpaired.jsonl").open("w") as unpaired:  # labels mixed unevenly, as KTO data are
        for _ in range(32):
            record = {"prompt": words(2, 8), "completion": " " + words(1, 8), "label": rng.random() < 0.6}
            unpaired.write(json.dumps(record) + "\n")
    with (root / "prompts.jsonl").open("w") as prompts:
        for _ in range(32):
            prompts.write(json.dumps({"prompt": words(2, 8), "answer": rng.choice(WORDS)}) + "\n")
    return root


# ---------------------------------------------------------------------------------------------- the runs
@dataclass
class Side:
    """One side of the comparison: a label (ref / new), what it is (a commit or the working tree), its tree."""

    label: str
    name: str
    tree: Path


def run_path(side: Side, path: str, fixture: Path, work: Path, timeout: int) -> tuple[Path, float]:
    """One 2-rank run of ``path`` on ``side``'s tree; returns its metrics file and wall time."""
    recipe, data, settings = PATHS[path]
    out = work / f"{side.label}-{path}"
    out.mkdir(parents=True, exist_ok=True)
    values = {
        **COMMON,
        **settings,
        "model_name_or_path": str(fixture / "model"),
        "dataset_name": str(fixture / data),
        "output_dir": str(out / "run"),
    }
    config = out / "recipe.yaml"
    config.write_text("".join(f"{k}: {json.dumps(v)}\n" for k, v in values.items()))  # JSON values are YAML
    script = side.tree / "recipes" / f"{recipe}.py"
    if not script.is_file():
        raise SameLossesError(f"{path}: {side.name} has no recipes/{recipe}.py; choose a later ref")
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        "2",
        "--master_addr",
        "127.0.0.1",
        "--master_port",
        str(_free_port()),
        str(script),
        "--config",
        str(config),
    ]
    start = time.perf_counter()
    try:
        proc = subprocess.run(
            cmd, cwd=out, env=run_env(side.tree), capture_output=True, text=True, timeout=timeout
        )
    except subprocess.TimeoutExpired as err:
        raise SameLossesError(
            f"{path} on {side.name}: no end after {timeout} s (--timeout to give it longer)"
        ) from err
    seconds = time.perf_counter() - start
    (out / "stdout.txt").write_text(proc.stdout)
    (out / "stderr.txt").write_text(proc.stderr)
    metrics = out / "run" / METRICS_FILE
    if proc.returncode != 0 or not metrics.is_file():
        tail = "\n".join(_error_lines(proc.stdout + proc.stderr)[-8:])
        raise SameLossesError(
            f"{path} cannot run on {side.name} (exit {proc.returncode}; the recipe {config} may use a key that tree "
            f"does not know: choose a later ref or --paths without it). Its last error lines ({out}/stderr.txt):\n{tail}"
        )
    return metrics, seconds


def _error_lines(text: str) -> list[str]:
    keep = [line for line in text.splitlines() if "error" in line.lower() or "Error" in line]
    return keep or text.splitlines()


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("ref", help="the git ref before the change (commit, tag, branch, HEAD~20)")
    parser.add_argument(
        "new", nargs="?", default=None, help="a second ref; default the working tree as it is"
    )
    parser.add_argument("--paths", default=",".join(PATHS), help=f"comma-separated, of {', '.join(PATHS)}")
    parser.add_argument(
        "--keep", type=Path, default=None, help="work in this folder and keep it (runs' logs)"
    )
    parser.add_argument("--timeout", type=int, default=300, help="seconds one run may take")
    args = parser.parse_args(argv)
    paths = [p.strip() for p in args.paths.split(",") if p.strip()]
    unknown = [p for p in paths if p not in PATHS]
    if unknown or not paths:
        parser.error(f"--paths {args.paths!r}: unknown {unknown}; choose from {', '.join(PATHS)}")
    work = args.keep.resolve() if args.keep else Path(tempfile.mkdtemp(prefix="same_losses-"))
    if args.keep and work.exists() and any(work.iterdir()):
        parser.error(f"--keep {work} is not empty; give a new or empty folder")
    work.mkdir(parents=True, exist_ok=True)
    try:
        return compare_trees(args.ref, args.new, paths, work, args.timeout)
    except SameLossesError as err:
        print(f"same_losses: {err}", file=sys.stderr)
        return 2
    finally:
        if args.keep is None:
            shutil.rmtree(work, ignore_errors=True)
        else:
            print(f"runs kept in {work}")


def compare_trees(ref: str, new: str | None, paths: list[str], work: Path, timeout: int) -> int:
    commit = resolve(ref)
    ref_side = Side("ref", f"{ref} ({commit[:9]})", export_tree(commit, work / "tree-ref"))
    if new is None:
        new_side = Side("new", f"the working tree {REPO}", REPO)
    else:
        new_commit = resolve(new)
        new_side = Side("new", f"{new} ({new_commit[:9]})", export_tree(new_commit, work / "tree-new"))
    probed = {s.label: package_files(s.tree, work) for s in (ref_side, new_side)}
    files = {label: found["hf_fsdp2"] for label, found in probed.items()}
    for s in (ref_side, new_side):
        others = ", ".join(f"{k} {v}" for k, v in probed[s.label].items() if k != "hf_fsdp2")
        alias = "" if recipes_alias(s.tree) else "; its recipes import no hf_fsdp2.recipes alias"
        print(
            f"{s.label}: {s.name}: hf_fsdp2 from {files[s.label]}"
            + (f" (and {others})" if others else "")
            + alias
        )
    if files["ref"] == files["new"]:
        raise SameLossesError(
            f"both sides import hf_fsdp2 from {files['ref']}: the comparison would prove nothing"
        )
    fixture = build_fixture(work / "fixture")
    results: list[PathResult] = []
    failed: dict[str, str] = {}
    for path in paths:
        try:
            ref_metrics, ref_s = run_path(ref_side, path, fixture, work, timeout)
            new_metrics, new_s = run_path(new_side, path, fixture, work, timeout)
        except SameLossesError as err:  # the other paths still run: one table for all
            failed[path] = str(err)
            print(f"same_losses: {err}", file=sys.stderr, flush=True)
            continue
        result = compare_files(path, ref_metrics, new_metrics)
        compare_exports(result, ref_metrics.parent, new_metrics.parent)
        results.append(result)
        print(f"ran {path}: ref {ref_s:.1f} s, new {new_s:.1f} s", flush=True)
    print(f"\n{ref_side.name} vs {new_side.name}\n")
    print(table(results))
    for path in failed:
        print(f"| {path} | cannot run: see the error above |")
    for r in results:
        if r.only_one_side:
            print(f"{r.path}: fields logged by one side only (not compared): {', '.join(r.only_one_side)}")
        for line in r.differences[:12]:
            print(f"{r.path}: {line}")
    if any(not r.identical for r in results):
        print("\nDIFFERENT: the change moved the numerics (above)")
        return 1
    if failed:
        ran = (
            f"identical where both sides ran ({', '.join(r.path for r in results)})"
            if results
            else "no path ran"
        )
        print(f"\n{ran}; {', '.join(failed)} could not run (above)")
        return 2
    print("\nidentical on every path")
    return 0


if __name__ == "__main__":
    sys.exit(main())
