"""Unit tests of reward modelling: the per-pair margin column (a bad one named or skipped and counted), the collator's
margins, the Bradley-Terry loss and the step's statistics against hand computation, the recipe's refusals, and which
transformers class loads an export."""

from __future__ import annotations

import math

import pytest
import torch

from hf_fsdp2.config import Config, ConfigError
from hf_fsdp2.data.pairs import PreferenceCollator, tokenize_pairs
from hf_fsdp2.data.records import RecordError
from hf_fsdp2.methods import parse_method_config
from hf_fsdp2.methods.rm.objective import rm_objective
from hf_fsdp2.methods.rm.step import RewardSettings, _metrics, _sums, bt_losses
from hf_fsdp2.model import auto_class_name


def parse_config(argv: list[str]) -> Config:
    return parse_method_config(
        "rm", ["--model_name_or_path", "m", "--dataset_name", "d.jsonl", "--output_dir", "out", *argv]
    )


@pytest.mark.parametrize("margin", ["big", float("nan"), True, [1]])
def test_a_bad_margin_is_named_with_its_record_or_skipped_and_counted(chatml_tokenizer, margin) -> None:
    good = {"prompt": "Q", "chosen": " yes", "rejected": " no", "margin": 0.5}
    bad = {**good, "margin": margin}
    with pytest.raises(RecordError, match=r"^p.jsonl record 1: margin=.* is not a finite number"):
        tokenize_pairs([good, bad], chatml_tokenizer, max_length=32, source="p.jsonl")
    pairs, stats = tokenize_pairs([good, bad], chatml_tokenizer, max_length=32, on_bad_record="skip")
    assert len(pairs) == 1 and pairs[0]["margin"] == 0.5 and stats.skipped == {"bad margin": 1}


def test_the_collator_carries_the_margins_only_when_every_pair_has_one() -> None:
    pairs = [
        {"prompt_ids": [1], "chosen_ids": [2], "rejected_ids": [3], "index": 0, "margin": 0.25},
        {"prompt_ids": [1], "chosen_ids": [4], "rejected_ids": [5], "index": 1, "margin": 1.0},
    ]
    collate = PreferenceCollator(pad_token_id=0, max_length=8)
    assert collate(pairs)["margin"].tolist() == [0.25, 1.0]
    assert "margin" not in collate([pairs[0], {k: v for k, v in pairs[1].items() if k != "margin"}])


def test_the_bradley_terry_loss_and_the_statistics_are_the_hand_computed_ones() -> None:
    rewards = torch.tensor([1.0, -0.5, 0.2, 0.3])  # chosen 1.0, -0.5; rejected 0.2, 0.3
    margin = torch.tensor([0.5, 0.0])
    settings = RewardSettings(center_rewards_coefficient=0.1)
    sig = lambda x: 1 / (1 + math.exp(-x))  # noqa: E731
    want = [-math.log(sig(1.0 - 0.2 - 0.5)) + 0.1 * 1.2**2, -math.log(sig(-0.5 - 0.3)) + 0.1 * (-0.2) ** 2]
    assert bt_losses(rewards, margin, settings).tolist() == pytest.approx(want, rel=1e-6)
    assert bt_losses(rewards, None, RewardSettings()).tolist() == pytest.approx(
        [-math.log(sig(0.8)), -math.log(sig(-0.8))], rel=1e-6
    )
    sums, high, low = _sums(rewards)
    stats = _metrics(sums, 2, float(high), float(low))
    assert stats["accuracy"] == 0.5 and stats["margin"] == pytest.approx((0.8 - 0.8) / 2, abs=1e-7)
    assert stats["mean_reward"] == pytest.approx(0.25) and stats["std_reward"] == pytest.approx(
        float(rewards.std()), rel=1e-6
    )
    assert (stats["min_reward"], stats["max_reward"]) == (-0.5, 1.0)


def test_the_reward_recipe_refuses_preference_settings_and_drops_long_pairs() -> None:
    for args, key in (
        (["--beta", "0.2"], "beta"),
        (["--loss_type", "ipo"], "loss_type"),
        (["--precompute_ref_log_probs", "true"], "precompute_ref_log_probs"),
    ):
        with pytest.raises(
            ConfigError, match=f"'{key}' in the command line is a key of the .* recipe, not of the rm"
        ):
            parse_config(args)
    cfg = parse_config([])
    rm_objective(cfg)
    # The method's default: a cut row would lose the token its reward is read at.
    assert cfg.data.long_examples == "drop"
    sft = parse_method_config(
        "sft", ["--model_name_or_path", "m", "--dataset_name", "d", "--output_dir", "o"]
    )
    assert sft.data.long_examples == "truncate"  # the other methods' default is untouched
    cfg = parse_config(["--long_examples", "error", "--center_rewards_coefficient", "0.01"])
    rm_objective(cfg)
    assert cfg.data.long_examples == "error"
    with pytest.raises(
        ConfigError, match="long_examples=truncate: a reward model reads each row's reward at its last"
    ):
        rm_objective(parse_config(["--long_examples", "truncate"]))
    with pytest.raises(ConfigError, match="center_rewards_coefficient=-1.0 must be >= 0"):
        parse_config(["--center_rewards_coefficient=-1"])


