"""What a TRL user's GRPO run produces, against TRL 1.16's ``GRPOTrainer`` fed the same raw input:
completions stop at every end id the model declares (TRL's union), clipped ones are counted; the rollout samples the
plain distribution the loss scores, whatever the model's ``generation_config`` says (a hand-built sampler draws the
same tokens with the same seed), with TRL's generation fields; prompts are tokenized as TRL tokenizes them (BOS
included, chat templates with ``chat_template_kwargs``); the new keys are validated."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from conftest import CHATML_SPECIAL_TOKENS, CHATML_TEMPLATE, LLAMA3_SPECIAL_TOKENS, LLAMA3_TEMPLATE
from conftest import build_llama2_test_tokenizer as build_tokenizer
from support.tiny import make_tiny_llama_dir

from hf_fsdp2.config import ConfigError
from hf_fsdp2.methods.grpo.config import GrpoArgs, sampling_kwargs
from hf_fsdp2.methods.grpo.data import tokenize_prompts
from hf_fsdp2.methods.grpo.rollout import (
    SamplingSettings,
    TransformersGenerator,
    is_clipped,
    stop_token_ids,
)

END_OF_TURN = "<|im_end|>"  # the ChatML end of turn: in generation_config's eos list only, as Qwen2.5's
MAX_NEW, TEMPERATURE = 8, 0.8
REPEATED = 500


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Llama (Llama-2 tokenizer: BOS <s>, EOS </s>; ChatML) whose generation_config says what a chat model's
    does: the end-of-turn id beside EOS, and sampling fields a rollout must not inherit (temperature 0.5, top_p
    0.8, repetition_penalty 2.0, top_k 3, min_p 0.3). Its end-of-turn logit is raised so that sampled completions end at different lengths."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = make_tiny_llama_dir(tmp_path_factory.mktemp("semantics") / "model", seed=4)
    tok = AutoTokenizer.from_pretrained(folder)
    end = tok.convert_tokens_to_ids(END_OF_TURN)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    with torch.no_grad():
        ids = torch.randint(3, 2000, (16, 12), generator=torch.Generator().manual_seed(0))
        mean = model.model(input_ids=ids).last_hidden_state.mean((0, 1))
        model.lm_head.weight[end] = 5.0 * mean / mean.pow(2).sum()
    model.generation_config.eos_token_id = [tok.eos_token_id, end]
    model.generation_config.do_sample, model.generation_config.temperature = (
        True,
        0.5,
    )  # as Qwen2.5-Instruct's
    model.generation_config.top_p = 0.8
    model.generation_config.repetition_penalty = 2.0
    model.generation_config.top_k = 3
    model.generation_config.min_p = 0.3
    model.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def trl_trainer(chat_model: Path) -> Any:
    """TRL 1.16's GRPOTrainer on the same model, with the keys this file sets."""
    import datasets
    from transformers import AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    tok = AutoTokenizer.from_pretrained(chat_model)
    with tempfile.TemporaryDirectory() as tmp:
        config = GRPOConfig(
            output_dir=tmp,
            use_cpu=True,
            bf16=False,
            num_generations=2,
            per_device_train_batch_size=2,
            max_completion_length=MAX_NEW,
            temperature=TEMPERATURE,
            report_to="none",
        )
        return GRPOTrainer(
            model=str(chat_model),
            reward_funcs=lambda completions, **kw: [0.0] * len(completions),
            args=config,
            train_dataset=datasets.Dataset.from_list([{"prompt": "a b"}] * 2),
            processing_class=tok,
        )


def _generator(model: Any, tok: Any, **settings: Any) -> TransformersGenerator:
    eos = stop_token_ids(tok.eos_token_id, model.generation_config.eos_token_id)
    return TransformersGenerator(
        model,
        pad_id=tok.pad_token_id,
        eos_ids=eos,
        bos_id=tok.bos_token_id,
        settings=SamplingSettings(max_completion_length=MAX_NEW, temperature=TEMPERATURE, **settings),
    )


