"""The batch layout and attention kernel of a run (hf_fsdp2.attention_layout.choose_attention_layout), and the mask each
layout makes transformers build.

Documents flattened into one row are kept apart by ``position_ids``; transformers' ``create_causal_mask`` (what
a Llama forward calls) turns that into a dense ``[1, 1, T, T]`` tensor over all T tokens under sdpa and eager, a
``BlockMask`` under flex_attention and nothing under flash-attention (varlen); a padded batch without padding gets
no mask at all (sdpa's ``is_causal``). So on a GPU padding-free is the default only with flex or flash kernels.
"""

from __future__ import annotations

import copy
import inspect
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from support.tiny import make_tiny_llama_dir
from transformers import BloomConfig, LlamaConfig
from transformers.masking_utils import create_causal_mask

from hf_fsdp2.attention_layout import attention_layout_for, choose_attention_layout
from hf_fsdp2.config import ConfigError
from hf_fsdp2.data.loader import PaddingCollator
from hf_fsdp2.data.packing import PackedCollator
from hf_fsdp2.methods import get_method
from hf_fsdp2.model import load_model

CONFIG = LlamaConfig(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
)
EXAMPLES = [
    {"input_ids": [5, 9, 13, 200, 201, 202, 7], "labels": [-100, -100, -100, 200, 201, 202, 7]},
    {"input_ids": [4, 8, 300, 301], "labels": [-100, -100, 300, 301]},
    {"input_ids": [6, 11, 12, 14, 15, 400, 401, 402, 403, 404, 2], "labels": [-100] * 5 + [400, 401, 402, 403, 404, 2]},
]  # fmt: skip
FLASH = frozenset({"flash_attention_2"})


def _mask(attn: str, batch: dict[str, torch.Tensor]) -> object:
    """What ``create_causal_mask`` builds for ``batch`` under ``attn``, called as LlamaModel.forward calls it."""
    config = copy.deepcopy(CONFIG)
    config._attn_implementation = attn
    ids = batch["input_ids"]
    positions = batch.get("position_ids", torch.arange(ids.shape[1])[None].expand(ids.shape[0], -1))
    return create_causal_mask(
        config=config,
        inputs_embeds=torch.zeros((*ids.shape, CONFIG.hidden_size)),
        attention_mask=batch.get("attention_mask"),
        position_ids=positions,
        **{_CACHE_ARG: None},
    )


# The KV-cache argument's name: ``past_key_values`` in transformers 5.17 (the floor), ``cache`` in 5.24.
_CACHE_ARG = "cache" if "cache" in inspect.signature(create_causal_mask).parameters else "past_key_values"


def _block_diagonal(lengths: list[int]) -> torch.Tensor:
    """The causal mask of documents of ``lengths`` end to end: no position sees another document."""
    doc = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    causal = torch.ones(len(doc), len(doc), dtype=torch.bool).tril()
    return causal & (doc[:, None] == doc[None, :])


def test_sdpa_and_eager_build_a_dense_mask_over_the_whole_flattened_micro_batch() -> None:
    flat = PackedCollator(pad_token_id=0, padding_free=True)(EXAMPLES)
    lengths = [len(e["input_ids"]) for e in EXAMPLES]
    tokens = sum(lengths)
    sdpa = _mask("sdpa", flat)
    assert (
        isinstance(sdpa, torch.Tensor) and sdpa.shape == (1, 1, tokens, tokens) and sdpa.dtype == torch.bool
    )
    assert torch.equal(sdpa[0, 0], _block_diagonal(lengths))
    eager = _mask("eager", flat)  # additive, in the compute dtype
    assert isinstance(eager, torch.Tensor) and eager.shape == (1, 1, tokens, tokens)
    assert torch.equal(eager[0, 0] == 0, _block_diagonal(lengths))
    assert _mask("flash_attention_2", flat) is None  # varlen: the boundaries come from position_ids


def test_padded_batches_build_no_mask_without_padding_and_a_per_row_one_with_it() -> None:
    same = PaddingCollator(pad_token_id=0)([EXAMPLES[0], EXAMPLES[0]])
    assert _mask("sdpa", same) is None  # sdpa runs is_causal: the flash kernel, no mask
    padded = PaddingCollator(pad_token_id=0)(EXAMPLES)
    mask = _mask("sdpa", padded)
    longest = max(len(e["input_ids"]) for e in EXAMPLES)
    assert isinstance(mask, torch.Tensor) and mask.shape == (3, 1, longest, longest)  # rows x L^2, not T^2


