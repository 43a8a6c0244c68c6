"""The tiny model the vLLM tests (GRPO's server and colocate modes, the harness's vLLM backend) hand to vLLM's CPU
engine, and where the vLLM environment is."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from support.launch import REPO
from support.tiny import CHATML_SPECIAL_TOKENS, CHATML_TEMPLATE, build_llama2_test_tokenizer, save_tokenizer

VLLM_PYTHON = REPO / ".venv-vllm" / "bin" / "python"
NO_VLLM = f"{VLLM_PYTHON} absent: bash scripts/setup_vllm.sh builds it (setup.sh runs it)"


def tiny_vllm_llama(folder: Path, *, tied: bool) -> Path:
    """A tiny Llama vLLM's CPU attention takes (head size 32; it has no 16) with the cut Llama-2 tokenizer (conftest.py), saved to
    ``folder``.

    ``tied=True``: the output head tied to the embedding (as SmolLM2's and Llama-3.2-1B's: vLLM's CPU engine packs the
    head's weight once, so a reload must remake it, and a test that syncs weights several times fails without that),
    and the end-of-sequence logit raised along the mean final hidden state so that completions end at different
    lengths. ``tied=False``: an untied random head, so that greedy answers are non-empty strings of many tokens (a
    tied random head repeats the prompt's last token: a newline, answer "")."""
    tok = build_llama2_test_tokenizer(CHATML_TEMPLATE, CHATML_SPECIAL_TOKENS, small=True)
    tok.pad_token = tok.eos_token
    config = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=512,
        tie_word_embeddings=tied,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    torch.manual_seed(3)
    model = LlamaForCausalLM(config)
    if tied:
        with torch.no_grad():
            ids = torch.randint(3, 2000, (16, 12), generator=torch.Generator().manual_seed(0))
            mean = model.model(input_ids=ids).last_hidden_state.mean((0, 1))
            model.lm_head.weight[tok.eos_token_id] = 6.0 * mean / mean.pow(2).sum()
    model.save_pretrained(folder)
    save_tokenizer(tok, folder)
    return folder


# vLLM 0.32's LoRAConfig.max_lora_rank values (MaxLoRARanks); tests/recipes/test_eval_harness_vllm.py checks them
# against the installed vLLM, the unit tests of the harness's model_args use them without it.
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
