"""The export, LoRA merge, evaluation and DPO paths with the model on an accelerator, on a CPU-only machine.

On a GPU the model's shards live on the GPU while files, collators and reloads hand back CPU tensors; an op that
mixes the two raises there and passes unseen on CPU. Here the model is put on a fake ``cuda:0``
(:class:`support.devices.FakeAccelerator`: a torch function mode enforcing torch's cross-device rules on marked
CPU tensors), so each path meets exactly the device boundaries it meets on a GPU. docs/contributing.md ("How the
CPU tests see a GPU") says what the fake device does and what these tests cover.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from support.devices import DEVICE, CrossDeviceError, FakeAccelerator
from support.tiny import make_tiny_llama_dir

from hf_fsdp2.export import ExportVerificationError, export_model, make_plan, verify_export
from hf_fsdp2.export.files import WEIGHTS_NAME
from hf_fsdp2.export.verify import readback
from hf_fsdp2.model import load_model, load_tokenizer


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_llama_dir(tmp_path_factory.mktemp("device") / "model", seed=3)


def _on_device(model_dir: Path) -> tuple[torch.nn.Module, FakeAccelerator]:
    model = load_model(str(model_dir))
    mode = FakeAccelerator()
    mode.put_module(model)
    return model, mode


def _export(model: torch.nn.Module, model_dir: Path, out: Path, *, verify: bool, dtype: str = "bfloat16"):  # type: ignore[no-untyped-def]
    return export_model(
        model,
        out,
        config=model.config,
        tokenizer=load_tokenizer(str(model_dir)),
        generation_config=None,
        dtype=dtype,
        max_shard_bytes=10**9,
        verify=verify,
    )


def test_the_harness_raises_where_a_gpu_raises(model_dir: Path) -> None:
    model, mode = _on_device(model_dir)
    ids = torch.tensor([[1, 2, 3]])
    with mode:
        assert next(model.parameters()).device == DEVICE
        with pytest.raises(CrossDeviceError):
            model(input_ids=ids)  # ids left on the host
        out = model(input_ids=ids.to(DEVICE)).logits
        assert out.device == DEVICE and out.cpu().device.type == "cpu"
        with pytest.raises(CrossDeviceError):
            torch.equal(out, out.detach().cpu())


# ---------------------------------------------------------------------------------------------------
# Export: the byte read-back, the whole verification, the whole export
# ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_readback_compares_device_shards_with_the_host_files(
    model_dir: Path, tmp_path: Path, dtype: str
) -> None:
    model = load_model(str(model_dir))
    _export(model, model_dir, tmp_path / "out", verify=False, dtype=dtype)
    plan = make_plan(model, dtype, max_shard_bytes=10**9)
    mode = FakeAccelerator()
    mode.put_module(model)
    with mode:
        tensors, nbytes, problems = readback(plan, tmp_path / "out")
    assert problems == [] and not mode.mismatches
    assert tensors == len(plan.shapes) and nbytes == plan.total_bytes


def test_readback_on_device_still_finds_a_changed_value(model_dir: Path, tmp_path: Path) -> None:
    model = load_model(str(model_dir))
    _export(model, model_dir, tmp_path / "out", verify=False)
    key = "model.layers.1.mlp.up_proj.weight"
    tensors = load_file(str(tmp_path / "out" / WEIGHTS_NAME))
    tensors[key] = tensors[key].clone()
    tensors[key][2, 3] += 1.0
    save_file(tensors, str(tmp_path / "out" / WEIGHTS_NAME), metadata={"format": "pt"})
    plan = make_plan(model, "bfloat16", max_shard_bytes=10**9)
    mode = FakeAccelerator()
    mode.put_module(model)
    with mode:
        _, _, problems = readback(plan, tmp_path / "out")
    assert (
        len(problems) == 1
        and problems[0].startswith(f"{key}: the bytes on disk differ")
        and "max |diff| 1" in problems[0]
    )


def test_export_of_a_model_on_the_device_is_verified_and_published(model_dir: Path, tmp_path: Path) -> None:
    model, mode = _on_device(model_dir)
    with mode:
        result = _export(model, model_dir, tmp_path / "out", verify=True)
    assert result.verify is not None and result.verify.ok, result.verify
    assert not mode.mismatches
    assert (tmp_path / "out" / WEIGHTS_NAME).is_file()


def test_verification_of_a_model_on_the_device_still_rejects_swapped_layers(
    model_dir: Path, tmp_path: Path
) -> None:
    model, mode = _on_device(model_dir)
    _export(model, model_dir, tmp_path / "out", verify=False)
    tensors = load_file(str(tmp_path / "out" / WEIGHTS_NAME))
    for key in [k for k in tensors if k.startswith("model.layers.0.")]:
        other = key.replace("layers.0.", "layers.1.")
        tensors[key], tensors[other] = tensors[other], tensors[key]
    save_file(tensors, str(tmp_path / "out" / WEIGHTS_NAME), metadata={"format": "pt"})
    with (
        mode,
        pytest.raises(ExportVerificationError, match=r"model\.layers\.[01]\..*: the bytes on disk differ"),
    ):
        verify_export(model, tmp_path / "out", dtype="bfloat16")
    assert not mode.mismatches


def test_readback_of_fused_experts_split_on_the_device(tmp_path: Path) -> None:
    # The read-back only: transformers' MoE forward takes its GPU branch (histc on ints) when it sees cuda.
    from support.families import make_family_dir

    path = make_family_dir(tmp_path / "moe", "qwen3_moe")
    model = load_model(str(path))
    _export(model, path, tmp_path / "out", verify=False)
    plan = make_plan(model, "bfloat16", max_shard_bytes=10**9)
    assert plan.expert_sources
    mode = FakeAccelerator()
    mode.put_module(model)
    with mode:
        tensors, _, problems = readback(plan, tmp_path / "out")
    assert problems == [] and tensors == len(plan.shapes) and not mode.mismatches


# ---------------------------------------------------------------------------------------------------
# LoRA: the adapter (gathered, reloaded with PEFT) and the merged model (twin, export)
# ---------------------------------------------------------------------------------------------------


def test_lora_adapter_and_merged_exports_of_a_model_on_the_device(model_dir: Path, tmp_path: Path) -> None:
    from transformers import LlamaForCausalLM

    from hf_fsdp2.config.plans import LoraSettings
    from hf_fsdp2.lora.adapter import apply_lora
    from hf_fsdp2.lora.save import export_lora

    model = apply_lora(
        LlamaForCausalLM.from_pretrained(model_dir, use_kernels=False),
        LoraSettings(r=4, alpha=8, dropout=0.0),
        seed=0,
    )
    with torch.no_grad():  # a non-zero delta, as after training
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05, generator=torch.Generator().manual_seed(len(name)))
    mode = FakeAccelerator()
    mode.put_module(model)
    with mode:
        result = export_lora(
            model,
            tmp_path / "run",
            base_model=str(model_dir),
            tokenizer=load_tokenizer(str(model_dir)),
            merge=True,
            layer_cls_names=("LlamaDecoderLayer",),
            mp_policy=None,
            dtype="bfloat16",
            max_shard_bytes=10**9,
            compute_dtype=torch.float32,
            is_main_process=True,
        )
    assert result.adapter_report is not None and result.adapter_report.ok
    assert result.merged_report is not None and result.merged_report.ok
    assert not mode.mismatches


# ---------------------------------------------------------------------------------------------------
# Host syncs inside the steps
# ---------------------------------------------------------------------------------------------------


def _library_reads(mode: FakeAccelerator) -> list[tuple[str, str]]:
    """The host reads of device tensors made by hf_fsdp2's own code (transformers' own are not ours to change)."""
    return [
        (what, where) for what, where in mode.host_reads if where.split("/")[0] in ("train", "run", "observe")
    ]


@pytest.mark.parametrize("chunked", [False, True])
def test_a_dpo_step_reads_the_device_once(model_dir: Path, chunked: bool) -> None:
    from hf_fsdp2.data.pairs import PreferenceCollator
    from hf_fsdp2.methods.dpo.step import DPOLoss, DPOSettings
    from hf_fsdp2.train.logps import FrozenModel
    from hf_fsdp2.train.loss import LossPlan, plan_loss
    from hf_fsdp2.train.step import StepSettings, forward_backward

    model = load_model(str(model_dir))
    plan = plan_loss(model, 8) if chunked else LossPlan()
    assert (plan.chunk_tokens > 0) == chunked
    pairs = [
        {"prompt_ids": [5, 6, 7], "chosen_ids": [8, 9, 10, 11], "rejected_ids": [12, 13], "index": 0},
        {"prompt_ids": [14, 15], "chosen_ids": [16], "rejected_ids": [17, 18, 19], "index": 1},
    ]
    batches = [PreferenceCollator(pad_token_id=0, max_length=16)(pairs)] * 2
    reference = FrozenModel(model, plan)
    mode = FakeAccelerator()
    mode.put_module(model)
    with mode:
        loss = DPOLoss(reference, DPOSettings(), plan, DEVICE)
        acc = forward_backward(model, batches, StepSettings(plan), DEVICE, loss=loss)
        assert acc.counts.loss_count == 4 and acc.loss_sum.device == DEVICE and not mode.mismatches
    # The one all-reduce of the step's pair and token counts; the completion positions come from the host labels.
    assert [what for what, _ in _library_reads(mode)] == ["tolist()"], _library_reads(mode)


@pytest.mark.parametrize("chunk", [0, 8])
def test_an_sft_step_reads_the_device_once(model_dir: Path, chunk: int) -> None:
    from hf_fsdp2.train.loss import LossPlan
    from hf_fsdp2.train.step import StepSettings, forward_backward

    model = load_model(str(model_dir))
    ids = torch.randint(3, 100, (2, 12), generator=torch.Generator().manual_seed(0))
    labels = ids.clone()
    labels[0, :5] = -100  # target positions with gaps: the chunked loss must find them from the host labels
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels}
    mode = FakeAccelerator()
    mode.put_module(model)
    with mode:
        acc = forward_backward(model, [batch, batch], StepSettings(LossPlan(chunk_tokens=chunk)), DEVICE)
        loss_sum, tokens, processed = acc.loss_sum, acc.counts.target_tokens, acc.counts.processed_tokens
        assert loss_sum.device == DEVICE and tokens == 2 * (2 * 11 - 4) and processed == 2 * 24
    assert not mode.mismatches
    # The step's token counts, all-reduced on the device and read once: they scale the loss before backward.
    # The chunked loss's target positions come from the host labels (no nonzero() on the device).
    assert [what for what, _ in _library_reads(mode)] == ["tolist()"], _library_reads(mode)
    plain = forward_backward(
        load_model(str(model_dir)), [batch, batch], StepSettings(LossPlan()), torch.device("cpu")
    )
    torch.testing.assert_close(loss_sum.cpu(), plain.loss_sum, rtol=1e-5, atol=0)


def test_a_training_step_with_its_stop_check_reads_the_device_once(
    model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The whole per-step path the recipe runs: the step's forward/backward, then ``RunState.after_step`` (the
    save cadence and the SIGTERM check). On a GPU the process group is NCCL even at world size 1, so the
    collectives' device is the GPU: patched here to the fake one. The stop flag must never become a device
    tensor: one host read per step, the step's token counts."""
    import signal
    from types import SimpleNamespace

    from hf_fsdp2 import collectives
    from hf_fsdp2.config import parse_config
    from hf_fsdp2.elastic.agent import AgentLaunch
    from hf_fsdp2.run.state import RunState
    from hf_fsdp2.train.loss import LossPlan
    from hf_fsdp2.train.step import StepSettings, forward_backward

    monkeypatch.setattr(collectives, "_device", lambda: DEVICE)  # what NCCL's default group takes
    cfg = parse_config(
        [
            "--model_name_or_path",
            str(model_dir),
            "--dataset_name",
            "unused.jsonl",
            "--output_dir",
            str(tmp_path),
            "--save_steps",
            "0",
        ]
    )
    session = SimpleNamespace(
        cfg=cfg,
        output_dir=tmp_path,
        is_main=True,
        hub_token=None,
        world=1,
        resume_from=None,
        launch=AgentLaunch(under_agent=False),
    )
    model = load_model(str(model_dir))
    previous = signal.getsignal(signal.SIGTERM)
    state = RunState(session, model, torch.optim.SGD(model.parameters(), lr=0.1), scheduler=None, stream=None)  # type: ignore[arg-type]
    try:
        ids = torch.randint(3, 100, (2, 12), generator=torch.Generator().manual_seed(0))
        batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}
        mode = FakeAccelerator()
        mode.put_module(model)
        reads_per_step = []
        with mode:
            for step in (1, 2, 3):
                before = len(mode.host_reads)
                forward_backward(model, [batch], StepSettings(LossPlan()), DEVICE)
                assert state.after_step(step, 3) is False
                reads_per_step.append(
                    [
                        w
                        for w in mode.host_reads[before:]
                        if w[1].split("/")[0] in ("hf_fsdp2", "train", "run")
                    ]
                )
        assert [[what for what, _ in reads] for reads in reads_per_step] == [["tolist()"]] * 3, reads_per_step
    finally:
        signal.signal(signal.SIGTERM, previous)


