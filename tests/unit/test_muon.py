"""Muon + AdamW in one process: the same numbers as torch.optim.Muon + torch.optim.AdamW, bit for bit; the split of
the parameters; the owners' plan; the state dict round trip. The 2-rank sharded path: tests/distributed/test_muon_fsdp2.py."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from hf_fsdp2.train.muon import (
    MuonAdamW,
    MuonSettings,
    _row_blocks,
    build_muon_adamw,
    owner_rounds,
    split_params,
)


class Block(nn.Module):  # a "decoder layer": Muon takes its matrices, AdamW its norm and bias
    def __init__(self, d: int) -> None:
        super().__init__()
        self.up, self.down, self.norm = nn.Linear(d, 3 * d), nn.Linear(3 * d, d, bias=False), nn.LayerNorm(d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(self.norm(x))))


class Tiny(nn.Module):
    def __init__(self, vocab: int = 50, d: int = 16) -> None:
        super().__init__()
        self.embed, self.layers, self.head = (
            nn.Embedding(vocab, d),
            nn.ModuleList([Block(d), Block(d)]),
            nn.Linear(d, vocab),
        )

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids)
        for layer in self.layers:
            h = layer(h)
        return self.head(h)


def _ours(model: Tiny, settings: MuonSettings) -> MuonAdamW:
    split = split_params(model, ["Block"])
    groups = [
        {"params": [p for _, p in split.adamw_decay], "weight_decay": 0.1},
        {"params": [p for _, p in split.adamw_no_decay], "weight_decay": 0.0},
    ]
    return MuonAdamW(
        [p for _, p in split.muon], groups, settings, lr=3e-3, betas=(0.9, 0.95), eps=1e-8, fused=True
    )


def _theirs(model: Tiny, settings: MuonSettings) -> list[torch.optim.Optimizer]:
    split = split_params(model, ["Block"])
    adamw = torch.optim.AdamW(
        [
            {"params": [p for _, p in split.adamw_decay], "weight_decay": 0.1},
            {"params": [p for _, p in split.adamw_no_decay], "weight_decay": 0.0},
        ],
        lr=3e-3,
        betas=(0.9, 0.95),
        eps=1e-8,
        fused=True,
    )
    muon = torch.optim.Muon(
        [p for _, p in split.muon],
        lr=settings.lr,
        weight_decay=settings.weight_decay,
        momentum=settings.momentum,
        nesterov=settings.nesterov,
        ns_steps=settings.ns_steps,
        adjust_lr_fn=settings.adjust_lr,
    )
    return [adamw, muon]


def _train(model: Tiny, step_fns: list, steps: int, gen: torch.Generator | None = None) -> list[float]:
    gen, losses = gen or torch.Generator().manual_seed(0), []
    for _ in range(steps):
        ids = torch.randint(0, 50, (4, 12), generator=gen)
        loss = nn.functional.cross_entropy(model(ids[:, :-1]).flatten(0, 1), ids[:, 1:].flatten())
        loss.backward()
        for fn in step_fns:
            fn()
        model.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


def test_split_muon_takes_decoder_matrices_only() -> None:
    split = split_params(Tiny(), ["Block"])
    assert [n for n, _ in split.muon] == [f"layers.{i}.{m}.weight" for i in (0, 1) for m in ("up", "down")]
    assert [n for n, _ in split.adamw_decay] == ["embed.weight", "head.weight"]
    assert {n.rsplit(".", 2)[-2] for n, _ in split.adamw_no_decay} >= {"up", "norm", "head"}  # biases, norms
    assert "Muon on 4 decoder-layer matrices" in split.describe()


def test_split_finds_the_layers_after_fully_shard_renamed_their_class() -> None:
    model = Tiny()
    for layer in model.layers:  # as fully_shard does: a subclass named FSDP<name>
        layer.__class__ = type(f"FSDP{type(layer).__name__}", (type(layer),), {})
    assert len(split_params(model, ["Block"]).muon) == 4


@pytest.mark.parametrize(
    "settings",
    [
        MuonSettings(lr=0.02, weight_decay=0.1, adjust_lr="original"),
        MuonSettings(lr=3e-3, nesterov=False, ns_steps=3),
    ],
    ids=["keller-original", "moonlight-match-rms-no-nesterov"],
)
def test_one_process_equals_torch_muon_plus_adamw_bit_for_bit(settings: MuonSettings) -> None:
    torch.manual_seed(0)
    a = Tiny()
    b = copy.deepcopy(a)
    ours = _ours(a, settings)
    theirs = _theirs(b, settings)
    la = _train(a, [ours.step], 5)
    lb = _train(b, [o.step for o in theirs], 5)
    assert la == lb and la[-1] < la[0]
    for (name, pa), pb in zip(a.named_parameters(), b.parameters(), strict=True):
        assert torch.equal(pa, pb), name


def test_state_dict_round_trip_resumes_exactly() -> None:
    settings = MuonSettings(lr=0.01, weight_decay=0.05)
    torch.manual_seed(1)
    a = Tiny()
    b = copy.deepcopy(a)
    opt_a = _ours(a, settings)
    full = _train(a, [opt_a.step], 6)
    opt_b, gen = _ours(b, settings), torch.Generator().manual_seed(0)
    first = _train(b, [opt_b.step], 3, gen)
    saved_model, saved_opt = copy.deepcopy(b.state_dict()), copy.deepcopy(opt_b.state_dict())
    c = Tiny()  # a restart: fresh model and optimizer, loaded
    c.load_state_dict(saved_model)
    opt_c = _ours(c, settings)
    opt_c.load_state_dict(saved_opt)
    assert [g["algorithm"] for g in opt_c.param_groups] == ["adamw", "adamw", "muon"]
    rest = _train(c, [opt_c.step], 3, gen)
    assert first + rest == full
    for pa, pc in zip(a.parameters(), c.parameters(), strict=True):
        assert torch.equal(pa, pc)
    muon_param = opt_c.param_groups[-1]["params"][0]
    assert opt_c.state[muon_param]["momentum_buffer"].abs().sum() > 0


def test_newton_schulz_runs_in_bf16_so_sending_bf16_loses_nothing() -> None:
    """The all-to-alls carry bf16 row blocks: exact only while torch's Newton-Schulz casts to bf16 first."""
    from torch.optim._muon import _zeropower_via_newtonschulz as ns

    x = torch.randn(24, 40, dtype=torch.float32)
    coeffs = (3.4445, -4.7750, 2.0315)
    assert torch.equal(ns(x, coeffs, 5, 1e-7), ns(x.bfloat16(), coeffs, 5, 1e-7))


