"""The peak-FLOP table: every entry found from the name torch.cuda.get_device_name() reports, whole tokens
only, the most specific name first; unknown devices have no peak (the ``peak_flops`` key then gives it)."""

from __future__ import annotations

import pytest

from hf_fsdp2.observe.flops import PEAK_FLOPS, peak_flops_for

# (device name as torch reports it, table entry it must get, peak dense bf16 FLOP/s of that device)
DEVICES = [
    ("NVIDIA H100 80GB HBM3", "H100", 989e12),
    ("NVIDIA H100 PCIe", "H100 PCIe", 756e12),
    ("NVIDIA H100 NVL", "H100 NVL", 835e12),
    ("NVIDIA H200", "H200", 989e12),
    ("NVIDIA H200 NVL", "H200 NVL", 835e12),
    ("NVIDIA GH200 480GB", "GH200", 989e12),
    ("NVIDIA H20", "H20", 148e12),
    ("NVIDIA B200", "B200", 2.25e15),
    ("NVIDIA A100-SXM4-80GB", "A100", 312e12),
    ("NVIDIA A100-SXM4-40GB", "A100", 312e12),
    ("NVIDIA A100 80GB PCIe", "A100", 312e12),
    ("NVIDIA A800-SXM4-80GB", "A800", 312e12),
    ("NVIDIA A10G", "A10G", 70e12),
    ("NVIDIA A10", "A10", 125e12),
    ("NVIDIA L40S", "L40S", 362e12),
    ("NVIDIA L40", "L40", 181e12),
    ("NVIDIA L4", "L4", 121e12),
    ("NVIDIA GeForce RTX 4090", "RTX 4090", 165e12),
    ("AMD Instinct MI300X", "MI300X", 1307e12),
    ("AMD Instinct MI325X", "MI325X", 1307e12),
    # ROCm reports one device per GCD, two per MI250X package
    ("AMD Instinct MI250X", "MI250X", 191.5e12),
    ("AMD Instinct MI250X/MI250", "MI250X", 191.5e12),
]


@pytest.mark.parametrize(("device", "entry", "peak"), DEVICES, ids=[d[0] for d in DEVICES])
def test_each_device_gets_its_own_entry(device: str, entry: str, peak: float) -> None:
    assert PEAK_FLOPS[entry] == peak
    assert peak_flops_for(device) == peak


def test_every_entry_is_tested_with_a_real_device_name() -> None:
    assert {entry for _, entry, _ in DEVICES} == set(PEAK_FLOPS)


def test_names_match_whole_tokens_only() -> None:
    # A shorter name inside a longer token is not a match: L4 in L40, H20 in H200, A10 in A100, H200 in GH200.
    assert peak_flops_for("NVIDIA L40") != PEAK_FLOPS["L4"]
    assert peak_flops_for("NVIDIA H200") != PEAK_FLOPS["H20"]
    assert peak_flops_for("NVIDIA A100-SXM4-80GB") != PEAK_FLOPS["A10"]
    # Variants of a listed device that the table does not know fall back to nothing rather than a neighbour.
    assert peak_flops_for("NVIDIA L40G") is None
    assert peak_flops_for("NVIDIA A40") is None


@pytest.mark.parametrize(
    "device", ["cpu", "Intel Xeon", "NVIDIA GeForce RTX 3090", "Tesla V100-SXM2-16GB", ""]
)
def test_unknown_devices_have_no_peak(device: str) -> None:
    assert peak_flops_for(device) is None
