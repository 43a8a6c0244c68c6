"""``hf-fsdp2 eval-harness`` with lm-eval's vLLM backend, run in .venv-vllm (vLLM pins
transformers<5.20; scripts/setup_vllm.sh installs lm-eval and the trainer's dependencies there): on the local tasks
its greedy answers equal transformers' token for token and its log-likelihoods equal a direct computation with
transformers (in this environment, transformers 5.24) on the same items (the answers up to the leading space vLLM's detokenizer keeps, which the
task's exact_match ignores). Skipped, with the reason, without
.venv-vllm."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch
import yaml
from support.harness import direct_scores, harness_answers, harness_logliks
from support.launch import REPO
from support.vllm_models import NO_VLLM, VLLM_PYTHON, tiny_vllm_llama

from hf_fsdp2.harness.tasks import DATES_MC_TASK, DATES_TASK, write_local_tasks

N = 4  # items per local task
# slow: vLLM's import and two engine starts in a process of their own, as the SmolLM2 harness test.
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        not VLLM_PYTHON.exists(),
        reason=NO_VLLM,
    ),
]
# The command's code path (evaluate_and_report, as `hf-fsdp2 eval-harness MODEL --tasks ... --backend vllm`), with
# lm-eval's per-item samples kept so that answers and log-likelihoods can be compared item by item: the model on both
# local tasks, then an adapter over it on the generation task only (vLLM 0.32's CPU LoRA kernels fail on the prompt
# log-probs a multiple-choice task asks for: an einsum shape error in punica_cpu.add_lora_logits, vLLM's own). One
# process for both: vLLM's import is half of each evaluation's time, each evaluation starts its own engine.
RUN = """
import json, sys
from pathlib import Path
from hf_fsdp2.harness.evaluate import evaluate_and_report
from hf_fsdp2.harness.run import vllm_lora_ranks
from hf_fsdp2.harness.tasks import DATES_MC_TASK, DATES_TASK
n = int(sys.argv[3])
report = evaluate_and_report(Path(sys.argv[1]), [DATES_TASK, DATES_MC_TASK], local_items=n, log_samples=True,
                             device="cpu", backend="vllm")
keep = {t: [{"doc_id": s["doc_id"], "filtered_resps": s["filtered_resps"]} for s in v]
        for t, v in report.after["samples"].items()}
print("RESULT " + json.dumps({**{k: v for k, v in report.after.items() if k != "samples"}, "samples": keep}),
      flush=True)
report = evaluate_and_report(Path(sys.argv[2]), [DATES_TASK], local_items=n, log_samples=True, device="cpu",
                             backend="vllm")
keep = [{"doc_id": s["doc_id"], "filtered_resps": s["filtered_resps"]} for s in report.after["samples"][DATES_TASK]]
print("ADAPTER " + json.dumps({"ranks": list(vllm_lora_ranks()), "samples": keep}))
"""


@pytest.fixture(scope="module")
def evaluated(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The tiny model (an untied random head, so that greedy answers are strings of many tokens) and an r=32 LoRA
    adapter over it (q and v, random B), both evaluated in one .venv-vllm process: its two results."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("harness_vllm")
    model = tiny_vllm_llama(root / "model", tied=False)
    torch.manual_seed(0)
    peft_model = get_peft_model(
        AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32),
        LoraConfig(r=32, lora_alpha=64, target_modules=["q_proj", "v_proj"], init_lora_weights=False),
    )
    adapter = root / "adapter"
    peft_model.save_pretrained(adapter)
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "HF_HUB_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "tests")]),
    }
    proc = subprocess.run(
        [str(VLLM_PYTHON), "-c", RUN, str(model), str(adapter), str(N)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    lines = proc.stdout.splitlines()
    found = {
        kind: json.loads(next(x for x in lines if x.startswith(f"{kind} ")).removeprefix(f"{kind} "))
        for kind in ("RESULT", "ADAPTER")
    }
    return {"model": model, "adapter": adapter, "base": found["RESULT"], "lora": found["ADAPTER"]}


def test_vllm_backend_numbers_equal_transformers_on_the_local_tasks(evaluated: dict, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model, got = evaluated["model"], evaluated["base"]
    assert got["backend"] == "vllm" and got["backend_reason"] == "vllm imports in this environment"
    direct = direct_scores(
        AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32),
        AutoTokenizer.from_pretrained(model),
        N,
    )
    answers = harness_answers(got["samples"][DATES_TASK])
    # Greedy: the same tokens. vLLM detokenizes them in the prompt's context, so a first token that starts a word
    # (SentencePiece's mark) keeps its space; transformers decodes them alone and drops it. The task's exact_match
    # ignores it. Both kinds of first token occur here.
    assert [a.lstrip() for a in answers] == direct["answers"] and all(len(a) > 10 for a in direct["answers"])
    assert all(a in (d, " " + d) for a, d in zip(answers, direct["answers"], strict=True)), answers
    assert any(a.startswith(" ") for a in answers), answers
    spec = yaml.safe_load((write_local_tasks(tmp_path / "tasks", n=1) / f"{DATES_TASK}.yaml").read_text())
    from lm_eval.api.metrics import exact_match_hf_evaluate

    kwargs = {k: v for k, v in spec["metric_list"][0].items() if k == "regexes_to_ignore"}
    assert exact_match_hf_evaluate([answers[0]], [direct["answers"][0]], **kwargs)["exact_match"] == 1.0
    logliks = [x for row in harness_logliks(got["samples"][DATES_MC_TASK]) for x in row]
    # vLLM's kernels (fused q/k/v, gate/up) round differently from transformers': ~1e-5 nats on ~-100 here.
    assert logliks == pytest.approx([x for row in direct["logliks"] for x in row], abs=1e-3)
    assert got["tasks"][DATES_TASK]["exact_match"] == direct["exact_match"]
    assert got["tasks"][DATES_MC_TASK]["acc"] == direct["acc"] and got["tasks"][DATES_MC_TASK]["n"] == N
    saved = json.loads((model / "eval_harness.json").read_text())["after"]
    assert saved["backend"] == "vllm" and saved["tasks"] == got["tasks"]


def test_vllm_backend_evaluates_a_lora_adapter_of_rank_32(evaluated: dict) -> None:
    """lm-eval's vLLM backend bounds adapters at max_lora_rank 16 unless told: an r=32 adapter was refused
    ("LoRA rank 32 is greater than max_lora_rank 16"); given its rank, vLLM serves it and its greedy answers are
    the base + adapter's (transformers, the adapter merged). The allowed ranks the harness rounds up to are the
    installed vLLM's."""
    from peft import PeftModel
    from support.vllm_models import VLLM_LORA_RANKS
    from transformers import AutoModelForCausalLM, AutoTokenizer

    base, got = evaluated["model"], evaluated["lora"]
    assert tuple(got["ranks"]) == VLLM_LORA_RANKS
    merged = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32), str(evaluated["adapter"])
    )
    direct = direct_scores(merged.merge_and_unload(), AutoTokenizer.from_pretrained(base), N)
    plain = direct_scores(
        AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32),
        AutoTokenizer.from_pretrained(base),
        N,
    )
    assert direct["answers"] != plain["answers"]  # the adapter changes the answers
    assert [a.lstrip() for a in harness_answers(got["samples"])] == direct["answers"]