def test_a_llama_forward_hands_its_layers_the_mask_create_causal_mask_builds(tmp_path: Path) -> None:
    model = load_model(str(make_tiny_llama_dir(tmp_path / "llama")), attn_implementation="sdpa")
    seen: list[object] = []
    layer = model.model.layers[0]
    layer.register_forward_pre_hook(
        lambda _m, _a, kw: seen.append(kw.get("attention_mask")), with_kwargs=True
    )
    flat = PackedCollator(pad_token_id=0, padding_free=True)(EXAMPLES)
    same = PaddingCollator(pad_token_id=0)([EXAMPLES[0], EXAMPLES[0]])
    with torch.no_grad():
        model(**{k: v for k, v in flat.items() if k != "labels"}, use_cache=False)
        model(**{k: v for k, v in same.items() if k != "labels"}, use_cache=False)
    tokens = flat["input_ids"].shape[1]
    assert isinstance(seen[0], torch.Tensor) and seen[0].shape == (1, 1, tokens, tokens)
    assert seen[1] is None


@pytest.mark.slow  # flex_attention compiles its CPU kernels (tens of seconds on 2 cores)
@pytest.mark.usefixtures("fresh_compile_state")
def test_flex_attention_runs_padding_free_on_cpu_with_a_block_mask_and_the_padded_losses(
    tmp_path: Path,
) -> None:
    from torch.nn.attention.flex_attention import BlockMask

    flat = PackedCollator(pad_token_id=0, padding_free=True)(EXAMPLES)
    block = _mask("flex_attention", flat)
    assert isinstance(block, BlockMask) and not isinstance(block, torch.Tensor)
    lengths = [len(e["input_ids"]) for e in EXAMPLES]
    q, kv = torch.meshgrid(torch.arange(sum(lengths)), torch.arange(sum(lengths)), indexing="ij")
    zero = torch.zeros_like(q)
    assert torch.equal(block.mask_mod(zero, zero, q, kv), _block_diagonal(lengths))  # evaluated, never stored

    path = make_tiny_llama_dir(tmp_path / "llama", seed=1)
    flex, sdpa = load_model(str(path), attn_implementation="flex_attention"), load_model(str(path))
    flex.eval()
    sdpa.eval()
    padded = PaddingCollator(pad_token_id=0)(EXAMPLES)
    with torch.no_grad():
        flat_logits = flex(
            input_ids=flat["input_ids"], position_ids=flat["position_ids"], use_cache=False
        ).logits
        padded_logits = sdpa(
            input_ids=padded["input_ids"], attention_mask=padded["attention_mask"], use_cache=False
        ).logits
    flat_losses = torch.nn.functional.cross_entropy(
        flat_logits[0, :-1], flat["labels"][0, 1:], reduction="none", ignore_index=-100
    )
    offset = 0
    for row, n in enumerate(lengths):
        want = torch.nn.functional.cross_entropy(
            padded_logits[row, : n - 1], padded["labels"][row, 1:n], reduction="none", ignore_index=-100
        )
        torch.testing.assert_close(flat_losses[offset : offset + n - 1], want, rtol=1e-5, atol=1e-5)
        offset += n


# device, attn_implementation, padding_free, packing, installed -> padding-free, kernel, dense mask, warned
TABLE = [
    ("cuda", "auto", None, False, frozenset(), False, "sdpa", False, False),
    ("cuda", "auto", None, False, FLASH, False, "sdpa", False, False),  # auto never switches kernels
    ("cuda", "sdpa", None, False, FLASH, False, "sdpa", False, False),
    ("cuda", "eager", None, False, frozenset(), False, "eager", False, False),
    ("cuda", "flex_attention", None, False, frozenset(), True, "flex_attention", False, False),
    ("cuda", "flash_attention_2", None, False, FLASH, True, "flash_attention_2", False, False),
    ("cuda", "sdpa", True, False, frozenset(), True, "sdpa", True, True),  # asked for: allowed, warned
    ("cuda", "auto", True, False, frozenset(), True, "sdpa", True, True),
    ("cuda", "eager", True, False, frozenset(), True, "eager", True, True),
    ("cuda", "flex_attention", True, False, frozenset(), True, "flex_attention", False, False),
    ("cuda", "auto", False, False, frozenset(), False, "sdpa", False, False),
    ("cuda", "auto", None, True, frozenset(), False, "sdpa", True, False),  # packed rows: a mask per row
    ("cuda", "flex_attention", None, True, frozenset(), False, "flex_attention", False, False),
    # rows of several documents under flash: one row (its varlen path finds documents only in a one-row batch)
    ("cuda", "flash_attention_2", None, True, FLASH, True, "flash_attention_2", False, False),
    ("cpu", "auto", None, False, frozenset(), True, "sdpa", True, False),  # the probe; faster on CPU
    ("cpu", "sdpa", None, False, frozenset(), True, "sdpa", True, False),
    ("cpu", "eager", None, False, frozenset(), True, "eager", True, False),
    ("cpu", "sdpa", True, False, frozenset(), True, "sdpa", True, False),  # no warning on CPU
    ("cpu", "auto", None, True, frozenset(), False, "sdpa", True, False),
    ("cpu", "auto", False, False, frozenset(), False, "sdpa", False, False),
]


