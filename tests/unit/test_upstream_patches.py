"""Every patch of torch / accelerate / torchao and every write into their private state (docs/compatibility.md's
table), each tested twice: the upstream behaviour the patch relies on or works around is still there (these tests
fail when an upgrade changes it: the patch is then to be revisited, not silently kept), and the patch is applied,
restored or refused as its guard says."""

from __future__ import annotations

import inspect
import logging
from typing import Any

import pytest
import torch

# -- torchao NF4Tensor.dequantize (hf_fsdp2/lora/quantize.py::_peft_dequantize; the DoRA reload's copy) ----------


def _nf4() -> Any:
    pytest.importorskip("torchao")
    from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import NF4Tensor, to_nf4

    return NF4Tensor, to_nf4


def test_peft_calls_weight_dequantize_which_torchao_nf4_answers_only_with_two_arguments() -> None:
    """Why the patch exists: PEFT dequantises any torchao weight with ``weight.dequantize()``; torchao's NF4 tensor
    has a static ``dequantize(value, nf4)`` (its lookup step) and ``get_original_weight()`` for the whole weight."""
    from peft.utils import integrations

    nf4_type, _ = _nf4()
    assert "module.weight.dequantize()" in inspect.getsource(integrations.dequantize_module_weight)
    original = nf4_type.__dict__["dequantize"]
    if getattr(original, "_hf_fsdp2", False):  # patched earlier in this process: the wrapped step
        original = staticmethod(inspect.getclosurevars(original).nonlocals["lookup"])
    assert isinstance(original, staticmethod)
    assert list(inspect.signature(original.__func__).parameters) == ["value", "nf4"]
    assert callable(nf4_type.get_original_weight)


def test_the_dequantize_patch_answers_both_calls_once_and_refuses_a_changed_torchao() -> None:
    from hf_fsdp2.lora.quantize import QuantizationError, _peft_dequantize

    nf4_type, to_nf4 = _nf4()
    weight = torch.randn(128, 128)
    nf4 = to_nf4(weight, 64, 256)
    found = nf4_type.__dict__["dequantize"]
    step = (
        found.__func__
        if isinstance(found, staticmethod)
        else inspect.getclosurevars(found).nonlocals["lookup"]
    )
    _peft_dequantize(nf4_type)
    patched = nf4_type.__dict__["dequantize"]
    _peft_dequantize(nf4_type)  # idempotent: the marker stops a second wrap
    assert nf4_type.__dict__["dequantize"] is patched and patched._hf_fsdp2
    assert torch.equal(nf4.dequantize(), nf4.get_original_weight())
    codes = torch.tensor([0, 15])
    assert torch.equal(nf4_type.dequantize(codes, nf4.nf4), step(codes, nf4.nf4))

    class Changed:  # an NF4 tensor whose dequantize became an ordinary method
        def dequantize(self) -> None: ...

        def get_original_weight(self) -> None: ...

    with pytest.raises(QuantizationError, match="not the static dequantize"):
        _peft_dequantize(Changed)


def test_the_dora_reload_answers_dequantize_once_and_refuses_a_changed_torchao() -> None:
    """The reload script's copy (hf_fsdp2/export/reload_scripts/reload_adapter.py): idempotent in the shared
    interpreter, refused with the fix on a changed torchao."""
    import runpy

    from hf_fsdp2.export import reload_scripts

    answer = runpy.run_path(str(reload_scripts.ADAPTER))["answer_dequantize"]

    class Nf4:
        @staticmethod
        def dequantize(value: Any, nf4: Any) -> Any:
            return ("step", value, nf4)

        def get_original_weight(self) -> str:
            return "whole"

    answer(Nf4)
    first = Nf4.__dict__["dequantize"]
    answer(Nf4)  # a second QDoRA reload in the same interpreter
    assert Nf4.__dict__["dequantize"] is first
    assert Nf4().dequantize() == "whole" and Nf4.dequantize(1, 2) == ("step", 1, 2)  # type: ignore[call-arg]

    class Changed:
        def dequantize(self) -> None: ...

    with pytest.raises(RuntimeError, match="DoRA reload cannot answer"):
        answer(Changed)


# -- torchao NF4Tensor.fsdp_pre/post_all_gather (hf_fsdp2/lora/quantize.py::_single_rank_all_gather) --------------