def test_completions_stop_at_every_end_id_the_model_declares_as_trls(
    chat_model: Path, trl_trainer: Any
) -> None:
    """The stop ids are TRL's (tokenizer EOS + generation_config's list), generation stops at the end-of-turn
    token (today's EOS-only config runs on to max_completion_length), and the clipped completions are the ones
    without an end id at their end."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(chat_model)
    model = AutoModelForCausalLM.from_pretrained(chat_model, dtype=torch.float32)
    end = tok.convert_tokens_to_ids(END_OF_TURN)
    assert stop_token_ids(tok.eos_token_id, model.generation_config.eos_token_id) == trl_trainer.eos_token_ids
    assert stop_token_ids(tok.eos_token_id, end) == [tok.eos_token_id, end]
    assert stop_token_ids(tok.eos_token_id, None) == [tok.eos_token_id]
    prompts = [tok("alpha bravo charlie")["input_ids"]] * 12
    generator = _generator(model, tok)
    assert generator.sampling.eos_token_id == trl_trainer.generation_config.eos_token_id == generator.eos_ids
    completions = generator.generate(prompts, seed=5)
    ended = [c for c in completions if c[-1] == end]
    assert ended and any(len(c) < MAX_NEW for c in ended), completions  # stopped at the end of the turn
    assert all(end not in c[:-1] and tok.eos_token_id not in c[:-1] for c in completions)
    clipped = [is_clipped(c, [tok.eos_token_id, end]) for c in completions]
    assert clipped == [len(c) == MAX_NEW and c[-1] not in (end, tok.eos_token_id) for c in completions]
    assert 0 < sum(clipped) < len(completions), completions


def _plain_samples(
    model: Any, prompts: torch.Tensor, seed: int, greedy: bool = False, penalty: float = 1.0
) -> list[list[int]]:
    """The distribution GRPO's loss scores, sampled by hand: softmax(logits / temperature) of the model's forward,
    one multinomial draw per row and step as transformers draws (no cache, no logits processor but the
    ``penalty`` asked for)."""
    from transformers import RepetitionPenaltyLogitsProcessor

    ids = prompts.clone()
    with torch.no_grad(), torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        for _ in range(MAX_NEW):
            logits = model(input_ids=ids).logits[:, -1].float()
            if penalty != 1.0:
                logits = RepetitionPenaltyLogitsProcessor(penalty)(ids, logits)
            if greedy:
                token = logits.argmax(-1)
            else:
                token = torch.multinomial(torch.softmax(logits / TEMPERATURE, -1), num_samples=1).squeeze(1)
            ids = torch.cat([ids, token[:, None]], dim=1)
    return ids[:, prompts.shape[1] :].tolist()


def test_the_rollout_samples_the_distribution_the_loss_scores(chat_model: Path, trl_trainer: Any) -> None:
    """The model's generation_config asks for repetition_penalty 2.0, top_k 3 and min_p 0.3; the rollout
    samples the plain softmax(logits / T) (the same tokens as a hand-built sampler with the same seed; greedy is the
    plain argmax), and the sampling fields are TRL's GenerationConfig's."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(chat_model)
    model = AutoModelForCausalLM.from_pretrained(chat_model, dtype=torch.float32)
    model.generation_config.eos_token_id = tok.eos_token_id  # no stop inside the compared rows
    prompts = torch.tensor([tok("alpha bravo charlie delta")["input_ids"]] * 6)
    model.lm_head.weight.data[tok.convert_tokens_to_ids(END_OF_TURN)] = 0.0
    with (
        torch.no_grad()
    ):  # one token the model nearly always says: a repetition penalty changes what is drawn
        mean = model.model(input_ids=prompts).last_hidden_state.mean((0, 1))
        model.lm_head.weight[REPEATED] = 12.0 * mean / mean.pow(2).sum()
    generator = _generator(model, tok)
    sampled = generator.generate(prompts.tolist(), seed=11)
    greedy = generator.generate(prompts.tolist(), seed=0, greedy=True)
    assert sampled == _plain_samples(model, prompts, 11)
    assert greedy == _plain_samples(model, prompts, 0, greedy=True)
    assert model.generation_config.repetition_penalty == 2.0  # restored after the rollout
    line = generator.describe()
    assert "repetition_penalty 1.0" in line and "not from the model's generation_config: min_p 0.3" in line, (
        line
    )
    ours, theirs = generator.sampling, trl_trainer.generation_config
    for key in (
        "do_sample",
        "temperature",
        "top_p",
        "top_k",
        "min_p",
        "repetition_penalty",
        "max_new_tokens",
        "pad_token_id",
        "bos_token_id",
    ):
        assert getattr(ours, key) == getattr(theirs, key), key
    # The keys: a repetition penalty asked for is applied, generation_kwargs come last (a suppressed token never
    # appears).
    penalised = _generator(model, tok, repetition_penalty=1.5).generate(prompts.tolist(), seed=11)
    assert penalised == _plain_samples(model, prompts, 11, penalty=1.5) != sampled
    assert sum(row.count(REPEATED) for row in penalised) < sum(row.count(REPEATED) for row in sampled)
    banned = sorted({t for row in sampled for t in row})[:3]
    kept = _generator(model, tok, generation_kwargs={"suppress_tokens": banned}).generate(
        prompts.tolist(), seed=11
    )
    assert not {t for row in kept for t in row} & set(banned)


