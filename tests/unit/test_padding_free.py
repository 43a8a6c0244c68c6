"""Padding-free batches by default where they compute the same thing: the start-up probe decides per model; for
every family users fine-tune, each target's loss in a row of several documents equals the document's own, or the
family's rows of several documents are refused by name (layers that carry state along a row)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from support.families import FAMILIES, make_family_dir
from transformers import FalconH1Config, LlamaConfig

from hf_fsdp2.attention_layout import choose_attention_layout
from hf_fsdp2.config import ConfigError
from hf_fsdp2.data.loader import PaddingCollator
from hf_fsdp2.data.packing import PackedCollator
from hf_fsdp2.model import load_model, load_model_config
from hf_fsdp2.padding_free_probe import PROBE_FAILED, padding_free_matches
from hf_fsdp2.train.loss import LossPlan, causal_lm_loss

EXAMPLES = [
    {"input_ids": [5, 9, 13, 200, 201, 202, 7], "labels": [-100, -100, -100, 200, 201, 202, 7]},
    {"input_ids": [4, 8, 300, 301], "labels": [-100, -100, 300, 301]},
    {"input_ids": [6, 11, 12, 14, 15, 400, 401, 402, 403, 404, 2], "labels": [-100] * 5 + [400, 401, 402, 403, 404, 2]},
]  # fmt: skip


# The families whose rows of several documents are refused, and what the refusal names: a Mamba-2 mixer or gated
# DeltaNet carries its state along the row (the layer kind, from the config); gpt-oss's forward in transformers 5.25
# builds its masks without position_ids, so its attention crosses documents (the probe, under its eager kernel).
REFUSED = {
    "qwen3_5": "layers are linear_attention:", "qwen3_5_moe": "layers are linear_attention:",
    "qwen3_next": "layers are linear_attention:", "granite4": "layers are linear_attention:",
    "falcon_h1": "layers are hybrid:", "gpt_oss": "documents of one row would see each other: with eager attention",
}  # fmt: skip


def _per_token_losses(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """The next-token cross entropy of every target of ``batch``, in order."""
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    with torch.no_grad():
        logits = model(**inputs, use_cache=False).logits[:, :-1].float()
    labels = batch["labels"][:, 1:]
    losses = F.cross_entropy(logits.reshape(-1, logits.size(-1)), labels.reshape(-1), reduction="none")
    return losses[labels.reshape(-1) != -100]


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_documents_in_one_row_train_as_alone_or_the_family_is_refused(family: str, tmp_path: Path) -> None:
    """Padding-free batches and packed rows put several documents in one row with position_ids restarting per
    document: every target's loss must be the one the document gives alone. Where a family's layers make that
    false, the rows are refused by name (and padding_free unset keeps padded batches), on every device."""
    path = make_family_dir(tmp_path / family, family, initializer_range=0.2)
    config = load_model_config(str(path))
    model = load_model(str(path)).eval()
    flat = PackedCollator(pad_token_id=0, padding_free=True)(EXAMPLES)
    assert flat["input_ids"].shape == (1, sum(len(e["input_ids"]) for e in EXAMPLES))  # no padding at all
    got = _per_token_losses(model, flat)
    alone = torch.cat([_per_token_losses(model, PackedCollator(pad_token_id=0)([e])) for e in EXAMPLES])
    assert got.shape == alone.shape == (12,)
    matches, why = padding_free_matches(config)
    if family not in REFUSED:
        assert matches, why
        torch.testing.assert_close(got, alone, rtol=1e-5, atol=1e-5)
        # And through the library's loss: the padded micro-batch's sum over the same 12 targets.
        padded = PaddingCollator(pad_token_id=0)(EXAMPLES)
        with torch.no_grad():
            sums = [
                causal_lm_loss(
                    model, {k: v for k, v in b.items() if k != "labels"}, b["labels"], LossPlan()
                ).ce_sum
                for b in (padded, flat)
            ]
        torch.testing.assert_close(sums[1], sums[0], rtol=1e-5, atol=1e-5)
        assert choose_attention_layout(config, device_type="cpu").padding_free
        return
    # The refusal is needed: a later document's losses depend on the earlier ones.
    assert float((got - alone).abs().max()) > 1e-3, (got - alone).abs().max()
    assert not matches, why
    recurrent = (
        family != "gpt_oss"
    )  # refused from the config on every device; gpt-oss by the probe of its masks
    where = [("cpu", "auto", None)] + [
        ("cuda", "flash_attention_2", frozenset({"flash_attention_2"}))
    ] * recurrent
    for device, attn, kernels in where:
        for rows in ({"packing": True}, {"padding_free": True}, {"packing": True, "padding_free": False}):
            with pytest.raises(ConfigError) as refused:
                choose_attention_layout(
                    config, device_type=device, attn_implementation=attn, installed=kernels, **rows
                )
            message = str(refused.value)
            assert f"(model_type {config.model_type})" in message and REFUSED[family] in message, message
            assert "packing: false and padding_free: false" in message, message
            assert ("cross_document_attention: true" in message) == recurrent, message
        layout = choose_attention_layout(
            config, device_type=device, attn_implementation=attn, installed=kernels
        )
        assert not layout.padding_free, layout.reason
        assert (REFUSED[family] if recurrent else "padding-free logits differ") in layout.reason, (
            layout.reason
        )


def test_a_model_whose_attention_mixes_flattened_examples_keeps_padded_batches(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import transformers.masking_utils as masking

    import hf_fsdp2.padding_free_probe

    monkeypatch.setattr(
        hf_fsdp2.padding_free_probe, "_PROBED", {}
    )  # the probe is kept per process: probe afresh here
    config = load_model_config(str(make_family_dir(tmp_path / "m", "llama3_untied")))
    assert padding_free_matches(config)[0]
    # Without the detection of packed rows, attention crosses from one example into the next.
    monkeypatch.setattr(masking, "find_packed_sequence_indices", lambda position_ids: None)
    monkeypatch.setattr(hf_fsdp2.padding_free_probe, "_PROBED", {})
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


_TINY = dict(
    vocab_size=128,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
)


def test_a_probe_that_cannot_shrink_the_config_keeps_padded_batches_and_says_why(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import hf_fsdp2.padding_free_probe

    monkeypatch.setattr(hf_fsdp2.padding_free_probe, "_PROBED", {})
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

    import hf_fsdp2.padding_free_probe

    def broken(self: object, *args: object, **kwargs: object) -> None:
        raise RuntimeError("a kernel this machine lacks")

    monkeypatch.setattr(hf_fsdp2.padding_free_probe, "_PROBED", {})
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
    import hf_fsdp2.padding_free_probe

    monkeypatch.setattr(hf_fsdp2.padding_free_probe, "_PROBED", {})
    config = FalconH1Config(**_TINY, mamba_d_ssm=32, mamba_n_heads=4, mamba_d_state=8, mamba_chunk_size=8)
    matches, why = padding_free_matches(config)
    # It ran: the Mamba mixers carry their state from one flattened example into the next.
    assert not matches and "padding-free logits differ from the padded ones" in why, why


def test_context_parallel_and_cpt_rows_are_refused_on_layers_that_carry_state_along_a_row() -> None:
    from types import SimpleNamespace

    from transformers import Qwen3NextConfig

    from hf_fsdp2.attention_layout import check_row_layers, method_rows

    config = Qwen3NextConfig(**_TINY, layer_types=["linear_attention", "full_attention"] * 2)
    with pytest.raises(
        ConfigError, match=r"cp_size=2 on Qwen3NextForCausalLM .*2 of its 4 layers are linear_att"
    ):
        check_row_layers(config, packing=False, padding_free=False, cp_size=2)
    # Continued pre-training's rows hold several documents unless cross_document_attention is set.
    cpt = SimpleNamespace(cross_document_attention=False, padding_free=None)
    with pytest.raises(ConfigError, match="cross_document_attention: true"):
        check_row_layers(
            config, **dict(zip(("packing", "padding_free"), method_rows(cpt, "corpus"), strict=True))
        )
    cpt.cross_document_attention = True  # documents that see each other on purpose
    check_row_layers(
        config, **dict(zip(("packing", "padding_free"), method_rows(cpt, "corpus"), strict=True))
    )
    check_row_layers(config, packing=False, padding_free=None)  # padded rows: nothing to refuse
    check_row_layers(LlamaConfig(**_TINY), packing=True, padding_free=True, cp_size=2)  # attention only
