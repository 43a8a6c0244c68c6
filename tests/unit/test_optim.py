"""Unit tests for hf_fsdp2.train.optim: parameter groups, AdamW, LR schedules, warmup length."""

from __future__ import annotations

import math

import pytest
import torch

from hf_fsdp2.train.optim import build_adamw, build_scheduler, lr_lambda, param_groups, warmup_steps_for


class Toy(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(10, 4)
        self.proj = torch.nn.Linear(4, 3)  # weight 2-D, bias 1-D
        self.norm = torch.nn.LayerNorm(3)  # weight and bias 1-D
        self.frozen = torch.nn.Linear(3, 3)
        self.frozen.weight.requires_grad_(False)
        self.frozen.bias.requires_grad_(False)


def ids(params: list[torch.nn.Parameter]) -> set[int]:
    return {id(p) for p in params}


def test_param_groups_split_by_ndim_and_skip_frozen() -> None:
    model = Toy()
    groups = param_groups(model, weight_decay=0.1)
    assert len(groups) == 2
    decay, no_decay = groups
    assert decay["weight_decay"] == 0.1
    assert no_decay["weight_decay"] == 0.0
    assert ids(decay["params"]) == ids([model.embed.weight, model.proj.weight])
    assert ids(no_decay["params"]) == ids([model.proj.bias, model.norm.weight, model.norm.bias])
    grouped = ids(decay["params"]) | ids(no_decay["params"])
    assert id(model.frozen.weight) not in grouped
    assert id(model.frozen.bias) not in grouped


def test_param_groups_omit_empty_groups() -> None:
    only_1d = torch.nn.LayerNorm(3)
    groups = param_groups(only_1d, weight_decay=0.1)
    assert len(groups) == 1
    assert groups[0]["weight_decay"] == 0.0
    assert ids(groups[0]["params"]) == ids([only_1d.weight, only_1d.bias])

    only_2d = torch.nn.Linear(3, 3, bias=False)
    groups = param_groups(only_2d, weight_decay=0.05)
    assert [(g["weight_decay"], len(g["params"])) for g in groups] == [(0.05, 1)]

    frozen = torch.nn.Linear(3, 3)
    frozen.requires_grad_(False)
    assert param_groups(frozen, weight_decay=0.1) == []


def test_build_adamw_uses_foreach_where_no_fused_kernel() -> None:
    opt = build_adamw(param_groups(Toy(), 0.0), lr=1e-3, betas=(0.9, 0.999), eps=1e-8, device_type="meta")
    assert all(not g["fused"] and g["foreach"] for g in opt.param_groups)


def test_build_adamw_keeps_groups_and_hyperparameters() -> None:
    model = Toy()
    opt = build_adamw(param_groups(model, 0.1), lr=3e-4, betas=(0.8, 0.95), eps=1e-6, device_type="cpu")
    assert isinstance(opt, torch.optim.AdamW)
    assert [g["weight_decay"] for g in opt.param_groups] == [0.1, 0.0]
    for group in opt.param_groups:
        assert group["lr"] == 3e-4
        assert group["betas"] == (0.8, 0.95)
        assert group["eps"] == 1e-6
        assert group["fused"]  # torch's fused AdamW kernel exists for CPU and CUDA
    # One real step moves a parameter that has a gradient.
    before = model.proj.weight.detach().clone()
    model.proj(torch.ones(2, 4)).sum().backward()
    opt.step()
    assert not torch.equal(before, model.proj.weight)


# ---------------------------------------------------------------------------------------------------
# lr_lambda
# ---------------------------------------------------------------------------------------------------

COS_QUARTER = 0.5 * (1 + math.cos(math.pi / 4))  # 0.8535...


@pytest.mark.parametrize(
    ("kind", "step", "expected"),
    [
        # warmup 2 of 10: (step + 1) / 3 during warmup, then 8 decay steps
        ("cosine", 0, 1 / 3),
        ("cosine", 1, 2 / 3),
        ("cosine", 2, 1.0),
        ("cosine", 4, COS_QUARTER),
        ("cosine", 6, 0.5),
        ("cosine", 10, 0.0),
        ("cosine", 15, 0.0),  # past the end stays at 0
        ("linear", 0, 1 / 3),
        ("linear", 1, 2 / 3),
        ("linear", 2, 1.0),
        ("linear", 4, 0.75),
        ("linear", 6, 0.5),
        ("linear", 9, 0.125),
        ("linear", 10, 0.0),
        ("constant", 0, 1 / 3),
        ("constant", 1, 2 / 3),
        ("constant", 2, 1.0),
        ("constant", 9, 1.0),
    ],
)
def test_lr_lambda_with_warmup(kind: str, step: int, expected: float) -> None:
    assert lr_lambda(kind, warmup_steps=2, total_steps=10)(step) == pytest.approx(expected, abs=1e-12)


@pytest.mark.parametrize(
    ("kind", "step", "expected"),
    [
        ("cosine", 0, 1.0),
        ("cosine", 5, 0.5),
        ("cosine", 10, 0.0),
        ("linear", 0, 1.0),
        ("linear", 3, 0.7),
        ("linear", 10, 0.0),
        ("constant", 0, 1.0),
        ("constant", 9, 1.0),
    ],
)
def test_lr_lambda_without_warmup(kind: str, step: int, expected: float) -> None:
    assert lr_lambda(kind, warmup_steps=0, total_steps=10)(step) == pytest.approx(expected, abs=1e-12)


def test_lr_lambda_bad_kind() -> None:
    with pytest.raises(ValueError, match="'cosin'"):
        lr_lambda("cosin", 0, 10)


@pytest.mark.parametrize("warmup", [10, 11])
def test_lr_lambda_warmup_not_shorter_than_training(warmup: int) -> None:
    with pytest.raises(ValueError) as err:
        lr_lambda("cosine", warmup, 10)
    assert f"{warmup} steps" in str(err.value)
    assert "10 steps" in str(err.value)


def test_scheduler_drives_the_optimizer_lr() -> None:
    param = torch.nn.Parameter(torch.zeros(2, 2))
    opt = build_adamw(
        [{"params": [param], "weight_decay": 0.0}], lr=0.3, betas=(0.9, 0.99), eps=1e-8, device_type="cpu"
    )
    sched = build_scheduler(opt, "linear", warmup_steps=2, total_steps=10)
    seen = []
    for _ in range(4):
        seen.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert seen == pytest.approx([0.1, 0.2, 0.3, 0.3 * 0.875])


# ---------------------------------------------------------------------------------------------------
# warmup_steps_for
# ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("total", "steps", "ratio", "expected"),
    [
        (100, 0, 0.1, 10),
        (100, 5, 0.1, 5),  # explicit steps win over the ratio
        (10, 0, 0.15, 2),  # ceil(1.5)
        (10, 0, 0.0, 0),
        (1000, 0, 0.03, 30),
        (7, 3, 0.0, 3),
    ],
)
def test_warmup_steps_for(total: int, steps: int, ratio: float, expected: int) -> None:
    assert warmup_steps_for(total, steps, ratio) == expected


def test_warmup_steps_for_exact_ratio_is_not_rounded_up() -> None:
    assert warmup_steps_for(100, 0, 0.07) == 7
