"""Reload a LoRA adapter on its base with plain transformers + PEFT, as a user would, and write what verification
compares.

Run by path in a separate CPU interpreter (hf_fsdp2/lora/save.py's ``verify_adapter``):
``python reload_adapter.py request.pt out.pt``. The request (``torch.load``) holds the base and adapter folders,
the dtypes, the probe ids, the trained adapter's digests by PEFT's names, and for QLoRA the 4-bit modules with
their scale blocks (the base is quantised here as the run did); for a reward model the auto class, the head's
arguments and, where transformers has no class for it, the score head's modeling source. The findings
(``torch.save`` to ``out.pt``) are the probe logits (and on the dequantised base for QLoRA), the reload's own
rounding noise, the adapter tensors that differ or are extra, and whether any hf_fsdp2 module was imported here.

Imports nothing of hf_fsdp2 (hf_fsdp2/export/reload_scripts/__init__.py says why).
"""

from __future__ import annotations

import hashlib
import importlib.util
import pathlib
import sys
import tempfile
from typing import Any

import torch
import transformers
from peft import PeftModel


def auto_class(request: dict[str, Any]) -> Any:
    """The transformers auto class of the base; a score head transformers lacks: the class the adapter folder
    ships, registered with it."""
    auto = getattr(transformers, request.get("auto_class", "AutoModelForCausalLM"))
    if request.get("modeling"):
        path = pathlib.Path(tempfile.mkdtemp()) / "modeling_score_head.py"
        path.write_text(request["modeling"])
        spec = importlib.util.spec_from_file_location("modeling_score_head", path)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        head_class = getattr(module, request["modeling_class"])
        auto.register(head_class.config_class, head_class, exist_ok=True)
    return auto


def answer_dequantize(nf4_type: Any) -> None:
    """PEFT's DoRA calls ``weight.dequantize()`` on torchao tensors; torchao's NF4 tensor has a static
    ``dequantize(value, nf4)`` (its lookup-table step) instead. The replacement answers both, as
    ``hf_fsdp2.lora.quantize._peft_dequantize`` does in the run (docs/qlora.md, docs/compatibility.md).

    Raises:
        RuntimeError: this torchao's NF4 tensor has no static ``dequantize`` or no ``get_original_weight``: the
            replacement would hide a changed API (tests/unit/test_upstream_patches.py names the versions tested).
    """
    original = nf4_type.__dict__.get("dequantize")
    if getattr(
        original, "_hf_fsdp2", False
    ):  # answered already (an earlier request of the shared interpreter)
        return
    if not isinstance(original, staticmethod) or not hasattr(nf4_type, "get_original_weight"):
        raise RuntimeError(
            f"torchao's NF4Tensor.dequantize is {original!r} (a staticmethod dequantize(value, nf4) and "
            "get_original_weight() expected): the DoRA reload cannot answer PEFT's weight.dequantize(); use the "
            "torchao docs/compatibility.md lists as tested"
        )
    lookup = original.__func__

    def dequantize(*args: Any) -> Any:
        return args[0].get_original_weight() if len(args) == 1 else lookup(*args[-2:])

    dequantize._hf_fsdp2 = True  # type: ignore[attr-defined]
    nf4_type.dequantize = dequantize


def load(request: dict[str, Any], auto: Any, dtype: str, dequantised: bool = False) -> Any:
    """Base + adapter as the run loaded them, the base's floating parameters in ``dtype``."""
    nf4 = request.get("nf4") or {}
    # The base as the run loaded it (an offline export of a bf16 run computes in fp32 from the bf16 values).
    base_dtype = request["nf4_dtype"] if nf4 else request.get("base_dtype") or dtype
    base = (
        auto.from_pretrained(  # use_kernels=False: the modules the run computed with (compat.NO_HUB_KERNELS)
            request["base"], dtype=getattr(torch, base_dtype), use_kernels=False, **request.get("head", {})
        )
    )
    if nf4:
        from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import to_nf4

        for name, block in nf4.items():
            linear = base.get_submodule(name)
            weight = to_nf4(linear.weight.detach().contiguous(), request["nf4_block"], block)
            if dequantised:  # the dequantised base: the 4-bit values as plain tensors
                weight = weight.get_original_weight()
            linear.weight = torch.nn.Parameter(weight, requires_grad=False)
    for param in base.parameters():  # the rest computes in the run's dtype; NF4 dequantises to it in F.linear
        # (parameters only: a whole-model .to() would also round buffers computed at init, rotary frequencies)
        if type(param).__name__ != "NF4Tensor" and param.is_floating_point():
            param.data = param.data.to(getattr(torch, dtype))
    return PeftModel.from_pretrained(base, request["adapter"])


def adapter_to(model: Any, dtype: str) -> None:
    """The adapter (PEFT keeps it in fp32) computes in the live model's dtype too; parameters only: a
    whole-model ``.to()`` would also round buffers computed at init (rotary frequencies)."""
    for name, param in model.named_parameters():
        if ".lora_" in name or ".modules_to_save." in name:
            param.data = param.data.to(getattr(torch, dtype))


def probe(model: Any, ids: torch.Tensor) -> torch.Tensor:
    """The logits of the probe batch (eval mode, no grad), in fp32."""
    model.eval()
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits.float()  # type: ignore[no-any-return]


def main(argv: list[str]) -> None:
    """``argv``: the request file and the file the findings go to."""
    request = torch.load(argv[0])
    out = argv[1]
    auto = auto_class(request)
    nf4 = (
        request.get("nf4") or {}
    )  # QLoRA: {module: scale block} of the 4-bit base, quantised here as the run did
    if nf4 and request.get("dora"):  # PEFT's DoRA calls weight.dequantize() on torchao tensors: answer it
        from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import NF4Tensor

        answer_dequantize(NF4Tensor)
    compute = request["compute_dtype"]
    model = load(request, auto, compute)
    state = {k: v for k, v in model.state_dict().items() if ".lora_" in k or ".modules_to_save." in k}
    mismatched = []
    for name, digest in request["digests"].items():
        got = state.get(name)
        if got is None:
            mismatched.append(f"{name}: not in the reloaded model")
        elif (
            hashlib.sha256(got.detach().float().contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()
            != digest
        ):
            mismatched.append(f"{name}: differs")
    extra = sorted(set(state) - set(request["digests"]))
    adapter_to(model, compute)
    logits, noise = probe(model, request["ids"]), 0.0
    dequantised = None
    if nf4:
        del model
        model = load(request, auto, compute, dequantised=True)
        adapter_to(model, compute)
        dequantised = probe(model, request["ids"])
    if request["reference_dtype"]:
        # The same weights computed in a wider dtype: how much this process's own rounding moves the logits.
        del model
        noise = float(
            (
                probe(load(request, auto, request["reference_dtype"]), request["ids"]).double()
                - logits.double()
            )
            .abs()
            .max()
        )
    torch.save(
        {
            "logits": logits,
            "dequantised_logits": dequantised,
            "noise": noise,
            "mismatched": mismatched,
            "extra": extra,
            "compared": len(request["digests"]),
            "hf_fsdp2": any(m.startswith("hf_fsdp2") for m in sys.modules),
        },
        out,
    )


if __name__ == "__main__":
    main(sys.argv[1:])
