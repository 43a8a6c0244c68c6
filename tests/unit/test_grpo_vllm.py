"""GRPO's vLLM rollouts without vLLM: the importance sampling correction (TRL 1.16's four modes), its place in the
loss, the keys, the client's errors against a stand-in HTTP server (not up, dies, too slow, other weights), the
per-layer weight sending, and the ``hf-fsdp2 vllm-serve`` command's choice of Python. The real server:
tests/recipes/test_grpo_vllm.py."""

from __future__ import annotations

import math
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from support import vllm_standin as standin

from hf_fsdp2.config import ConfigError
from hf_fsdp2.methods.grpo.config import GrpoArgs
from hf_fsdp2.methods.grpo.loss import GrpoSettings, grpo_loss_sums
from hf_fsdp2.methods.grpo.rollout import SamplingSettings
from hf_fsdp2.methods.grpo.vllm.client import (
    ServerSettings,
    VllmClient,
    VllmGenerator,
    VllmServerError,
    cut_at_eos_list,
)
from hf_fsdp2.methods.grpo.vllm.importance import ImportanceSampling, attach_sampling_logps, importance_ratio
from hf_fsdp2.methods.grpo.vllm.probe import probe_bound
from hf_fsdp2.parallel.gather import sync_units

OLD = torch.tensor([[-1.0, -2.0, -0.5], [-0.1, -3.0, -1.0]])
SAMPLING = torch.tensor([[-1.5, -1.0, -0.5], [-0.1, float("nan"), -2.0]])
MASK = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])


def test_importance_ratio_is_trls_formula_in_each_mode() -> None:
    """d = (old - sampling) x mask, NaN -> 0 (TRL: a token vLLM could not score gets ratio 1); token modes exp(d),
    sequence modes exp(sum d); truncate clamps to [min, max], mask zeroes outside."""
    d = torch.tensor([[0.5, -1.0, 0.0], [0.0, 0.0, 1.0]])
    got = importance_ratio(OLD, SAMPLING, MASK, "token_truncate", None, 2.0)
    assert torch.allclose(got, d.exp().clamp(max=2.0))
    got = importance_ratio(OLD, SAMPLING, MASK, "token_mask", 0.5, 2.0)
    want = d.exp()
    want[(want < 0.5) | (want > 2.0)] = 0.0
    assert torch.allclose(got, want) and got[0, 1] == 0.0 and got[1, 2] == 0.0
    seq = d.sum(-1, keepdim=True).exp()  # [[e^-0.5], [e^1]]
    got = importance_ratio(OLD, SAMPLING, MASK, "sequence_truncate", 0.7, 2.0)
    assert got.shape == (2, 1) and torch.allclose(got, seq.clamp(0.7, 2.0))
    got = importance_ratio(OLD, SAMPLING, MASK, "sequence_mask", None, 2.5)  # e^1 = 2.72 > 2.5: masked
    assert torch.allclose(got, torch.tensor([[math.exp(-0.5)], [0.0]]))
    with pytest.raises(ValueError, match="vllm_importance_sampling_mode='sequence'"):
        importance_ratio(OLD, SAMPLING, MASK, "sequence", None, 3.0)