def _original_hooks(nf4_type: Any) -> tuple[Any, Any]:
    pre, post = nf4_type.__dict__["fsdp_pre_all_gather"], nf4_type.__dict__["fsdp_post_all_gather"]
    if getattr(pre, "_hf_fsdp2", False):
        names = inspect.getclosurevars(pre).nonlocals
        pre, post = names["pre"], inspect.getclosurevars(post).nonlocals["post"]
    return pre, post


def test_fsdp2_with_one_rank_copies_only_the_first_all_gather_input() -> None:
    """Why the patch exists: with a one-rank shard group FSDP2 skips the all-gather and copies
    ``all_gather_inputs[0]`` alone; torchao's NF4 hands it three (scales, factors, codes)."""
    from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup

    from hf_fsdp2.lora.quantize import single_rank_hooks_problem

    source = inspect.getsource(FSDPParamGroup.wait_for_unshard)
    assert "if world_size == 1:" in source and "fsdp_param.all_gather_inputs[0]" in source
    nf4_type, _ = _nf4()
    pre, post = _original_hooks(nf4_type)
    assert single_rank_hooks_problem(pre, post) is None


class _Mesh:
    """What the hooks ask of FSDP2's mesh: its group's size."""

    def __init__(self, size: int) -> None:
        self._size = size

    def get_group(self) -> Any:
        return self

    def size(self) -> int:
        return self._size


def test_the_one_rank_hooks_pack_and_rebuild_and_leave_more_ranks_to_torchao() -> None:
    from hf_fsdp2.lora.quantize import _single_rank_all_gather

    nf4_type, to_nf4 = _nf4()
    _single_rank_all_gather(nf4_type)
    assert nf4_type.__dict__["fsdp_pre_all_gather"]._hf_fsdp2
    nf4 = to_nf4(torch.randn(128, 128), 64, 256).new_zeros(128, 128)
    nf4.copy_(to_nf4(torch.randn(128, 128), 64, 256))  # as FSDP2 holds a shard: copied into a padded buffer
    pre, _ = _original_hooks(nf4_type)
    assert len(pre(nf4, _Mesh(1))[0]) == 3  # torchao's own: three parts
    inputs, metadata = nf4.fsdp_pre_all_gather(_Mesh(1))
    assert len(inputs) == 1 and inputs[0].dtype == torch.uint8  # one packed byte buffer
    rebuilt, _ = nf4.fsdp_post_all_gather(inputs, metadata, torch.float32)
    assert torch.equal(rebuilt.get_original_weight(), nf4.get_original_weight())
    inputs, _ = nf4.fsdp_pre_all_gather(_Mesh(2))
    assert len(inputs) == 3  # more ranks: torchao's hooks, unchanged


def test_hooks_of_another_shape_are_left_alone_and_the_run_is_told(caplog: pytest.LogCaptureFixture) -> None:
    from hf_fsdp2.lora.quantize import _single_rank_all_gather

    class Changed:
        def fsdp_pre_all_gather(self, mesh: Any, module: Any) -> None: ...

        def fsdp_post_all_gather(self, outputs: Any, metadata: Any) -> None: ...

    pre = Changed.__dict__["fsdp_pre_all_gather"]
    with caplog.at_level(logging.WARNING, logger="hf_fsdp2"):
        _single_rank_all_gather(Changed)
    assert Changed.__dict__["fsdp_pre_all_gather"] is pre
    assert (
        "not patched for one-rank shard groups" in caplog.text and "['self', 'mesh', 'module']" in caplog.text
    )


# -- accelerate.utils.modeling.is_torchao_available (hf_fsdp2/parallel/accelerator.py::_torchao_checked_once) -----


def test_accelerate_reads_is_torchao_available_per_parameter_through_its_module() -> None:
    from accelerate.utils import fsdp_utils, modeling

    assert "is_torchao_available" in modeling._get_parameter_id.__code__.co_names
    assert "_get_parameter_id" in inspect.getsource(fsdp_utils) + inspect.getsource(modeling)


