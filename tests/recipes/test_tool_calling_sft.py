"""A 2-rank SFT run on tool-calling records: a tiny Llama whose tokenizer carries Qwen2.5's own chat
template (as TRL 1.16 ships it), records with ``tools`` and assistant ``tool_calls`` followed by ``tool`` turns; the
run trains on the calls and answers, and the export's tokenizer renders the same conversation with the same tools to
the same text and ids."""

from __future__ import annotations

import json
import random
from pathlib import Path

import torch
import trl
from conftest import CHATML_SPECIAL_TOKENS, build_llama2_test_tokenizer
from support.runs import sft_2ranks, write_recipe
from support.tiny import save_tokenizer
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

from hf_fsdp2.observe.logs import read_metrics

QWEN25 = Path(trl.__file__).parent / "chat_templates" / "qwen2_5.jinja"
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather in a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "add",
            "description": "Add two numbers",
            "parameters": {
                "type": "object",
                "properties": {"a": {"type": "number"}, "b": {"type": "number"}},
            },
        },
    },
]
CITIES = ["Paris", "Rome", "Oslo", "Lima", "Kyiv", "Cairo", "Quito", "Delhi"]


def tool_records(n: int, seed: int = 0) -> list[dict]:
    """``n`` conversations: a weather question answered through get_weather, or a sum through add (arguments as a
    JSON string, tools as a JSON string, as Arrow-friendly files store them)."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        if i % 2:
            city, temp = rng.choice(CITIES), rng.randint(-5, 35)
            call, args, result = "get_weather", {"city": city}, {"temp": temp}
            question, answer = f"Weather in {city}?", f"It is {temp} degrees in {city}."
        else:
            a, b = rng.randint(1, 99), rng.randint(1, 99)
            call, args, result = "add", {"a": a, "b": b}, a + b
            question, answer = f"What is {a} plus {b}?", f"{a} plus {b} is {a + b}."
        messages = [
            {"role": "user", "content": question},
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [
                    {"type": "function", "function": {"name": call, "arguments": json.dumps(args)}}
                ],
            },
            {"role": "tool", "name": call, "content": json.dumps(result)},
            {"role": "assistant", "content": answer},
        ]
        out.append({"messages": messages, "tools": json.dumps(TOOLS)})
    return out


def make_model(path: Path) -> Path:
    tokenizer = build_llama2_test_tokenizer(QWEN25.read_text(), CHATML_SPECIAL_TOKENS)
    tokenizer.pad_token = tokenizer.eos_token
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(0)
    path.mkdir(parents=True)
    LlamaForCausalLM(config).save_pretrained(path)
    save_tokenizer(tokenizer, path)
    return path


def test_two_rank_sft_on_tool_calls_trains_and_the_export_renders_tools_alike(tmp_path: Path) -> None:
    model = make_model(tmp_path / "model")
    data = tmp_path / "tools.jsonl"
    records = tool_records(16)
    data.write_text("".join(json.dumps(r) + "\n" for r in records))
    out = tmp_path / "run"
    sft_2ranks(
        write_recipe(tmp_path / "r.yaml", model, data, out, max_length=512, max_steps=4, learning_rate=3e-3)
    )
    metrics = [m for m in read_metrics(out / "metrics.jsonl") if "loss" in m]
    losses = [m["loss"] for m in metrics]
    assert [m["step"] for m in metrics] == [1, 2, 3, 4]
    assert all(torch.isfinite(torch.tensor(losses))) and losses[-1] < losses[0] - 0.5, losses

    original = AutoTokenizer.from_pretrained(model)
    exported = AutoTokenizer.from_pretrained(out)  # the export is the run folder
    assert exported.chat_template == original.chat_template
    hf_messages = [
        {
            **m,
            "tool_calls": [
                {
                    "type": "function",
                    "function": {
                        "name": c["function"]["name"],
                        "arguments": json.loads(c["function"]["arguments"]),
                    },
                }
                for c in m["tool_calls"]
            ],
        }
        if "tool_calls" in m
        else m
        for m in records[1]["messages"]
    ]
    for generation in (False, True):
        turns = hf_messages[:3] if generation else hf_messages
        texts = [
            tok.apply_chat_template(turns, tools=TOOLS, tokenize=False, add_generation_prompt=generation)
            for tok in (original, exported)
        ]
        assert texts[0] == texts[1]
        assert "<tools>" in texts[1] and '"name": "get_weather"' in texts[1] and "<tool_response>" in texts[1]
        assert (
            exported(texts[1], add_special_tokens=False)["input_ids"]
            == original(texts[0], add_special_tokens=False)["input_ids"]
        )
