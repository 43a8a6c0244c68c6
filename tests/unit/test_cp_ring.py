"""Ring context parallel (``cp_backend: ring``) on CPU, where torch's ring attention itself cannot run: the layout
against torch's own load balancer, each rank's labels and positions, the loss of the parts against the whole batch
(fp64, one process, with a stand-in for torch's ring SDPA), and every refusal by name."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from transformers import (
    Gemma2Config,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    Qwen2Config,
)

from hf_fsdp2.config import ConfigError
from hf_fsdp2.config.plans import MeshPlan, check_mesh, resolve_mesh
from hf_fsdp2.parallel.all_to_all import RING_ATTENTION_NAME, ContextParallelError, whole_sequences
from hf_fsdp2.parallel.ring import (
    RING_CPU_REFUSAL,
    check_ring_settings,
    enable_ring_attention,
    ring_mesh,
    ring_order,
    shard_ring,
)
from hf_fsdp2.train.loss import count_target_tokens, cross_entropy_sum


@pytest.mark.parametrize(("length", "cp"), [(8, 2), (24, 2), (24, 3), (32, 4), (64, 8)])
def test_the_layout_is_torchs_head_tail_load_balancer(length: int, cp: int) -> None:
    from torch.distributed.tensor.experimental._context_parallel import _HeadTailLoadBalancer

    balancer = _HeadTailLoadBalancer(length, cp, "cpu")
    assert ring_order(length, cp).tolist() == balancer._generate_indices()[0].tolist()
    # torch's restore indices put the ranks' parts, concatenated in rank order, back in sequence order.
    parts = torch.cat([ring_order(length, cp).view(cp, -1)[r] for r in range(cp)])
    assert parts[balancer._generate_indices(restore=True)[0]].tolist() == list(range(length))


def test_a_length_that_does_not_split_into_2cp_chunks_is_refused() -> None:
    with pytest.raises(
        ContextParallelError, match=r"2 x cp_size = 4 chunks; length 10 does not divide \(pad it to 12\)"
    ):
        ring_order(10, 2)


def _batch(width: int) -> dict[str, torch.Tensor]:
    ids = torch.arange(1, 2 * width + 1).reshape(2, width)
    labels = ids.clone()
    labels[:, :2] = -100  # a prompt without loss
    mask = torch.ones_like(ids)
    mask[1, -2:] = 0  # the second row right-padded
    labels[1, -2:] = -100
    return {"input_ids": ids, "labels": labels, "attention_mask": mask}


def test_each_rank_holds_its_chunks_with_their_positions_and_targets() -> None:
    batch = _batch(
        7
    )  # 7 tokens, cp 2: padded to 8, chunks of 2; rank 0 holds chunks 0 and 3, rank 1 chunks 1 and 2
    first, second = (shard_ring(batch, 2, i) for i in range(2))
    assert (
        first["position_ids"].tolist() == [[0, 1, 6, 7]] * 2
        and second["position_ids"].tolist() == [[2, 3, 4, 5]] * 2
    )
    assert first["input_ids"].tolist() == [[1, 2, 7, 0], [8, 9, 14, 0]]
    assert second["input_ids"].tolist() == [[3, 4, 5, 6], [10, 11, 12, 13]]
    # One column wider, column j + 1 the target of position j: token 3 follows token 2 although rank 1 holds it.
    assert first["labels"].tolist() == [[-100, -100, 3, -100, -100], [-100, -100, 10, -100, -100]]
    assert second["labels"].tolist() == [
        [-100, 4, 5, 6, 7],
        [-100, 11, 12, -100, -100],
    ]  # row 2: 13, 14 padding
    whole = count_target_tokens(batch["labels"])
    assert count_target_tokens(first["labels"]) + count_target_tokens(second["labels"]) == whole == 8


def test_packed_rows_and_left_padding_are_refused_at_the_batch() -> None:
    batch = _batch(8)
    packed = {**batch, "position_ids": torch.tensor([[0, 1, 2, 0, 1, 2, 3, 4]] * 2)}
    with pytest.raises(ContextParallelError, match="position_ids restart inside a row.*packing=false"):
        shard_ring(packed, 2, 0)
    plain = {**batch, "position_ids": torch.arange(8).expand(2, 8)}  # one document per row: fine
    assert shard_ring(plain, 2, 1)["position_ids"].tolist() == [[2, 3, 4, 5]] * 2
    left = {**batch, "attention_mask": torch.tensor([[0, 1, 1, 1, 1, 1, 1, 1]] * 2)}
    with pytest.raises(ContextParallelError, match="right-padded"):
        shard_ring(left, 2, 0)


@pytest.fixture
def one_rank_group(tmp_path: Any) -> Iterator[Any]:
    """A world-1 gloo group: enable_ring_attention builds its DeviceMesh from a process group."""
    owned = not dist.is_initialized()
    if owned:
        dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    yield dist.group.WORLD
    if owned:
        dist.destroy_process_group()


def _llama(attn: str = "sdpa") -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=61,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        attn_implementation=attn,
    )
    return LlamaForCausalLM(config).double()


@pytest.mark.parametrize("cp", [2, 4])
def test_the_ranks_losses_and_gradients_add_up_to_the_whole_batchs(
    cp: int, one_rank_group: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """fp64, one process. torch's ring SDPA (CUDA only) is stood in for by what it computes for this layout: each
    query attends to every key at or before its place in the row, wherever the key sits. The ranks' parts are run as
    one row in rank order (each rank's queries then see every rank's keys, as around the ring); everything else is
    the run's code: the layout, the labels, the positions, the attention interface (GQA repeat, scale, no mask)."""
    torch.manual_seed(1)
    width = 13  # padded to a multiple of 2 x cp
    ids = torch.randint(1, 61, (2, width))
    labels = ids.clone()
    labels[:, :3] = -100
    mask = torch.ones_like(ids)
    mask[1, -4:] = 0
    labels[1, -4:] = -100
    batch = {"input_ids": ids, "labels": labels, "attention_mask": mask}

    model = _llama()
    whole = model(input_ids=ids, attention_mask=mask).logits
    want = cross_entropy_sum(whole, labels)
    want.backward()
    want_grads = [p.grad.clone() for p in model.parameters()]  # type: ignore[union-attr]
    model.zero_grad()

    line = enable_ring_attention(model, one_rank_group, cp, device_type="cpu")
    assert f"ring attention (torch context_parallel, SDPA) over {cp} ranks (2 attention modules)" in line
    assert model.config._attn_implementation == RING_ATTENTION_NAME and ring_mesh(model) is not None
    parts = [shard_ring(batch, cp, r) for r in range(cp)]
    places = torch.cat([p["position_ids"][0] for p in parts])
    sdpa, seen = F.scaled_dot_product_attention, []

    def ring_stand_in(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kw: Any) -> torch.Tensor:
        assert kw.pop("is_causal") is True and kw.get("attn_mask") is None and k.shape[1] == q.shape[1]
        seen.append(kw["scale"])
        return sdpa(q, k, v, attn_mask=places[None, :] <= places[:, None], **kw)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", ring_stand_in)
    logits = model(
        input_ids=torch.cat([p["input_ids"] for p in parts], 1),
        position_ids=torch.cat([p["position_ids"] for p in parts], 1),
    ).logits
    part = logits.shape[1] // cp
    sums = [cross_entropy_sum(logits[:, r * part : (r + 1) * part], parts[r]["labels"]) for r in range(cp)]
    got = torch.stack(sums).sum()
    got.backward()
    assert seen == [model.model.layers[0].self_attn.scaling] * 2  # the module's scale, both layers
    assert sum(count_target_tokens(p["labels"]) for p in parts) == count_target_tokens(labels)
    assert torch.allclose(got, want, rtol=1e-12, atol=0)
    for p, g in zip(model.parameters(), want_grads, strict=True):
        assert torch.allclose(p.grad, g, rtol=1e-9, atol=1e-12)  # type: ignore[arg-type]
    # A ring blind to the layout (causal in the order the parts sit) trains another loss: the test can fail.
    model.zero_grad()
    places = torch.arange(len(places))
    blind = model(
        input_ids=torch.cat([p["input_ids"] for p in parts], 1),
        position_ids=torch.cat([p["position_ids"] for p in parts], 1),
    ).logits
    blind_sum = sum(
        cross_entropy_sum(blind[:, r * part : (r + 1) * part], parts[r]["labels"]) for r in range(cp)
    )
    assert not torch.allclose(blind_sum, want, rtol=1e-6)  # type: ignore[arg-type]
    # Greedy samples at eval: every rank the whole sequence, the model's own sdpa inside whole_sequences.
    with whole_sequences(model):
        assert model.config._attn_implementation == "sdpa"
    assert model.config._attn_implementation == RING_ATTENTION_NAME