@pytest.mark.parametrize(
    ("template", "markers"),
    [(CHATML_TEMPLATE, CHATML_SPECIAL_TOKENS), (LLAMA3_TEMPLATE, LLAMA3_SPECIAL_TOKENS)],
)
def test_prompts_are_tokenized_as_trls_grpo_trainer(template: str, markers: tuple[str, ...]) -> None:
    """String prompts keep the tokenizer's BOS (Llama-2's <s>), message lists go through the chat template
    with the generation prompt and chat_template_kwargs (Llama-3's template writes its own BOS, once), the ids equal
    TRL's ``GRPOTrainer._tokenize_prompts`` given the same raw prompts."""
    from trl import GRPOTrainer

    hinted = template.replace(
        "{% if add_generation_prompt %}", "{% if add_generation_prompt %}{% if hint %}{{ hint }}{% endif %}"
    )
    tok = build_tokenizer(hinted, markers)
    kwargs = {"hint": "Think step by step."}
    strings = ["alpha bravo", "What is 2+2? Answer briefly."]
    chats = [
        [{"role": "user", "content": "alpha bravo"}],
        [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "What is 2+2?"}],
    ]
    for prompts in (strings, chats):
        trl_self = SimpleNamespace(
            processing_class=tok,
            _is_vlm=False,
            environment_factories=None,
            tools=None,
            chat_template=None,
            chat_template_kwargs=kwargs,
        )
        theirs, _, _ = GRPOTrainer._tokenize_prompts(trl_self, prompts)  # type: ignore[arg-type]
        records = [{"prompt": p, "answer": "4"} for p in prompts]
        ours = tokenize_prompts(
            records, tok, limit=512, long_examples="error", source="test", chat_template_kwargs=kwargs
        )
        assert [e["prompt_ids"] for e in ours] == [list(ids) for ids in theirs]
        with_bos = prompts is strings or "bos_token" in template  # a chat template writes its own (or none)
        assert all((e["prompt_ids"][0] == tok.bos_token_id) is with_bos for e in ours), [
            e["prompt_ids"][:3] for e in ours
        ]
        assert all(e["prompt_ids"][1:].count(tok.bos_token_id) == 0 for e in ours)
    hinted_ids, plain_ids = (
        tokenize_prompts(
            [{"prompt": chats[0]}],
            tok,
            limit=512,
            long_examples="error",
            source="test",
            chat_template_kwargs=k,
        )[0]["prompt_ids"]
        for k in (kwargs, None)
    )
    assert "Think step by step." in tok.decode(hinted_ids) and "Think" not in tok.decode(plain_ids)


def test_the_new_keys_are_checked_and_a_yaml_mapping_is_accepted(tmp_path: Path) -> None:
    from hf_fsdp2.config.parse import parse_config

    for kwargs, message in (
        ({"repetition_penalty": 0.0}, "repetition_penalty=0.0 must be > 0"),
        ({"min_p": 1.5}, r"min_p=1.5 must be in \[0, 1\]"),
        ({"generation_kwargs": "{oops"}, "generation_kwargs='{oops' is not a JSON object"),
        ({"generation_kwargs": "[1]"}, "is not a JSON object"),
        (
            {"generation_kwargs": '{"top_p": 0.9}'},
            "sets 'top_p', which has a key of its own here: set top_p instead",
        ),
        ({"generation_kwargs": '{"max_new_tokens": 9}'}, "set max_completion_length instead"),
        ({"generation_kwargs": '{"supress_tokens": [1]}'}, r"has \['supress_tokens'\], not fields"),
        ({"chat_template_kwargs": "3"}, "chat_template_kwargs='3' is not a JSON object"),
    ):
        with pytest.raises(ConfigError, match=message):
            GrpoArgs(reward_funcs=["exact_match"], **kwargs).validate()
    assert sampling_kwargs('{"suppress_tokens": [5], "no_repeat_ngram_size": 3}') == {
        "suppress_tokens": [5],
        "no_repeat_ngram_size": 3,
    }
    recipe = tmp_path / "grpo.yaml"
    recipe.write_text(
        "model_name_or_path: m\ndataset_name: d.jsonl\noutput_dir: out\nreward_funcs: [exact_match]\nmin_p: 0.05\n"
        "generation_kwargs: {suppress_tokens: [5, 6]}\nchat_template_kwargs:\n  enable_thinking: false\n"
    )
    cfg = parse_config(["--config", str(recipe)], section=GrpoArgs, recipe="grpo")
    assert json.loads(cfg.method.generation_kwargs) == {"suppress_tokens": [5, 6]}
    assert json.loads(cfg.method.chat_template_kwargs) == {"enable_thinking": False}
    assert cfg.method.min_p == 0.05 and cfg.method.repetition_penalty == 1.0
