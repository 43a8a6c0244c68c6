"""The family matrix: every family users fine-tune trains correctly on 2 gloo ranks, or is refused.

For each family, a tiny random-init model built from its transformers config, with a real tokenizer:

* fp32 losses of 3 steps through the library's own train step (2 ranks, 2 micro-batches each, one rank's
  micro-batch under ``ce_chunk_tokens`` target positions and the other's over it) equal a plain
  single-process transformers + torch.optim.AdamW loop on the same data (relative 1e-4), through both the
  chunked and the plain loss; MoE with its router auxiliary loss, as transformers computes it;
* the export reloads with plain transformers and gives the reference model's logits; for some families
  a LoRA adapter (reloaded with plain PEFT) and its merge (plain transformers) too;
* a bf16 mixed-precision run has finite, decreasing losses.

The composite checkpoints (a vision tower + projector + language model in one folder: Gemma 3, Qwen3.5 dense and MoE,
Llama 4, Mistral 3; tests/support/composites.py) are rows like the others, trained on text with the tower and the
projector frozen, against their own class (``AutoModelForImageTextToText``); their export (and merged LoRA export)
holds every tensor of the checkpoint under its name, the tower and projector byte-identical.

docs/models.md holds the same matrix as a table; ``test_docs_table_matches_the_matrix`` keeps them equal.
"""

from __future__ import annotations

import importlib
import json
import math
import re
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from support.composites import COMPOSITE_FAMILIES, checkpoint_names, make_composite_dir
from support.families import FAMILIES, LR, STEPS, family_batches, make_family_dir
from support.launch import REPO, torchrun
from support.runs import sft_2ranks, write_recipe
from support.tiny import write_chat_jsonl
from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

WORKER = Path(__file__).parent / "workers" / "family_worker.py"
WORLD = 2
# The composite checkpoints (vision tower + projector + language model, tests/support/composites.py) are rows like the
# others: trained on text with the tower and projector frozen, against their own class in one process.
COMPOSITE = tuple(COMPOSITE_FAMILIES)
ALL = (*FAMILIES, *COMPOSITE)
# A composite's vision tower and projector: their module names (Gemma 3, Mistral 3, Qwen3.5, Llama 4), and their
# checkpoint names, with Qwen3.5's mtp.* that the class does not load.
TOWER_MODULES = (
    "model.vision_tower.",
    "model.visual.",
    "vision_model.",
    "model.multi_modal_projector.",
    "multi_modal_projector.",
)
TOWER_NAMES = ("model.visual.", "vision_tower.", "vision_model.", "multi_modal_projector.", "mtp.")
LORA = (
    "llama_tied",
    "llama3_untied",
    "gemma2",
    "qwen3_moe",
    "mixtral",
    "gpt_oss",
    "deepseek_v3",
    "falcon_h1",
    "llama4_text",
    "gemma3_vlm",
)
# What all-linear leaves out (hf_fsdp2.lora.build.lora_exclusions), stated here for the plain-PEFT reference: a
# Mamba-2 mixer's out_proj (its weight goes to mamba-ssm's fused kernel on CUDA; PEFT refuses it on Falcon-H1), and
# Llama 4's router (an nn.Linear whose forward returns a tuple); on a composite, its frozen vision tower and projector.
LORA_EXCLUDED = {
    "falcon_h1": r".*\.mamba\.out_proj",
    "llama4_text": r".*\.feed_forward\.router",
    "gemma3_vlm": r"model\.vision_tower(\..*)?|model\.multi_modal_projector(\..*)?",
}
# LoRA on the fused MoE experts (PEFT's target_parameters: one rank-r pair per expert), merged gather-free. PEFT's
# all-linear already extends to the experts and router of Qwen3-MoE, Mixtral and DeepSeek-V3 (its transformers-5
# conversion); gpt-oss's experts (transposed, with biases that stay frozen) and Mixtral's are also named through
# lora_target_parameters: all-experts, spelt here as the parameters it stands for.
LORA_PARAMETERS = {
    "mixtral": ["mlp.experts.down_proj", "mlp.experts.gate_up_proj"],
    "gpt_oss": ["mlp.experts.down_proj", "mlp.experts.gate_up_proj"],
}
LORA_EXPERTS = ("qwen3_moe", "mixtral", "gpt_oss", "deepseek_v3")