def test_a_model_the_ring_cannot_run_is_refused(one_rank_group: Any) -> None:
    with pytest.raises(ContextParallelError, match="runs torch's ring SDPA kernels; the model runs 'eager'"):
        enable_ring_attention(_llama("eager"), one_rank_group, 2, device_type="cpu")


def _ok(**overrides: Any) -> dict[str, Any]:
    return {
        "on_gpu": True,
        "packing": False,
        "padding_free": None,
        "attn_implementation": "sdpa",
        "model_config": None,
        **overrides,
    }


@pytest.mark.parametrize(
    ("overrides", "needle"),
    [
        ({"on_gpu": False}, "runs on CUDA only.*no CPU sharding rule for SDPA"),
        ({"packing": True}, "with packed rows.*set packing=false, or use cp_backend=all_to_all"),
        ({"padding_free": True}, "with padding_free=true.*set padding_free=false"),
        ({"attn_implementation": "flash_attention_2"}, "attn_implementation=flash_attention_2.*SDPA"),
        ({"model_config": MistralConfig(sliding_window=4096)}, "sliding window of 4096 tokens"),
        (
            {
                "model_config": Qwen2Config(
                    layer_types=["full_attention", "sliding_attention"], num_hidden_layers=2
                )
            },
            "sliding_attention layers",
        ),
        ({"model_config": Gemma2Config(num_hidden_layers=2)}, "sliding_attention layers"),
    ],
)
def test_what_the_ring_cannot_run_is_refused_by_name(overrides: dict[str, Any], needle: str) -> None:
    with pytest.raises(ConfigError, match=needle):
        check_ring_settings(**_ok(**overrides))


def test_what_the_ring_runs_passes_and_auto_stays_all_to_all() -> None:
    check_ring_settings(**_ok(model_config=LlamaConfig(), attn_implementation="auto"))
    check_ring_settings(**_ok(model_config=MistralConfig(sliding_window=None), padding_free=False))
    assert "CUDA" in RING_CPU_REFUSAL
    # auto never picks ring; ring splits no heads (cp 3 with 8 heads runs, where all-to-all refuses it).
    assert (
        resolve_mesh(4, dp_replicate=None, dp_shard=None, tp=None, cp=2, cp_backend="auto").cp_backend
        == "all_to_all"
    )
    check_mesh(
        MeshPlan(dp_replicate=1, dp_shard=2, tp=1, cp=3, cp_backend="ring"),
        heads=8,
        kv_heads=2,
        max_length=1024,
    )
    with pytest.raises(ConfigError, match="cp_size=3 does not divide the model's num_attention_heads=8"):
        check_mesh(
            MeshPlan(dp_replicate=1, dp_shard=2, tp=1, cp=3, cp_backend="all_to_all"),
            heads=8,
            kv_heads=2,
            max_length=1024,
        )