# ---------------------------------------------------------------------------------------------------
# Evaluation
# ---------------------------------------------------------------------------------------------------


def test_evaluation_of_a_model_on_the_device(model_dir: Path) -> None:
    from hf_fsdp2.data.loader import PaddingCollator
    from hf_fsdp2.observe.evaluate import Evaluator

    tokenizer = load_tokenizer(str(model_dir))
    model = load_model(str(model_dir))
    examples = [{"input_ids": list(range(5, 5 + n)), "labels": list(range(5, 5 + n))} for n in (4, 7, 9)]
    evaluator = Evaluator(
        examples,
        collator=PaddingCollator(pad_token_id=0),
        batch_size=2,
        rank=0,
        world_size=1,
        device=DEVICE,
        tokenizer=tokenizer,
        prompts=["hello"],
        max_new_tokens=3,
    )
    mode = FakeAccelerator()
    mode.put_module(model)
    with mode:
        record = evaluator.run(model, step=1)
    assert record["eval_tokens"] == 3 + 6 + 8 and not mode.mismatches


def test_preference_win_rate_of_a_model_on_the_device(model_dir: Path) -> None:
    from hf_fsdp2.demo.tasks import preference_win_rate

    tokenizer = load_tokenizer(str(model_dir))
    tokenizer.pad_token = tokenizer.eos_token
    records = [{"prompt": "a question", "chosen": " yes yes", "rejected": " no"}] * 3
    model = load_model(str(model_dir))
    mode = FakeAccelerator()
    mode.put_module(model)
    with mode:
        out = preference_win_rate(model, tokenizer, records, batch_size=2)
    assert out["n"] == 3 and not mode.mismatches


