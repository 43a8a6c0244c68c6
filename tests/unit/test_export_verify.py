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
        model, out, config=model.config, tokenizer=load_tokenizer(str(path)), generation_config=None,
        dtype=dtype, max_shard_bytes=10**9, verify=verify,
    )  # fmt: skip
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