@pytest.mark.parametrize("family", ["granite", "codegen"])
def test_a_family_without_a_sequence_classification_class_gets_transformers_generic_score_head(
    tmp_path, family
) -> None:
    """Granite (tied, logits scaling; prefix ``model``) and CodeGen (prefix ``transformer``) have no
    ``*ForSequenceClassification`` in transformers: the reward model is transformers' generic class over the
    family's base model; its reward is the backbone's last non-padding hidden state times the score weight, computed
    here by hand; the causal LM's backbone loads whole (only the score head is new) and a save of it reloads to the
    same rewards with the modeling file it carries."""
    from support.families import make_family_dir
    from transformers import AutoModelForCausalLM, CodeGenConfig

    from hf_fsdp2.model import load_model
    from hf_fsdp2.score_head import MODELING_FILE, write_modeling_file

    if family == "codegen":
        folder = tmp_path / family
        config = CodeGenConfig(vocab_size=64, n_embd=64, n_layer=2, n_head=4, rotary_dim=8, n_positions=64)
        AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    else:
        folder = make_family_dir(tmp_path / family, family)
    torch.manual_seed(0)
    model = load_model(str(folder), reward_head=0, dtype="float32").eval()
    name = type(model).__name__
    assert name.endswith("ForSequenceClassification") and type(model).__module__ == "hf_fsdp2.score_head"
    assert model.config.auto_map == {"AutoModelForSequenceClassification": f"modeling_score_head.{name}"}
    lm = load_model(str(folder), dtype="float32")
    backbone = {k: v for k, v in lm.state_dict().items() if not k.startswith("lm_head.")}
    loaded = model.state_dict()
    assert all(torch.equal(loaded[k], v) for k, v in backbone.items()), (
        "the causal LM's backbone did not load"
    )
    ids = torch.randint(3, 60, (3, 9))
    ids[1, 6:], ids[2, 2:] = 0, 0  # right padding of different lengths
    mask = (ids != 0).long()
    with torch.no_grad():
        got = model(input_ids=ids, attention_mask=mask).logits
        hidden = getattr(model, model.base_model_prefix)(input_ids=ids, attention_mask=mask).last_hidden_state
    last = mask.sum(1) - 1
    want = hidden[torch.arange(3), last] @ model.score.weight.T
    assert got.shape == (3, 1) and torch.allclose(got, want, atol=1e-6), (got, want)
    model.save_pretrained(tmp_path / "saved")
    assert write_modeling_file(model.config, tmp_path / "saved")
    source = (tmp_path / "saved" / MODELING_FILE).read_text()
    assert (
        "hf_fsdp2" not in source.split('"""')[-1]
        and f"class {name}(GenericForSequenceClassification" in source
    )
    again = load_model(str(tmp_path / "saved"), reward_head=0, dtype="float32").eval()
    with torch.no_grad():
        assert torch.equal(again(input_ids=ids, attention_mask=mask).logits, got)


def test_a_family_with_no_base_model_is_refused_and_a_backbone_that_does_not_load_is_named(tmp_path) -> None:
    from safetensors.torch import load_file, save_file
    from support.tiny import make_tiny_llama_dir
    from transformers import TrOCRConfig

    from hf_fsdp2.model import load_model
    from hf_fsdp2.score_head import score_head_class

    with pytest.raises(
        ValueError, match="model_type='trocr' .* has neither a sequence-classification class nor"
    ):
        score_head_class(TrOCRConfig())
    folder = make_tiny_llama_dir(tmp_path / "llama", seed=1)
    weights = load_file(folder / "model.safetensors")
    save_file({k.replace("model.", "backbone."): v for k, v in weights.items()}, folder / "model.safetensors")
    with pytest.raises(ValueError, match=r"backbone weights are not in the checkpoint .*'model' prefix"):
        load_model(str(folder), reward_head=0)


def test_an_export_loads_with_the_class_its_architecture_names() -> None:
    class Config:
        architectures: list[str] | None = None

    config = Config()
    assert auto_class_name(config) == "AutoModelForCausalLM"
    config.architectures = ["Qwen3ForSequenceClassification"]
    assert auto_class_name(config) == "AutoModelForSequenceClassification"
    config.architectures = ["LlamaForCausalLM"]
    assert auto_class_name(config) == "AutoModelForCausalLM"