def test_is_torchao_available_is_answered_once_inside_the_prepare_and_restored(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from accelerate.utils import modeling

    from hf_fsdp2.parallel.accelerator import _torchao_checked_once

    original = modeling.is_torchao_available
    with _torchao_checked_once():
        assert modeling.is_torchao_available is not original
        assert modeling.is_torchao_available() == original()
    assert modeling.is_torchao_available is original
    with pytest.raises(ValueError), _torchao_checked_once():
        raise ValueError("a failed prepare")
    assert modeling.is_torchao_available is original  # restored on failure too
    monkeypatch.setattr(
        modeling, "_get_parameter_id", lambda param: id(param)
    )  # an accelerate that stopped asking
    with _torchao_checked_once():
        assert modeling.is_torchao_available is original  # guard: nothing patched


# -- accelerate PartialState._shared_state (hf_fsdp2/parallel/accelerator.py: the CPU path marks itself FSDP) ------


def test_partial_state_keeps_its_fields_in_the_class_wide_shared_dict() -> None:
    from accelerate.state import AcceleratorState, PartialState

    assert isinstance(vars(PartialState)["_shared_state"], dict)
    assert "self.__dict__ = self._shared_state" in inspect.getsource(PartialState.__init__)
    assert "PartialState._shared_state" in inspect.getsource(AcceleratorState)  # built on the partial state


def test_the_shared_state_guard_refuses_a_state_kept_otherwise() -> None:
    from hf_fsdp2.parallel.accelerator import check_shared_state

    class Borg:
        _shared_state: dict[str, Any] = {}

        def __init__(self) -> None:
            self.__dict__ = self._shared_state

    class Plain:
        _shared_state: dict[str, Any] = {}

    check_shared_state(Borg())
    with pytest.raises(RuntimeError, match="no longer keeps its fields in the shared _shared_state"):
        check_shared_state(Plain())


# -- torch._dynamo.config.skip_fwd_side_effects_in_bwd_under_checkpoint (hf_fsdp2/parallel/compiling.py) ----------


def test_the_dynamo_setting_exists_and_is_set_or_the_run_is_told(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    from hf_fsdp2.parallel import compiling

    config = torch._dynamo.config
    assert isinstance(getattr(config, compiling.DYNAMO_SETTING), bool)
    with config.patch(compiling.DYNAMO_SETTING, False):
        compiling._configure_dynamo()
        assert getattr(config, compiling.DYNAMO_SETTING) is True
    monkeypatch.setattr(compiling, "DYNAMO_SETTING", "renamed_in_a_later_torch")
    with caplog.at_level(logging.WARNING, logger="hf_fsdp2"):
        compiling._configure_dynamo()
    assert "has no torch._dynamo.config.renamed_in_a_later_torch: not set" in caplog.text
    assert not hasattr(config, "renamed_in_a_later_torch")


# -- nn.Module._compiled_call_impl (hf_fsdp2/parallel/compiling.py::compile_model) ---------------------------------


def test_module_call_runs_the_compiled_call_slot_and_the_guard_refuses_without_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from hf_fsdp2.config.plans import CompilePlan
    from hf_fsdp2.parallel import compiling

    assert compiling.compiled_call_slot()
    module = torch.nn.Linear(2, 2)
    module._compiled_call_impl = lambda *a, **k: "through the slot"  # what nn.Module.compile sets
    assert module(torch.zeros(2)) == "through the slot"
    monkeypatch.setattr(compiling, "compiled_call_slot", lambda: False)
    with pytest.raises(RuntimeError, match="no longer runs _compiled_call_impl"):
        compiling.compile_model(torch.nn.Linear(2, 2), CompilePlan(enabled=True, scope="model"))


# -- LRScheduler._last_lr (hf_fsdp2/train/optim.py::restore_scheduler) ---------------------------------------------


def test_get_last_lr_answers_from_last_lr_which_the_resume_sets() -> None:
    from torch.optim.lr_scheduler import LambdaLR

    from hf_fsdp2.train.optim import restore_scheduler

    assert "_last_lr" in inspect.getsource(LambdaLR.get_last_lr)
    param = torch.nn.Parameter(torch.zeros(1))
    scheduler = LambdaLR(torch.optim.SGD([param], lr=1.0), lambda step: 0.5**step)
    for _ in range(3):
        scheduler.optimizer.step()
        scheduler.step()
    state = scheduler.state_dict()
    fresh = LambdaLR(torch.optim.SGD([param], lr=2.0), lambda step: 0.5**step)
    restore_scheduler(fresh, state, peak_lr=2.0)
    assert fresh.get_last_lr() == [2.0 * 0.5**3] == [g["lr"] for g in fresh.optimizer.param_groups]

    class NoLastLr(LambdaLR):
        def load_state_dict(self, state_dict: dict[str, Any]) -> None:
            super().load_state_dict(state_dict)
            del self._last_lr

    odd = NoLastLr(torch.optim.SGD([param], lr=2.0), lambda step: 1.0)
    with pytest.raises(RuntimeError, match="no _last_lr list after load_state_dict"):
        restore_scheduler(odd, state, peak_lr=2.0)


# -- optimizer.found_inf (hf_fsdp2/train/nonfinite.py: the GradScaler protocol, not a patch) -----------------------


def test_fused_adamw_skips_its_step_when_found_inf_is_set() -> None:
    """Not a patch: the attribute torch.amp.GradScaler sets. The non-finite guard relies on fused AdamW reading it
    (on CPU too): with 1 the step changes nothing, with 0 it steps."""
    param = torch.nn.Parameter(torch.ones(4))
    opt = torch.optim.AdamW([param], lr=0.1, fused=True)
    param.grad = torch.ones(4)
    opt.found_inf = torch.tensor(1.0)  # type: ignore[attr-defined]
    opt.step()
    assert torch.equal(param.detach(), torch.ones(4))
    opt.found_inf = torch.tensor(0.0)  # type: ignore[attr-defined]
    opt.step()
    assert not torch.equal(param.detach(), torch.ones(4))


# -- FSDP2 reshard_after_forward (hf_fsdp2/methods/grpo/rollout.py::gathered: the public setter, a read-only read) --

_GATHERED = r"""
import json, socket, sys
import torch, torch.distributed as dist
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor
try:
    from hf_fsdp2.methods.grpo.rollout import gathered, reshards_after_forward
except ImportError:  # the path before the methods/ move
    from hf_fsdp2.train.rollout import gathered, reshards_after_forward
with socket.socket() as s:
    s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
fully_shard(model[0]); fully_shard(model[1], reshard_after_forward=False); fully_shard(model)  # root: automatic
units = [m for m in model.modules() if isinstance(m, FSDPModule)]
model(torch.ones(2, 4))  # the root's lazy init: its automatic setting resolves to no reshard
before = [reshards_after_forward(u) for u in units]
with gathered(model):
    inside = [reshards_after_forward(u) for u in units]
    model(torch.ones(2, 4))
    kept = not any(isinstance(p, DTensor) for p in model[0].parameters())  # still gathered after a forward
after = [reshards_after_forward(u) for u in units]
model(torch.ones(2, 4))
resharded = all(isinstance(p, DTensor) for p in model[0].parameters())  # resharded after forward again
print(json.dumps({"before": before, "inside": inside, "kept": kept, "after": after, "resharded": resharded}))
dist.destroy_process_group()
"""


def test_the_rollout_keeps_units_gathered_through_the_public_setter_and_restores_each() -> None:
    """Upstream: ``FSDPModule.set_reshard_after_forward(bool, recurse)`` and the parameter groups'
    ``post_forward_mesh_info`` / ``mesh_info`` that ``reshards_after_forward`` reads. Then, at world 1 on gloo: each
    unit's setting (a layer that reshards, one that does not, the root) is the same after the block as before, no
    unit reshards inside it, and the layer reshards after its forwards again."""
    import json

    from support.launch import python
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup

    assert list(inspect.signature(FSDPModule.set_reshard_after_forward).parameters) == [
        "self",
        "reshard_after_forward",
        "recurse",
    ]
    init = inspect.getsource(FSDPParamGroup.__init__)
    assert (
        "self.post_forward_mesh_info = post_forward_mesh_info" in init
        and "self.mesh_info = mesh_info" in init
    )
    out = json.loads(
        python("-c", [_GATHERED]).stdout.strip().splitlines()[-1]
    )  # units: root, layer 0, layer 1
    assert out == {
        "before": [False, True, False],
        "inside": [False, False, False],
        "kept": True,
        "after": [False, True, False],
        "resharded": True,
    }, out
