"""Verification separates rounding from mistakes: it never rejects a correct export (large logits, every
dtype), and it always rejects a wrong one (config, swapped layers, a lost tie, a transposed or dropped
tensor). One process; the 2-rank run-dtype x export-dtype matrix is tests/distributed/test_verify_matrix.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from support.families import make_family_dir

from hf_fsdp2.export import ExportVerificationError, export_model, verify_export
from hf_fsdp2.export.files import WEIGHTS_NAME
from hf_fsdp2.model import load_model, load_tokenizer


@pytest.fixture(scope="module")
def big_logits(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny untied Llama-3 with initializer_range 0.5: logits in the hundreds, where rounding is large."""
    return make_family_dir(tmp_path_factory.mktemp("big") / "model", "llama3_untied", initializer_range=0.5)


@pytest.fixture(scope="module")
def tied_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_family_dir(tmp_path_factory.mktemp("tied") / "model", "llama_tied", initializer_range=0.5)


def _export(path: Path, out: Path, dtype: str, verify: bool = True):  # type: ignore[no-untyped-def]
    model = load_model(str(path))
    result = export_model(
        model,
        out,
        config=model.config,
        tokenizer=load_tokenizer(str(path)),
        generation_config=None,
        dtype=dtype,
        max_shard_bytes=10**9,
        verify=verify,
    )
    return model, result


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32", "training"])
def test_no_rejection_with_large_logits_in_any_export_dtype(
    big_logits: Path, tmp_path: Path, dtype: str
) -> None:
    model, result = _export(big_logits, tmp_path / "out", dtype)
    report = result.verify
    assert report is not None and report.ok
    assert report.logit_scale > 10  # large logits: bf16 rounding of the weights moves them by whole units
    # The probe's reference used the same rounded weights: what is left is kernel noise, far under the limit.
    assert report.max_logit_diff <= report.atol / 100, report.summary()
    assert report.reloaded_tensors == len(model.state_dict()) and report.config_keys > 20
    # The rounding is real: the fp32 model's own logits differ from the reload's by far more than the limit
    # when the export rounds, which is why the reference must round too.
    if dtype in ("bfloat16", "float16"):
        reloaded = type(model).from_pretrained(tmp_path / "out", dtype=torch.float32).eval()
        ids = torch.randint(
            0, model.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(1234)
        )
        with torch.no_grad():
            unrounded = model.eval()(input_ids=ids).logits
            got = reloaded(input_ids=ids).logits
        assert float((got - unrounded).abs().max()) > report.atol


def _rewrite(folder: Path, edit) -> None:  # type: ignore[no-untyped-def]
    tensors = load_file(str(folder / WEIGHTS_NAME))
    edit(tensors)
    save_file(tensors, str(folder / WEIGHTS_NAME), metadata={"format": "pt"})


@pytest.fixture()
def exported(big_logits: Path, tmp_path: Path):  # type: ignore[no-untyped-def]
    model, _ = _export(big_logits, tmp_path / "out", "bfloat16", verify=False)
    return model, tmp_path / "out"


def _rejects(model: torch.nn.Module, folder: Path, match: str) -> None:
    with pytest.raises(ExportVerificationError, match=match):
        verify_export(model, folder, dtype="bfloat16")


def test_rejects_a_wrong_rope_theta(exported) -> None:  # type: ignore[no-untyped-def]
    model, folder = exported
    config = json.loads((folder / "config.json").read_text())
    config["rope_parameters"]["rope_theta"] *= 2
    (folder / "config.json").write_text(json.dumps(config))
    _rejects(model, folder, r"config.json differs from the live config: .*rope_parameters")


def test_rejects_two_swapped_layers(exported) -> None:  # type: ignore[no-untyped-def]
    model, folder = exported

    def swap(t: dict[str, torch.Tensor]) -> None:
        for key in [k for k in t if k.startswith("model.layers.0.")]:
            other = key.replace("layers.0.", "layers.1.")
            t[key], t[other] = t[other], t[key]

    _rewrite(folder, swap)
    _rejects(model, folder, r"model\.layers\.[01]\..*: the bytes on disk differ")


def test_rejects_a_transposed_weight(exported) -> None:  # type: ignore[no-untyped-def]
    model, folder = exported
    key = "model.layers.0.mlp.down_proj.weight"  # [64, 128]: transposed it has another shape
    _rewrite(folder, lambda t: t.__setitem__(key, t[key].t().contiguous()))
    _rejects(model, folder, rf"{key}: file says BF16\[128, 64\], the model has BF16\[64, 128\]")
    square = "model.layers.0.self_attn.q_proj.weight"  # [64, 64]: transposed it keeps its shape
    _rewrite(
        folder,
        lambda t: (
            t.__setitem__(key, t[key].t().contiguous()),
            t.__setitem__(square, t[square].t().contiguous()),
        ),
    )
    _rejects(model, folder, rf"{square}: the bytes on disk differ")


def test_rejects_a_dropped_tensor(exported) -> None:  # type: ignore[no-untyped-def]
    model, folder = exported
    _rewrite(folder, lambda t: t.pop("model.norm.weight"))
    _rejects(model, folder, r"tensors missing from the files: \['model\.norm\.weight'\]")


