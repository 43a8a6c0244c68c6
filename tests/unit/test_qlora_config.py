"""QLoRA's settings and its 4-bit base, in one process: refused combinations name the key, the value and the fix;
the scale block chosen for a weight lets FSDP2's row split cut every NF4 part evenly, and each shard then holds
exactly its rows of the 4-bit weight; which weights are quantised (decoder-layer linears only)."""

from __future__ import annotations

import pytest
import torch
from test_config import parse_cli

from hf_fsdp2.config import ConfigError
from hf_fsdp2.lora.quantize import (
    NF4_BLOCK_SIZE,
    NF4_SCALER_BLOCK_SIZE,
    QuantizationError,
    local_nf4_bytes,
    quantize_base,
    scaler_block_for,
)

torchao = pytest.importorskip("torchao")


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (("--load_in_4bit", "true"), "load_in_4bit=true with use_peft=false"),
        (("--use_dora", "true"), "use_dora=true needs use_peft=true"),
        (
            ("--use_peft", "true", "--load_in_4bit", "true", "--bnb_4bit_quant_type", "fp4"),
            "bnb_4bit_quant_type='fp4'",
        ),
        (
            ("--use_peft", "true", "--load_in_4bit", "true", "--bnb_4bit_use_double_quant", "false"),
            "bnb_4bit_use_double_quant=false",
        ),
        (
            (
                "--use_peft",
                "true",
                "--load_in_4bit",
                "true",
                "--mixed_precision",
                "bf16",
                "--bnb_4bit_compute_dtype",
                "float16",
            ),
            "bnb_4bit_compute_dtype='float16' but the run computes in bfloat16",
        ),
    ],
)
def test_refused_combinations_name_the_key_and_the_fix(args: tuple[str, ...], expected: str) -> None:
    with pytest.raises(ConfigError) as err:
        parse_cli(*args)
    assert expected in str(err.value)


def test_accepted_settings() -> None:
    cfg = parse_cli(
        "--use_peft",
        "true",
        "--load_in_4bit",
        "true",
        "--use_dora",
        "true",
        "--mixed_precision",
        "bf16",
        "--bnb_4bit_compute_dtype",
        "bfloat16",
        "--merge_adapter",
        "true",
    )
    assert cfg.peft.load_in_4bit and cfg.peft.lora_settings().use_dora


def test_rank0_only_loading_is_refused_and_defaults_off_with_4bit() -> None:
    cfg = parse_cli("--use_peft", "true", "--load_in_4bit", "true")
    note = cfg.fsdp.resolve_ram_efficient_loading(8, resize_embeddings=False, load_in_4bit=True)
    assert cfg.fsdp.fsdp_cpu_ram_efficient_loading is False and "load_in_4bit" in note
    cfg = parse_cli(
        "--use_peft", "true", "--load_in_4bit", "true", "--fsdp_cpu_ram_efficient_loading", "true"
    )
    with pytest.raises(ConfigError, match="fsdp_cpu_ram_efficient_loading=true with load_in_4bit=true"):
        cfg.fsdp.resolve_ram_efficient_loading(8, resize_embeddings=False, load_in_4bit=True)


@pytest.mark.parametrize(
    ("shape", "shards", "block"),
    [
        ((256, 256), 2, 256),  # 1024 scales, 4 factors
        ((192, 576), 2, 32),  # SmolLM2's key projection: 1728 scales = 27 x 64
        ((192, 576), 1, 64),
        ((4096, 4096), 8, 256),
        ((100, 64), 8, None),  # 100 rows do not split over 8 ranks
        ((3, 10), 1, None),  # 30 weights: not a whole 64-weight block
    ],
)
def test_scale_block_splits_every_part_evenly(shape: tuple[int, int], shards: int, block: int | None) -> None:
    assert scaler_block_for(shape[0] * shape[1], shape[0], shards) == block


@pytest.mark.parametrize(("shape", "shards"), [((192, 576), 2), ((256, 256), 2), ((512, 128), 4)])
def test_a_row_shard_of_the_nf4_weight_holds_exactly_its_rows(shape: tuple[int, int], shards: int) -> None:
    """What FSDP2 does with the weight (torch.chunk on dim 0): each shard dequantises to its rows of the whole."""
    from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import to_nf4

    block = scaler_block_for(shape[0] * shape[1], shape[0], shards)
    assert block is not None
    weight = torch.randn(shape, generator=torch.Generator().manual_seed(0))
    nf4 = to_nf4(weight, NF4_BLOCK_SIZE, block)
    whole = nf4.get_original_weight()
    assert (whole - weight).abs().max() < 0.25 * weight.abs().max()  # 4-bit rounding, not garbage
    pieces = torch.chunk(nf4, shards, dim=0)
    assert len(pieces) == shards
    rows = shape[0] // shards
    for i, piece in enumerate(pieces):
        assert torch.equal(piece.get_original_weight(), whole[i * rows : (i + 1) * rows])


