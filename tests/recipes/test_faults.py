"""Fault injection, end to end on 2 gloo ranks (unit checks where one process shows the same): a run is never
lost or poisoned, and never ends "verified" with a broken model.

* overwrite_output_dir with save_total_limit over an older run's folder: the older run's checkpoints are removed
  first, retention keeps the new run's own checkpoint, and ``latest`` resumes the new run;
* a full disk (a small tmpfs): refused at the start when one checkpoint cannot fit; a save that runs out of
  space is named as such, with the path, the bytes needed and what truthfully exists;
* a read-only output_dir: one error line, exit status 2 on every rank;
* divergence (``learning_rate 1e9``): ``on_nonfinite: stop`` stops at the first NaN step on every rank, writes no
  checkpoint of that state, names the step and the last good checkpoint, exit status 2; ``skip_step`` skips the
  update (weights and optimizer state unchanged), counts and logs it, and finishes;
* collapse (``learning_rate 1e6``: gradient norm exactly 0 for 3 steps while there are target tokens): decided as
  divergence, ``on_collapse: stop`` (no export, exit status 2, the last good checkpoint named) or ``warn`` (once,
  and the run goes on); metrics.jsonl, summary.json and the model card record it either way;
* damaged checkpoint bytes (4 KB overwritten inside a ``.distcp``, same size): the manifest's digests catch it,
  the offline export refuses naming the file, ``resume_from_checkpoint latest`` falls back to the previous good
  checkpoint naming the damaged file, an explicit resume of it is refused;
* non-finite weights, whatever their source: the export (full model and LoRA adapter) refuses them, naming the
  tensor;
* the non-finite watch costs no host read of its own (the same reads per step with and without it).
"""

from __future__ import annotations

import json
import math
import re
import subprocess
from pathlib import Path

import pytest
import torch
from support.launch import SFT
from support.runs import copy_run, finished_run, sft_2ranks, shared_assets, write_recipe
from support.tiny import make_tiny_llama_dir

from hf_fsdp2.checkpoint.layout import CheckpointError
from hf_fsdp2.checkpoint.manifest import MANIFEST_FILE
from hf_fsdp2.checkpoint.resume import checkpoint_problems, resolve_resume
from hf_fsdp2.export.errors import ExportError
from hf_fsdp2.observe.logs import read_metrics


