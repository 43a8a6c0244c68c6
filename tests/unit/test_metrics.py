"""Metrics on known inputs: FLOPs/MFU by hand for Llama-3-8B, tokens without padding, the meter, the
JSONL file, TensorBoard events read back, trackers' errors, plots, profiler traces, eval loss."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from hf_fsdp2.cli import main as cli_main
from hf_fsdp2.config import plans
from hf_fsdp2.config.plans import parse_report_to, parse_step_range
from hf_fsdp2.observe import logs
from hf_fsdp2.observe import meter as meter_module
from hf_fsdp2.observe.flops import (
    FlopsModel,
    flops_model,
    non_embedding_params,
    peak_flops_for,
    sequence_lengths,
)
from hf_fsdp2.observe.logs import MetricsWriter, format_log_line, read_metrics
from hf_fsdp2.observe.meter import StepMeter
from hf_fsdp2.observe.plot import plot_run
from hf_fsdp2.observe.profiling import StepProfiler, apply_distributed_debug
from hf_fsdp2.observe.summary import run_summary
from hf_fsdp2.observe.trackers import build_trackers, tracker_values

LLAMA3_8B = LlamaConfig(
    vocab_size=128256,
    hidden_size=4096,
    intermediate_size=14336,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=8,
    max_position_embeddings=8192,
    tie_word_embeddings=False,
)


def test_llama3_8b_flops_per_token_by_hand() -> None:
    with torch.device("meta"):
        model = LlamaForCausalLM(LLAMA3_8B)
    # By hand: per layer q,o 4096x4096, k,v 4096x1024, MLP 3 x 4096x14336, two RMSNorms of 4096.
    layer = 2 * 4096 * 4096 + 2 * 4096 * 1024 + 3 * 4096 * 14336 + 2 * 4096
    head = 128256 * 4096  # the output projection is a matmul: counted
    hand_n = 32 * layer + 4096 + head  # + final norm; the input embedding table is not counted
    assert hand_n == 7_504_924_672
    assert sum(p.numel() for p in model.parameters()) == hand_n + 128256 * 4096  # 8.03B in all
    assert non_embedding_params(model) == hand_n
    fm = flops_model(LLAMA3_8B, non_embedding_params(model))
    assert (fm.layers, fm.heads, fm.head_dim) == (32, 32, 128)
    hand_per_token = 6 * hand_n + 12 * 32 * 32 * 128 * 8192
    assert hand_per_token == 57_914_449_920
    assert fm.per_token(8192) == hand_per_token
    # torchtitan's published anchor: 5,762 tok/s per H100 at seq 8192 is 33.7% MFU.
    assert 5762 * fm.per_token(8192) / peak_flops_for("NVIDIA H100 80GB HBM3") == pytest.approx(
        0.337, abs=5e-4
    )
    # One sequence of s tokens costs s * per_token(s); two sequences are two such terms.
    assert fm.for_sequences([8192]) == 8192 * hand_per_token
    assert fm.for_sequences([100, 50]) == 100 * fm.per_token(100) + 50 * fm.per_token(50)


def test_tied_head_is_counted_once_as_the_head() -> None:
    config = LlamaConfig(
        vocab_size=100,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        tie_word_embeddings=True,
    )
    model = LlamaForCausalLM(config)
    assert non_embedding_params(model) == sum(p.numel() for p in model.parameters())


def test_sequence_lengths_exclude_padding() -> None:
    padded = {
        "input_ids": torch.tensor([[5, 6, 7, 0], [5, 6, 0, 0]]),
        "attention_mask": torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]]),
        "labels": torch.tensor([[-100, 6, 7, -100], [-100, 6, -100, -100]]),
    }
    assert sequence_lengths(padded, pad_token_id=0) == [3, 2]
    # Packed rows: sequences where positions restart; the trailing pad run (its own positions) is not one.
    packed = {
        "input_ids": torch.tensor([[5, 6, 7, 8, 9, 0, 0], [5, 6, 7, 8, 9, 10, 11]]),
        "position_ids": torch.tensor([[0, 1, 2, 0, 1, 0, 1], [0, 1, 2, 3, 0, 1, 2]]),
        "labels": torch.tensor([[-100, 6, 7, -100, 9, -100, -100], [-100, 6, 7, 8, -100, 10, 11]]),
    }
    assert sequence_lengths(packed, pad_token_id=0) == [3, 2, 4, 3]
    flat = {"input_ids": torch.tensor([[5, 6, 7, 8, 9]]), "position_ids": torch.tensor([[0, 1, 2, 0, 1]])}
    assert sequence_lengths(flat, pad_token_id=0) == [3, 2]


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_meter_tokens_per_second_excludes_padding(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = FakeClock()
    monkeypatch.setattr(meter_module.time, "perf_counter", clock)
    fm = FlopsModel(non_embedding_params=1000, layers=2, heads=4, head_dim=8)
    meter = StepMeter(
        flops=fm, world_size=1, device=torch.device("cpu"), total_steps=10, peak_flops=1e6, pad_token_id=0
    )
    batch = {  # 3 + 2 real tokens in a 2 x 6 padded batch: 7 pad tokens are not counted
        "input_ids": torch.tensor([[5, 6, 7, 0, 0, 0], [5, 6, 0, 0, 0, 0]]),
        "attention_mask": torch.tensor([[1, 1, 1, 0, 0, 0], [1, 1, 0, 0, 0, 0]]),
        "labels": torch.tensor([[-100, 6, 7, -100, -100, -100], [-100, 6, -100, -100, -100, -100]]),
    }

    def slow_batches():
        while True:
            clock.now += 0.5  # waiting for data
            yield batch

    batches = meter.wrap(slow_batches())
    for _ in range(2):  # two steps of one micro-batch, 2 s each
        meter.start_step()
        micro = [next(batches)]
        meter.count(micro)
        clock.now += 1.5
        meter.end_step(target_tokens=3, sync=True)
    record = meter.collect(step=2, loss_sum=torch.tensor(6.0))
    assert record["tokens"] == 10
    assert record["tokens_per_s"] == pytest.approx(10 / 4.0)
    assert record["target_tokens_per_s"] == pytest.approx(6 / 4.0)
    assert record["tokens_per_s_per_device"] == record["tokens_per_s"]
    assert record["step_time_s"] == pytest.approx(2.0)
    assert record["data_wait_s"] == pytest.approx(0.5)
    flops = 2 * fm.for_sequences([3, 2])
    assert record["tflops_per_device"] == pytest.approx(flops / 4.0 / 1e12)
    assert record["mfu"] == pytest.approx(flops / 4.0 / 1e6)
    assert record["loss_sum"] == 6.0
    assert record["eta_s"] == pytest.approx(8 * 2.0)
    assert record["host_rss_gib"] > 0 and record["host_peak_rss_gib"] >= record["host_rss_gib"]
    assert "mem_allocated_gib" not in record  # CPU: host memory only
    summary = run_summary(
        meter,
        first_step=1,
        last_step=2,
        wall_seconds=9.0,
        last_record={"loss": 2.0},
        last_eval={"eval_loss": 1.5, "eval_perplexity": math.exp(1.5)},
        export_dir="out",
    )
    assert summary["tokens"] == 10 and summary["target_tokens"] == 6 and summary["steps"] == 2
    assert summary["tokens_per_s"] == pytest.approx(2.5) and summary["mfu"] == pytest.approx(record["mfu"])
    assert summary["final_eval_loss"] == 1.5 and summary["export_dir"] == "out"
    line = format_log_line(
        {"step": 2, "loss": 2.0, "lr": 1e-4, "grad_norm": 1.0, "target_tokens": 3, **record}, 10
    )
    for part in ("step 2/10", "all tok/s 2.5", "mfu", "data_wait 0.500s", "eta 16s", "rss"):
        assert part in line


def test_metrics_jsonl_written_and_resumed(tmp_path: Path) -> None:
    writer = MetricsWriter(tmp_path, enabled=True)
    for step in (1, 2, 3):
        writer.write({"step": step, "loss": 1.0 / step, "bad": float("nan")})
    rows = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3] and rows[0]["bad"] == "nan"
    MetricsWriter(tmp_path, enabled=True, resume_step=2)
    assert [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl")] == [1, 2]
    MetricsWriter(tmp_path / "other", enabled=False).write({"step": 1})
    assert not (tmp_path / "other").exists()


def test_report_to_values() -> None:
    assert parse_report_to("none") == () and parse_report_to("") == ()
    assert parse_report_to("tensorboard, wandb") == ("tensorboard", "wandb")
    assert parse_report_to("all") == ("all",)
    for bad in ("mlflow", "none,tensorboard", "all,wandb"):
        with pytest.raises(ValueError, match="report_to"):
            parse_report_to(bad)


def test_missing_tracker_names_the_pip_install(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(plans, "tracker_installed", lambda name: name == "tensorboard")
    with pytest.raises(ValueError, match="pip install wandb trackio"):
        build_trackers("tensorboard,wandb,trackio", tmp_path, project="p", run_name="r")
    assert [t.name for t in build_trackers("all", tmp_path, project="p", run_name="r")] == ["tensorboard"]
    monkeypatch.setattr(plans, "tracker_installed", lambda name: False)
    with pytest.raises(ValueError, match="pip install tensorboard"):
        build_trackers("all", tmp_path, project="p", run_name="r")


def test_tensorboard_tracker_events_read_back(tmp_path: Path) -> None:
    pytest.importorskip("tensorboard")
    from accelerate import Accelerator
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    built = build_trackers("tensorboard", tmp_path / "tb", project="p", run_name="run")
    accelerator = Accelerator(cpu=True, log_with=built)
    accelerator.init_trackers("p", config={"learning_rate": 1e-3, "report_to": "tensorboard"})
    for step in (1, 2):
        accelerator.log(
            tracker_values({"step": step, "loss": 3.0 - step, "tokens_per_s": 10.0 * step}), step=step
        )
    accelerator.end_training()
    events = EventAccumulator(str(tmp_path / "tb" / "run"))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("loss")] == [(1, 2.0), (2, 1.0)]
    assert [e.value for e in events.Scalars("tokens_per_s")] == [10.0, 20.0]


def test_plot_command_writes_pngs(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("matplotlib")
    writer = MetricsWriter(tmp_path, enabled=True)
    for step in (1, 2, 3, 4):
        record = {
            "step": step,
            "loss": 2.0 / step,
            "lr": 1e-4 * step,
            "tokens_per_s": 100.0 + step,
            "target_tokens_per_s": 50.0,
            "host_peak_rss_gib": 1.0 + step / 10,
        }
        if step % 2 == 0:
            record["eval_loss"] = 2.5 / step
        writer.write(record)
    with (tmp_path / "metrics.jsonl").open("a") as fh:
        fh.write('{"step": 5, "lo')  # a running job is writing this line
    assert cli_main(["plot", str(tmp_path)]) == 0
    out = json.loads(capsys.readouterr().out)
    names = sorted(Path(p).name for p in out["plots"])
    assert names == ["loss.png", "lr.png", "memory.png", "throughput.png"]
    for name in names:
        assert (tmp_path / "plots" / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert plot_run(tmp_path, tmp_path / "elsewhere")[0].parent == tmp_path / "elsewhere"
    assert cli_main(["plot", str(tmp_path / "missing")]) == 2
    assert "metrics.jsonl" in capsys.readouterr().err


def test_step_ranges() -> None:
    assert parse_step_range("3-5", "profile_steps") == (3, 5)
    assert parse_step_range("4", "profile_steps") == (4, 4)
    assert parse_step_range(None, "profile_steps") is None
    for bad in ("5-3", "0-2", "a-b", "3-"):
        with pytest.raises(ValueError, match="profile_steps"):
            parse_step_range(bad, "profile_steps")


def test_profiler_writes_a_trace_on_cpu(tmp_path: Path) -> None:
    prof = StepProfiler(
        profile_steps=(2, 3),
        memory_steps=None,
        output_dir=tmp_path,
        rank=0,
        device=torch.device("cpu"),
        first_step=1,
        last_step=5,
    )
    x = torch.randn(32, 32)
    for step in range(1, 6):
        prof.start_step(step)
        with torch.profiler.record_function("my_step_work"):
            (x @ x).sum()
        prof.end_step(step)
    prof.close()
    traces = sorted((tmp_path / "profile").glob("rank0.*.pt.trace.json"))
    assert len(traces) == 1 and prof.files == traces
    events = json.loads(traces[0].read_text())["traceEvents"]
    names = {e.get("name") for e in events}
    assert "my_step_work" in names
    assert {"ProfilerStep#2", "ProfilerStep#3"} <= names  # the two active steps, not the warm-up


def test_memory_snapshot_needs_cuda(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="memory_snapshot_steps=2-3 needs a CUDA device"):
        StepProfiler(
            profile_steps=None,
            memory_steps=(2, 3),
            output_dir=tmp_path,
            rank=0,
            device=torch.device("cpu"),
            first_step=1,
            last_step=5,
        )


def test_distributed_debug_sets_env_without_overriding(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    # Set, then deleted: monkeypatch then restores each to unset at teardown, whatever the test sets (left set, they
    # would restart the worker's launch server at its next launch: TORCH_CPP_LOG_LEVEL is read at torch's load).
    for name in ("TORCH_DISTRIBUTED_DEBUG", "NCCL_DEBUG", "TORCH_CPP_LOG_LEVEL", "NCCL_DEBUG_SUBSYS"):
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)
    monkeypatch.setenv("NCCL_DEBUG", "WARN")
    try:
        shown = apply_distributed_debug("info", tmp_path)
        assert "TORCH_DISTRIBUTED_DEBUG=INFO" in shown and "NCCL_DEBUG=WARN" in shown
        import torch.distributed as dist

        assert dist.get_debug_level() == dist.DebugLevel.INFO
    finally:
        monkeypatch.delenv("TORCH_DISTRIBUTED_DEBUG", raising=False)
        import torch.distributed as dist

        dist.set_debug_level_from_env()
    before = dict(os.environ)
    assert "NCCL_DEBUG=WARN" in apply_distributed_debug("off", tmp_path)
    assert dict(os.environ) == before  # off sets nothing


REQUIRED = ["--model_name_or_path", "m", "--dataset_name", "d.jsonl", "--output_dir", "out"]


def test_observe_config_keys() -> None:
    from hf_fsdp2.config import parse_config

    cfg = parse_config(
        [
            *REQUIRED,
            "--report_to",
            "tensorboard",
            "--eval_split_fraction",
            "0.05",
            "--eval_steps",
            "10",
            "--eval_prompts",
            "hi",
            "there",
            "--profile_steps",
            "3-5",
            "--peak_flops",
            "989e12",
        ]
    )
    o = cfg.observe
    assert (o.report_to, o.eval_steps, o.eval_prompts, o.profile_steps, o.peak_flops) == (
        "tensorboard",
        10,
        ["hi", "there"],
        "3-5",
        989e12,
    )
    assert cfg.to_flat_dict()["report_to"] == "tensorboard"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--report_to", "mlflow"], "report_to='mlflow'"),
        (["--eval_steps", "5"], "eval_steps=5 but there is no eval set"),
        (["--eval_prompts", "hi"], "eval_prompts"),
        (["--eval_steps=-1", "--eval_split_fraction", "0.1"], "eval_steps=-1"),
        (["--profile_steps", "5-2"], "profile_steps='5-2'"),
        (["--memory_snapshot_steps", "x"], "memory_snapshot_steps='x'"),
        (["--peak_flops", "0"], "peak_flops=0"),
        (["--per_device_eval_batch_size", "0"], "per_device_eval_batch_size=0"),
    ],
)
def test_observe_config_errors(args: list[str], message: str) -> None:
    from hf_fsdp2.config import ConfigError, parse_config

    with pytest.raises(ConfigError) as err:
        parse_config([*REQUIRED, *args])
    assert message in str(err.value)


def test_progress_bar_when_interactive(
    capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture
) -> None:
    record = {
        "step": 1,
        "loss": 2.5,
        "lr": 1e-4,
        "grad_norm": 1.0,
        "target_tokens": 3,
        "target_tokens_per_s": 3.0,
        "step_time_s": 1.0,
        "tokens_per_s": 12.0,
        "tokens_per_s_per_device": 6.0,
        "eval_loss": 2.0,
    }
    bar = logs.Progress(4, 1, enabled=True, interactive=True)
    bar.step()
    bar.log(record)
    bar.close()
    err = capsys.readouterr().err
    assert "1/4" in err and "loss=2.5000" in err
    with caplog.at_level("INFO", logger="hf_fsdp2"):
        lines = logs.Progress(4, 1, enabled=True, interactive=False)
        lines.log(record)
        logs.Progress(4, 1, enabled=False, interactive=False).log(record)
    assert [r.getMessage() for r in caplog.records] == [format_log_line(record, 4)]  # one line, rank 0 only


@pytest.mark.parametrize("padding_free", [False, True])
def test_sequence_lengths_of_real_packed_batches(padding_free: bool) -> None:
    import datasets

    from hf_fsdp2.data.packing import PackedCollator, pack_examples

    lengths = [5, 9, 3, 7, 4, 6, 2, 8]
    examples = datasets.Dataset.from_dict(
        {
            "input_ids": [[7] * n for n in lengths],  # pad id 0 never appears in real tokens...
            "labels": [[-100] + [7] * (n - 1) for n in lengths],
            "length": lengths,
            "num_targets": [n - 1 for n in lengths],
        }
    )
    packed = pack_examples(examples, max_length=12)
    batch = PackedCollator(pad_token_id=0, padding_free=padding_free)([packed[i] for i in range(len(packed))])
    got = sequence_lengths(batch, pad_token_id=0)
    assert sorted(got) == sorted(lengths)  # ...so every real sequence is found and padding is not one
    assert sum(got) < batch["input_ids"].numel() or padding_free