def test_the_correction_weights_the_surrogate_not_the_kl_and_logs_trls_metrics() -> None:
    settings = GrpoSettings(loss_type="dapo", beta=0.1, num_generations=2)
    logps = OLD.clone().requires_grad_()
    adv, ref = torch.tensor([1.0, -1.0]), OLD - 0.3
    ratio = torch.tensor([[2.0, 0.5, 1.0], [0.0, 1.0, 3.0]])
    plain = grpo_loss_sums(logps, OLD, ref, adv, MASK, settings)
    zero_kl = GrpoSettings(loss_type="dapo", beta=0.0, num_generations=2)
    surrogate = lambda r: grpo_loss_sums(logps, OLD, None, adv, MASK, zero_kl, is_ratio=r).loss  # noqa: E731
    weighted = grpo_loss_sums(logps, OLD, ref, adv, MASK, settings, is_ratio=ratio)
    kl_part = plain.loss - surrogate(None)
    assert torch.allclose(weighted.loss, surrogate(ratio) + kl_part)
    # ratio 1 (old == logps): the surrogate is -A per token, so the weighted sum is -sum(A x rho x mask)
    assert torch.allclose(surrogate(ratio), -(adv[:, None] * ratio * MASK).sum())
    correction = ImportanceSampling("token_truncate", None, 3.0)
    rows = [{"completion_mask": MASK.long(), "sampling_logps": SAMPLING}]
    (r,) = correction.ratios([OLD], rows)
    metrics = correction.metrics(torch.device("cpu"))
    flat = r[MASK.bool()]
    assert metrics["sampling/importance_sampling_ratio/mean"] == pytest.approx(float(flat.mean()))
    assert metrics["sampling/importance_sampling_ratio/min"] == pytest.approx(float(flat.min()))
    assert metrics["sampling/sampling_logp_difference/max"] == pytest.approx(1.0)  # NaN token left out
    assert metrics["sampling/sampling_logp_difference/mean"] == pytest.approx((0.5 + 1.0 + 0.0 + 1.0) / 4)


def test_sampling_logps_are_attached_per_micro_batch_in_order() -> None:
    class Kept:
        def take_logps(self) -> list[list[float]]:
            return [[-1.0], [-2.0, -3.0], [-4.0, -5.0, -6.0]]

    rows = [
        {"completion_mask": torch.ones((1, 2), dtype=torch.long)},
        {"completion_mask": torch.ones((2, 3))},
    ]
    attach_sampling_logps(rows, Kept())
    assert rows[0]["sampling_logps"].tolist() == [[-1.0, 0.0]]
    assert rows[1]["sampling_logps"].tolist() == [[-2.0, -3.0, 0.0], [-4.0, -5.0, -6.0]]
    attach_sampling_logps(rows[:1], object())  # a generator without them: nothing
    assert rows[0]["sampling_logps"].tolist() == [[-1.0, 0.0]]


def test_vllm_keys_trl_defaults_and_refusals() -> None:
    g = GrpoArgs(reward_funcs=["format"])
    g.validate()
    assert (
        g.use_vllm,
        g.vllm_importance_sampling_correction,
        g.vllm_importance_sampling_mode,
        g.is_clip_max,
    ) == (False, True, "sequence_mask", 3.0)
    assert g.vllm_url == "http://0.0.0.0:8000"
    assert (
        GrpoArgs(vllm_importance_sampling_cap=2.0).is_clip_max == 2.0
    )  # TRL's deprecated name sets clip_max
    assert GrpoArgs(vllm_server_base_url="http://h:9/").vllm_url == "http://h:9/"
    GrpoArgs(
        reward_funcs=["format"], use_vllm=True, vllm_mode="colocate"
    ).validate()  # built: needs vLLM at run
    with pytest.raises(ConfigError, match=r"vllm_gpu_memory_utilization=1.5 is not a fraction in \(0, 1\]"):
        GrpoArgs(vllm_gpu_memory_utilization=1.5).validate()
    with pytest.raises(ConfigError, match="vllm_importance_sampling_mode='tok' is not one of token_truncate"):
        GrpoArgs(vllm_importance_sampling_mode="tok").validate()
    with pytest.raises(ConfigError, match="clip_min=3.0 must be below vllm_importance_sampling_clip_max=3.0"):
        GrpoArgs(vllm_importance_sampling_clip_min=3.0).validate()
    with pytest.raises(ConfigError, match="vllm_request_timeout=0.0 must be > 0"):
        GrpoArgs(vllm_request_timeout=0.0).validate()