def test_owner_rounds_balance_and_cover_every_matrix_once() -> None:
    shapes = [(64, 64)] * 3 + [(64, 192), (192, 64)] * 2 + [(8, 64)]
    rounds = owner_rounds(shapes, 2)
    owned = [i for r in rounds for i in r if i is not None]
    assert sorted(owned) == list(range(len(shapes)))
    cost = [min(s) ** 2 * max(s) for s in shapes]
    loads = [sum(cost[r[k]] for r in rounds if r[k] is not None) for k in range(2)]
    assert max(loads) - min(loads) <= max(cost)  # greedy largest-first: within one matrix of even
    assert rounds == owner_rounds(shapes, 2)  # deterministic: every rank computes the same plan
    assert owner_rounds(shapes[:1], 4) == [[0, None, None, None]]


def test_row_blocks_are_torch_chunk_sizes_with_empty_tail() -> None:
    assert _row_blocks(10, 4) == [3, 3, 3, 1]
    assert _row_blocks(5, 4) == [2, 2, 1, 0]
    assert _row_blocks(2, 4) == [1, 1, 0, 0]


def test_refuses_non_matrices_and_unknown_adjustment() -> None:
    with pytest.raises(ValueError, match="2-D matrices only"):
        MuonAdamW(
            [nn.Parameter(torch.ones(3))],
            [],
            MuonSettings(lr=1.0),
            lr=1.0,
            betas=(0.9, 0.9),
            eps=1e-8,
            fused=False,
        )
    with pytest.raises(ValueError, match="muon_adjust_lr='spectral'"):
        MuonAdamW(
            [],
            [],
            MuonSettings(lr=1.0, adjust_lr="spectral"),
            lr=1.0,
            betas=(0.9, 0.9),
            eps=1e-8,
            fused=False,
        )


