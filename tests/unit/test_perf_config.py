"""Config of the performance switches: activation checkpointing modes, compile scope, Liger."""

from __future__ import annotations

import importlib.util

import pytest
from test_config import parse_cli

from hf_fsdp2.config import ConfigError
from hf_fsdp2.config.plans import CompilePlan, ShardingPlan
from hf_fsdp2.parallel.accelerator import build_accelerator
from hf_fsdp2.parallel.kernels import KernelError, check_liger_available


def test_activation_checkpointing_resolves_from_either_key():
    assert parse_cli().fsdp.ac_mode() == "none"
    assert parse_cli("--gradient_checkpointing", "true").fsdp.ac_mode() == "full"
    assert parse_cli("--activation_checkpointing", "selective").fsdp.ac_mode() == "selective"
    assert (
        parse_cli("--gradient_checkpointing", "true", "--activation_checkpointing", "full").fsdp.ac_mode()
        == "full"
    )
    cfg = parse_cli("--activation_checkpointing", "every_k", "--ac_every_k", "3")
    assert (cfg.fsdp.ac_mode(), cfg.fsdp.ac_every_k) == ("every_k", 3)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ["--activation_checkpointing", "sometimes"],
            "activation_checkpointing='sometimes' is not one of none, full",
        ),
        (["--gradient_checkpointing", "true", "--activation_checkpointing", "selective"], "disagree"),
        (["--activation_checkpointing", "every_k", "--ac_every_k", "0"], "ac_every_k=0 must be >= 1"),
    ],
)
def test_bad_activation_checkpointing_settings_are_refused(args, message):
    with pytest.raises(ConfigError, match=message):
        parse_cli(*args)


def test_compile_scope_is_checked():
    assert parse_cli().fsdp.torch_compile_scope == "regional"
    assert parse_cli("--torch_compile_scope", "model").fsdp.torch_compile_scope == "model"
    with pytest.raises((ConfigError, SystemExit)):
        parse_cli("--torch_compile_scope", "layers")


def test_offload_is_refused_on_a_cpu_run(monkeypatch):
    for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(key, raising=False)
    plan = ShardingPlan(activation_checkpointing=ac_plan("offload"))
    with pytest.raises(ValueError, match="activation_checkpointing=offload .* use full"):
        build_accelerator(plan, mixed_precision="no", compile_plan=CompilePlan(), force_cpu=True)


def ac_plan(mode: str):  # type: ignore[no-untyped-def]
    from hf_fsdp2.config.plans import ACPlan

    return ACPlan(mode, pin_memory=False)


def test_liger_without_the_package_or_a_gpu_is_refused(monkeypatch):
    if importlib.util.find_spec("liger_kernel") is None:
        with pytest.raises(KernelError, match="pip install liger-kernel"):
            check_liger_available(on_gpu=True)
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object())
    with pytest.raises(KernelError, match="CPU-only run"):
        check_liger_available(on_gpu=False)


def test_liger_switch_defaults_off():
    assert parse_cli().train.use_liger_kernel is False
    assert parse_cli("--use_liger_kernel", "true").train.use_liger_kernel is True
