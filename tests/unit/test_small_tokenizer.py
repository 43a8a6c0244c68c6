"""The cut Llama-2 tokenizer of the tiny test models (conftest.py): a real BPE tokenizer whose ids below the cut are
Llama-2's, which turns any text into ids under its size and back."""

from __future__ import annotations

from conftest import CHATML_SPECIAL_TOKENS, CHATML_TEMPLATE, SMALL_VOCAB_PIECES, build_llama2_test_tokenizer

TEXTS = [
    "Hello! alpha bravo charlie, the quick brown fox jumps over 12 lazy dogs.",
    "Été à Zürich: 東京 🙂 {x: [1]}",
]


def test_the_cut_tokenizer_round_trips_any_text_with_llama2_ids_below_the_cut() -> None:
    small = build_llama2_test_tokenizer(CHATML_TEMPLATE, CHATML_SPECIAL_TOKENS, small=True)
    full = build_llama2_test_tokenizer(CHATML_TEMPLATE, CHATML_SPECIAL_TOKENS)
    assert len(small) == 2098 and len(full) == 32002
    assert small.convert_tokens_to_ids(list(CHATML_SPECIAL_TOKENS)) == [2096, 2097]
    for text in TEXTS:
        ids = small(text)["input_ids"]
        assert max(ids) < len(small) and small.decode(ids, skip_special_tokens=True) == text
        assert len(ids) >= len(full(text)["input_ids"])  # fewer merges: as many tokens or more
    # Pieces below the cut keep their Llama-2 ids (bytes, specials, the most frequent merges).
    for piece in ("<unk>", "<s>", "</s>", "<0x0A>", "▁t", "er"):
        assert small.convert_tokens_to_ids(piece) == full.convert_tokens_to_ids(piece) < SMALL_VOCAB_PIECES
    chat = small.apply_chat_template([{"role": "user", "content": TEXTS[0]}], tokenize=False)
    assert chat.startswith("<|im_start|>system\n") and small(chat)["input_ids"].count(2097) == 2