def test_resumed_schedule_keeps_each_groups_peak() -> None:
    """A resumed run's schedule puts Muon's group back on muon_lr's curve, AdamW's on learning_rate's."""
    from hf_fsdp2.train.optim import build_scheduler, restore_scheduler

    model = Tiny()
    opt = _ours(model, MuonSettings(lr=0.02))
    sched = build_scheduler(opt, "cosine", 0, 10)
    for _ in range(4):
        opt.step()
        sched.step()
    want = [g["lr"] for g in opt.param_groups]
    fresh = _ours(Tiny(), MuonSettings(lr=0.02))
    restore_scheduler(build_scheduler(fresh, "cosine", 0, 10), sched.state_dict(), 3e-3, 0.02)
    assert [g["lr"] for g in fresh.param_groups] == want and want[-1] > want[0]


@pytest.mark.parametrize("name", ["sft", "cpt", "dpo", "kto", "rm", "grpo"])
def test_every_method_reads_optim_muon_and_its_keys(name: str) -> None:
    """Every method builds its optimizer in run/build.py::build_model from these keys: none refuses them."""
    from hf_fsdp2.methods import method_names, parse_method_config

    assert name in method_names()
    argv = [
        "--model_name_or_path",
        "org/m",
        "--dataset_name",
        "d.jsonl",
        "--output_dir",
        "out",
        "--optim",
        "muon",
        "--muon_lr",
        "0.01",
        "--muon_momentum",
        "0.9",
        "--muon_nesterov",
        "false",
        "--muon_ns_steps",
        "4",
        "--muon_adjust_lr",
        "original",
    ]
    t = parse_method_config(name, argv).train
    assert (t.optim, t.muon_lr, t.muon_momentum, t.muon_nesterov, t.muon_ns_steps, t.muon_adjust_lr) == (
        "muon",
        0.01,
        0.9,
        False,
        4,
        "original",
    )


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--optim", "sgd"], "optim='sgd' has no equivalent here"),
        (["--optim", "muon", "--muon_momentum", "1.0"], "muon_momentum=1.0 must be in [0, 1)"),
        (["--optim", "muon", "--muon_ns_steps", "0"], "muon_ns_steps=0 must be in [1, 99]"),
        (["--optim", "muon", "--muon_lr", "-1"], "muon_lr=-1.0 must be > 0"),
    ],
)
def test_bad_muon_values_are_refused_with_the_key(argv: list[str], message: str) -> None:
    import re

    from hf_fsdp2.config import ConfigError, parse_config

    with pytest.raises(ConfigError, match=re.escape(message)):
        parse_config(
            ["--model_name_or_path", "org/m", "--dataset_name", "d.jsonl", "--output_dir", "out", *argv]
        )