@pytest.fixture(scope="module")
def assets(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return shared_assets(tmp_path_factory)


@pytest.fixture(scope="module")
def finished(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A finished 4-step run with checkpoint-2 and checkpoint-4 (shared with test_edges.py on this worker)."""
    return finished_run(tmp_path_factory)


_recipe, _sft = write_recipe, sft_2ranks


def _one_error(proc: subprocess.CompletedProcess[str]) -> str:
    """Exactly one ``hf_fsdp2 error`` line, no traceback from any rank."""
    assert proc.returncode != 0
    lines = [line for line in proc.stderr.splitlines() if line.startswith("hf_fsdp2 error:")]
    assert len(lines) == 1, proc.stderr[-3000:]
    # torchrun reports a failed child with its own traceback (ChildFailedError): only a rank's frames count.
    frames = [line for line in proc.stderr.splitlines() if line.strip().startswith('File "')]
    assert not [f for f in frames if "hf_fsdp2" in f or "recipes" in f], proc.stderr[-3000:]
    assert not [line for line in proc.stderr.splitlines() if line.startswith("[rank")], proc.stderr[-3000:]
    return lines[0]


def _steps(out: Path) -> list[int]:
    return sorted(int(p.name.split("-")[1]) for p in out.glob("checkpoint-*"))


def _damage(file: Path, offset: int = 64, size: int = 4096) -> None:
    """Overwrite ``size`` bytes inside ``file`` (its size unchanged: DCP's own checks see nothing)."""
    length = file.stat().st_size
    offset = min(offset, max(length - size, 0))
    with open(file, "r+b") as f:
        f.seek(offset)
        f.write(b"\x7f" * min(size, length - offset))


# ---------------------------------------------------------------------------------------------------
# Divergence and collapse
# ---------------------------------------------------------------------------------------------------


def test_divergence_stops_at_the_nan_step_without_a_poisoned_checkpoint(assets, tmp_path: Path) -> None:
    model, data = assets
    out = tmp_path / "run"
    recipe = _recipe(tmp_path / "r.yaml", model, data, out, learning_rate=1e9, save_steps=1, max_steps=6)
    proc = _sft(recipe, check=False)
    error = _one_error(proc)
    assert 2 in _rank_codes(proc), proc.stderr[-2000:]  # the rank that reported it exited with status 2
    bad = int(error.split("step ", 1)[1].split(":", 1)[0])
    assert (
        1 <= bad <= 6
        and "not finite (NaN or inf)" in error
        and "no checkpoint of that state was written" in error
    )
    # Every checkpoint is of a step before the NaN one, and the message names the newest.
    assert _steps(out) == list(range(1, bad)), (_steps(out), error)
    if bad > 1:
        assert f"The last good checkpoint is {out / f'checkpoint-{bad - 1}'}" in error
        last = out / f"checkpoint-{bad - 1}"
        assert checkpoint_problems(last) == [] and (last / MANIFEST_FILE).is_file()
        from hf_fsdp2.export.offline import load_checkpoint_model

        weights, _, _ = load_checkpoint_model(last)
        assert all(torch.isfinite(p).all() for p in weights.parameters())
    else:
        assert "No checkpoint was saved before it" in error
    assert not (out / "model.safetensors").exists()  # never exported
    logged = read_metrics(out / "metrics.jsonl") if (out / "metrics.jsonl").exists() else []
    assert all(r["step"] <= bad for r in logged)


def test_skip_step_skips_the_update_and_finishes(assets, tmp_path: Path) -> None:
    model, data = assets
    out = tmp_path / "run"
    recipe = _recipe(
        tmp_path / "r.yaml",
        model,
        data,
        out,
        learning_rate=1e9,
        on_nonfinite="skip_step",
        save_steps=0,
        max_steps=4,
        export_verify=False,
    )
    proc = _sft(recipe)
    skipped = [line for line in proc.stderr.splitlines() if "its optimizer update was skipped" in line]
    assert skipped, proc.stderr[-3000:]
    assert "step(s) skipped so far" in skipped[-1]
    # The weights exported are finite: no NaN update was ever applied.
    from safetensors.torch import load_file

    tensors = load_file(str(out / "model.safetensors"))
    assert all(torch.isfinite(t.float()).all() for t in tensors.values())


def _collapse_start(out: Path) -> int:
    """The first step of the first 3 steps in a row whose gradient norm is exactly 0 (the fault itself)."""
    norms = [r["grad_norm"] for r in read_metrics(out / "metrics.jsonl") if "event" not in r]
    starts = [i + 1 for i in range(len(norms) - 2) if norms[i] == norms[i + 1] == norms[i + 2] == 0]
    assert starts, norms  # the model collapsed
    return starts[0]


def test_collapse_stops_naming_the_last_good_checkpoint(assets, tmp_path: Path) -> None:
    """on_collapse: stop (the default): at the third zero-gradient step every rank stops alike (exit status 2, one
    line), nothing is exported, the checkpoints of the collapsed state are named apart from the last good one, and
    metrics.jsonl and summary.json say why the run stopped."""
    model, data = assets
    out = tmp_path / "run"
    recipe = _recipe(tmp_path / "r.yaml", model, data, out, learning_rate=1e6, save_steps=1, max_steps=6)
    proc = _sft(recipe, check=False)
    error = _one_error(proc)
    assert 2 in _rank_codes(proc), proc.stderr[-2000:]
    first = _collapse_start(out)
    last = first + 2
    assert (
        f"COLLAPSE: the gradient norm has been exactly 0 for 3 steps in a row (steps {first}..{last})"
        in error
        and f"the run stopped at step {last} and exports nothing" in error
        and "Lower learning_rate" in error
        and "on_collapse: warn" in error
    ), error
    assert proc.stderr.count("COLLAPSE") == 1, proc.stderr[-3000:]  # said once, by rank 0
    # The save of step `last` read the flags first: checkpoints up to last - 1; the weights after step first - 1
    # already gave a zero gradient, so the good ones end at first - 2.
    assert _steps(out) == list(range(1, last)), _steps(out)
    good = [s for s in _steps(out) if s <= first - 2]
    spoiled = ", ".join(f"checkpoint-{s}" for s in _steps(out) if s > first - 2)
    assert f"({spoiled} hold the state it stopped on)" in error, error
    if good:
        assert f"The last good checkpoint is {out / f'checkpoint-{good[-1]}'}" in error, error
    else:
        assert "No checkpoint was saved before the collapse" in error, error
    assert not (out / "model.safetensors").exists() and not (out / "README.md").exists()
    events = [r for r in read_metrics(out / "metrics.jsonl") if "event" in r]
    assert [(e["event"], e["action"], e["first_step"], e["step"]) for e in events] == [
        ("collapse", "stopped", first, last)
    ]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["stopped"] == "collapse" and summary["export_dir"] is None, summary
    assert summary["learned_nothing"] == events


def test_collapse_with_on_collapse_warn_goes_on_and_marks_the_run(assets, tmp_path: Path) -> None:
    """on_collapse: warn: one warning (rank 0), the run finishes and exports, and metrics.jsonl, summary.json and
    the model card record the collapse."""
    model, data = assets
    out = tmp_path / "run"
    recipe = _recipe(
        tmp_path / "r.yaml",
        model,
        data,
        out,
        learning_rate=1e6,
        save_steps=0,
        max_steps=5,
        on_collapse="warn",
    )
    proc = _sft(recipe)
    first = _collapse_start(out)
    assert proc.stderr.count("COLLAPSE: the gradient norm has been exactly 0") == 1, proc.stderr[-3000:]
    assert "on_collapse is warn: the run goes on" in proc.stderr
    events = [r for r in read_metrics(out / "metrics.jsonl") if "event" in r]
    assert [(e["event"], e["action"], e["first_step"]) for e in events] == [("collapse", "warned", first)]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["learned_nothing"] == events and summary["export_dir"] == str(out), summary
    assert "summary: LEARNED NOTHING at steps" in proc.stderr
    card = (out / "README.md").read_text()
    assert "## Warning: this run learned nothing" in card and events[0]["message"] in card
    assert "| loss |" in card  # the final metrics are the last step's record, not the event
    assert (out / "model.safetensors").is_file()


def _tiny_model(tmp_path: Path) -> tuple[torch.nn.Module, Path]:
    from hf_fsdp2.model import load_model

    path = make_tiny_llama_dir(tmp_path / "model", seed=3)
    return load_model(str(path)), path


def test_skip_step_leaves_weights_and_optimizer_state_unchanged(tmp_path: Path) -> None:
    from hf_fsdp2.train.loss import LossPlan
    from hf_fsdp2.train.nonfinite import NonFiniteGuard, attach
    from hf_fsdp2.train.step import StepSettings, train_step

    model, _ = _tiny_model(tmp_path)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)  # as build_adamw on CPU and CUDA
    guard = attach(optimizer, NonFiniteGuard("skip_step"))
    ids = torch.randint(3, 100, (2, 12), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}
    settings = StepSettings(LossPlan())
    train_step(model, optimizer, None, [batch], settings, torch.device("cpu"))
    with torch.no_grad():  # a finite weight whose logits overflow: the next gradient is NaN
        model.get_input_embeddings().weight[ids[0, 0]] = 3e38
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    moments = [{k: v.clone() for k, v in s.items()} for s in optimizer.state.values()]
    out = train_step(model, optimizer, None, [batch], settings, torch.device("cpu"))
    assert not math.isfinite(float(out.grad_norm))
    assert all(torch.equal(weights[k], v) for k, v in model.state_dict().items())
    assert all(
        torch.equal(m[k], v)
        for m, s in zip(moments, optimizer.state.values(), strict=True)
        for k, v in s.items()
    )
    guard.settle_now()
    assert guard.skipped == [2]


def test_stop_raises_naming_the_step_on_the_next_step(tmp_path: Path) -> None:
    from hf_fsdp2.train.loss import LossPlan
    from hf_fsdp2.train.nonfinite import NonFiniteError, NonFiniteGuard, attach
    from hf_fsdp2.train.step import StepSettings, train_step

    model, _ = _tiny_model(tmp_path)
    optimizer = torch.optim.SGD(
        model.parameters(), lr=0.1
    )  # not fused: the update is not masked, never saved
    attach(optimizer, NonFiniteGuard("stop", last_step=6, last_good=lambda: "CKPT. "))
    ids = torch.randint(3, 100, (2, 12), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}
    with torch.no_grad():
        model.get_input_embeddings().weight[ids[0, 0]] = float("nan")
    train_step(model, optimizer, None, [batch], StepSettings(LossPlan()), torch.device("cpu"))  # step 7
    with pytest.raises(
        NonFiniteError,
        match=r"step 7: the loss \(on 1 rank\(s\)\) and the gradient norm are not finite .* CKPT\.",
    ):
        train_step(model, optimizer, None, [batch], StepSettings(LossPlan()), torch.device("cpu"))


@pytest.mark.parametrize("mode", ["stop", "skip_step"])
def test_a_dpo_step_is_watched_as_the_sft_step(tmp_path: Path, mode: str) -> None:
    """The DPO objective's step reports to the same guard: a diverged step stops the run at the next step's read
    (stop), or its update is skipped on the device, weights unchanged (skip_step, fused AdamW)."""
    from hf_fsdp2.data.pairs import PreferenceCollator
    from hf_fsdp2.methods.dpo.step import DPOLoss, DPOSettings
    from hf_fsdp2.train.logps import FrozenModel
    from hf_fsdp2.train.loss import LossPlan
    from hf_fsdp2.train.nonfinite import NonFiniteError, NonFiniteGuard, attach
    from hf_fsdp2.train.step import StepSettings, train_step

    model, _ = _tiny_model(tmp_path)
    reference, _ = _tiny_model(tmp_path / "ref")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    guard = attach(optimizer, NonFiniteGuard(mode, last_step=3, last_good=lambda: "CKPT. "))
    pairs = [
        {"prompt_ids": [5, 6, 7], "chosen_ids": [8, 9, 10, 11], "rejected_ids": [12, 13], "index": 0},
        {"prompt_ids": [14, 15], "chosen_ids": [16], "rejected_ids": [17, 18, 19], "index": 1},
    ]
    batch = PreferenceCollator(pad_token_id=0, max_length=16)(pairs)
    settings, cpu = DPOSettings(), torch.device("cpu")

    def step():  # type: ignore[no-untyped-def]
        frozen = FrozenModel(reference, LossPlan())
        loss = DPOLoss(frozen, settings, LossPlan(), cpu)
        return train_step(model, optimizer, None, [batch], StepSettings(LossPlan()), cpu, loss)

    step()  # step 4: finite
    with torch.no_grad():
        model.get_input_embeddings().weight[5] = float(
            "nan"
        )  # every row's prompt: the loss and gradient are NaN
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    out = step()  # step 5: diverged; fused AdamW's found_inf leaves the weights as they were
    assert not math.isfinite(float(out.grad_norm))
    assert all(
        torch.equal(weights[k], v) or k.endswith("embed_tokens.weight") for k, v in model.state_dict().items()
    )
    if mode == "stop":
        with pytest.raises(NonFiniteError, match=r"step 5: the loss .* not finite .* CKPT\."):
            step()
    else:
        guard.settle_now()
        assert guard.skipped == [5]


def test_the_watch_adds_no_host_read_to_a_step(tmp_path: Path) -> None:
    """The same host reads per step with and without the watch (the flags ride on the token-count read)."""
    from support.devices import DEVICE, FakeAccelerator

    from hf_fsdp2.train.loss import LossPlan
    from hf_fsdp2.train.nonfinite import NonFiniteGuard, attach
    from hf_fsdp2.train.step import StepSettings, train_step

    model, _ = _tiny_model(tmp_path)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    ids = torch.randint(3, 100, (2, 12), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}
    mode = FakeAccelerator()
    mode.put_module(model)
    reads: dict[bool, list[list[tuple[str, str]]]] = {False: [], True: []}
    with mode:
        for watched in (False, True):
            if watched:
                guard = attach(optimizer, NonFiniteGuard("stop"))
            for _ in range(3):
                before = len(mode.host_reads)
                train_step(model, optimizer, None, [batch], StepSettings(LossPlan()), DEVICE)
                reads[watched].append(
                    [w for w in mode.host_reads[before:] if w[1].split("/")[0] in ("train", "run")]
                )
    assert reads[True] == reads[False], reads
    assert [what for what, where in reads[True][1] if "read_step_counts" in where] == ["tolist()"], reads
    assert guard.pending is not None and guard.step == 3  # each step's flags recorded, read with the next


# ---------------------------------------------------------------------------------------------------
# Non-finite weights in an export
# ---------------------------------------------------------------------------------------------------


def test_the_export_refuses_non_finite_weights_naming_the_tensor(tmp_path: Path) -> None:
    from hf_fsdp2.export import export_model
    from hf_fsdp2.model import load_tokenizer

    model, path = _tiny_model(tmp_path)
    key = "model.layers.1.mlp.up_proj.weight"
    with torch.no_grad():
        model.get_submodule("model.layers.1.mlp.up_proj").weight[0, 0] = float("inf")
    with pytest.raises(ExportError, match=rf"refusing to export the model: non-finite values .* in {key}"):
        export_model(
            model,
            tmp_path / "out",
            config=model.config,
            tokenizer=load_tokenizer(str(path)),
            generation_config=None,
            dtype="bfloat16",
            max_shard_bytes=10**9,
            verify=True,
        )
    assert not (tmp_path / "out" / "model.safetensors").exists()


def test_the_lora_export_refuses_a_non_finite_adapter(tmp_path: Path) -> None:
    from hf_fsdp2.config.plans import LoraSettings
    from hf_fsdp2.lora.adapter import apply_lora
    from hf_fsdp2.lora.save import export_lora
    from hf_fsdp2.model import load_tokenizer

    model, path = _tiny_model(tmp_path)
    model = apply_lora(model, LoraSettings(r=4, alpha=8, dropout=0.0), seed=0)
    name = next(n for n, _ in model.named_parameters() if "lora_B" in n)
    with torch.no_grad():
        model.get_parameter(name).fill_(float("nan"))
    with pytest.raises(ExportError, match=r"refusing to export the LoRA adapter: non-finite values .*lora_B"):
        export_lora(
            model,
            tmp_path / "run",
            base_model=str(path),
            tokenizer=load_tokenizer(str(path)),
            merge=False,
            layer_cls_names=("LlamaDecoderLayer",),
            mp_policy=None,
            dtype="bfloat16",
            max_shard_bytes=10**9,
            compute_dtype=torch.float32,
            is_main_process=True,
        )


# ---------------------------------------------------------------------------------------------------
# Damaged checkpoint bytes
# ---------------------------------------------------------------------------------------------------


def test_damaged_bytes_are_refused_by_the_export_and_skipped_by_resume(
    assets, finished: Path, tmp_path: Path
) -> None:
    from hf_fsdp2.export.offline import export_checkpoint

    model, data = assets
    out = copy_run(finished, tmp_path / "run")  # a finished run of this recipe: checkpoint-2 and checkpoint-4
    recipe = _recipe(tmp_path / "r.yaml", model, data, out, save_steps=2, max_steps=4)
    manifest = json.loads((out / "checkpoint-4" / MANIFEST_FILE).read_text())
    shards = sorted((out / "checkpoint-4").glob("*.distcp"))
    assert len(shards) == 2 and {s.name for s in shards} <= set(manifest["files"])
    assert {".metadata", "trainer_state.json", "rng/rank0.pt", "rng/rank1.pt"} <= set(manifest["files"])
    assert checkpoint_problems(out / "checkpoint-4") == []
    shard = shards[0]
    _damage(shard)
    # The offline export refuses, naming the file.
    with pytest.raises(
        ExportError, match=rf"checkpoint-4 is damaged: {shard.name} is damaged: its \w+ digest"
    ):
        export_checkpoint(out / "checkpoint-4", tmp_path / "export")
    # An explicit resume of it is refused; latest falls back to checkpoint-2, naming the damaged file.
    with pytest.raises(CheckpointError, match=rf"{shard.name} is damaged"):
        resolve_resume(out, str(out / "checkpoint-4"))
    proc = _sft(recipe, "--resume_from_checkpoint", "latest", "--max_steps", "6")
    assert f"skipping {out / 'checkpoint-4'}, which is damaged ({shard.name} is damaged" in proc.stderr, (
        proc.stderr[-3000:]
    )
    assert "resumed from" in proc.stderr and "checkpoint-2 at step 2" in proc.stderr
    assert (out / "checkpoint-6" / MANIFEST_FILE).is_file()


# ---------------------------------------------------------------------------------------------------
# Overwrite with retention
# ---------------------------------------------------------------------------------------------------


def _run_id(checkpoint: Path) -> str:
    return str(json.loads((checkpoint / "trainer_state.json").read_text())["run_id"])


def test_overwrite_with_retention_never_keeps_or_resumes_the_older_run(
    assets, finished: Path, tmp_path: Path
) -> None:
    model, shared = assets
    data = tmp_path / "data.jsonl"
    data.write_text(shared.read_text())
    # The older run: 4 steps, checkpoint-2 and checkpoint-4 ('latest' 4, past the new run's 3 steps).
    out = copy_run(finished, tmp_path / "run")
    old_id = _run_id(out / "checkpoint-4")
    new = _recipe(
        tmp_path / "new.yaml",
        model,
        data,
        out,
        max_steps=3,
        save_steps=3,
        save_total_limit=1,
        seed=7,
        overwrite_output_dir=True,
    )
    proc = _sft(new)
    log = proc.stdout + proc.stderr
    assert "removed the previous run's checkpoints" in log and "checkpoint-4" in log
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-3"]
    assert (out / "latest").read_text().strip() == "3"
    assert _run_id(out / "checkpoint-3") not in ("", old_id)
    # The data file changed in place before the resume: named in a warning.
    data.write_text(data.read_text() + data.read_text().splitlines()[0] + "\n")
    proc = _sft(
        new, "--resume_from_checkpoint", "latest", "--max_steps", "4", "--overwrite_output_dir", "false"
    )
    log = proc.stdout + proc.stderr
    assert "resumed from" in log and "checkpoint-3 at step 3" in log
    assert "data files changed since it was written" in log and f"{data} changed (" in log
    # The checkpoint resumed from is kept; the resumed run keeps its identity.
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-3", "checkpoint-4"]
    assert _run_id(out / "checkpoint-4") == _run_id(out / "checkpoint-3")


# ---------------------------------------------------------------------------------------------------
# Full disk, read-only output, clean exit on every rank, SIGTERM during the export
# ---------------------------------------------------------------------------------------------------


def _mount_tmpfs(path: Path, options: str) -> None:
    path.mkdir(parents=True, exist_ok=True)
    if subprocess.run(
        ["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)], capture_output=True
    ).returncode:
        pytest.skip("cannot mount a small tmpfs here (needs root)")


def _rank_codes(proc: subprocess.CompletedProcess[str]) -> set[int]:
    """The ranks' exit statuses: a served run's own (tests/support/launch_server.py waits for each rank, as
    torchrun's agent does), or torchrun's report of them for a run of torchrun itself."""
    if hasattr(proc, "rank_codes"):
        return set(proc.rank_codes)
    return {int(c) for c in re.findall(r"^\s*exitcode\s*:\s*(-?\d+)", proc.stderr, flags=re.MULTILINE)}


def _clean_exit_2(proc: subprocess.CompletedProcess[str]) -> None:
    """No rank aborted: a rank exits with status 2, the root cause. A rank the launcher itself ended with
    SIGTERM (-15), because a sibling's status 2 reached it first, is the launcher's doing, not an abort."""
    text = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert "SIGABRT" not in text and "Signal 6" not in text, text[-3000:]
    codes = _rank_codes(proc)
    assert 2 in codes and codes <= {2, -15}, (codes, text[-3000:])


def test_a_full_disk_is_refused_at_the_start_or_named_when_a_save_runs_out(assets, tmp_path: Path) -> None:
    model, data = assets
    # ~4.3 MiB a checkpoint (343k fp32 parameters + 2 AdamW moments, measured 4.49 MB): the tiny disk holds none, the
    # small one a first but not a second.
    tiny, small = tmp_path / "tiny", tmp_path / "small"
    _mount_tmpfs(tiny, "size=2M")
    _mount_tmpfs(small, "size=7M")
    try:
        proc = _sft(
            _recipe(tmp_path / "a.yaml", model, data, tiny / "run", save_steps=2),
            check=False,
        )
        error = _one_error(proc)
        assert (
            "not enough disk space" in error and "one checkpoint needs about" in error and "MiB free" in error
        )
        _clean_exit_2(proc)
        out = small / "run"
        proc = _sft(_recipe(tmp_path / "b.yaml", model, data, out, save_steps=2), check=False)
        text = proc.stdout + proc.stderr
        assert "the run plans about" in text and "2 checkpoint(s)" in text  # the start-of-run warning
        error = _one_error(proc)
        assert "saving checkpoint-4" in error and "ENOSPC" in error and f"the disk of {out} is full" in error
        assert (
            "a checkpoint needs about" in error
            and "the previous checkpoint checkpoint-2 and 'latest' are kept" in error
        )
        assert (out / "latest").read_text().strip() == "2" and not (out / ".tmp-checkpoint-4").exists()
    finally:
        for mount in (tiny, small):
            subprocess.run(["umount", str(mount)], check=False)


def test_a_read_only_output_dir_is_one_error_and_status_2_on_every_rank(assets, tmp_path: Path) -> None:
    model, data = assets
    ro = tmp_path / "ro"
    _mount_tmpfs(ro, "ro,size=1m")
    try:
        proc = _sft(_recipe(tmp_path / "r.yaml", model, data, ro / "run"), check=False)
        error = _one_error(proc)
        assert f"output_dir='{ro / 'run'}' cannot be written" in error and "read-only file system" in error
        _clean_exit_2(proc)
    finally:
        subprocess.run(["umount", str(ro)], check=False)


def test_sigterm_to_the_launcher_during_the_export_finishes_it_and_says_so(assets, tmp_path: Path) -> None:
    import signal
    import sys
    import time

    from support.launch import REPO, _env, free_port

    model, data = assets
    out = tmp_path / "run"
    # Its message says "verified"; no checkpoint (its end-of-run one: nothing resumes it, and the message names none).
    recipe = _recipe(tmp_path / "r.yaml", model, data, out, export_verify=True, save_steps=0)
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
        while not (out / ".export-incomplete").exists() and proc.poll() is None and time.time() < deadline:
            time.sleep(0.005)
        assert (out / ".export-incomplete").exists() or (out / "model.safetensors").exists()
        proc.send_signal(signal.SIGTERM)  # the launcher, as a scheduler's preemption does
        output, _ = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert "SIGTERM during the export: the export of step 4 finished and was verified" in output, output[
        -3000:
    ]
    assert (out / "model.safetensors").is_file() and not (out / ".export-incomplete").exists()
    assert not [line for line in output.splitlines() if line.startswith("[rank")], output[-3000:]