def test_rejects_a_missing_tie(tied_model: Path, tmp_path: Path) -> None:
    model, _ = _export(tied_model, tmp_path / "out", "bfloat16", verify=False)
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    config["tie_word_embeddings"] = False  # the head would load as a new, random tensor
    (tmp_path / "out" / "config.json").write_text(json.dumps(config))
    with pytest.raises(ExportVerificationError) as err:
        verify_export(model, tmp_path / "out", dtype="bfloat16")
    message = str(err.value)
    assert "from_pretrained reported missing_keys: ['lm_head.weight']" in message
    assert "tie_word_embeddings" in message and "tied embeddings: live model True, reloaded False" in message


def test_rejects_any_single_flipped_value(exported) -> None:  # type: ignore[no-untyped-def]
    model, folder = exported
    key = "model.layers.1.self_attn.o_proj.weight"

    def flip(t: dict[str, torch.Tensor]) -> None:
        t[key] = t[key].clone()
        t[key][3, 5] = torch.nextafter(t[key][3, 5].float(), torch.tensor(1e9)).to(t[key].dtype) + 0.0078125

    _rewrite(folder, flip)
    _rejects(model, folder, rf"{key}: the bytes on disk differ")


# ---------------------------------------------------------------------------------------------------
# The probe across kernels: the live model on a GPU, the reload on a CPU
# ---------------------------------------------------------------------------------------------------


def test_probe_limit_grows_with_the_reload_rounding_noise() -> None:
    from hf_fsdp2.export.probe import NOISE_MARGIN, probe_limit, reference_dtype

    assert probe_limit(torch.bfloat16, 35.0) == pytest.approx(1.75)  # the floor: 5 % of the logit scale
    assert probe_limit(torch.bfloat16, 35.0, noise=1.2) == pytest.approx(NOISE_MARGIN * 1.2)
    assert probe_limit(torch.bfloat16, 35.0, noise=0.1) == pytest.approx(1.75)  # never under the floor
    assert reference_dtype(torch.bfloat16) == reference_dtype(torch.float16) == torch.float32
    assert reference_dtype(torch.float32) is None


def test_bf16_compute_measures_the_reload_rounding_noise(big_logits: Path, tmp_path: Path) -> None:
    model = load_model(str(big_logits), dtype="bfloat16")
    result = export_model(
        model,
        tmp_path / "out",
        config=model.config,
        tokenizer=None,
        generation_config=None,
        dtype="bfloat16",
        max_shard_bytes=10**9,
    )
    report = result.verify
    assert report is not None and report.ok
    assert report.logit_noise > 0  # the bf16 reload against itself in float32
    assert report.atol == pytest.approx(max(0.05 * report.logit_scale, 4 * report.logit_noise))
    assert "reload rounding noise" in report.summary()


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory: pytest.TempPathFactory) -> tuple[torch.nn.Module, Path]:
    """SmolLM2-135M computing in bf16 (its weights are bf16) and its bf16 export, not verified yet."""
    from hf_fsdp2.demo.assets import ensure_smollm2

    model = load_model(str(ensure_smollm2()), dtype="bfloat16")
    out = tmp_path_factory.mktemp("smollm2") / "out"
    export_model(
        model,
        out,
        config=model.config,
        tokenizer=None,
        generation_config=None,
        dtype="bfloat16",
        max_shard_bytes=10**10,
        verify=False,
    )
    return model, out


@pytest.mark.slow
def test_a_correct_export_is_accepted_under_gpu_sized_kernel_noise(smollm2) -> None:  # type: ignore[no-untyped-def]
    # The live model computes as a GPU would (each GEMM output off by up to 2 bf16 ulps, eager attention instead
    # of the reload's SDPA); the reload runs the CPU's kernels. A correct export must pass.
    from support.devices import other_kernels

    from hf_fsdp2.export.probe import probe_limit

    model, out = smollm2
    with other_kernels(model, ulps=2, seed=0):
        report = verify_export(model, out, dtype="bfloat16")
    assert report.ok
    # A limit relative to the logit scale alone (5 %) is under this noise: it rejected the correct export.
    assert report.max_logit_diff > probe_limit(torch.bfloat16, report.logit_scale), report.summary()
    assert report.max_logit_diff <= report.atol


@pytest.mark.slow
def test_the_probe_still_rejects_swapped_layers_under_kernel_noise(smollm2) -> None:  # type: ignore[no-untyped-def]
    # The probe on its own (the byte checks catch a swap first): live logits of a model whose first two or last
    # two layers run swapped, with the same GPU-sized noise, against the bf16 reload of the correct export.
    from support.devices import other_kernels
    from transformers import AutoModelForCausalLM

    from hf_fsdp2.export.probe import live_logits, probe_ids, probe_limit

    model, out = smollm2
    ids = probe_ids(model.config.vocab_size)
    reload = live_logits(AutoModelForCausalLM.from_pretrained(out, dtype=torch.bfloat16), ids)
    exact = live_logits(AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32), ids)
    limit = probe_limit(torch.bfloat16, float(reload.abs().max()), float((reload - exact).abs().max()))
    with other_kernels(model, ulps=2, seed=1):
        assert float((live_logits(model, ids) - reload).abs().max()) <= limit
    layers = model.model.layers
    n = len(layers)
    for a, b in ((0, 1), (n - 2, n - 1)):
        layers[a], layers[b] = layers[b], layers[a]
        try:
            with other_kernels(model, ulps=2, seed=1):
                diff = float((live_logits(model, ids) - reload).abs().max())
        finally:
            layers[a], layers[b] = layers[b], layers[a]
        assert diff > 3 * limit, (a, b, diff, limit)
