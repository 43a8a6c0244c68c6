"""The plan knows mixtures of experts (hf_fsdp2/plan/experts.py, hf_fsdp2/parallel/grouped_mm.py): the figures of
Qwen3-30B-A3B's shapes on 8 GPUs computed by hand from the stated formulas, on the meta device (no weights); the
meta forward of fused experts equal to a real forward's saved bytes; the proposal of ep_size by the plan, the
recommender, the command and doctor; the kernel the experts run with.

Qwen3-30B-A3B (its config.json): hidden 2048, 128 experts of moe_intermediate_size 768, top 8, 48 layers, 32 query and
4 KV heads of 128, vocabulary 151936, untied. Per-layer figures do not depend on the layer count, so the model here
has 2 layers (a 48-layer meta model takes ~10 s to build on this machine); the per-step figures are per 2 layers.
One expert: P = 3 x 2048 x 768 = 4,718,592 parameters (gate_up_proj 2 x 768 rows, down_proj 2048 rows of 768).
"""

from __future__ import annotations

import json

import pytest
import torch
import transformers

from hf_fsdp2.config.plans import ACPlan, LoraSettings
from hf_fsdp2.parallel.grouped_mm import LOOP, experts_kernel, model_experts_kernel
from hf_fsdp2.plan import PlanSettings, build_meta_model, fsdp_units, plan_memory, recommend, state_bytes
from hf_fsdp2.plan.experts import expert_plan

P = 3 * 2048 * 768
E, K, H, T = 128, 8, 2048, 4096  # experts, top-k, hidden, tokens per rank and micro-batch
BF16, FP32 = 2, 4
ROWS = T * K * H * BF16  # one token exchange's rows: 134,217,728 bytes


def qwen3_30b_a3b(layers: int = 2) -> transformers.Qwen3MoeConfig:
    return transformers.Qwen3MoeConfig(
        vocab_size=151936,
        hidden_size=2048,
        intermediate_size=6144,
        moe_intermediate_size=768,
        num_hidden_layers=layers,
        num_attention_heads=32,
        num_key_value_heads=4,
        head_dim=128,
        num_experts=128,
        num_experts_per_tok=8,
        max_position_embeddings=40960,
        tie_word_embeddings=False,
    )


SETTINGS = PlanSettings(world_size=8, seq_len=T, load_dtype="bfloat16", mixed_precision="bf16")


@pytest.fixture(scope="module")
def meta() -> torch.nn.Module:
    return build_meta_model(qwen3_30b_a3b(), SETTINGS)


