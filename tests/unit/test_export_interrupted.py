"""A stop signal that ends the export's verifier is a stop, not a bad model.

A launcher's SIGTERM reaches the rank's whole process group (torch elastic ends each worker with ``killpg``), so
the reload interpreter of the verification dies with the rank still running. Its negative exit status is read as
the signal it is: the export raises :class:`ExportInterrupted` ("stopped by a signal ... nothing was published"),
never "the export does not reproduce the model: from_pretrained in a fresh process failed". A SIGKILL (the OOM
killer's) stays a failure of the reload (tests/unit/test_reload_process.py).
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Any

import pytest
from support.tiny import make_tiny_llama_dir

from hf_fsdp2.export import reload_process
from hf_fsdp2.export.errors import ExportInterrupted, ExportVerificationError
from hf_fsdp2.export.reload_process import ReloadInterrupted, run_reload, shared_reload_process


@pytest.fixture
def terminated(tmp_path: Path) -> dict[str, str]:
    """An environment whose interpreters SIGTERM themselves as they start (a ``sitecustomize`` on PYTHONPATH), as a
    launcher's SIGTERM to the process group ends a reload midway: whatever script the reload runs."""
    folder = tmp_path / "sigterm"
    folder.mkdir()
    (folder / "sitecustomize.py").write_text("import os, signal\nos.kill(os.getpid(), signal.SIGTERM)\n")
    return dict(os.environ, PYTHONPATH=str(folder))


@pytest.mark.parametrize("shared", [False, True], ids=["own interpreter", "shared interpreter"])
def test_a_reload_ended_by_sigterm_raises_reload_interrupted(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, terminated: dict[str, str], shared: bool
) -> None:
    monkeypatch.setattr(reload_process, "_shared", None)  # conftest's session block: start from none
    (tmp_path / "script.py").write_text("print('never reached')\n")
    script: Any = str(tmp_path / "script.py")  # a file's path: the reload never gets to run it
    block = shared_reload_process() if shared else contextlib.nullcontext()
    with block, pytest.raises(ReloadInterrupted, match="killed by SIGTERM") as err:
        run_reload(script, tmp_path / "r.pt", tmp_path / "o.pt", terminated)
    assert err.value.signal_name == "SIGTERM"


def test_the_export_says_it_was_stopped_and_publishes_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, terminated: dict[str, str]
) -> None:
    from hf_fsdp2.export import export_model
    from hf_fsdp2.model import load_model, load_tokenizer

    # A reload in its own interpreter, as a run's: the suite's session-wide shared reload interpreter (conftest) was
    # started without the SIGTERM environment and would answer instead.
    monkeypatch.setattr(reload_process, "_shared", None)
    real = reload_process.run_reload
    monkeypatch.setattr(
        reload_process, "run_reload", lambda script, req, out, env: real(script, req, out, terminated)
    )
    path = make_tiny_llama_dir(tmp_path / "model", seed=3)
    model, out = load_model(str(path)), tmp_path / "out"
    with pytest.raises(ExportInterrupted) as err:
        export_model(
            model,
            out,
            config=model.config,
            tokenizer=load_tokenizer(str(path)),
            generation_config=None,
            dtype="bfloat16",
            max_shard_bytes=10**9,
            verify=True,
        )
    message = str(err.value)
    assert not isinstance(err.value, ExportVerificationError)
    assert "the export was stopped by a signal: SIGTERM ended its verification" in message, message
    assert f"Nothing was published: {out} is as it was" in message
    assert (
        "does not reproduce the model" not in message
        and "from_pretrained in a fresh process failed" not in message
    )
    assert not (out / "model.safetensors").exists()