@pytest.fixture(autouse=True)
def _stand_in_vllm(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """The stand-in's ``vllm`` module for the tests that run the server's code, not for the one that needs none."""
    if "without_vllm" not in request.node.name:
        import sys

        monkeypatch.setitem(sys.modules, "vllm", standin.vllm_module())


class Fake:
    """The real server (its HTTP handler, ``Engine`` and worker functions) over a stand-in engine
    (tests/support/vllm_standin.py), behaving as ``behaviour`` says."""

    def __init__(
        self, behaviour: str, workers: int = 1, dtype: str = "float32", reads: int | None = None
    ) -> None:
        self.llm = standin.LLM(workers=workers, dtype=dtype)
        if reads is not None:
            self.llm.workers[-1].reads = reads
        self.engine = standin.engine(self.llm, dtype)
        self.server, self.url, self.bodies = standin.serve(self.engine, behaviour)


@pytest.fixture
def fake(request: pytest.FixtureRequest) -> Iterator[Fake]:
    server = Fake(request.param)
    yield server
    server.server.shutdown()


def _generator(
    url: str, model: torch.nn.Module | None = None, settings: SamplingSettings | None = None, **kw: float
) -> VllmGenerator:
    model = model or torch.nn.Linear(2, 2)
    client = VllmClient(ServerSettings(url, **kw))
    gen = VllmGenerator(
        model,
        client,
        eos_ids=[standin.EOS],
        settings=settings or SamplingSettings(max_completion_length=4),
        probe=([1], [2]),
        compute_dtype="float32",
        device=torch.device("cpu"),
    )
    gen.check_probe = lambda: 0.0  # type: ignore[method-assign]  # a Linear has no log-probs; the real one: recipes
    return gen


def test_a_server_that_is_not_up_is_named_with_its_timeout_and_the_command_to_start_it() -> None:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    gen = _generator(f"http://127.0.0.1:{port}", timeout=2.0)
    start = time.monotonic()
    with pytest.raises(VllmServerError) as err:
        gen.connect()
    assert time.monotonic() - start < 10
    text = str(err.value)
    assert f"no vLLM server answered at http://127.0.0.1:{port} within vllm_server_timeout=2 s" in text
    assert (
        "failed while connecting to the vLLM server (rank 0)" in text
        and "hf-fsdp2 vllm-serve --model" in text
    )


@pytest.mark.parametrize("fake", ["unreachable"], indirect=True)
def test_a_server_that_cannot_join_the_weight_group_stops_the_connect_within_its_timeout(fake: Fake) -> None:
    """The server's workers cannot reach the trainer's store: the connect fails on every rank within
    vllm_server_timeout (the rendezvous's), with the server's reason, not after vllm_request_timeout."""
    gen = _generator(fake.url, timeout=2.0, request_timeout=600.0)
    start = time.monotonic()
    with pytest.raises(
        VllmServerError,
        match=r"failed while connecting to the vLLM server \(rank 0\).*failed POST /weights/group \(HTTP 500\): "
        "DistNetworkError: failed to connect",
    ):
        gen.connect()
    assert time.monotonic() - start < 30


@pytest.mark.parametrize("fake", ["dies"], indirect=True)
def test_a_server_that_dies_mid_update_is_a_clear_error(fake: Fake) -> None:
    gen = _generator(fake.url)
    gen.connect()
    with pytest.raises(
        VllmServerError, match="failed while sending the weights to the vLLM server .*is not answering"
    ):
        gen.generate([[1, 3]], seed=0)


@pytest.mark.parametrize("fake", ["slow"], indirect=True)
def test_a_request_past_its_timeout_names_vllm_request_timeout(fake: Fake) -> None:
    gen = _generator(fake.url, request_timeout=0.5)
    gen.connect()
    with pytest.raises(
        VllmServerError, match="did not answer POST /weights/update within vllm_request_timeout=0.5 s"
    ):
        gen.generate([[1, 3]], seed=0)


@pytest.mark.parametrize("fake", ["other"], indirect=True)
def test_a_server_answering_with_other_weights_is_refused(fake: Fake) -> None:
    gen = _generator(fake.url)
    gen.connect()
    with pytest.raises(VllmServerError, match="answered a rollout with weights version 99, not 1"):
        gen.generate([[1, 3]], seed=0)


def test_one_process_sends_a_unit_per_layer_over_the_group_and_a_batch_in_one_call() -> None:
    """An unsharded model (one process): one unit per decoder layer and one for the rest, each one broadcast in the
    server's dtype (bf16) to its workers (2, as --tensor-parallel-size 2), none over HTTP; a generation batch is one
    call of its unique prompts with n, completion k drawn with seed + k and cut at the end id."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=32,
        hidden_size=8,
        intermediate_size=16,
        num_hidden_layers=3,
        num_attention_heads=2,
        num_key_value_heads=1,
    )
    model = LlamaForCausalLM(config)
    units = sync_units(model)
    assert [u[0][0] for u in units[1:4]] == [f"model.layers.{i}.self_attn.q_proj.weight" for i in range(3)]
    assert {n for u in units[:1] + units[4:] for n, _ in u} == {
        "model.embed_tokens.weight",
        "model.norm.weight",
        "lm_head.weight",
    }
    fake = Fake("ok", workers=2, dtype="bfloat16")
    try:
        gen = _generator(fake.url, model)
        gen.connect()
        got = gen.generate_groups([[1, 3], [4]], 3, slice(0, 6), seed=7)
        assert got == [cut_at_eos_list(standin.completion_of(7 + k, 4), [standin.EOS]) for k in range(6)]
        assert len(gen.take_logps()) == 6 and gen.take_logps() == []
        sync = gen.last_sync
        assert sync is not None and (sync.gather.collectives, sync.broadcasts) == (0, len(units))
        assert sync.broadcast_bytes == 2 * sum(p.numel() for p in model.parameters())
        state = model.state_dict()
        for worker in fake.llm.workers:
            assert worker.loaded.keys() == state.keys() - {"lm_head.weight"} | {"lm_head.weight"}
            assert all(torch.equal(t, state[n].to(torch.bfloat16)) for n, t in worker.loaded.items())
        assert [p for p, _ in fake.bodies] == ["/weights/group", "/weights/update", "/generate"]
        (call,) = fake.llm.calls
        assert call["prompts"] == [[1, 3], [4]] and call["n"] == [3, 3]
        assert [p.seed for p in call["params"]] == [7, 10]
        gen.generate([[1]], seed=0, greedy=True)  # no update since: no new weights; greedy keeps no log-probs
        assert [p for p, _ in fake.bodies].count("/weights/update") == 1 and gen.take_logps() == []
        gen.mark_stale()
        gen.generate([[1]], seed=0)
        assert gen.version == 2 and fake.engine.version == 2
    finally:
        fake.server.shutdown()


def test_an_update_a_worker_did_not_load_whole_leaves_the_engine_refusing_rollouts() -> None:
    """A worker whose loader stopped early still receives every unit (the trainer never waits on a broadcast), the
    update fails on the trainer with the counts, and the engine refuses rollouts until a whole update arrives."""
    fake = Fake("ok", workers=2, reads=1)
    try:
        gen = _generator(fake.url, torch.nn.Linear(2, 2))
        gen.connect()
        with pytest.raises(VllmServerError, match=r"workers loaded \[2, 1\] tensors of the 2 sent"):
            gen.generate([[1, 3]], seed=0)
        assert fake.engine.version == 0 and fake.engine.torn
        gen.stale = False
        with pytest.raises(VllmServerError, match="holds a mix of two weight versions and refuses rollouts"):
            gen.generate([[1, 3]], seed=0)
        fake.llm.workers[-1].reads = None
        gen.version = 1
        gen.mark_stale()
        assert gen.generate([[1, 3]], seed=0) and fake.engine.version == 2 and fake.engine.torn is None
    finally:
        fake.server.shutdown()


def test_generation_kwargs_with_vllm_are_sampling_params_fields() -> None:
    """With use_vllm, generation_kwargs are vLLM SamplingParams fields (TRL's meaning): accepted at start-up (the names
    are checked against the engine's own fields once it answers), those with a key of their own or that the run sets
    itself refused by name; without vLLM they stay GenerationConfig fields."""
    vllm = {"reward_funcs": ["format"], "use_vllm": True}
    for kwargs in ('{"min_tokens": 2, "bad_words": ["no"]}', '{"suppress_tokens": [5]}'):
        GrpoArgs(**vllm, generation_kwargs=kwargs).validate()
    with pytest.raises(
        ConfigError, match=r"has \['min_tokens'\], not fields of transformers' GenerationConfig"
    ):
        GrpoArgs(reward_funcs=["format"], generation_kwargs='{"min_tokens": 2}').validate()
    for kwargs, message in (
        (
            '{"max_tokens": 3}',
            "sets 'max_tokens', which has a key of its own here: set max_completion_length instead",
        ),
        ('{"n": 2}', "set num_generations instead"),
        ('{"seed": 1}', "set seed \\(each prompt's sampling seed derives from it\\) instead"),
        (
            '{"logprobs": 5}',
            "sets 'logprobs', which the run sets itself \\(it asks for the sampled tokens' log-probs",
        ),
        (
            '{"stop_token_ids": [7]}',
            "the end ids are the tokenizer's EOS and generation_config.json's eos_token_id",
        ),
    ):
        with pytest.raises(ConfigError, match=message):
            GrpoArgs(**vllm, generation_kwargs=kwargs).validate()


@pytest.mark.parametrize("fake", ["ok"], indirect=True)
def test_generation_kwargs_reach_the_servers_sampling_params_and_other_names_are_refused(fake: Fake) -> None:
    """The engine's SamplingParams get generation_kwargs with every request (greedy too: eval samples as the rollout,
    as the transformers path applies them to both configs); a name its SamplingParams lacks stops the run at
    connect, before any rollout, with the name and the fields it has."""
    kwargs = {"min_tokens": 2, "bad_words": ["no"]}
    gen = _generator(fake.url, settings=SamplingSettings(max_completion_length=4, generation_kwargs=kwargs))
    gen.connect()
    gen.stale = False  # no weights to send: the stand-in model is a Linear
    assert "SamplingParams also bad_words ['no'], min_tokens 2; importance sampling" in gen.describe()
    gen.generate([[1, 3]], seed=1)
    gen.generate([[1]], seed=0, greedy=True)
    sent = [(p.min_tokens, p.bad_words) for call in fake.llm.calls for p in call["params"]]
    assert sent == [(2, ["no"]), (2, ["no"])]
    plain = _generator(fake.url)
    plain.connect()
    plain.stale = False
    plain.generate([[1]], seed=0)
    assert not hasattr(fake.llm.calls[-1]["params"][0], "min_tokens")
    odd = _generator(
        fake.url,
        settings=SamplingSettings(
            max_completion_length=4, generation_kwargs={"suppress_tokens": [5], "stop": ["."]}
        ),
    )
    with pytest.raises(
        ConfigError,
        match=rf"generation_kwargs has \['suppress_tokens'\], not fields of vLLM's "
        rf"SamplingParams \({fake.url}\); with use_vllm they go to SamplingParams \(TRL's meaning\), "
        r"whose fields are \['bad_words', 'logit_bias', 'logprobs', ",
    ):
        odd.connect()


def test_colocate_checks_and_forwards_generation_kwargs(monkeypatch: pytest.MonkeyPatch) -> None:
    """vllm_mode colocate: the recipe's builder checks generation_kwargs against its engine's SamplingParams fields
    before the first rollout, and every rollout's SamplingParams carry them (the engine is server.Engine's)."""
    from hf_fsdp2.methods.grpo.vllm import colocate as vllm_colocate

    llm = standin.LLM()
    monkeypatch.setattr(vllm_colocate, "require_vllm", lambda: None)
    monkeypatch.setattr(vllm_colocate, "build_engine", lambda *a, **kw: standin.engine(llm))
    g = GrpoArgs(reward_funcs=["format"], use_vllm=True, vllm_mode="colocate")
    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)

    def tokenizer(text: str, add_special_tokens: bool = False) -> dict[str, list[int]]:
        return {"input_ids": [1, 2]}

    def build(kwargs: dict[str, Any]) -> Any:
        return vllm_colocate.build_colocate_generator(
            g,
            model,
            optimizer,
            tokenizer,
            [standin.EOS],
            SamplingSettings(max_completion_length=4, generation_kwargs=kwargs),
            "no",
            torch.device("cpu"),
            "model",
            64,
        )

    gen = build({"min_tokens": 3})
    gen.stale = False
    assert gen.generate([[1, 4]], seed=0) == [cut_at_eos_list(standin.completion_of(0, 4), [standin.EOS])]
    assert llm.calls[-1]["params"][0].min_tokens == 3
    assert "SamplingParams also min_tokens 3" in gen.describe()
    with pytest.raises(
        ConfigError,
        match=r"generation_kwargs has \['suppress_tokens'\], not fields of vLLM's "
        r"SamplingParams \(in-process vLLM \(rank 0\)\)",
    ):
        build({"suppress_tokens": [1]})


@pytest.mark.parametrize(
    ("asked", "gpu_gib", "peak_gib", "sleeps", "why"),
    [
        (
            None,
            80,
            40,
            False,
            "off (vllm_enable_sleep_mode unset: the engine and training fit this GPU of 80.00 GiB",
        ),
        (None, 48, 40, True, "level 2 (vllm_enable_sleep_mode unset: the engine and training need 63.49 GiB"),
        (None, 80, None, True, "level 2 (vllm_enable_sleep_mode unset and no memory plan"),
        (False, 48, 40, False, "off (vllm_enable_sleep_mode: false, as set)"),
        (True, 80, 40, True, "level 2 (vllm_enable_sleep_mode: true, as set)"),
        (None, None, 40, False, "off (no GPU: vLLM's CPU backend has no sleep mode)"),
    ],
)
def test_colocate_sleep_mode_left_unset_is_the_plans_choice(  # type: ignore[no-untyped-def]
    monkeypatch: pytest.MonkeyPatch, caplog, asked, gpu_gib, peak_gib, sleeps, why
) -> None:
    """vllm_enable_sleep_mode unset: the recipe's builder sleeps the engine (level 2) only where the start-up plan's
    training peak and the engine's reservation do not fit this GPU side by side (or no plan says they do); set, as
    set; without a GPU never. The engine is built with that choice and the log says why (a GPU of gpu_gib as torch
    would report it). Before: unset was false, whatever the GPU."""
    import logging

    from hf_fsdp2.methods.grpo.vllm import colocate as vllm_colocate

    gib = 2**30
    llm, built = standin.LLM(), []
    monkeypatch.setattr(vllm_colocate, "require_vllm", lambda: None)
    monkeypatch.setattr(
        vllm_colocate, "build_engine", lambda *a, **kw: built.append(kw) or standin.engine(llm)
    )
    monkeypatch.setattr(vllm_colocate, "gpu_bytes", lambda device: None if gpu_gib is None else gpu_gib * gib)
    g = GrpoArgs(reward_funcs=["format"], use_vllm=True, vllm_mode="colocate", vllm_enable_sleep_mode=asked)
    model = torch.nn.Linear(2, 2)
    with caplog.at_level(logging.INFO, logger="hf_fsdp2"):
        vllm_colocate.build_colocate_generator(
            g,
            model,
            torch.optim.SGD(model.parameters(), lr=0.1),
            lambda text, add_special_tokens=False: {"input_ids": [1, 2]},
            [standin.EOS],
            SamplingSettings(max_completion_length=4),
            "no",
            torch.device("cpu"),
            "model",
            64,
            training_peak=None if peak_gib is None else peak_gib * gib,
        )
    assert built[0]["sleep_mode"] is sleeps
    assert f"vLLM colocate sleep mode: {why}" in caplog.text


def test_probe_bound_scales_with_the_coarser_dtype() -> None:
    logps = torch.tensor([-0.5, -10.0])
    assert probe_bound(logps, "float32", "float32") == pytest.approx(32 * 2**-24 * math.sqrt(2) * 11)
    assert probe_bound(logps, "bfloat16", "float32", 3) == pytest.approx(32 * 2**-8 * 2 * 11)


def test_vllm_serve_finds_a_python_with_vllm_or_says_how_to_build_one(tmp_path, monkeypatch) -> None:
    import argparse

    from hf_fsdp2.commands import vllm_serve
    from hf_fsdp2.commands.common import BadInput

    monkeypatch.delenv("HF_FSDP2_VLLM_PYTHON", raising=False)
    monkeypatch.setattr(vllm_serve, "CHECKOUT_VENV", tmp_path / "none" / "python")
    monkeypatch.setattr(vllm_serve, "has_vllm", lambda: False)
    with pytest.raises(BadInput, match="no Python with vLLM: .*build it with `bash scripts/setup_vllm.sh`"):
        vllm_serve.vllm_python()
    with pytest.raises(BadInput, match="HF_FSDP2_VLLM_PYTHON=/nope does not exist"):
        vllm_serve.vllm_python("/nope")
    args = argparse.Namespace(
        model=tmp_path,
        host="127.0.0.1",
        port=9,
        dtype="float32",
        gpu_memory_utilization=0.5,
        tensor_parallel_size=1,
        kv_cache_gib=2,
        seed=0,
        max_model_len=128,
    )
    cmd = vllm_serve.server_command(args, "/py")
    assert cmd[:3] == ["/py", "-P", str(vllm_serve.SERVER)] and vllm_serve.SERVER.exists()
    assert cmd[cmd.index("--port") + 1] == "9" and cmd[-2:] == ["--max-model-len", "128"]


def test_colocate_in_a_python_without_vllm_stops_before_loading_and_names_the_command(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """This Python (.venv) has no vLLM: the recipe's objective refuses colocate, naming .venv-vllm's command."""
    import importlib.util

    from hf_fsdp2.config.parse import parse_config
    from hf_fsdp2.methods.grpo.objective import grpo_objective

    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("this Python imports vllm: colocate runs here")
    recipe = tmp_path / "grpo.yaml"
    recipe.write_text(
        "model_name_or_path: m\ndataset_name: d.jsonl\noutput_dir: out\nreward_funcs: [format]\n"
        "use_vllm: true\nvllm_mode: colocate\n"
    )
    cfg = parse_config(["--config", str(recipe)], section=GrpoArgs, recipe="grpo")
    with pytest.raises(
        ConfigError,
        match=r"cannot import vllm .*\.venv-vllm/bin/python -m hf_fsdp2.cli train grpo --config_file .*fsdp2",
    ):
        grpo_objective(cfg)


def test_the_plan_says_whether_a_colocated_engine_needs_sleep_mode() -> None:
    """The start-up plan's colocate line: the GPU size on which the engine's reservation and the training peak fit
    side by side, and for this GPU whether sleep mode (level 2) is needed, asked for without need, or not needed."""
    from types import SimpleNamespace

    from hf_fsdp2.methods.grpo.plan import colocate_gpu_bytes, colocate_note

    gib = 2**30
    plan = SimpleNamespace(total_params=8 * 10**9, peak=40 * gib)

    def cfg(sleep: bool | None, mode: str = "colocate") -> Any:
        g = GrpoArgs(
            use_vllm=True, vllm_mode=mode, vllm_enable_sleep_mode=sleep, vllm_gpu_memory_utilization=0.3
        )
        return SimpleNamespace(
            method=g, train=SimpleNamespace(mixed_precision="bf16"), model=SimpleNamespace(torch_dtype="auto")
        )

    need = colocate_gpu_bytes(40 * gib, 0.3, 0.1)
    assert need == int(40 * gib / (0.7 * 0.9))  # 63.5 GiB
    assert colocate_note(plan, cfg(False, "server"), None) is None
    line = colocate_note(plan, cfg(False), None)
    assert (
        line is not None
        and "its weights 14.90 GiB" in line
        and "63.49 GiB or more" in line
        and "no GPU here" in line
    )
    assert "fits, no sleep mode needed" in str(colocate_note(plan, cfg(False), 80 * gib))
    assert "does not fit both: set vllm_enable_sleep_mode: true" in str(
        colocate_note(plan, cfg(False), 48 * gib)
    )
    assert "this GPU would not need it" in str(colocate_note(plan, cfg(True), 80 * gib))
    assert "would not need" not in str(colocate_note(plan, cfg(True), 48 * gib))
    # Unset: the plan says what the run chooses (the same function as the run).
    assert "; sleep mode off (vllm_enable_sleep_mode unset: the engine and training fit" in str(
        colocate_note(plan, cfg(None), 80 * gib)
    )
    assert (
        "; sleep mode level 2 (vllm_enable_sleep_mode unset: the engine and training need 63.49 GiB"
        in str(colocate_note(plan, cfg(None), 48 * gib))
    )