@pytest.fixture(scope="module")
def matrix(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("families")
    for family in FAMILIES:
        make_family_dir(root / "models" / family, family)
    for family in COMPOSITE:
        make_composite_dir(root / "models" / family, family)
    torchrun(
        WORKER,
        [
            "--root",
            str(root / "models"),
            "--families",
            ",".join(ALL),
            "--lora",
            ",".join(LORA),
            "--lora_parameters",
            ",".join(LORA_PARAMETERS),
            "--out",
            str(root / "out"),
        ],
        nproc=WORLD,
        timeout=900,
    )
    return root / "models", root / "out"


def _result(out: Path, family: str) -> dict:
    result = json.loads((out / family / "result.json").read_text())
    assert "error" not in result, f"{family}: {result.get('error')}\n{result.get('traceback')}"
    return result


def reference(
    model_dir: Path,
    *,
    lora: bool = False,
    exclude: str | None = None,
    parameters: list[str] | None = None,
    norms: list[float] | None = None,
) -> tuple[list[float], torch.nn.Module]:
    """Plain transformers (+ PEFT) and torch.optim.AdamW in one process, on every rank's micro-batches; a composite
    with its own class, its tower and projector frozen. ``norms``: filled with each step's gradient norm."""
    torch.manual_seed(0)
    composite = model_dir.name in COMPOSITE
    auto = AutoModelForImageTextToText if composite else AutoModelForCausalLM
    model = auto.from_pretrained(model_dir, dtype=torch.float32)
    if composite:
        for name, param in model.named_parameters():
            if name.startswith(TOWER_MODULES):
                param.requires_grad_(False)
    if lora:
        from peft import LoraConfig, get_peft_model

        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            config = LoraConfig(
                r=4,
                lora_alpha=8,
                lora_dropout=0.0,
                target_modules="all-linear",
                task_type="CAUSAL_LM",
                exclude_modules=exclude,
                target_parameters=parameters,
            )
            model = get_peft_model(model, config)
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=LR, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
    text = model.config.get_text_config()
    coef = text.router_aux_loss_coef if getattr(text, "output_router_logits", False) else 0.0
    # Under PEFT, the family's own class holds the router loss function.
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    balance = importlib.import_module(type(base).__module__).__dict__.get("load_balancing_loss_func")
    losses = []
    for step in range(STEPS):
        per_rank = [family_batches(step, rank) for rank in range(WORLD)]
        tokens = sum(int((b["labels"][:, 1:] != -100).sum()) for mbs in per_rank for b in mbs)
        ce_total = 0.0
        for m in range(len(per_rank[0])):  # micro-batch m of every rank
            loss, routed, masks = 0.0, [], []
            for mbs in per_rank:
                b = mbs[m]
                out = model(input_ids=b["input_ids"], attention_mask=b["attention_mask"])
                logits = out.logits[:, :-1].float()
                ce = F.cross_entropy(
                    logits.reshape(-1, logits.size(-1)), b["labels"][:, 1:].reshape(-1), reduction="sum"
                )
                loss = loss + ce / tokens
                ce_total += float(ce)
                if coef:
                    routed.append(out.router_logits)
                    masks.append(b["attention_mask"].reshape(-1))
            if coef:  # the router loss of micro-batch m's tokens of every rank, as transformers computes it
                joined = tuple(torch.cat(layer) for layer in zip(*routed, strict=True))
                aux = balance(joined, joined[0].size(-1), text.num_experts_per_tok, torch.cat(masks)[None])
                loss = loss + coef * aux / len(per_rank[0])
            loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad()
        losses.append(ce_total / tokens)
        if norms is not None:
            norms.append(float(norm))
    return losses, model.eval()


def _probe(model: torch.nn.Module) -> torch.Tensor:
    ids = torch.randint(3, 1000, (2, 16), generator=torch.Generator().manual_seed(99))
    with torch.no_grad():
        return model(input_ids=ids).logits.float()


def _close(got: list[float], want: list[float]) -> float:
    rel = max(abs(g - w) / abs(w) for g, w in zip(got, want, strict=True))
    assert rel <= 1e-4, (got, want)
    return rel


@pytest.mark.parametrize("family", list(ALL))
def test_family_trains_like_transformers_and_exports(matrix: tuple[Path, Path], family: str) -> None:
    models, out = matrix
    result = _result(out, family)
    want, ref_model = reference(models / family)
    # Both loss paths, and the chunked one really chunked (or refused with the reason logged).
    assert result["chunked"]["chunked"], result["chunked"]["plan"]
    assert not result["plain"]["chunked"]
    _close(result["chunked"]["losses"], want)
    _close(result["plain"]["losses"], want)
    assert result["export"].startswith("verified"), result["export"]
    auto = AutoModelForImageTextToText if family in COMPOSITE else AutoModelForCausalLM
    reloaded = auto.from_pretrained(out / family / "export", dtype=torch.float32).eval()
    if family in COMPOSITE:  # the whole checkpoint under its names, what did not train byte-identical
        assert type(reloaded).__name__ == type(ref_model).__name__
        assert checkpoint_names(out / family / "export") == checkpoint_names(models / family)
        _same_frozen_bytes(models / family, out / family / "export")
    expected = _probe(ref_model)
    assert float((_probe(reloaded) - expected).abs().max()) <= 1e-3 * max(1.0, float(expected.abs().max()))
    bf16 = result["bf16"]
    assert bf16["finite"] and bf16["losses"][-1] < bf16["losses"][0], bf16["losses"]


def _same_frozen_bytes(source: Path, export: Path) -> None:
    """The tensors of the vision tower and projector (and Qwen3.5's mtp.*) in ``export`` equal ``source``'s, dtype
    and bytes."""
    from safetensors import safe_open

    frozen = [n for n in checkpoint_names(source) if n.startswith(TOWER_NAMES)]
    assert frozen
    with (
        safe_open(str(source / "model.safetensors"), "pt") as a,
        safe_open(str(export / "model.safetensors"), "pt") as b,
    ):
        for name in frozen:
            x, y = a.get_tensor(name), b.get_tensor(name)
            assert x.dtype == y.dtype and torch.equal(x, y), name


@pytest.mark.parametrize("family", LORA)
def test_lora_adapter_and_merge_reload_with_plain_peft(matrix: tuple[Path, Path], family: str) -> None:
    from peft import PeftModel

    models, out = matrix
    result = _result(out, family)
    norms: list[float] = []
    want, ref_model = reference(
        models / family,
        lora=True,
        exclude=LORA_EXCLUDED.get(family),
        parameters=LORA_PARAMETERS.get(family),
        norms=norms,
    )
    _close(result["lora"]["losses"], want)
    _close(result["lora"]["grad_norms"], norms)  # the adapter's gradients, experts' pairs included
    assert all(r.startswith("verified") for r in result["lora_export"]), result["lora_export"]
    expected = _probe(ref_model)
    limit = 1e-3 * max(1.0, float(expected.abs().max()))
    auto = AutoModelForImageTextToText if family in COMPOSITE else AutoModelForCausalLM
    base = auto.from_pretrained(models / family, dtype=torch.float32)
    adapter = PeftModel.from_pretrained(base, out / family / "lora").eval()
    assert float((_probe(adapter) - expected).abs().max()) <= limit
    if family in LORA_EXPERTS:  # the adapter holds every expert's pair, and they trained
        saved = load_file(out / family / "lora" / "adapter_model.safetensors")
        experts = [k for k in saved if ".experts." in k and "lora_B" in k]
        assert len(experts) >= 2 and all(float(saved[k].abs().max()) > 0 for k in experts), sorted(saved)
    merged = auto.from_pretrained(out / family / "lora" / "merged", dtype=torch.float32).eval()
    assert float((_probe(merged) - expected).abs().max()) <= limit
    if family in COMPOSITE:  # the merged export is the whole composite, the tower carried
        assert checkpoint_names(out / family / "lora" / "merged") == checkpoint_names(models / family)
        _same_frozen_bytes(models / family, out / family / "lora" / "merged")


def test_moe_router_loss_is_logged_apart_and_only_when_asked(matrix: tuple[Path, Path]) -> None:
    _, out = matrix
    asked = _result(out, "qwen3_moe")  # output_router_logits: true in its config
    assert all(a is not None and math.isfinite(a) and a > 0 for a in asked["chunked"]["aux"])
    assert any("router auxiliary loss added with weight 0.01" in n for n in asked["chunked"]["plan"])
    asked = _result(out, "gpt_oss")  # its router has a bias; output_router_logits: true, coefficient 0.01
    assert all(a is not None and math.isfinite(a) and a > 0 for a in asked["chunked"]["aux"])
    for family in (
        "mixtral",
        "qwen3_next",
        "glm4_moe",
        "deepseek_v3",
        "llama4_text",
    ):  # output_router_logits off
        assert all(a is None for a in _result(out, family)["chunked"]["aux"]), family


def test_post_processed_heads_are_chunked_with_their_transform(matrix: tuple[Path, Path]) -> None:
    _, out = matrix
    assert any("softcap 30" in n for n in _result(out, "gemma2")["chunked"]["plan"])
    assert any("x 0.25" in n for n in _result(out, "granite")["chunked"]["plan"])
    assert any("x 0.5" in n for n in _result(out, "granite4")["chunked"]["plan"])  # logits_scaling 2
    assert any("x 0.5" in n for n in _result(out, "falcon_h1")["chunked"]["plan"])  # lm_head_multiplier 0.5


def test_a_hybrid_family_trains_on_padded_rows_and_refuses_packing_on_every_rank_before_any_work(
    matrix: tuple[Path, Path], tmp_path: Path
) -> None:
    """Falcon-H1 through the recipe: padding_free unset keeps padded batches (its Mamba mixers would carry state
    from one document into the next; the start-up probe once ended the run on every rank before any step), and
    packing is refused by name on every rank before the data is tokenized."""
    models, _ = matrix
    data = write_chat_jsonl(tmp_path / "chat.jsonl", 16, seed=3)
    trained = sft_2ranks(
        write_recipe(
            tmp_path / "a.yaml", models / "falcon_h1", data, tmp_path / "a", max_steps=2, save_steps=0
        ),
        check=False,
    )
    text = trained.stdout + trained.stderr
    assert trained.returncode == 0, text[-4000:]
    assert (
        "batches: padded (padding_free auto: FalconH1ForCausalLM (model_type falcon_h1): 2 of its 2 layers are hybrid"
        in text
    )
    assert len((tmp_path / "a" / "metrics.jsonl").read_text().splitlines()) >= 2
    refused = sft_2ranks(
        write_recipe(tmp_path / "b.yaml", models / "falcon_h1", data, tmp_path / "b", packing=True),
        check=False,
    )
    errors = [line for line in refused.stderr.splitlines() if line.startswith("hf_fsdp2 error:")]
    assert refused.returncode != 0 and len(errors) == 1, refused.stderr[-4000:]
    assert "FalconH1ForCausalLM (model_type falcon_h1): 2 of its 2 layers are hybrid" in errors[0], errors[0]
    assert "Set packing: false and padding_free: false" in errors[0], errors[0]
    assert (
        "training examples (max_length=" not in refused.stdout + refused.stderr
    )  # refused before tokenizing
    assert not (tmp_path / "b" / "metrics.jsonl").exists()


def test_docs_table_matches_the_matrix() -> None:
    """docs/models.md lists exactly the families tested here, with what is tested for each."""
    text = (REPO / "docs" / "models.md").read_text()
    rows = {}
    for line in text.splitlines():
        match = re.match(r"^\| `(\w+)` \|", line)
        if match:
            rows[match.group(1)] = line
    assert set(rows) == set(ALL), sorted(set(rows) ^ set(ALL))
    for family, line in rows.items():
        config = (FAMILIES[family] if family in FAMILIES else COMPOSITE_FAMILIES[family])[0]
        assert config.removesuffix("Config") in line, line
        assert ("LoRA" in line) == (family in LORA), line