def test_reward_score_head_and_lora_split() -> None:
    """A reward model's score head is AdamW's; under LoRA the adapters' A/B factors are AdamW's too (in its decay
    group, as under optim=adamw), the built optimizer's AdamW groups hold every one of them, and the log line says
    so; full matrices trained beside LoRA (lora_modules_to_save inside the layers) are still Muon's."""
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForSequenceClassification

    config = LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        num_labels=1,
    )
    rm = LlamaForSequenceClassification(config)
    split = split_params(rm, ["LlamaDecoderLayer"])
    assert len(split.muon) == 14 and "score.weight" in [n for n, _ in split.adamw_decay]
    full = split
    lora = get_peft_model(rm, LoraConfig(r=4, target_modules=["q_proj", "v_proj"], task_type="SEQ_CLS"))
    factors = [
        n for n, p in lora.named_parameters() if p.requires_grad and (".lora_A." in n or ".lora_B." in n)
    ]
    assert len(factors) == 8
    split = split_params(lora, ["LlamaDecoderLayer"])
    assert split.muon == []
    assert [n for n, _ in split.adamw_decay] == [
        *factors,
        "base_model.model.score.modules_to_save.default.weight",
    ]
    assert [n for n, _ in split.lora] == factors
    assert "Muon on 0 decoder-layer matrices" in split.describe()
    assert "LoRA's A/B factors on AdamW: 8 tensors" in split.describe()
    assert "trains as optim=adamw would" in str(split.warning())
    optimizer, _ = build_muon_adamw(
        lora,
        ["LlamaDecoderLayer"],
        MuonSettings(lr=0.02, weight_decay=0.1),
        lr=1e-3,
        betas=(0.9, 0.95),
        eps=1e-8,
        device_type="cpu",
    )
    adamw_ids = {id(p) for g in optimizer.param_groups if g["algorithm"] == "adamw" for p in g["params"]}
    named = dict(lora.named_parameters())
    assert all(id(named[n]) in adamw_ids for n in factors)
    assert all(g["algorithm"] == "adamw" for g in optimizer.param_groups)
    # a decoder-layer module trained in full beside LoRA is a hidden weight matrix: Muon's
    rm2 = LlamaForSequenceClassification(config)
    both = get_peft_model(
        rm2, LoraConfig(r=4, target_modules=["q_proj"], modules_to_save=["down_proj"], task_type="SEQ_CLS")
    )
    split = split_params(both, ["LlamaDecoderLayer"])
    assert len(split.muon) == 2 and all(".down_proj.modules_to_save." in n for n, _ in split.muon)
    assert len(split.lora) == 4 and split.warning() is None
    # full fine-tuning: no LoRA factor, nothing said about them
    assert full.lora == [] and full.warning() is None and "LoRA" not in full.describe()


def test_a_torch_without_the_private_muon_functions_is_refused_with_the_fix(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import torch.optim._muon as torch_muon

    monkeypatch.delattr(torch_muon, "_zeropower_via_newtonschulz")
    with pytest.raises(RuntimeError, match="use optim=adamw or the torch docs/compatibility.md lists"):
        MuonAdamW([], [], MuonSettings(lr=1.0), lr=1.0, betas=(0.9, 0.9), eps=1e-8, fused=False)


def test_rounds_go_in_buckets_of_at_most_the_cap_two_all_to_alls_each() -> None:
    """Llama-3-8B's 224 Muon matrices on 8 ranks: 28 rounds of one matrix per rank went out in 56 all-to-alls per step;
    in buckets of up to 256 MiB of whole bf16 matrices per rank, 8 buckets: 16 (the MLP's 112 MiB matrices two rounds a
    bucket). Every round in one bucket, in order; a bucket over the cap only when one round alone is."""
    from hf_fsdp2.train.muon_exchange import MUON_BUCKET_BYTES, muon_buckets

    per_layer = [
        (4096, 4096),
        (1024, 4096),
        (1024, 4096),
        (4096, 4096),
        (14336, 4096),
        (14336, 4096),
        (4096, 14336),
    ]
    shapes = per_layer * 32
    rounds = owner_rounds(shapes, 8)
    buckets = muon_buckets(rounds, shapes, 8, MUON_BUCKET_BYTES)
    assert (len(rounds), len(buckets)) == (28, 8)
    assert [k for bucket in buckets for k in bucket] == list(range(28))
    for bucket in buckets:
        per_rank = [
            sum(2 * shapes[i][0] * shapes[i][1] for k in bucket if (i := rounds[k][r]) is not None)
            for r in range(8)
        ]
        assert max(per_rank) <= MUON_BUCKET_BYTES or len(bucket) == 1
    assert (
        len(muon_buckets(rounds, shapes, 8, 1)) == 28
    )  # one round per bucket: 2 all-to-alls per round, as before
