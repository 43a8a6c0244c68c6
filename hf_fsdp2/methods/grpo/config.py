"""The GRPO recipe's keys (recipes/grpo.py), TRL's ``GRPOConfig`` names and defaults (``loss_type: dapo``, ``beta: 0``:
no reference model unless a KL term is asked for)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from hf_fsdp2.config.plans import check

GRPO_LOSS_TYPES = ("grpo", "dr_grpo", "dapo", "bnpo")
IMPORTANCE_SAMPLING_LEVELS = ("token", "sequence")
# generation_kwargs that have a key of their own (which also scores the log-probs, or shapes the rollout): refused
# there, so one setting has one place.
OWN_KEYS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "max_new_tokens": "max_completion_length",
    "do_sample": "(always sampled; eval is greedy)",
    "num_return_sequences": "num_generations",
}
# With use_vllm, generation_kwargs are vLLM SamplingParams fields (TRL's meaning); refused there: those with a key
# of their own, and those the run sets itself (what the rollout, the probe and the importance sampling correction read).
VLLM_OWN_KEYS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "max_tokens": "max_completion_length",
    "n": "num_generations",
    "seed": "seed (each prompt's sampling seed derives from it)",
}
_LOGPROBS = (
    "it asks for the sampled tokens' log-probs, which the importance sampling correction and the probe read"
)
VLLM_RUN_KEYS = {
    "stop_token_ids": "the end ids are the tokenizer's EOS and generation_config.json's eos_token_id",
    "logprobs": _LOGPROBS,
    "prompt_logprobs": _LOGPROBS,
    "logprob_token_ids": _LOGPROBS,
    "flat_logprobs": _LOGPROBS,
    "prompt_logprob_token_ids": _LOGPROBS,
    "prompt_logprob_start": _LOGPROBS,
    "output_kind": "the server reads each request's final output",
}
SCALE_REWARDS = ("group", "batch", "none")
IS_MODES = (
    "token_truncate",
    "token_mask",
    "sequence_truncate",
    "sequence_mask",
)  # vllm_importance_sampling_mode


@dataclass(kw_only=True)
class GrpoArgs:
    """Online RL with verifiable rewards (recipes/grpo.py)."""

    beta: float = field(
        default=0.0,
        metadata={"help": "KL coefficient to the reference (TRL's default 0: no reference model is loaded)."},
    )
    loss_type: str = field(
        default="dapo",
        metadata={"help": f"One of {', '.join(GRPO_LOSS_TYPES)} (TRL's GRPOConfig names; its default dapo)."},
    )
    ref_model_name_or_path: str | None = field(
        default=None,
        metadata={
            "help": "With beta > 0: the reference model folder or hub id; default the model being trained (its weights "
            "as loaded). Ignored with LoRA, whose reference is the base with the adapter disabled."
        },
    )
    disable_dropout: bool = field(
        default=True,
        metadata={
            "help": "Set every dropout of the policy and reference to 0, so log-probs are exact (TRL 1.16's default "
            "is false: docs/grpo.md, defaults that differ)."
        },
    )
    num_generations: int = field(default=8, metadata={"help": "Completions sampled per prompt (a group)."})
    max_completion_length: int = field(default=256, metadata={"help": "New tokens per completion at most."})
    temperature: float = field(
        default=1.0, metadata={"help": "Sampling temperature (also scales the scored log-probs)."}
    )
    top_p: float = field(
        default=1.0, metadata={"help": "Nucleus sampling: the smallest token set of this mass."}
    )
    top_k: int = field(default=0, metadata={"help": "Sample among the k most likely tokens (0: all)."})
    epsilon: float = field(default=0.2, metadata={"help": "Lower clipping bound of the ratio: 1 - epsilon."})
    epsilon_high: float | None = field(
        default=None,
        metadata={"help": "Upper clipping bound: 1 + epsilon_high (default epsilon; DAPO: 0.28)."},
    )
    num_iterations: int = field(
        default=1,
        metadata={"help": "Optimizer updates per generation batch (mu), against the sampler's log-probs."},
    )
    scale_rewards: str = field(
        default="group",
        metadata={
            "help": f"Advantage scaling: one of {', '.join(SCALE_REWARDS)} (std of the group, the batch, none)."
        },
    )
    reward_funcs: list[str] = field(
        default_factory=list,
        metadata={
            "help": "Reward functions: exact_match, format, length_penalty, or module:function (TRL signature)."
        },
    )
    reward_weights: list[float] = field(
        default_factory=list, metadata={"help": "One weight per reward function (default 1.0 each)."}
    )
    reward_reference_column: str = field(
        default="answer", metadata={"help": "The dataset column exact_match compares the completion with."}
    )
    reward_format_pattern: str | None = field(
        default=None,
        metadata={"help": "The regular expression the format reward requires the completion to match."},
    )
    rollout_gather: str = field(
        default="full",
        metadata={
            "help": "full: the model gathered once per rollout (fast); layer: gathered per layer and token, for "
            "models whose full copy does not fit beside their shards."
        },
    )
    # TRL 1.16's batch and step meaning, loss options, logging and scoring, under GRPOConfig's names and defaults.
    generation_batch_size: int | None = field(
        default=None,
        metadata={
            "help": "Completions per generation batch over all ranks (TRL's key); default "
            "per_device_train_batch_size x data-parallel ranks x steps_per_generation. Not with "
            "steps_per_generation."
        },
    )
    steps_per_generation: int | None = field(
        default=None,
        metadata={
            "help": "Micro-batches (of per_device_train_batch_size completions per rank) one generation batch "
            "feeds (TRL's key); default gradient_accumulation_steps. Not with generation_batch_size."
        },
    )
    rollout_batch_size: int | None = field(
        default=None,
        metadata={
            "help": "Completions a rank generates per generate call (its KV cache holds this many sequences); "
            "default all of its generation batch at once."
        },
    )
    mask_truncated_completions: bool = field(
        default=False,
        metadata={
            "help": "Completions that did not end with an end-of-sequence token are left out of the loss "
            "(TRL's key; DAPO's practice)."
        },
    )
    importance_sampling_level: str = field(
        default="token",
        metadata={
            "help": "token: one ratio per token; sequence: one per completion from the mean log-ratio over "
            "its tokens (GSPO; TRL recommends loss_type grpo with it)."
        },
    )
    top_entropy_quantile: float = field(
        default=1.0,
        metadata={
            "help": "Keep in the policy loss only the tokens in this top quantile of entropy over the "
            "micro-batch of every rank (TRL's key; 1.0: every token; the paper: 0.2)."
        },
    )
    log_completions: bool = field(
        default=False,
        metadata={
            "help": "At each logged step, a table of the prompts, completions, rewards and advantages of the "
            "generation batches since the last one in metrics.jsonl (and wandb/trackio), as TRL."
        },
    )
    num_completions_to_print: int | None = field(
        default=None,
        metadata={
            "help": "Rows of that table logged per step (default all); also the eval samples logged "
            "(default 4)."
        },
    )
    # What samples, and how prompts are rendered, as TRL 1.16's keys.
    repetition_penalty: float = field(
        default=1.0,
        metadata={
            "help": "Penalty on tokens already in the prompt or completion (TRL's default 1.0: none); the "
            "model's generation_config value is not inherited."
        },
    )
    min_p: float | None = field(
        default=None,
        metadata={"help": "Keep tokens of at least min_p x the top token's probability (default: off)."},
    )
    generation_kwargs: str | None = field(
        default=None,
        metadata={
            "help": "More sampling fields, a mapping (YAML) or JSON object (CLI), applied last: transformers "
            "GenerationConfig fields (e.g. {suppress_tokens: [5]}), or with use_vllm vLLM SamplingParams fields "
            "(e.g. {min_tokens: 2, bad_words: [...]}), as TRL.",
        },
    )
    chat_template_kwargs: str | None = field(
        default=None,
        metadata={
            "help": "Extra apply_chat_template arguments for message-list prompts (and reward "
            "models), a mapping or JSON object: e.g. {enable_thinking: false}.",
        },
    )
    # vLLM rollouts, TRL 1.16's keys (methods/grpo/vllm/, docs/grpo.md).
    use_vllm: bool = field(
        default=False, metadata={"help": "Sample the rollouts with vLLM (a server: hf-fsdp2 vllm-serve)."}
    )
    vllm_mode: str = field(
        default="server",
        metadata={
            "help": "server: a separate hf-fsdp2 vllm-serve process; colocate: vLLM in each training process "
            "(run with .venv-vllm's python: docs/grpo.md)."
        },
    )
    vllm_server_base_url: str | None = field(
        default=None, metadata={"help": "The server's URL (http://host:port); overrides host and port."}
    )
    vllm_server_host: str = field(default="0.0.0.0", metadata={"help": "The server's host (TRL's default)."})
    vllm_server_port: int = field(default=8000, metadata={"help": "The server's port (TRL's default)."})
    vllm_server_timeout: float = field(
        default=240.0, metadata={"help": "Seconds to wait at start for the server to answer (TRL's key)."}
    )
    vllm_request_timeout: float = field(
        default=600.0,
        metadata={"help": "Seconds one request may take (a rollout, a weight update, one unit's broadcast)."},
    )
    vllm_group_port: int = field(
        default=0,
        metadata={
            "help": "Port of the trainer-server weight group's store on rank 0 (TRL's key; 0: a free one)."
        },
    )
    vllm_tensor_parallel_size: int = field(
        default=1,
        metadata={
            "help": "colocate: GPUs (consecutive ranks) one engine spans (the server: --tensor-parallel-size)."
        },
    )
    vllm_gpu_memory_utilization: float = field(
        default=0.3,
        metadata={"help": "vllm_mode colocate: each engine's GPU memory fraction (the server: a flag)."},
    )
    vllm_enable_sleep_mode: bool | None = field(
        default=None,
        metadata={
            "help": "colocate: the engine sleeps (level 2) outside rollouts (GPU only; CPU vLLM has none). Unset: "
            "only where the start-up plan finds the engine and training do not fit the GPU side by side."
        },
    )
    vllm_importance_sampling_correction: bool = field(
        default=True,
        metadata={
            "help": "Weight each token's loss by the trainer/vLLM probability ratio, truncated or masked."
        },
    )
    vllm_importance_sampling_mode: str = field(
        default="sequence_mask",
        metadata={"help": "token_truncate, token_mask, sequence_truncate or sequence_mask (TRL's default)."},
    )
    vllm_importance_sampling_clip_max: float | None = field(
        default=3.0, metadata={"help": "Upper bound C_max of the ratio (clipped, or masked above)."}
    )
    vllm_importance_sampling_clip_min: float | None = field(
        default=None, metadata={"help": "Lower bound C_min of the ratio (default none)."}
    )
    vllm_importance_sampling_cap: float | None = field(
        default=None,
        metadata={"help": "Deprecated in TRL: vllm_importance_sampling_clip_max, which it sets."},
    )

    def validate(self) -> None:
        """Raises ConfigError for a value argparse cannot refuse."""
        check(
            self.loss_type in GRPO_LOSS_TYPES,
            f"loss_type={self.loss_type!r} is not a loss of the GRPO recipe: one "
            f"of {', '.join(GRPO_LOSS_TYPES)}",
        )
        check(self.beta >= 0, f"beta={self.beta} must be >= 0")
        check(
            self.num_generations >= 2,
            f"num_generations={self.num_generations} must be >= 2: a group of one has no baseline",
        )
        check(
            self.max_completion_length >= 1,
            f"max_completion_length={self.max_completion_length} must be >= 1",
        )
        check(self.temperature > 0, f"temperature={self.temperature} must be > 0")
        check(0 < self.top_p <= 1, f"top_p={self.top_p} must be in (0, 1]")
        check(self.top_k >= 0, f"top_k={self.top_k} must be >= 0")
        check(0 <= self.epsilon < 1, f"epsilon={self.epsilon} must be in [0, 1)")
        check(
            self.epsilon_high is None or self.epsilon_high >= 0,
            f"epsilon_high={self.epsilon_high} must be >= 0",
        )
        check(self.num_iterations >= 1, f"num_iterations={self.num_iterations} must be >= 1")
        check(
            self.importance_sampling_level in IMPORTANCE_SAMPLING_LEVELS,
            f"importance_sampling_level="
            f"{self.importance_sampling_level!r} is not one of {', '.join(IMPORTANCE_SAMPLING_LEVELS)}",
        )
        check(
            0.0 <= self.top_entropy_quantile <= 1.0,
            f"top_entropy_quantile={self.top_entropy_quantile} must be in [0, 1] (1.0: every token)",
        )
        check(
            self.generation_batch_size is None or self.steps_per_generation is None,
            f"generation_batch_size={self.generation_batch_size} and steps_per_generation="
            f"{self.steps_per_generation} are both set: set one (the other follows from it)",
        )
        for key in (
            "generation_batch_size",
            "steps_per_generation",
            "rollout_batch_size",
            "num_completions_to_print",
        ):
            value = getattr(self, key)
            check(value is None or value >= 1, f"{key}={value} must be >= 1 (or unset)")
        check(
            self.rollout_gather in ("full", "layer"),
            f"rollout_gather={self.rollout_gather!r} is not full or layer",
        )
        check(
            self.scale_rewards in SCALE_REWARDS,
            f"scale_rewards={self.scale_rewards!r} is not one of {', '.join(SCALE_REWARDS)}",
        )
        check(
            self.repetition_penalty > 0,
            f"repetition_penalty={self.repetition_penalty} must be > 0 (1.0: none)",
        )
        check(
            self.min_p is None or 0 <= self.min_p <= 1,
            f"min_p={self.min_p} must be in [0, 1] (or unset: off)",
        )
        sampling_kwargs(self.generation_kwargs, vllm=self.use_vllm)
        self.validate_vllm()
        json_mapping(self.chat_template_kwargs, "chat_template_kwargs")
        check(
            not self.reward_weights or len(self.reward_weights) == len(self.reward_funcs),
            f"reward_weights has {len(self.reward_weights)} values for {len(self.reward_funcs)} reward_funcs: one "
            "weight per function",
        )

    def validate_vllm(self) -> None:
        """The vLLM keys' checks (colocate's vLLM import: at the run's start, vllm/colocate.py:require_vllm)."""
        check(
            self.vllm_mode in ("server", "colocate"),
            f"vllm_mode={self.vllm_mode!r} is not server or colocate",
        )
        check(
            0 < self.vllm_gpu_memory_utilization <= 1,
            f"vllm_gpu_memory_utilization={self.vllm_gpu_memory_utilization} is not a fraction in (0, 1]",
        )
        check(
            self.vllm_importance_sampling_mode in IS_MODES,
            f"vllm_importance_sampling_mode="
            f"{self.vllm_importance_sampling_mode!r} is not one of {', '.join(IS_MODES)}",
        )
        low, high = self.vllm_importance_sampling_clip_min, self.is_clip_max
        check(
            low is None or high is None or low < high,
            f"vllm_importance_sampling_clip_min={low} must be below vllm_importance_sampling_clip_max={high}",
        )
        for key in ("vllm_server_timeout", "vllm_request_timeout"):
            check(getattr(self, key) > 0, f"{key}={getattr(self, key)} must be > 0 (seconds)")
        check(0 < self.vllm_server_port < 65536, f"vllm_server_port={self.vllm_server_port} is not a port")
        check(
            0 <= self.vllm_group_port < 65536,
            f"vllm_group_port={self.vllm_group_port} is not a port (0: any)",
        )
        check(
            self.vllm_tensor_parallel_size >= 1,
            f"vllm_tensor_parallel_size={self.vllm_tensor_parallel_size} must be >= 1",
        )
        check(
            self.vllm_tensor_parallel_size == 1 or not self.use_vllm or self.vllm_mode == "colocate",
            f"vllm_tensor_parallel_size={self.vllm_tensor_parallel_size} with vllm_mode=server: the server's engine "
            "is sharded by the server (hf-fsdp2 vllm-serve --tensor-parallel-size N); unset it here",
        )
        check(
            self.rollout_batch_size is None or not self.use_vllm,
            f"rollout_batch_size={self.rollout_batch_size} with use_vllm: it sizes transformers' generate calls; vLLM "
            "takes each generation batch in one call and sizes its own batches (its KV cache: "
            "vllm_gpu_memory_utilization); unset it",
        )

    @property
    def is_clip_max(self) -> float | None:
        """C_max: vllm_importance_sampling_cap when set (TRL's deprecated name), else ..._clip_max."""
        cap = self.vllm_importance_sampling_cap
        return self.vllm_importance_sampling_clip_max if cap is None else cap

    @property
    def vllm_url(self) -> str:
        return self.vllm_server_base_url or f"http://{self.vllm_server_host}:{self.vllm_server_port}"


