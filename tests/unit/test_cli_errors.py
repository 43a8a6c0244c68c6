"""Bad input to the commands is one line naming the file, the problem and the fix, exit status 2, never a
traceback (issue 25, item 5)."""

from __future__ import annotations

from pathlib import Path

import pytest

from hf_fsdp2.config import ConfigError
from hf_fsdp2.config.parse import load_yaml


def test_a_binary_or_invalid_recipe_yaml_is_named(tmp_path: Path) -> None:
    binary = tmp_path / "bin.yaml"
    binary.write_bytes(b"\x89PNG\r\n\x1a\n\xb4\x00")
    with pytest.raises(ConfigError, match=rf"--config {binary} is not a text file \(byte 0: not UTF-8\)"):
        load_yaml(binary)
    bad = tmp_path / "bad.yaml"
    bad.write_text("learning_rate: 1e-5\nmax_length: [64\n  seed: : 1\n")
    with pytest.raises(ConfigError) as err:
        load_yaml(bad)
    assert str(err.value).startswith(f"--config {bad} is not valid YAML at line 3") and "\n" not in str(err.value)
