"""Expert parallel's forward against transformers' own experts forward, in one process (an ep group of one rank: the
exchanges are identities, everything else runs: the sort by expert, the counts, the regrouping by local expert, the
local implementation on the local blocks, the restore and the weighted sum over the choices).

Each family's experts module (Qwen3-MoE, Mixtral, gpt-oss with its biases and interleaved gate) is run twice from
the same weights and the same routed tokens, once by transformers (``grouped_mm`` and ``eager``) and once through
expert parallel; outputs and every gradient (the hidden states', the top-k weights', each fused tensor's) match.
The regrouping of received rows from (source rank, expert) to (expert, source rank) order is checked on its own for
an ep group of 3, with empty blocks."""

from __future__ import annotations

import copy
import os

import pytest
import torch
import torch.distributed as dist
import transformers
from support.families import _COMMON, FAMILIES
from torch.distributed.device_mesh import init_device_mesh

from hf_fsdp2.parallel.expert_parallel import (
    EXPERTS_IMPLEMENTATION,
    _regroup,
    apply_expert_parallel,
    expert_shards,
)
from hf_fsdp2.parallel.experts import expert_load_metrics, find_experts


@pytest.fixture(scope="module")
def one_rank_group() -> object:
    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29533")
        dist.init_process_group("gloo", rank=0, world_size=1)
    yield init_device_mesh("cpu", (1,), mesh_dim_names=("ep",))


def _model(family: str, implementation: str) -> torch.nn.Module:
    name, extra = FAMILIES[family]
    config = getattr(transformers, name)(vocab_size=256, **{**_COMMON, **extra})
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, experts_implementation=implementation)
    for module in find_experts(model).values():
        for p in module.parameters(recurse=False):
            torch.nn.init.normal_(p, std=0.2)
    return model


def _run(module: torch.nn.Module, hidden: torch.Tensor, index: torch.Tensor, weights: torch.Tensor) -> dict:
    hidden, weights = hidden.clone().requires_grad_(), weights.clone().requires_grad_()
    out = module(hidden, index, weights)
    (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
    grads = {
        n: (p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad)
        for n, p in module.named_parameters()
    }
    return {"out": out.detach(), "hidden": hidden.grad, "weights": weights.grad, **grads}


@pytest.mark.parametrize("implementation", ["grouped_mm", "eager"])
@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral", "gpt_oss"])
def test_expert_parallel_forward_equals_transformers(
    one_rank_group, family: str, implementation: str
) -> None:
    reference = _model(family, implementation)
    model = copy.deepcopy(reference)
    line = apply_expert_parallel(model, one_rank_group)
    assert f"computed by {implementation!r}" in line
    assert model.config._experts_implementation == EXPERTS_IMPLEMENTATION
    name, experts = next(iter(find_experts(model).items()))
    assert isinstance(experts.gate_up_proj, torch.distributed.tensor.DTensor)
    ref_experts = reference.get_submodule(name)
    torch.manual_seed(1)
    tokens, k, hidden = 37, 2, experts.gate_up_proj.shape[-1 if family != "gpt_oss" else 1]
    hidden_states = torch.randn(tokens, hidden)
    index = torch.randint(0, 4, (tokens, k))
    index[:, 1] = (index[:, 0] + 1 + torch.randint(0, 3, (tokens,))) % 4  # distinct choices per token
    index[:5] = torch.tensor([0, 1])  # expert 3 never chosen by these; all experts by the rest
    weights = torch.softmax(torch.randn(tokens, k), -1)
    want = _run(ref_experts, hidden_states, index, weights)
    got = _run(experts, hidden_states, index, weights)
    assert want.keys() == got.keys()
    for key in want:
        torch.testing.assert_close(
            got[key], want[key], rtol=1e-4, atol=1e-5, msg=lambda m, key=key: f"{key}: {m}"
        )
    load = expert_shards(model)[name].load.counts
    assert load is not None and load.tolist() == torch.bincount(index.reshape(-1), minlength=4).tolist()


def test_the_load_of_the_experts_is_logged_as_multiples_of_an_even_load(one_rank_group) -> None:
    model = _model("qwen3_moe", "grouped_mm")
    apply_expert_parallel(model, one_rank_group)
    experts = find_experts(model)
    first, second = experts.values()
    first(torch.randn(4, 64), torch.tensor([[0, 1]] * 4), torch.full((4, 2), 0.5))  # 8 choices: 4, 4, 0, 0
    assert expert_load_metrics(model, torch.device("cpu")) == {"moe_load_min": 0.0, "moe_load_max": 2.0}
    assert expert_load_metrics(model, torch.device("cpu")) == {}  # read and reset; the second layer never ran


def test_received_rows_regroup_by_local_expert_then_source_rank() -> None:
    # ep 3, 2 local experts: received[source][expert] rows, laid out by source then expert.
    received = torch.tensor([[2, 0], [1, 3], [0, 1]])
    layout = [(s, e) for s in range(3) for e in range(2) for _ in range(int(received[s, e]))]
    index, experts = _regroup(received, len(layout))
    regrouped = [layout[i] for i in index.tolist()]
    assert regrouped == sorted(layout, key=lambda se: (se[1], se[0]))
    assert experts.tolist() == [e for _, e in regrouped]