def json_mapping(value: str | None, key: str) -> dict[str, Any]:
    """The key's JSON object (``{}`` when unset).

    Raises:
        ConfigError: not JSON, or JSON that is not an object.
    """
    if value is None:
        return {}
    try:
        out = json.loads(value)
    except json.JSONDecodeError as err:
        out = err
    check(
        isinstance(out, dict),
        f"{key}={value!r} is not a JSON object ({out}); give a mapping in the YAML or "
        f"--{key} '{{\"name\": value}}'",
    )
    return out  # type: ignore[return-value]


def sampling_kwargs(value: str | None, *, vllm: bool = False) -> dict[str, Any]:
    """``generation_kwargs`` as a dict: fields of transformers' ``GenerationConfig`` without a key of their own, or
    with ``vllm`` (TRL's meaning under ``use_vllm``) fields of vLLM's ``SamplingParams`` the run does not set itself;
    their names are checked against the engine's own fields once it answers (:func:`check_vllm_fields`: the
    trainer's Python may not import vLLM).

    Raises:
        ConfigError: not a JSON object, a field GenerationConfig does not have, or one the run sets itself.
    """
    out = json_mapping(value, "generation_kwargs")
    own, run = (VLLM_OWN_KEYS, VLLM_RUN_KEYS) if vllm else (OWN_KEYS, {})
    for name in out:
        check(
            name not in own,
            f"generation_kwargs sets {name!r}, which has a key of its own here: set {own.get(name)} instead",
        )
        check(
            name not in run,
            f"generation_kwargs sets {name!r}, which the run sets itself ({run.get(name)}); remove it",
        )
    if out and not vllm:
        from transformers import GenerationConfig

        known = set(GenerationConfig().to_dict())
        unknown = sorted(set(out) - known)
        check(
            not unknown,
            f"generation_kwargs has {unknown}, not fields of transformers' GenerationConfig; see "
            "https://huggingface.co/docs/transformers/main_classes/text_generation",
        )
    return out


def check_vllm_fields(kwargs: dict[str, Any], fields: list[str] | None, engine: str) -> None:
    """``generation_kwargs`` (with ``use_vllm``) against the fields of ``engine``'s vLLM ``SamplingParams``
    (``fields``: as its server's /health lists them; None: an engine that does not list them).

    Raises:
        ConfigError: a name ``SamplingParams`` does not have, listed with the fields it has.
    """
    if not kwargs:
        return
    check(
        fields is not None,
        f"generation_kwargs={kwargs} with use_vllm: {engine} does not list its SamplingParams "
        "fields; restart it with this checkout's `hf-fsdp2 vllm-serve`",
    )
    unknown = sorted(set(kwargs) - set(fields or ()))
    check(
        not unknown,
        f"generation_kwargs has {unknown}, not fields of vLLM's SamplingParams ({engine}); with "
        f"use_vllm they go to SamplingParams (TRL's meaning), whose fields are {sorted(fields or ())}",
    )
