"""The end-of-run export, end to end on 2 gloo ranks, when the disk fills or a signal stops it:
each says what happened in one line, publishes nothing, and names the checkpoint that keeps the trained weights
with the offline command that exports it.
"""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from support.launch import REPO, SFT, _env, free_port
from support.runs import sft_2ranks, write_recipe
from support.tiny import make_tiny_llama_dir, write_chat_jsonl


@pytest.fixture(scope="module")
def assets(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("export_faults")
    return make_tiny_llama_dir(root / "model", seed=4), write_chat_jsonl(root / "chat.jsonl", 32, seed=9)


def _error_lines(text: str) -> list[str]:
    """The ``hf_fsdp2 error`` line and the lines of the same message after it (up to the launcher's report)."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("hf_fsdp2 error:"))
    end = next(
        (
            i
            for i in range(start + 1, len(lines))
            if lines[i].startswith(("E1", "W1", "I1", "Traceback", "["))
        ),
        len(lines),
    )
    return lines[start:end]


def test_a_full_disk_during_the_export_is_named_in_one_line(assets, tmp_path: Path) -> None:
    model, data = assets
    disk = tmp_path / "disk"
    disk.mkdir()
    # ~4.3 MiB a checkpoint (343k fp32 parameters + 2 AdamW moments, measured 4.49 MB) and ~0.2 MiB the tokenizer and
    # run files, ~0.7 MiB the bf16 export: the checkpoint of step 2 fits, then the export's parts fill the disk.
    if subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=4800k", "tmpfs", str(disk)], capture_output=True
    ).returncode:
        pytest.skip("cannot mount a small tmpfs here (needs root)")
    try:
        out = disk / "run"
        proc = sft_2ranks(
            write_recipe(tmp_path / "r.yaml", model, data, out, max_steps=2, save_steps=2), check=False
        )
        assert proc.returncode != 0 and 2 in proc.rank_codes, proc.stderr[-3000:]
        error, rescue = _error_lines(proc.stderr)
        assert error.startswith("hf_fsdp2 error: disk full during the export (ENOSPC"), error
        assert "CheckpointException" not in proc.stderr and "Traceback" not in proc.stderr, proc.stderr[
            -3000:
        ]
        assert re.search(
            rf"the staging folder {re.escape(str(out / '.export-incomplete'))} held [\d.]+ [KM]iB when it filled",
            error,
        ), error
        assert re.search(r"[\d.]+ [KM]iB free now", error) and "the export needs about" in error
        assert rescue == (
            f"The trained weights are safe in {out / 'checkpoint-2'} (a sharded checkpoint). Export them offline "
            f"with: hf-fsdp2 export {out / 'checkpoint-2'} OUT_DIR"
        )
        assert not (out / ".export-incomplete").exists() and not (out / "model.safetensors").exists()
    finally:
        subprocess.run(["umount", str(disk)], check=False)


def _parent(pid: int) -> int:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return 0


def _verifier_started(launcher: int) -> bool:
    """A verification's reload interpreter (its request file is in a ``hf_fsdp2-verify-`` folder) runs under
    ``launcher`` (not another test's, on a shared machine)."""
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            if b"hf_fsdp2-verify-" not in cmdline.read_bytes():
                continue
        except OSError:
            continue
        pid = int(cmdline.parent.name)
        while pid > 1:
            pid = _parent(pid)
            if pid == launcher:
                return True
    return False


def test_sigterm_to_the_launcher_while_the_export_is_verified_says_it_was_stopped(
    assets, tmp_path: Path
) -> None:
    """torchrun itself (its SIGTERM reaches each rank's process group, the verifier included), not a served run."""
    model, data = assets
    out = tmp_path / "run"
    recipe = write_recipe(
        tmp_path / "r.yaml", model, data, out, max_steps=2, save_steps=2, export_verify=True
    )
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        "2",
        "--master_addr",
        "127.0.0.1",
        "--master_port",
        str(free_port()),
        str(SFT),
        "--config",
        str(recipe),
    ]
    proc = subprocess.Popen(
        cmd, cwd=REPO, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        deadline = time.time() + 300
        while not _verifier_started(proc.pid) and proc.poll() is None and time.time() < deadline:
            time.sleep(0.05)
        assert _verifier_started(proc.pid), "the verification never started"
        proc.send_signal(signal.SIGTERM)  # the launcher, as a scheduler's preemption does
        output, _ = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            proc.kill()
    error, rescue = _error_lines(output)
    assert error.startswith(
        "hf_fsdp2 error: the export was stopped by a signal: SIGTERM ended its verification"
    ), output[-3000:]
    assert f"Nothing was published: {out} is as it was" in error
    assert (
        "does not reproduce the model" not in output
        and "from_pretrained in a fresh process failed" not in output
    )
    assert rescue.startswith(f"The trained weights are safe in {out / 'checkpoint-2'}")
    assert f"hf-fsdp2 export {out / 'checkpoint-2'} OUT_DIR" in rescue
    assert not (out / "model.safetensors").exists()