def _step_reads(mode: FakeAccelerator) -> list[tuple[str, str]]:
    """The library's host reads but those of the shared update (clip_grad_norm)."""
    return [(what, where) for what, where in _library_reads(mode) if "clip_grad_norm" not in where]


def _optimizer(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)


def test_a_kto_step_with_its_kl_estimate_reads_the_device_once(model_dir: Path) -> None:
    from hf_fsdp2.data.unpaired import UnpairedCollator, with_kl_completions
    from hf_fsdp2.methods.kto.step import KTOLoss, KTOSettings
    from hf_fsdp2.train.logps import FrozenModel
    from hf_fsdp2.train.loss import LossPlan
    from hf_fsdp2.train.step import StepSettings, train_step

    model = load_model(str(model_dir))
    examples = with_kl_completions(
        [
            {"prompt_ids": [5, 6, 7], "completion_ids": [8, 9, 10], "label": True},
            {"prompt_ids": [14, 15], "completion_ids": [16], "label": False},
            {"prompt_ids": [20], "completion_ids": [21, 22, 23, 24], "label": True},
        ],
        world_size=1,
        batch_size=3,
    )
    batches = [UnpairedCollator(pad_token_id=0, max_length=16)(examples)] * 2
    mode = FakeAccelerator()
    mode.put_module(model)
    frozen = load_model(str(model_dir))
    mode.put_module(frozen)
    with mode:
        loss = KTOLoss(FrozenModel(frozen, LossPlan()), KTOSettings(), LossPlan(), DEVICE)
        out = train_step(model, _optimizer(model), None, batches, StepSettings(LossPlan()), DEVICE, loss)
        assert (
            out.loss_count == 6
            and loss.desirable == 4
            and out.loss_sum.device == DEVICE
            and not mode.mismatches
        )
    # The step's counts (all-reduced, read once); the KL estimate's sum and count stay on the device. (Not counted:
    # a cpu() the harness sees in torch's clip_grad_norm_, which stacks the per-group norms on the first gradient's
    # device: a fake-device tensor's real device is the host; on a GPU it is the GPU, no read.)
    assert [what for what, _ in _step_reads(mode)] == ["tolist()"], _library_reads(mode)


