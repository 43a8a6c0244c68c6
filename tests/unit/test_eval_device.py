"""An eval pass on a (fake) GPU reads the device once: the all-reduced loss and token count at its end. The
chunked loss's target rows come from the host labels (found on the device, each batch would also wait
for it in ``nonzero()``)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from support.devices import DEVICE, FakeAccelerator
from support.tiny import make_tiny_llama_dir

from hf_fsdp2.data.loader import PaddingCollator
from hf_fsdp2.data.packing import PackedCollator
from hf_fsdp2.model import load_model
from hf_fsdp2.observe.evaluate import eval_batches, evaluate_loss
from hf_fsdp2.train.loss import LossPlan


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_llama_dir(tmp_path_factory.mktemp("eval_device") / "model", seed=8)


def _examples() -> list[dict[str, list[int]]]:
    # Prompt positions masked, as in chat data: the target rows have gaps that must be found somewhere.
    out = []
    for n in (6, 9, 11, 7, 5):
        ids = list(range(5, 5 + n))
        out.append({"input_ids": ids, "labels": [-100] * 3 + ids[3:]})
    return out


@pytest.mark.parametrize("padding_free", [False, True])
def test_an_eval_pass_reads_the_device_once(model_dir: Path, padding_free: bool) -> None:
    model = load_model(str(model_dir))
    collator = PackedCollator(0, padding_free=True) if padding_free else PaddingCollator(pad_token_id=0)
    plan = LossPlan(chunk_tokens=4)  # several chunks per batch: rows matter
    batches = list(eval_batches(_examples(), rank=0, world_size=1, batch_size=2, collator=collator))
    assert len(batches) == 3
    mode = FakeAccelerator()
    mode.put_module(model)
    with mode:
        result = evaluate_loss(model, iter(batches), DEVICE, plan=plan)
    assert not mode.mismatches
    ours = [(what, where) for what, where in mode.host_reads if where.split("/")[0] in ("train", "observe")]
    assert [what for what, _ in ours] == ["tolist()"], ours  # three batches, one read: the totals at the end
    plain = evaluate_loss(load_model(str(model_dir)), iter(batches), torch.device("cpu"), plan=LossPlan())
    assert result.tokens == plain.tokens == sum(len(e["input_ids"]) - 3 for e in _examples())
    assert result.loss == pytest.approx(plain.loss, rel=1e-5)  # fp32: chunked vs plain summation order