def _tiny(**overrides: int) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    values = dict(
        vocab_size=256,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    values.update(overrides)
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(**values))


def test_only_the_decoder_layers_linear_weights_are_quantised() -> None:
    model = _tiny()
    head, emb = model.lm_head.weight.clone(), model.model.embed_tokens.weight.clone()
    report = quantize_base(model, ("LlamaDecoderLayer",), shards=2)
    assert report.weights == 2 * 7 and not report.small_scaler_blocks
    nf4 = [n for n, p in model.named_parameters() if type(p).__name__ == "NF4Tensor"]
    assert len(nf4) == 14 and all(".layers." in n for n in nf4)
    assert all(not p.requires_grad for n, p in model.named_parameters() if n in nf4)
    assert torch.equal(model.lm_head.weight, head) and torch.equal(model.model.embed_tokens.weight, emb)
    assert local_nf4_bytes(model) == report.nf4_bytes
    # ~4.1 bits per weight: codes (4), scales (8 per 64), scale factors (32 per 64 x 256).
    linear = sum(m.weight.numel() for m in model.model.layers.modules() if isinstance(m, torch.nn.Linear))
    assert (
        report.nf4_bytes
        == linear // 2 + linear // NF4_BLOCK_SIZE + 4 * linear // NF4_BLOCK_SIZE // NF4_SCALER_BLOCK_SIZE
    )
    # The forward runs on the 4-bit weights (dequantised to the input's dtype).
    logits = model(input_ids=torch.tensor([[1, 2, 3]])).logits
    assert torch.isfinite(logits).all()


def test_modules_to_save_stay_unquantised_and_odd_shapes_are_named() -> None:
    model = _tiny()
    quantize_base(model, ("LlamaDecoderLayer",), shards=2, skip=("down_proj",))
    assert all(type(layer.mlp.down_proj.weight).__name__ != "NF4Tensor" for layer in model.model.layers)
    with pytest.raises(
        QuantizationError, match=r"q_proj.weight \(256, 256\) cannot be split evenly.*over 3 ranks"
    ):
        quantize_base(_tiny(), ("LlamaDecoderLayer",), shards=3)


class _Mesh:
    """What the NF4 all-gather hooks ask of FSDP2's mesh: the size of its shard group."""

    def __init__(self, ranks: int) -> None:
        self.ranks = ranks

    def get_group(self) -> _Mesh:
        return self

    def size(self) -> int:
        return self.ranks


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_one_rank_unshard_hands_fsdp2_one_buffer_and_rebuilds_the_weight(dtype: torch.dtype) -> None:
    """With one rank FSDP2 copies only the first all-gather input (no all-gather): the hooks pack the NF4 parts
    into one byte buffer; the weight rebuilt on it dequantises to the original's values, also through the ``out=``
    path of later unshards; with more ranks torchao's three inputs are unchanged."""
    model = _tiny()
    for layer in model.model.layers:
        layer.to(dtype)
    quantize_base(model, ("LlamaDecoderLayer",), shards=1)
    weight = model.model.layers[0].self_attn.k_proj.weight  # 128 x 256: scales (512 int8) before fp32 factors
    inputs, metadata = weight.fsdp_pre_all_gather(_Mesh(1))
    assert len(inputs) == 1 and inputs[0].dtype == torch.uint8
    parts = (weight.quantized_data, weight.quantized_scalers, weight.quantization_factor)
    assert inputs[0].numel() == sum(p.numel() * p.element_size() for p in parts)
    gathered = inputs[0].clone()  # what FSDP2's one-rank path copies into its unsharded buffer
    rebuilt, buffers = weight.fsdp_post_all_gather((gathered,), metadata, dtype)
    assert len(buffers) == 1 and buffers[0] is gathered  # the buffer FSDP2 frees after forward
    assert torch.equal(rebuilt.get_original_weight(), weight.get_original_weight())
    # A later unshard: FSDP2 refills the same buffer and passes the weight it built as ``out``.
    gathered.zero_()
    gathered.copy_(inputs[0])
    assert weight.fsdp_post_all_gather((gathered,), metadata, dtype, out=rebuilt) is None
    assert torch.equal(rebuilt.get_original_weight(), weight.get_original_weight())
    # Two ranks: torchao's own hooks, three inputs.
    assert len(weight.fsdp_pre_all_gather(_Mesh(2))[0]) == 3
