"""Padding-free batches by default where they compute the same thing: the start-up probe decides per model, and
for every family users fine-tune the summed loss of a padding-free micro-batch equals the padded one's."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from support.families import FAMILIES, make_family_dir

from hf_fsdp2.attention_layout import padding_free_matches
from hf_fsdp2.data.loader import PaddingCollator
from hf_fsdp2.data.packing import PackedCollator
from hf_fsdp2.model import load_model, load_model_config
from hf_fsdp2.train.loss import LossPlan, causal_lm_loss

EXAMPLES = [
    {"input_ids": [5, 9, 13, 200, 201, 202, 7], "labels": [-100, -100, -100, 200, 201, 202, 7]},
    {"input_ids": [4, 8, 300, 301], "labels": [-100, -100, 300, 301]},
    {"input_ids": [6, 11, 12, 14, 15, 400, 401, 402, 403, 404, 2], "labels": [-100] * 5 + [400, 401, 402, 403, 404, 2]},
]  # fmt: skip


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_the_probe_allows_padding_free_only_where_the_loss_is_the_padded_loss(
    family: str, tmp_path: Path
) -> None:
    path = make_family_dir(tmp_path / family, family, initializer_range=0.2)
    matches, why = padding_free_matches(load_model_config(str(path)))
    model = load_model(str(path))
    model.eval()
    plan = LossPlan()
    padded = PaddingCollator(pad_token_id=0)(EXAMPLES)
    flat = PackedCollator(pad_token_id=0, padding_free=True)(EXAMPLES)
    with torch.no_grad():
        want = causal_lm_loss(
            model, {k: v for k, v in padded.items() if k != "labels"}, padded["labels"], plan
        )
        got = causal_lm_loss(model, {k: v for k, v in flat.items() if k != "labels"}, flat["labels"], plan)
    assert flat["input_ids"].shape == (1, sum(len(e["input_ids"]) for e in EXAMPLES))  # no padding at all
    # Every family here separates flattened examples; the loss is the same sum over the same 14 targets.
    assert matches, why
    torch.testing.assert_close(got.ce_sum, want.ce_sum, rtol=1e-5, atol=1e-5)


def test_a_model_whose_attention_mixes_flattened_examples_keeps_padded_batches(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import transformers.masking_utils as masking

    import hf_fsdp2.attention_layout

    monkeypatch.setattr(
        hf_fsdp2.attention_layout, "_PROBED", {}
    )  # the probe is kept per process: probe afresh here
    config = load_model_config(str(make_family_dir(tmp_path / "m", "llama3_untied")))
    assert padding_free_matches(config)[0]
    # Without the detection of packed rows, attention crosses from one example into the next.
    monkeypatch.setattr(masking, "find_packed_sequence_indices", lambda position_ids: None)
    monkeypatch.setattr(hf_fsdp2.attention_layout, "_PROBED", {})
    matches, why = padding_free_matches(config)
    assert not matches and "padding-free logits differ from the padded ones" in why
    assert padding_free_matches(config, "flash_attention_2")[0]  # varlen kernels: by design
    assert not padding_free_matches(config, "some_kernel")[0]
