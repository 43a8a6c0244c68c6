"""Padding-free batches by default where they compute the same thing: the start-up probe decides per model, and
for every family users fine-tune the summed loss of a padding-free micro-batch equals the padded one's."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from support.families import FAMILIES, make_family_dir
from transformers import FalconH1Config, LlamaConfig

from hf_fsdp2.attention_layout import PROBE_FAILED, choose_attention_layout, padding_free_matches
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


class _ReadOnlyLayerTypes(LlamaConfig):
    """A config whose per-layer list is a read-only property that does not follow ``num_hidden_layers`` (the probe
    cannot shrink it): Falcon-H1's ``layers_block_type`` is read-only too."""

    @property
    def layer_types(self) -> list[str]:
        return ["full_attention"] * 4


_TINY = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2)  # fmt: skip


def test_a_probe_that_cannot_shrink_the_config_keeps_padded_batches_and_says_why(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import hf_fsdp2.attention_layout

    monkeypatch.setattr(hf_fsdp2.attention_layout, "_PROBED", {})
    matches, why = padding_free_matches(_ReadOnlyLayerTypes(**_TINY))  # raised out of the probe before
    assert not matches
    assert why.startswith(PROBE_FAILED) and "shrink the config of _ReadOnlyLayerTypes" in why, why
    assert "AttributeError" in why and "padded batches kept" in why
    layout = choose_attention_layout(_ReadOnlyLayerTypes(**_TINY), device_type="cpu")
    assert not layout.padding_free and layout.warning == layout.reason and PROBE_FAILED in layout.reason


def test_a_probe_whose_forward_raises_keeps_padded_batches_and_says_why(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import transformers

    import hf_fsdp2.attention_layout

    def broken(self: object, *args: object, **kwargs: object) -> None:
        raise RuntimeError("a kernel this machine lacks")

    monkeypatch.setattr(hf_fsdp2.attention_layout, "_PROBED", {})
    monkeypatch.setattr(transformers.LlamaForCausalLM, "forward", broken)
    matches, why = padding_free_matches(LlamaConfig(**_TINY))  # raised out of the probe before
    assert not matches
    assert "could not run its forward of LlamaConfig: RuntimeError: a kernel this machine lacks" in why, why
    layout = choose_attention_layout(LlamaConfig(**_TINY), device_type="cpu")
    assert not layout.padding_free and layout.warning is not None and "run its forward" in layout.warning


def test_falcon_h1s_read_only_layer_list_follows_the_shrunk_layer_count(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Falcon-H1's ``layers_block_type`` (``layer_types``) is a read-only property derived from ``num_hidden_layers``:
    the probe builds and runs the family instead of dying on it (which killed every rank before any step)."""
    import hf_fsdp2.attention_layout

    monkeypatch.setattr(hf_fsdp2.attention_layout, "_PROBED", {})
    config = FalconH1Config(**_TINY, mamba_d_ssm=32, mamba_n_heads=4, mamba_d_state=8, mamba_chunk_size=8)
    matches, why = padding_free_matches(config)
    # It ran: the Mamba mixers carry their state from one flattened example into the next.
    assert not matches and "padding-free logits differ from the padded ones" in why, why