@pytest.mark.parametrize(
    ("device", "attn", "padding_free", "packing", "installed", "flat", "kernel", "dense", "warned"), TABLE
)
def test_the_decision_table(
    device: str,
    attn: str,
    padding_free: bool | None,
    packing: bool,
    installed: frozenset[str],
    flat: bool,
    kernel: str,
    dense: bool,
    warned: bool,
) -> None:
    layout = choose_attention_layout(
        CONFIG,
        device_type=device,
        attn_implementation=attn,
        packing=packing,
        padding_free=padding_free,
        installed=installed,
    )
    assert (layout.padding_free, layout.kernel, layout.dense_mask, layout.warning is not None) == (
        flat,
        kernel,
        dense,
        warned,
    ), layout
    assert layout.attn_implementation == attn  # the kernel the run loads is the one the user named
    line = layout.describe()
    assert line.startswith(f"batches: {'padding-free' if flat else 'packed rows' if packing else 'padded'} (")
    tail = layout.describe(why=False)
    assert line.endswith(tail.split(";", 1)[1]) and f"attention {kernel}," in tail
    assert ("dense [T x T] mask" in tail) == dense
    if warned:
        assert "T^2" in layout.warning and "flex_attention" in layout.warning  # type: ignore[operator]


def test_why_a_gpu_run_keeps_padded_batches_names_the_kernels_that_would_not() -> None:
    without = choose_attention_layout(CONFIG, device_type="cuda", installed=frozenset()).reason
    assert "dense [T x T] mask" in without and "flex_attention" in without and "flash" not in without
    with_flash = choose_attention_layout(CONFIG, device_type="cuda", installed=FLASH).reason
    assert "flash_attention_2 (installed)" in with_flash


def test_kernels_a_gpu_run_cannot_load_are_refused_before_any_work() -> None:
    with pytest.raises(
        ConfigError, match="flash_attention_2 needs the flash_attn package or the kernels package"
    ):
        choose_attention_layout(
            CONFIG, device_type="cuda", attn_implementation="flash_attention_2", installed=frozenset()
        )
    bloom = BloomConfig(vocab_size=64, hidden_size=32, n_layer=2, n_head=4)
    with pytest.raises(ConfigError, match="BloomForCausalLM does not support it"):
        choose_attention_layout(bloom, device_type="cuda", attn_implementation="flex_attention")
    layout = choose_attention_layout(bloom, device_type="cuda")  # auto: transformers' eager for this model
    assert layout.kernel == "eager" and not layout.padding_free


def test_each_recipe_reads_its_rows_into_the_decision() -> None:
    def cfg(**data: object) -> SimpleNamespace:
        values = {"packing": False, "padding_free": None, "cross_document_attention": False, **data}
        return SimpleNamespace(
            model=SimpleNamespace(attn_implementation="sdpa", trust_remote_code=False),
            data=SimpleNamespace(**values),
        )

    def layout(recipe: str, **data: object) -> tuple[bool, bool, bool]:
        got = attention_layout_for(
            cfg(**data),
            CONFIG,
            device_type="cuda",
            batch_rows=get_method(recipe).batch_rows,
            installed=frozenset(),
        )
        return got.padding_free, got.packing, got.dense_mask

    assert layout("sft") == (False, False, False)
    assert layout("sft", packing=True) == (False, True, True)
    assert layout("cpt") == (False, True, True)  # rows of documents apart: a per-row mask under sdpa
    assert layout("cpt", cross_document_attention=True) == (False, False, False)  # one sequence per row
    assert layout("cpt", padding_free=True) == (True, True, True)
    assert layout("dpo", padding_free=None) == (False, False, False)
