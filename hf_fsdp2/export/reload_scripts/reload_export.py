"""Reload an exported folder with plain transformers, as a user would, and write what verification compares.

Run by path in a separate CPU interpreter (hf_fsdp2/export/verify.py's ``reload_in_subprocess``):
``python reload_export.py request.pt out.pt``. The request (``torch.load``) holds the folder, the dtypes, the probe
ids, the live model's tensor slices as digests (``boxes``: name -> [(offsets, sizes, sha256)]), its config and the
memory the reload may use; the findings (``torch.save`` to ``out.pt``) are the probe logits, the reload's own
rounding noise, from_pretrained's loading report, the slices that differ, the config keys that differ, whether the
head is tied, the devices used and whether any hf_fsdp2 module was imported here (it must not be).

Imports nothing of hf_fsdp2 (hf_fsdp2/export/reload_scripts/__init__.py says why).
"""

from __future__ import annotations

import hashlib
import sys
from typing import Any

import torch
import transformers


def load(request: dict[str, Any], dtype: str) -> tuple[Any, dict[str, Any]]:
    """The folder loaded in ``dtype``, weights beyond the request's RAM offloaded to disk; and the loading info."""
    auto = getattr(transformers, request.get("auto_class", "AutoModelForCausalLM"))
    # use_kernels=False: the model's own modules, as the run computed with (hf_fsdp2/compat.py NO_HUB_KERNELS).
    kwargs = dict(
        device_map="auto",
        max_memory={"cpu": request["ram"]},
        offload_folder=request["offload"],
        use_kernels=False,
    )
    model, info = auto.from_pretrained(
        request["folder"],
        dtype=getattr(torch, dtype),
        output_loading_info=True,
        trust_remote_code=request.get("trust_remote_code", False),
        **kwargs,
    )
    return model, info


def tensor(model: Any, name: str) -> torch.Tensor:
    """A parameter or buffer by name; an offloaded one (on the meta device) from accelerate's weights map."""
    module_name, _, leaf = name.rpartition(".")
    param = model.get_parameter(name) if name in dict(model.named_parameters()) else model.get_buffer(name)
    if param.device.type != "meta":
        return param.detach()  # type: ignore[no-any-return]
    hook = getattr(model.get_submodule(module_name), "_hf_hook", None)
    return hook.weights_map[leaf]  # type: ignore[union-attr,no-any-return]


def compare_slices(model: Any, boxes: dict[str, list[Any]]) -> tuple[list[str], int]:
    """The live slices whose bytes differ in the reload (or whose tensor it lacks), and how many were compared."""
    mismatched, compared = [], 0
    for name, items in boxes.items():
        try:
            full = tensor(model, name).cpu()
        except Exception as err:
            mismatched.append(f"{name}: not in the reloaded model ({type(err).__name__})")
            continue
        for offsets, sizes, digest in items:
            part = full[tuple(slice(o, o + s) for o, s in zip(offsets, sizes, strict=False))].contiguous()
            compared += 1
            if hashlib.sha256(part.view(torch.uint8).numpy().tobytes()).hexdigest() != digest:
                where = ", ".join(f"{o}:{o + s}" for o, s in zip(offsets, sizes, strict=False))
                mismatched.append(f"{name}[{where}]")
    return mismatched, compared


def probe(model: Any, ids: torch.Tensor) -> torch.Tensor:
    """The logits of the probe batch (eval mode, no grad), in fp32."""
    model.eval()
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits.float()  # type: ignore[no-any-return]


def main(argv: list[str]) -> None:
    """``argv``: the request file and the file the findings go to."""
    request = torch.load(argv[0])
    out = argv[1]
    model, info = load(request, request["load_dtype"])
    mismatched, compared = compare_slices(model, request["boxes"])
    config = {k: v for k, v in model.config.to_dict().items() if k not in request["ignore"]}
    live_config = request["config"]
    differ = sorted(k for k in set(config) | set(live_config) if config.get(k) != live_config.get(k))
    config_diff = [f"{k}: live {live_config.get(k)!r}, reloaded {config.get(k)!r}" for k in differ]
    architecture = type(model).__name__  # the class the auto class chose from config.json
    head, emb = model.get_output_embeddings(), model.get_input_embeddings()
    tied = head is not None and head.weight is emb.weight
    devices = sorted(set(map(str, (getattr(model, "hf_device_map", None) or {"": "cpu"}).values())))
    if request["compute_dtype"] != request["load_dtype"]:
        # Loaded again rather than cast: buffers computed at init (rotary frequencies) follow the load dtype.
        del model
        model, _ = load(request, request["compute_dtype"])
    logits, noise = probe(model, request["ids"]), 0.0
    if request["reference_dtype"]:
        # The same weights computed in a wider dtype: how much this process's own rounding moves the logits.
        del model
        model, _ = load(request, request["reference_dtype"])
        noise = float((probe(model, request["ids"]).double() - logits.double()).abs().max())
    torch.save(
        {
            "logits": logits,
            "noise": noise,
            "problems": {k: sorted(str(x) for x in v) for k, v in info.items() if v},
            "mismatched": mismatched,
            "compared": compared,
            "config_diff": config_diff,
            "config_keys": len(config),
            "tied": tied,
            "architecture": architecture,
            "devices": devices,
            "hf_fsdp2": any(m.startswith("hf_fsdp2") for m in sys.modules),
        },
        out,
    )


if __name__ == "__main__":
    main(sys.argv[1:])