def test_qwen3_30b_a3b_on_8_gpus_by_hand(meta: torch.nn.Module) -> None:
    plan = expert_plan(meta, qwen3_30b_a3b(), SETTINGS)
    assert plan is not None
    s = plan.shapes
    assert (s.num_experts, s.top_k, s.hidden, s.expert_numel, s.layers) == (E, K, H, P, (0, 1))
    assert s.expert_params == 2 * E * P and s.trained and s.classes == ("Qwen3MoeExperts",)
    by_ep = {o.ep: o for o in plan.options}
    assert sorted(by_ep) == [1, 2, 4, 8]
    # Per layer, ep 1 (flat FSDP2 over 8): the whole stack gathered in bf16, 7/8 of it received; the gradients
    # reduce-scattered in fp32, 7 of the 8 chunks of 16 experts sent.
    flat = by_ep[1]
    assert flat.gathered == E * P * BF16 == 1_207_959_552
    assert flat.gather_received == 1_056_964_608
    assert flat.reduce_sent == 16 * 7 * P * FP32 == 2_113_929_216
    assert flat.exchange_sent == flat.exchange_buffers == 0
    # ep 2 (efsdp 4): 64 experts gathered over 4; each exchange sends half of T x k rows of H in bf16 away.
    assert (by_ep[2].gathered, by_ep[2].gather_received, by_ep[2].reduce_sent) == (
        64 * P * BF16,
        64 * P * BF16 * 3 // 4,
        16 * 3 * P * FP32,
    )
    assert by_ep[2].exchange_sent == ROWS // 2 == 67_108_864
    # ep 8 (efsdp 1): nothing gathered from another rank, nothing reduce-scattered; 7/8 of every exchange moves.
    ep8 = by_ep[8]
    assert (ep8.experts_per_rank, ep8.gathered, ep8.gather_received, ep8.reduce_sent) == (
        16,
        16 * P * BF16,
        0,
        0,
    )
    assert ep8.exchange_sent == ROWS * 7 // 8 == 117_440_512
    assert ep8.exchange_buffers == 2 * ROWS and ep8.exchange_buffers_worst == ROWS + 8 * ROWS
    # Per step (1 micro-batch, reshard after forward: 2 gathers; no checkpointing: 4 exchanges), 2 layers.
    assert flat.step_sent == 2 * (2 * 1_056_964_608 + 2_113_929_216) == 8_455_716_864
    assert ep8.step_sent == 2 * 4 * 117_440_512 == 939_524_096
    assert by_ep[4].step_sent == 2 * (2 * 32 * P * BF16 // 2 + 16 * P * FP32 + 4 * ROWS * 3 // 4)
    # The sharded state (fp32 masters, gradients, AdamW's two moments) is 16 experts per rank at every ep_size.
    assert {o.sharded_bytes for o in plan.options} == {2 * 16 * P * FP32 * 4}
    assert plan.proposed == 8 and ep8.step_sent / flat.step_sent < 0.12
    text = "\n".join(plan.describe(str))
    # 65% of the 2-layer model (the 151936 x 2048 embedding and head weigh here; 95% of the 48-layer one).
    assert "set ep_size: 8" in text and "<- proposed" in text and "(65% of the model" in text
    # Full activation checkpointing recomputes the layer: the forward's two exchanges again (6 per micro-batch).
    recomputed = expert_plan(meta, qwen3_30b_a3b(), SETTINGS.replace(ac=ACPlan("full"), ep=8))
    assert recomputed is not None and recomputed.current.step_sent == 2 * 6 * 117_440_512


def test_frozen_experts_under_lora_move_no_gradients() -> None:
    lora = LoraSettings(r=8, alpha=16, dropout=0.0, target_modules=["q_proj", "v_proj"])
    settings = SETTINGS.replace(lora=lora)
    plan = expert_plan(build_meta_model(qwen3_30b_a3b(), settings), qwen3_30b_a3b(), settings)
    assert plan is not None and not plan.shapes.trained
    flat = plan.current
    assert (
        flat.reduce_sent == 0 and flat.sharded_bytes == 2 * 16 * P * BF16
    )  # frozen bf16, no gradient or moments
    assert flat.step_sent == 2 * 2 * 1_056_964_608 and plan.proposed == 8


def test_expert_parallel_splits_the_gathered_experts_not_the_sharded_state(meta: torch.nn.Module) -> None:
    ep8 = SETTINGS.replace(ep=8)
    for rank in (0, 5):  # 16 whole experts per rank either way (E / 8)
        assert state_bytes(meta, SETTINGS, rank) == state_bytes(meta, ep8, rank)
    flat_layer = next(u for u in fsdp_units(meta, SETTINGS) if u.name.endswith("layers.0"))
    ep_layer = next(u for u in fsdp_units(meta, ep8) if u.name.endswith("layers.0"))
    assert flat_layer.gathered_bytes - ep_layer.gathered_bytes == (E - 16) * P * BF16
    assert flat_layer.trainable_numel - ep_layer.trainable_numel == (E - 16) * P  # the reduce-scatter buffer


@pytest.mark.parametrize(
    ("cls", "extra"),
    [
        ("Qwen3MoeConfig", {"head_dim": 16, "num_experts": 4, "moe_intermediate_size": 32}),
        ("MixtralConfig", {"num_local_experts": 4}),
        ("GptOssConfig", {"head_dim": 16, "num_local_experts": 4, "intermediate_size": 32}),
    ],
)
def test_the_meta_forward_of_fused_experts_saves_what_a_real_forward_saves(cls: str, extra: dict) -> None:
    """fp32 on CPU: grouped_mm's meta kernel takes bf16 only, so the plan runs a stand-in that saves both inputs and
    the offsets as the kernel does; every (token, choice) row goes through it whatever the routing, so the meta
    forward's activations equal the real model's, byte for byte (the same meter on both; the loss's saved bytes are
    the dense planner's concern, tested elsewhere)."""
    from hf_fsdp2.model import decoder_layer_classes
    from hf_fsdp2.plan import SavedTensorMeter
    from hf_fsdp2.train.loss import causal_lm_loss, plan_loss

    common = dict(
        vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, num_experts_per_tok=2, pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    config = getattr(transformers, cls)(**{**common, **extra})
    settings = PlanSettings(
        world_size=1, micro_batch=2, seq_len=32, device_type="cpu", mixed_precision="no", ce_chunk_tokens=0
    )
    planned = plan_memory(config, settings).compute.saved
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).train()
    ids = torch.randint(3, 1000, (2, 32), generator=torch.Generator().manual_seed(0))
    with SavedTensorMeter(model, decoder_layer_classes(model)) as meter:
        causal_lm_loss(
            model, {"input_ids": ids, "attention_mask": torch.ones_like(ids)}, ids, plan_loss(model, 0)
        )
    real = meter.result()
    assert planned.activations == real.activations


def test_the_recommender_the_command_and_doctor_propose_ep_size(tmp_path, capsys) -> None:
    from hf_fsdp2.cli import main as cli_main
    from hf_fsdp2.config import parse_config
    from hf_fsdp2.doctor.layouts import expert_findings

    settings = SETTINGS.replace(seq_len=256)
    tried = recommend(qwen3_30b_a3b(), settings, 80 * 10**9, 0.1, expert_parallel=True)
    assert tried[0].changes == {"ep_size": 8} and tried[0].fits
    assert recommend(qwen3_30b_a3b(), settings, 80 * 10**9, 0.1)[0].changes == {}  # a method without it

    folder = tmp_path / "qwen3_30b_a3b"
    qwen3_30b_a3b().save_pretrained(folder)
    recipe = tmp_path / "r.yaml"
    recipe.write_text(
        f"model_name_or_path: {folder}\ndataset_name: d.jsonl\noutput_dir: {tmp_path / 'out'}\nmax_length: 256\n"
        "mixed_precision: bf16\ntorch_dtype: bfloat16\n"
    )
    assert cli_main(["plan", "--config", str(recipe), "--world_size", "8", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["experts"]["proposed_ep_size"] == 8 and out["experts"]["num_experts"] == E
    assert [o["ep"] for o in out["experts"]["options"]] == [1, 2, 4, 8]
    assert cli_main(["plan", "--config", str(recipe), "--world_size", "8"]) == 0
    text = capsys.readouterr().out
    assert "MoE: 2 layers of Qwen3MoeExperts, 128 experts (top 8)" in text and "set ep_size: 8" in text

    cfg = parse_config(["--config", str(recipe)])
    plan = plan_memory(qwen3_30b_a3b(), settings)
    found = {f.check: f for f in expert_findings(cfg, plan, on_gpu=False)}
    assert found["experts"].level == "warning"
    assert found["experts"].fix.startswith("set ep_size: 8")
    assert (found["experts kernel"].level, found["experts kernel"].value) == ("ok", "grouped_mm")


def test_the_experts_kernel_names_the_per_expert_loop_and_why() -> None:
    bf16, fp32 = torch.bfloat16, torch.float32
    assert (
        experts_kernel(None, compiled=True, compute_dtype=bf16, device_type="cuda", capability=(9, 0)).reason
        is None
    )
    loop = experts_kernel("grouped_mm", compiled=True, compute_dtype=fp32, device_type="cpu")
    assert loop.kernel == LOOP and "only with bf16 weights" in (loop.reason or "")
    # Expert parallel runs the rank's experts eagerly inside the compiled layer: grouped_mm in fp32 too.
    assert (
        experts_kernel(
            "grouped_mm", compiled=True, compute_dtype=fp32, device_type="cpu", expert_parallel=True
        ).reason
        is None
    )
    old = experts_kernel(
        "grouped_mm", compiled=False, compute_dtype=bf16, device_type="cuda", capability=(7, 5)
    )
    assert "sm_75" in (old.reason or "")
    assert "experts_implementation='eager'" in (
        experts_kernel("eager", compiled=False, compute_dtype=bf16, device_type="cpu").reason or ""
    )
    assert (
        experts_kernel("batched_mm", compiled=False, compute_dtype=bf16, device_type="cpu").kernel
        == "batched_mm"
    )
    # The line the run logs, from the model itself.
    config = transformers.Qwen3MoeConfig(
        vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
    )  # fmt: skip
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    kernel, line = model_experts_kernel(
        model, compiled=True, compute_dtype=None, device=torch.device("cpu")
    ) or (None, "")
    assert kernel is not None and kernel.kernel == LOOP
    assert line.startswith(
        "MoE experts (Qwen3MoeExperts, 2 layers): experts_implementation='grouped_mm' runs the"
    )
    llama = transformers.LlamaConfig(
        vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2
    )
    with torch.device("meta"):
        assert (
            model_experts_kernel(
                transformers.AutoModelForCausalLM.from_config(llama),
                compiled=False,
                compute_dtype=None,
                device=torch.device("cpu"),
            )
            is None
        )
