"""The device mesh keys: sizes resolved against the world size, the launcher's parallelism config, and every
refusal before any work with the numbers (products, HSDP without sharding, TP heads, CP sequence length, TP /
CP not available in this version)."""

from __future__ import annotations

import pytest

from hf_fsdp2.config import ConfigError, FSDPArgs
from hf_fsdp2.config.plans import HeadSplit, MeshPlan, check_mesh, resolve_mesh, split_heads
from hf_fsdp2.parallel.accelerator import launcher_mesh


def test_sizes_resolve_to_the_world() -> None:
    assert resolve_mesh(8, dp_replicate=None, dp_shard=None, tp=None, cp=None) == MeshPlan(
        dp_replicate=1, dp_shard=8, tp=1, cp=1
    )
    assert resolve_mesh(16, dp_replicate=2, dp_shard=None, tp=None, cp=None) == MeshPlan(
        dp_replicate=2, dp_shard=8, tp=1, cp=1
    )
    assert resolve_mesh(4, dp_replicate=2, dp_shard=2, tp=None, cp=None).hybrid


@pytest.mark.parametrize(
    "world, sizes, message",
    [
        (6, dict(dp_replicate=4), "dp_replicate_size(4) x tp_size(1) x cp_size(1) = 4 does not divide the world size 6"),
        (8, dict(dp_replicate=2, dp_shard=2), "= 4, but the run has 8 processes"),
        (4, dict(dp_replicate=4), "dp_replicate_size=4 with dp_shard_size=1 replicates whole parameters"),
        (4, dict(dp_shard=0), "dp_shard_size=0 must be >= 1"),
    ],
)  # fmt: skip
def test_bad_sizes_are_refused_with_the_numbers(world: int, sizes: dict, message: str) -> None:
    kwargs = dict(dp_replicate=None, dp_shard=None, tp=None, cp=None) | sizes
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        resolve_mesh(world, **kwargs)


def test_tp_needs_whole_heads_per_rank_and_data_ranks_for_fsdp2() -> None:
    with pytest.raises(ConfigError, match="tp_size=4 does not divide the model's num_key_value_heads=2"):
        check_mesh(MeshPlan(dp_replicate=1, dp_shard=2, tp=4, cp=1), heads=8, kv_heads=2, max_length=1024)
    with pytest.raises(ConfigError, match="tp_size=4 does not divide the model's num_attention_heads=6"):
        check_mesh(MeshPlan(dp_replicate=1, dp_shard=2, tp=4, cp=1), heads=6, kv_heads=2, max_length=1024)
    with pytest.raises(ConfigError, match="tp_size=4 takes every one of the 4 ranks"):
        check_mesh(MeshPlan(dp_replicate=1, dp_shard=1, tp=4, cp=1), heads=8, kv_heads=4, max_length=1024)
    check_mesh(
        MeshPlan(dp_replicate=1, dp_shard=2, tp=2, cp=2), heads=8, kv_heads=2, max_length=1024
    )  # tp x cp: cp splits heads / tp
    with pytest.raises(
        ConfigError, match="cp_size=4 does not divide the model's num_attention_heads=2 \\(per tensor"
    ):
        check_mesh(
            MeshPlan(dp_replicate=1, dp_shard=1, tp=4, cp=4), heads=8, kv_heads=4, max_length=1024
        )  # 8 heads / tp 4 = 2 per tp rank
    check_mesh(
        MeshPlan(dp_replicate=1, dp_shard=2, tp=2, cp=1), heads=8, kv_heads=2, max_length=1024
    )  # tp 2 x dp_shard 2
    assert "tensor parallel 2" in MeshPlan(dp_replicate=1, dp_shard=2, tp=2, cp=1).describe()
    check_mesh(
        MeshPlan(dp_replicate=2, dp_shard=4, tp=1, cp=1), heads=8, kv_heads=2, max_length=1000
    )  # HSDP: nothing to refuse


def test_cp_all_to_all_needs_whole_query_heads_per_rank_and_repeats_kv_heads_when_they_do_not_divide() -> (
    None
):
    with pytest.raises(ConfigError, match="cp_size=3 does not divide the model's num_attention_heads=8"):
        check_mesh(MeshPlan(dp_replicate=1, dp_shard=2, tp=1, cp=3), heads=8, kv_heads=2, max_length=1024)
    # Any max_length: each micro-batch is padded to a multiple of cp_size.
    check_mesh(MeshPlan(dp_replicate=1, dp_shard=2, tp=1, cp=4), heads=8, kv_heads=2, max_length=1021)
    assert split_heads(8, 2, 4) == HeadSplit(8, 2, 4, kv_repeat=2)  # 2 KV heads -> 4, one per rank
    assert split_heads(8, 8, 4).kv_repeat == 1
    assert split_heads(12, 3, 2).kv_repeat == 2  # 6 KV heads, 2 query heads each
    # Ring splits no heads: the mesh passes; its refusals are hf_fsdp2.parallel.ring.check_ring_settings'.
    check_mesh(
        MeshPlan(dp_replicate=1, dp_shard=2, tp=1, cp=2, cp_backend="ring"),
        heads=8,
        kv_heads=2,
        max_length=1024,
    )
    with pytest.raises(ConfigError, match="cp_backend='ulysses' is not one of auto, all_to_all, ring"):
        resolve_mesh(4, dp_replicate=None, dp_shard=None, tp=None, cp=2, cp_backend="ulysses")
    mesh = resolve_mesh(8, dp_replicate=2, dp_shard=None, tp=None, cp=2)
    assert (mesh.dp_shard, mesh.fsdp_shard, mesh.cp_backend) == (2, 4, "all_to_all")
    assert "context parallel 2 (all_to_all)" in mesh.describe()


def test_the_recipe_keys_win_over_the_launchers_parallelism_config(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ACCELERATE_USE_PARALLELISM_CONFIG", "true")
    monkeypatch.setenv("PARALLELISM_CONFIG_DP_REPLICATE_SIZE", "2")
    monkeypatch.setenv("PARALLELISM_CONFIG_DP_SHARD_SIZE", "4")
    launcher = launcher_mesh()
    assert launcher == {"dp_replicate_size": 2, "dp_shard_size": 4}
    assert FSDPArgs().mesh_plan(8, launcher) == MeshPlan(dp_replicate=2, dp_shard=4, tp=1, cp=1)
    assert FSDPArgs(dp_replicate_size=1, dp_shard_size=8).mesh_plan(8, launcher) == MeshPlan(
        dp_replicate=1, dp_shard=8, tp=1, cp=1
    )
    monkeypatch.setenv("ACCELERATE_USE_PARALLELISM_CONFIG", "false")
    assert launcher_mesh() == {}


def test_the_prepare_reads_torchaos_presence_once(monkeypatch) -> None:
    """Accelerate's FSDP2 prepare asks is_torchao_available() twice per parameter (each a package-metadata read);
    inside shard_with_accelerate's prepare the first answer is reused, and accelerate's own function is back afterwards."""
    from accelerate.utils import modeling

    from hf_fsdp2.parallel.accelerator import _torchao_checked_once

    calls = []

    def check() -> bool:
        calls.append(1)
        return True

    monkeypatch.setattr(modeling, "is_torchao_available", check)
    with _torchao_checked_once():
        answers = [modeling.is_torchao_available() for _ in range(50)]
    assert answers == [True] * 50 and len(calls) == 1
    assert modeling.is_torchao_available is check
    with pytest.raises(RuntimeError), _torchao_checked_once():
        raise RuntimeError("a failed prepare")
    assert modeling.is_torchao_available is check