def test_a_reward_model_step_reads_the_device_once(model_dir: Path) -> None:
    from hf_fsdp2.data.pairs import PreferenceCollator
    from hf_fsdp2.methods.rm.step import RewardLoss, RewardSettings
    from hf_fsdp2.train.loss import LossPlan
    from hf_fsdp2.train.step import StepSettings, train_step

    torch.manual_seed(0)
    model = load_model(str(model_dir), reward_head=0)
    pairs = [
        {
            "prompt_ids": [5, 6, 7],
            "chosen_ids": [8, 9, 10, 11],
            "rejected_ids": [12, 13],
            "index": 0,
            "margin": 0.5,
        },
        {"prompt_ids": [14, 15], "chosen_ids": [16], "rejected_ids": [17, 18, 19], "index": 1, "margin": 0.0},
    ]
    batches = [PreferenceCollator(pad_token_id=0, max_length=16)(pairs)] * 2
    mode = FakeAccelerator()
    mode.put_module(model)
    with mode:
        loss = RewardLoss(RewardSettings(0.01), DEVICE)
        out = train_step(model, _optimizer(model), None, batches, StepSettings(LossPlan()), DEVICE, loss)
        assert out.loss_count == 4 and out.loss_sum.device == DEVICE and not mode.mismatches
    assert [what for what, _ in _step_reads(mode)] == ["tolist()"], _library_reads(mode)
