"""The training sections of a recipe (optimisation, FSDP2 sharding and compile): each validates
itself and builds the settings object its module applies. LoRA's section is :mod:`hf_fsdp2.config.peft`."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

from hf_fsdp2.config.float8 import FP8_TENSORWISE, Float8Plan
from hf_fsdp2.config.plans import (
    AC_MODES,
    COMPILE_MODES,
    COMPILE_SCOPES,
    ACPlan,
    CompilePlan,
    ConfigError,
    MeshPlan,
    ShardingPlan,
    check,
    resolve_mesh,
)


@dataclass(kw_only=True)
class TrainArgs:
    """The optimisation loop, its schedule and where outputs go."""

    output_dir: str | None = field(
        default=None, metadata={"help": "Run folder: export, metrics.jsonl, resolved config (required)."}
    )
    overwrite_output_dir: bool = field(
        default=False,
        metadata={"help": "Allow an output_dir that holds a previous run (its files are replaced)."},
    )
    max_steps: int = field(default=-1, metadata={"help": "Optimizer steps; -1 uses num_train_epochs."})
    num_train_epochs: float = field(default=1.0, metadata={"help": "Epochs when max_steps is -1."})
    per_device_train_batch_size: int = field(
        default=8, metadata={"help": "Examples per micro-batch per rank."}
    )
    gradient_accumulation_steps: int = field(
        default=1, metadata={"help": "Micro-batches per optimizer step."}
    )
    learning_rate: float = field(default=2e-5, metadata={"help": "Peak learning rate of AdamW."})
    weight_decay: float = field(
        default=0.0,
        metadata={
            "help": "AdamW weight decay of matrices (embeddings included); none on biases and norm weights."
        },
    )
    adam_beta1: float = field(default=0.9, metadata={"help": "AdamW beta1."})
    adam_beta2: float = field(default=0.999, metadata={"help": "AdamW beta2."})
    adam_epsilon: float = field(default=1e-8, metadata={"help": "AdamW epsilon."})
    optim: Literal["adamw", "muon"] = field(
        default="adamw",
        metadata={
            "help": "adamw (torch AdamW on everything) or muon (torch.optim.Muon's update on the decoder layers' 2-D "
            "matrices, orthogonalised across FSDP2 shards; AdamW on embeddings, head, norms, biases, LoRA factors)."
        },
    )
    muon_lr: float | None = field(
        default=None,
        metadata={
            "help": "Muon's peak learning rate; unset: learning_rate (what muon_adjust_lr match_rms_adamw is for)."
        },
    )
    muon_momentum: float = field(default=0.95, metadata={"help": "Muon's momentum."})
    muon_nesterov: bool = field(default=True, metadata={"help": "Muon's Nesterov momentum."})
    muon_ns_steps: int = field(default=5, metadata={"help": "Muon's Newton-Schulz iterations."})
    muon_adjust_lr: Literal["match_rms_adamw", "original"] = field(
        default="match_rms_adamw",
        metadata={
            "help": "Muon's per-matrix lr scale: match_rms_adamw (Moonlight: 0.2 sqrt(max(m, n)), AdamW's lr and "
            "weight decay carry over) or original (Keller Jordan: sqrt(max(1, m / n)), lr around 0.02)."
        },
    )
    lr_scheduler_type: Literal["cosine", "linear", "constant"] = field(
        default="cosine", metadata={"help": "Decay after warmup: cosine, linear or constant."}
    )
    warmup_ratio: float = field(default=0.0, metadata={"help": "Fraction of steps of linear warmup."})
    warmup_steps: int = field(default=0, metadata={"help": "Warmup steps; overrides warmup_ratio when > 0."})
    max_grad_norm: float = field(default=1.0, metadata={"help": "Clip the global gradient norm; 0 disables."})
    on_nonfinite: Literal["stop", "skip_step"] = field(
        default="stop",
        metadata={
            "help": "A NaN or inf loss or gradient norm: stop (at that step, no checkpoint of that state, the last "
            "good checkpoint named, exit status 2) or skip_step (its optimizer update skipped, counted and logged)."
        },
    )
    on_collapse: Literal["stop", "warn"] = field(
        default="stop",
        metadata={
            "help": "A run that learns nothing for 3 steps in a row (the gradient norm exactly 0 with target tokens: a "
            "collapse; GRPO: no usable reward): stop (exit status 2, the last good checkpoint named, no export) or "
            "warn (once, and go on); either way metrics.jsonl, summary.json and the model card record it."
        },
    )
    seed: int = field(default=42, metadata={"help": "Seed of model init, data order and dropout."})
    train_sampling_strategy: Literal["random", "sequential"] = field(
        default="random",
        metadata={
            "help": "Order of the training examples: random (reshuffled each epoch from the seed) or sequential "
            "(dataset order, ranks taking turns)."
        },
    )
    logging_steps: int = field(
        default=1, metadata={"help": "Log (and append to metrics.jsonl) every N steps."}
    )
    save_steps: int = field(
        default=500,
        metadata={
            "help": "Sharded checkpoint to <output_dir>/checkpoint-<step> every N steps and at the end of training "
            "(as the HF Trainer); 0 = none."
        },
    )
    save_total_limit: int = field(
        default=3,
        metadata={
            "help": "Keep the last K checkpoints (0 keeps all); the one resumed from is never deleted."
        },
    )
    save_async: bool = field(
        default=False, metadata={"help": "Write checkpoints in the background while training continues."}
    )
    resume_from_checkpoint: str | None = field(
        default=None,
        metadata={
            "help": "'latest' (in output_dir), 'auto' (this run's newest checkpoint in output_dir, a fresh start when "
            "it holds none; the default with restarts) or a checkpoint-<step> folder to resume from."
        },
    )
    mixed_precision: Literal["bf16", "fp16", "no", "fp8"] = field(
        default="bf16",
        metadata={
            "help": "Compute dtype; wins over the accelerate config file's value. fp8: the decoder layers' linears "
            "in torchao float8 (Ada/Hopper GPUs), the rest bf16."
        },
    )
    fp8_recipe: Literal["tensorwise", "rowwise"] = field(
        default="tensorwise",
        metadata={"help": "torchao float8 scaling: tensorwise (float8 all-gather) or rowwise (accurate)."},
    )
    fp8_all_gather: bool | None = field(
        default=None,
        metadata={"help": "FSDP2 all-gathers float8 weights (tensorwise only); unset: on with tensorwise."},
    )
    fp8_emulate: bool = field(
        default=False,
        metadata={"help": "Emulate the float8 rounding without FP8 hardware (CPU, older GPUs): slow; tests."},
    )
    fp8_size_filter: bool = field(
        default=True,
        metadata={
            "help": "Keep linears below torchao's size thresholds in bf16 (float8 is slower there: Llama-3-8B's "
            "k_proj/v_proj); false converts every linear with dimensions multiple of 16."
        },
    )
    ce_chunk_tokens: int = field(
        default=1024,
        metadata={
            "help": "Cross entropy over chunks of this many tokens, never the full [tokens x vocab] fp32 "
            "logits (used when a micro-batch has more tokens); 0 = plain logits."
        },
    )
    use_liger_kernel: bool = field(
        default=False,
        metadata={"help": "Liger's fused RMSNorm/SwiGLU/RoPE kernels (GPU, pip install liger-kernel)."},
    )
    ddp_timeout: int = field(
        default=1800,
        metadata={"help": "Seconds a collective may wait before the run fails (NCCL/gloo timeout)."},
    )
    strict_launch: bool = field(
        default=False,
        metadata={
            "help": "A world smaller than the processes asked for or the GPUs visible is an error, not a warning."
        },
    )
    host_wait_timeout: int = field(
        default=6 * 3600,
        metadata={
            "help": "Seconds the other ranks may wait (on a CPU gloo group) for rank 0's long host work: "
            "tokenising the dataset, the export's reload check."
        },
    )

    def __post_init__(self) -> None:
        # An empty value is no resume: the command line's --resume_from_checkpoint false arrives as one (argparse
        # has no None), and must cancel the YAML's value rather than name a folder "".
        if self.resume_from_checkpoint is not None and not self.resume_from_checkpoint.strip():
            self.resume_from_checkpoint = None

    def validate(self) -> None:
        """Raises ConfigError for a value argparse cannot refuse."""
        check(
            self.output_dir is not None,
            "output_dir is required: the folder for the export, metrics and config",
        )
        check(
            self.per_device_train_batch_size >= 1,
            f"per_device_train_batch_size={self.per_device_train_batch_size} must be >= 1",
        )
        check(
            self.gradient_accumulation_steps >= 1,
            f"gradient_accumulation_steps={self.gradient_accumulation_steps} must be >= 1",
        )
        check(
            self.max_steps == -1 or self.max_steps > 0,
            f"max_steps={self.max_steps} must be -1 (use epochs) or > 0",
        )
        check(
            self.max_steps > 0 or (self.num_train_epochs > 0 and math.isfinite(self.num_train_epochs)),
            f"num_train_epochs={self.num_train_epochs} must be > 0 when max_steps=-1",
        )
        check(
            self.learning_rate > 0 and math.isfinite(self.learning_rate),
            f"learning_rate={self.learning_rate} must be > 0",
        )
        check(self.weight_decay >= 0, f"weight_decay={self.weight_decay} must be >= 0")
        check(
            0 <= self.adam_beta1 < 1 and 0 <= self.adam_beta2 < 1,
            "adam_beta1 and adam_beta2 must be in [0, 1)",
        )
        check(
            self.muon_lr is None or (self.muon_lr > 0 and math.isfinite(self.muon_lr)),
            f"muon_lr={self.muon_lr} must be > 0 (or unset: learning_rate)",
        )
        check(0 <= self.muon_momentum < 1, f"muon_momentum={self.muon_momentum} must be in [0, 1)")
        check(
            1 <= self.muon_ns_steps < 100,
            f"muon_ns_steps={self.muon_ns_steps} must be in [1, 99] (torch: < 100)",
        )
        check(0 <= self.warmup_ratio < 1, f"warmup_ratio={self.warmup_ratio} must be in [0, 1)")
        check(self.warmup_steps >= 0, f"warmup_steps={self.warmup_steps} must be >= 0")
        check(
            self.max_grad_norm >= 0, f"max_grad_norm={self.max_grad_norm} must be >= 0 (0 disables clipping)"
        )
        check(
            self.ce_chunk_tokens >= 0,
            f"ce_chunk_tokens={self.ce_chunk_tokens} must be >= 0 (0 = plain logits)",
        )
        check(self.ddp_timeout > 0, f"ddp_timeout={self.ddp_timeout} must be > 0 seconds")
        check(
            self.host_wait_timeout > 0,
            f"host_wait_timeout={self.host_wait_timeout} must be > 0 seconds (default {6 * 3600}: 6 hours)",
        )
        check(self.logging_steps >= 1, f"logging_steps={self.logging_steps} must be >= 1")
        check(self.save_steps >= 0, f"save_steps={self.save_steps} must be >= 0 (0 = no checkpoints)")
        check(
            self.save_total_limit >= 0, f"save_total_limit={self.save_total_limit} must be >= 0 (0 keeps all)"
        )
        if self.mixed_precision == "fp8":
            self.float8_plan()  # recipe and all-gather agree
        if self.mixed_precision == "fp16":
            raise ConfigError(
                "mixed_precision='fp16' needs a gradient scaler that FSDP2 training here does not use; "
                "use 'bf16' (GPUs since Ampere) or 'no' (fp32)"
            )

    def float8_plan(self) -> Float8Plan:
        """The FP8 settings (``mixed_precision=fp8``); an unset ``fp8_all_gather`` is on with tensorwise scaling.

        Raises:
            ConfigError: ``fp8_all_gather=true`` with rowwise scaling.
        """
        gather = self.fp8_all_gather if self.fp8_all_gather is not None else self.fp8_recipe == FP8_TENSORWISE
        return Float8Plan(self.fp8_recipe, self.fp8_emulate, gather, self.fp8_size_filter)


@dataclass(kw_only=True)
class FSDPArgs:
    """How FSDP2 shards the model, activation checkpointing and torch.compile."""

    fsdp_layer_cls_to_wrap: list[str] = field(
        default_factory=list,
        metadata={"help": "Decoder-layer class names, one FSDP unit each; empty = model._no_split_modules."},
    )
    fsdp_reshard_after_forward: bool = field(
        default=True,
        metadata={"help": "Free gathered layer weights after forward (ZeRO-3) or keep (ZeRO-2)."},
    )
    fsdp_cpu_offload: bool = field(
        default=False, metadata={"help": "Keep sharded params, grads and optimizer state in host memory."}
    )
    fsdp_cpu_ram_efficient_loading: bool | None = field(
        default=None,
        metadata={
            "help": "Only rank 0 reads the weights; the others start on meta and get shards. Unset: on when a "
            "node runs more than one process (LOCAL_WORLD_SIZE > 1) and the embeddings are not resized."
        },
    )
    fsdp_reduce_dtype: Literal["float32", "bfloat16", "float16"] = field(
        default="float32",
        metadata={"help": "dtype of the gradient reduce-scatter (fp32 unless you accept bf16)."},
    )
    fsdp_sync_each_microbatch: bool = field(
        default=True,
        metadata={
            "help": "Reduce-scatter gradients after every micro-batch (sharded grads, low memory); false "
            "keeps unsharded grads until the last micro-batch (less traffic, full-size grads in memory)."
        },
    )
    dp_replicate_size: int | None = field(
        default=None,
        metadata={
            "help": "HSDP: replica groups (typically the number of nodes); parameters are sharded within a group "
            "and gradients all-reduced across groups. Unset: 1 (flat FSDP2), or the launcher's parallelism_config."
        },
    )
    dp_shard_size: int | None = field(
        default=None,
        metadata={
            "help": "Ranks a parameter is sharded over (typically GPUs per node); unset: the rest of the world."
        },
    )
    tp_size: int | None = field(
        default=None,
        metadata={
            "help": "Tensor-parallel size: each decoder layer's linear weights split over this many ranks (the family's base_model_tp_plan), FSDP2 over the rest; 1 = none."
        },
    )
    cp_size: int | None = field(
        default=None,
        metadata={
            "help": "Context parallel: ranks each sequence is split over (activations and loss at 1/cp_size of "
            "the sequence per rank); parameters are sharded over dp_shard_size x cp_size. Unset: 1."
        },
    )
    ep_size: int | None = field(
        default=None,
        metadata={
            "help": "Expert parallel (MoE models): each MoE layer's routed experts split over this many ranks, "
            "borrowed from dp_shard_size x cp_size (tokens exchanged by all-to-all); the experts' FSDP2 shards span "
            "dp_shard_size x cp_size / ep_size ranks, every other parameter stays as without. Unset: 1."
        },
    )
    cp_backend: str = field(
        default="auto",
        metadata={
            "help": "Context-parallel backend: all_to_all (Ulysses-style: heads scattered, whole sequences around "
            "attention; any attention kernel, packing, CPU and GPU), ring (torch's ring attention: CUDA, SDPA, "
            "causal rows only: no packing or padding-free rows), or auto (always all_to_all)."
        },
    )
    gradient_checkpointing: bool = field(
        default=False,
        metadata={
            "help": "Activation checkpointing around each decoder layer (activation_checkpointing=full)."
        },
    )
    activation_checkpointing: str | None = field(
        default=None,
        metadata={
            "help": "none, full, every_k, selective (keep matmul/attention outputs, recompute the rest) or "
            "offload (full, layer inputs in host memory; GPU); unset = full if gradient_checkpointing else none."
        },
    )
    ac_every_k: int = field(
        default=2, metadata={"help": "With activation_checkpointing=every_k: checkpoint layers 0, k, 2k, ..."}
    )
    torch_compile: bool | None = field(
        default=None, metadata={"help": "torch.compile the model; default on with a GPU, off on CPU."}
    )
    torch_compile_scope: Literal["regional", "model"] = field(
        default="regional",
        metadata={
            "help": "regional: each decoder layer, one shared graph (default); model: the whole model."
        },
    )
    torch_compile_mode: str | None = field(
        default=None, metadata={"help": "torch.compile mode: default, reduce-overhead, max-autotune..."}
    )
    torch_compile_dynamic: bool | None = field(
        default=None, metadata={"help": "torch.compile dynamic shapes."}
    )
    torch_compile_fullgraph: bool = field(default=False, metadata={"help": "torch.compile fullgraph."})

    def ac_mode(self) -> str:
        """The activation-checkpointing mode: ``activation_checkpointing``, else from gradient_checkpointing."""
        if self.activation_checkpointing is not None:
            return self.activation_checkpointing
        return "full" if self.gradient_checkpointing else "none"

    def resolve_ram_efficient_loading(
        self, local_world: int, *, resize_embeddings: bool, load_in_4bit: bool = False, float8: bool = False
    ) -> str:
        """Set an unset ``fsdp_cpu_ram_efficient_loading`` for this launch; returns the line for the log.

        Off, every process of a node loads the whole model in host memory before sharding it (fp32 master
        weights: 8 processes x 32 GB for an 8B model); on, only global rank 0 does. It is on by default where a
        node runs more than one process, except with ``resize_token_embeddings`` (the new rows are initialised
        from the weights, which only rank 0 would hold). It works on CPU/gloo as on NCCL (accelerate's
        broadcast of rank 0's state dict), so the default does not depend on the device.

        Args:
            local_world: processes on this node (``LOCAL_WORLD_SIZE``; 1 without a launcher).
            resize_embeddings: ``resize_token_embeddings``.
            load_in_4bit: ``load_in_4bit``: each rank quantises the weights itself, so each loads them.
            float8: ``mixed_precision=fp8``: each rank converts its linears before sharding, so each loads them.

        Raises:
            ConfigError: ``fsdp_cpu_ram_efficient_loading=true`` with ``load_in_4bit``.
        """
        key = "fsdp_cpu_ram_efficient_loading"
        if load_in_4bit:
            check(
                not self.fsdp_cpu_ram_efficient_loading,
                f"{key}=true with load_in_4bit=true is not supported: each rank quantises the base from its own "
                f"copy of the weights (rank 0's broadcast carries unquantised tensors); set {key}=false",
            )
            self.fsdp_cpu_ram_efficient_loading = False
            return f"{key}=false (load_in_4bit=true: each rank loads the weights and quantises them)"
        if self.fsdp_cpu_ram_efficient_loading is not None:
            return f"{key}={str(self.fsdp_cpu_ram_efficient_loading).lower()} (set by the recipe)"
        if float8:  # true is refused with fp8 (config.float8.check_float8_combination)
            self.fsdp_cpu_ram_efficient_loading = False
            return f"{key}=false (mixed_precision=fp8: every rank loads the weights before torchao converts them)"
        if resize_embeddings:
            self.fsdp_cpu_ram_efficient_loading = False
            return f"{key}=false (default: resize_token_embeddings=true needs every rank's weights)"
        self.fsdp_cpu_ram_efficient_loading = local_world > 1
        if local_world > 1:
            return f"{key}=true (default with {local_world} processes on this node: only rank 0 loads the weights)"
        return f"{key}=false (default with one process per node: it loads the weights once anyway)"

    def sharding_plan(self, *, on_gpu: bool) -> ShardingPlan:
        """What FSDP2 applies (offloaded activations are pinned only with a GPU)."""
        return ShardingPlan(
            reshard_after_forward=self.fsdp_reshard_after_forward,
            cpu_offload=self.fsdp_cpu_offload,
            cpu_ram_efficient_loading=bool(self.fsdp_cpu_ram_efficient_loading),
            activation_checkpointing=ACPlan(self.ac_mode(), self.ac_every_k, pin_memory=on_gpu),
            reduce_dtype=self.fsdp_reduce_dtype,
        )

    def compile_plan(self, *, on_gpu: bool) -> CompilePlan:
        """torch.compile settings; compile defaults to on with a GPU, off on CPU."""
        return CompilePlan(
            enabled=self.torch_compile if self.torch_compile is not None else on_gpu,
            scope=self.torch_compile_scope,
            mode=self.torch_compile_mode,
            dynamic=self.torch_compile_dynamic,
            fullgraph=self.torch_compile_fullgraph,
        )

    def mesh_plan(self, world: int, launcher: dict[str, int] | None = None) -> MeshPlan:
        """The device mesh for ``world`` ranks: these keys, else the launcher's ``parallelism_config`` values
        (``launcher``: accelerate launch's PARALLELISM_CONFIG_* variables), else flat FSDP2.

        Raises:
            ConfigError: sizes that do not multiply to ``world``.
        """
        launcher = launcher or {}

        def pick(key: str) -> int | None:
            value = getattr(self, key)
            return value if value is not None else launcher.get(key)

        return resolve_mesh(
            world,
            dp_replicate=pick("dp_replicate_size"),
            dp_shard=pick("dp_shard_size"),
            tp=pick("tp_size"),
            cp=pick("cp_size"),
            cp_backend=self.cp_backend,
            ep=self.ep_size,
        )

    def validate(self) -> None:
        """Raises ConfigError for a value argparse cannot refuse."""
        for key in ("dp_replicate_size", "dp_shard_size", "tp_size", "cp_size", "ep_size"):
            value = getattr(self, key)
            check(value is None or value >= 1, f"{key}={value} must be >= 1")
        check(
            self.activation_checkpointing is None or self.activation_checkpointing in AC_MODES,
            f"activation_checkpointing={self.activation_checkpointing!r} is not one of {', '.join(AC_MODES)}",
        )
        check(
            not (self.gradient_checkpointing and self.activation_checkpointing not in (None, "full")),
            f"gradient_checkpointing=true and activation_checkpointing={self.activation_checkpointing!r} disagree; "
            "set only activation_checkpointing",
        )
        check(self.ac_every_k >= 1, f"ac_every_k={self.ac_every_k} must be >= 1")
        check(
            self.torch_compile_scope in COMPILE_SCOPES,
            f"torch_compile_scope={self.torch_compile_scope!r} is not one of {', '.join(COMPILE_SCOPES)}",
        )
        check(
            self.torch_compile_mode in COMPILE_MODES,
            f"torch_compile_mode={self.torch_compile_mode!r} is not one of {', '.join(m for m in COMPILE_MODES if m)}",
        )
