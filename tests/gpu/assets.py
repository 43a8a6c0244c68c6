"""What the GPU checks train, built in code: nothing downloaded, no package beyond what an air-gapped GPU node has.

The node has ``tokenizers`` and ``transformers`` but no ``wordllama`` (the test suite's Llama-2 tokenizer) and
no SmolLM2 weights, so the tokenizer is a byte-level BPE trained here on a fixed word list (deterministic, well
under a second) with a ChatML template, and the models are random-init Llamas built from configs.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import torch

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
SPECIALS = ("<pad>", "<s>", "</s>", "<unk>", "<|im_start|>", "<|im_end|>")
_TEXT = (
    "alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike november oscar papa quebec "
    "romeo sierra tango uniform victor whiskey xray yankee zulu one two three four five six seven eight nine "
    "ten the a of and to in is it you that he was for on are with as his they be at have this from or had by"
)
WORDS = tuple(_TEXT.split())
# Llama-3.2-1B's shape (hidden, layers, heads, kv heads, intermediate, vocab; tied embeddings) and a tiny one.
SHAPES: dict[str, dict[str, int]] = {
    "llama3.2-1b": {"hidden_size": 2048, "num_hidden_layers": 16, "num_attention_heads": 32,
                    "num_key_value_heads": 8, "intermediate_size": 8192, "vocab_size": 128256},
    "tiny": {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
             "intermediate_size": 128, "vocab_size": 0},  # 0: the tokenizer's size
}  # fmt: skip


def build_tokenizer(vocab_size: int = 512) -> Any:
    """A byte-level BPE tokenizer trained in code on :data:`WORDS`, with the ChatML markers as special tokens.

    Returns:
        A ``PreTrainedTokenizerFast`` (pad ``<pad>``, bos ``<s>``, eos ``<|im_end|>``: the end of a turn).
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    rng = random.Random(0)
    corpus = [" ".join(rng.choice(WORDS) for _ in range(12)) for _ in range(400)]
    bpe = Tokenizer(models.BPE(unk_token="<unk>"))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIALS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator(corpus, trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=bpe, pad_token="<pad>", bos_token="<s>", eos_token="<|im_end|>", unk_token="<unk>"
    )
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tokenizer.chat_template = CHATML_TEMPLATE
    return tokenizer


def llama_config(shape: str, *, tied: bool, vocab_size: int, max_positions: int = 4096) -> Any:
    """A ``LlamaConfig`` of ``shape`` (:data:`SHAPES`), special token ids those of :func:`build_tokenizer`."""
    from transformers import LlamaConfig

    if shape not in SHAPES:
        raise ValueError(f"unknown shape {shape!r}; one of {sorted(SHAPES)}")
    dims = {**SHAPES[shape]}
    dims["vocab_size"] = dims["vocab_size"] or vocab_size
    return LlamaConfig(
        **dims,
        max_position_embeddings=max_positions,
        tie_word_embeddings=tied,
        rms_norm_eps=1e-5,
        pad_token_id=SPECIALS.index("<pad>"),
        bos_token_id=SPECIALS.index("<s>"),
        eos_token_id=SPECIALS.index("<|im_end|>"),
    )


def make_model_dir(path: Path, *, tied: bool, shape: str = "tiny", seed: int = 3) -> Path:
    """Save a random-init Llama of ``shape`` (fp32) and the tokenizer of :func:`build_tokenizer` to ``path``."""
    from transformers import LlamaForCausalLM

    tokenizer = build_tokenizer()
    config = llama_config(shape, tied=tied, vocab_size=len(tokenizer))
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path
