"""One GPU (an H200), one command under 7 minutes: hf_fsdp2's performance switches beside TRL's SFTTrainer.

    python bench/gpu_bench.py --out bench/out/gpu_bench.json           # on the GPU machine
    python bench/gpu_bench.py --quick --out /tmp/gpu_quick.json        # ~1-2 min: eager vs regional, no TRL
    python bench/gpu_bench.py --cpu --shape small --seq 1024 --warmup 2 --steps 3 --trl none:none \
        --configs eager:none:chunked,regional:none:chunked,model:none:chunked   # compile scopes on CPU (fp32)
    python bench/gpu_bench.py --smoke --out /tmp/gpu_bench.json        # any machine: tiny shape, CPU

The work. A Llama-3.2-1B-shaped model (hidden 2048, 16 layers, 32 heads / 8 KV heads, MLP 8192, vocab
128256, tied embeddings), random init (seed 0, built on the run's device), trained with AdamW (lr 1e-4,
betas 0.9/0.95, no weight decay, constant lr, clipping at 1.0) on packed rows of ``--seq`` tokens: step
``i`` gets row ``i``, random documents of random lengths back to back (position_ids restarting per
document, no target across a document boundary), sdpa attention, bf16 compute with fp32 master weights,
one process, FSDP2 through Accelerate at world size 1.

Runners, in this order (TRL first: the baseline of every "x TRL"):

* ``trl <kernels>:<ac>`` (``--trl``, default ``none:none,liger:none``): ``trl.SFTTrainer`` launched the way
  TRL documents it, ``accelerate launch --config_file <trl>/accelerate_configs/fsdp2.yaml --num_processes 1
  --mixed_precision bf16 bench/gpu_bench.py --trl-child ...`` (TRL's own FSDP2 file: fsdp_version 2,
  transformer-based wrap, reshard after forward, cpu_ram_efficient_loading; one fresh process per runner).
  The model is the same random init saved once to a temporary folder (fp32 safetensors + a word-level
  tokenizer naming the pad and eos tokens: the data are token ids) and given to ``SFTTrainer`` as a path,
  loaded by TRL (fp32, ``attn_implementation="sdpa"``). The data: rows ``0..warmup+steps-1`` handed over
  packed, in the two columns TRL's packing produces (``input_ids``, ``seq_lengths``), with
  ``skip_prepare_dataset`` and ``train_sampling_strategy="sequential"``: TRL's step ``i`` trains on the
  very row of the hf_fsdp2 runners' step ``i``, collated by TRL's own padding-free collator (position_ids
  rebuilt from ``seq_lengths``). Left to pack the same documents itself (``packing_strategy="bfd"``), TRL
  makes 14 rows of the 13 at seq 4096, the last of 281 tokens: one step would then be mostly overhead.
  SFTConfig: ``packing=True``, ``packing_strategy="bfd"``, ``padding_free=True``, ``max_length=seq``,
  ``per_device_train_batch_size=1``, ``bf16=True`` (Accelerate's FSDP2 policy for bf16: parameters,
  gradient reduction and outputs in bf16 over fp32 sharded weights), ``gradient_checkpointing`` = ``<ac> == full`` (TRL's
  default is on; off is the faster setting when memory allows), ``use_liger_kernel`` = ``<kernels> ==
  liger`` (Liger's RMSNorm/RoPE/SwiGLU kernels; the loss stays TRL's fused LM head, which never builds
  the full logits), the optimizer settings above with TRL's default ``adamw_torch_fused``,
  ``logging_steps=1`` (the last step's loss; TRL reads its own metrics back every step anyway), no
  saving, no reporting; the JSON lists them all. Liger needs CUDA and
  ``liger-kernel``: without them the entry says why and has no numbers. TRL 1.16 marks
  ``use_liger_kernel`` deprecated for Hub kernels (``model_init_kwargs={"use_kernels": True}``), which
  are downloaded from the Hub: not measured here, nor flash-attention (TRL's advice for padding-free
  batches); every runner uses sdpa, to which transformers gives a block-diagonal mask from the
  position_ids.
* ``hf_fsdp2 <compile>:<ac>:<loss>`` (``--configs``): the library's own pieces in this process
  (``prepare_fsdp2``, ``train_step``; bf16 compute, fp32 gradient reduction): eager vs regional compile,
  activation checkpointing none / full / offload, plain vs chunked cross entropy.

Measured per runner, over the ``--steps`` steps after ``--warmup`` (the clock runs from the end of step
``warmup`` to the end of the last step, each end after a device synchronize; TRL's from its
``on_step_end`` callback): tokens/s (non-pad tokens), target tokens/s, step time, achieved TFLOP/s and
MFU from the library's FLOP model (``6N + 12LHQT`` per token, ``T`` = each document's own length, the
same rows for every runner) against the device's spec peak (989 TFLOP/s for an H200) and against a
bf16 matmul measured once in this run (the same peak for every runner), ``torch.cuda.max_memory_allocated``
over the training steps, the loss of the last step; each hf_fsdp2 configuration also as "x TRL" (its
tokens/s over the best TRL runner's). TRL's token counts come from its own collated batches. On CPU
(``--cpu``, ``--smoke``) the TRL child is marked FSDP on gloo before the Trainer builds its Accelerator
(Accelerate keeps FSDP for GPUs): the same FSDP2 prepare path, checked (``fsdp2_sharded``) after training.

Time budget: ``--budget-s`` (default 400 s) for the runners, which leaves the interpreter's start and
the teardown inside 7 minutes. Planned from the FLOP model; the fixed costs (process starts, loading,
compile) are measured by the run itself, per runner as ``wall_s``:

* a step at seq 4096 is 3.2e13 to 3.4e13 FLOPs by the library's model (4096 tokens x (6 x 1.236e9 +
  attention over documents of 64 to 2047 tokens)); even at 10% of 989 TFLOP/s that is 0.34 s, so the
  3 + 10 steps of a runner take at most ~4.4 s: the budget goes to the fixed costs;
* per TRL runner: a fresh ``accelerate launch`` process (imports, CUDA and NCCL start), loading the
  4.9 GB fp32 folder (written once, by the first TRL runner) and the FSDP2 prepare;
* per hf_fsdp2 configuration: building the model on the GPU, and for regional compile the compile itself
  (reported as ``compile_s``; later configurations reuse Inductor's cache).

The script enforces the budget: a runner starts only while the time left exceeds the longest runner so
far; a TRL process is stopped after ``--trl-timeout-s`` (180 s) or at the deadline, whichever comes
first; what did not run says why, never with a number. ``--smoke`` runs every runner that can run on
CPU at a tiny size (2 layers, hidden 64, vocab 4096, seq 256, 1 + 1 steps, fp32) and lists the Liger
runner as skipped. On CPU the TRL process is given this process's torch thread count
(``--num_cpu_threads_per_process``; accelerate's GPU-style launch would give it one). Output: a table on
stdout and, with ``--out``, the JSON (every runner's entry, the device, the matmul and spec peaks, the
best TRL runner).
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[1]
DEFAULT_CONFIGS = (
    "eager:none:plain,eager:none:chunked,eager:full:chunked,eager:offload:chunked,"
    "regional:none:plain,regional:none:chunked,regional:full:chunked"
)
DEFAULT_TRL = "none:none,liger:none"
SHAPES = {
    # Llama-3.2-1B
    "1b": {"hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16, "num_attention_heads": 32,
           "num_key_value_heads": 8, "vocab_size": 128256},
    # a CPU-sized model with a real vocabulary (SmolLM2's size)
    "small": {"hidden_size": 256, "intermediate_size": 704, "num_hidden_layers": 4, "num_attention_heads": 4,
              "num_key_value_heads": 2, "vocab_size": 49152},
    "tiny": {"hidden_size": 64, "intermediate_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4,
             "num_key_value_heads": 2, "vocab_size": 4096},
}  # fmt: skip
LR, BETAS, EPS = 1e-4, (0.9, 0.95), 1e-8
# What a one-process run of this script put in its environment (hf_fsdp2's accelerator) and the launcher
# of a TRL child sets itself.
LAUNCH_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


# ---------------------------------------------------------------------------------------------- shared


def matmul_peak(device: torch.device, n: int) -> float:
    """Achieved bf16 matmul FLOP/s on an n x n x n product (the best of a few timed runs)."""
    if device.type != "cuda":
        return float("nan")
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    best = float("inf")
    for _ in range(5):
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(10):
            a @ b
        torch.cuda.synchronize()
        best = min(best, (time.perf_counter() - start) / 10)
    return 2 * n**3 / best


def packed_batch(seq: int, vocab: int, step: int) -> dict[str, torch.Tensor]:
    """One packed row: documents of random lengths back to back, position_ids restarting per document."""
    g = torch.Generator().manual_seed(step)
    lengths: list[int] = []
    while sum(lengths) < seq:
        # at most half a row per document: every row holds several (the same attention path every step)
        longest = max(65, min(2048, seq // 2))
        lengths.append(min(int(torch.randint(64, longest, (1,), generator=g)), seq - sum(lengths)))
    ids = torch.randint(0, vocab, (1, seq), generator=g)
    position_ids = torch.cat([torch.arange(n) for n in lengths]).unsqueeze(0)
    labels = ids.clone()
    labels[position_ids == 0] = -100  # no target across a document boundary
    return {"input_ids": ids, "position_ids": position_ids, "labels": labels}


def trl_rows(seq: int, vocab: int, rows: int) -> dict[str, list[list[int]]]:
    """Rows ``0..rows-1`` of :func:`packed_batch` in the columns TRL's own packing produces: ``input_ids``
    and ``seq_lengths`` (its documents' lengths, from which TRL's collator rebuilds the position_ids)."""
    columns: dict[str, list[list[int]]] = {"input_ids": [], "seq_lengths": []}
    for step in range(rows):
        batch = packed_batch(seq, vocab, step)
        starts = (batch["position_ids"][0] == 0).nonzero().flatten().tolist()
        columns["input_ids"].append(batch["input_ids"][0].tolist())
        columns["seq_lengths"].append([b - a for a, b in zip(starts, [*starts[1:], seq], strict=True)])
    return columns


def llama_config(args: argparse.Namespace) -> Any:
    from transformers import LlamaConfig

    config = LlamaConfig(**SHAPES[args.shape], max_position_embeddings=max(args.seq, 8192), rope_theta=500000.0,
                         tie_word_embeddings=True)  # fmt: skip
    config._attn_implementation = "sdpa"
    return config


def build(args: argparse.Namespace, device: torch.device) -> torch.nn.Module:
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(llama_config(args))  # fp32 master weights; bf16 compute by the policy
    model.config.use_cache = False
    return model


def batch_counts(batch: dict[str, torch.Tensor], flops: Any) -> tuple[int, int, float]:
    """(non-pad tokens, target tokens, FLOPs) of a collated batch: the recipe's meter's own counting
    (``tokens_and_flops``: each document of a packed row at its own length, never ``T = seq``)."""
    from hf_fsdp2.observe.flops import tokens_and_flops
    from hf_fsdp2.train.loss import count_target_tokens

    # No pad id: the rows are documents back to back, without padding (TRL's collated rows neither).
    tokens, batch_flops = tokens_and_flops(batch, flops, pad_token_id=None)
    return tokens, count_target_tokens(batch["labels"]), batch_flops


def summarize(counts: list[tuple[int, int, float]], seconds: float) -> dict[str, float]:
    """Throughput of the timed steps: ``counts`` holds (tokens, targets, FLOPs) per timed step."""
    tokens, targets = sum(c[0] for c in counts), sum(c[1] for c in counts)
    return {
        "tokens_per_s": tokens / seconds,
        "target_tokens_per_s": targets / seconds,
        "step_s": seconds / len(counts),
        "tflops": sum(c[2] for c in counts) / seconds / 1e12,
        "timed_tokens": tokens,
        "timed_targets": targets,
    }


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def max_mem_gib(device: torch.device) -> float | None:
    return torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None


# ---------------------------------------------------------------------------------------------- hf_fsdp2


def run_config(acc: Any, args: argparse.Namespace, item: str) -> dict[str, Any]:
    from hf_fsdp2.config.plans import ACPlan, CompilePlan, ShardingPlan
    from hf_fsdp2.observe.flops import flops_model, non_embedding_params
    from hf_fsdp2.parallel.accelerator import prepare_fsdp2
    from hf_fsdp2.parallel.compiling import CompileWatch
    from hf_fsdp2.train.loss import plan_loss
    from hf_fsdp2.train.optim import build_adamw, param_groups
    from hf_fsdp2.train.step import StepSettings, train_step

    scope, ac, loss_path = item.split(":")
    device = acc.device
    torch._dynamo.reset()
    model = build(args, device)
    flops = flops_model(model.config, non_embedding_params(model))
    opt = build_adamw(param_groups(model, 0.0), lr=LR, betas=BETAS, eps=EPS, device_type=device.type)
    sharding = ShardingPlan(activation_checkpointing=ACPlan(ac, pin_memory=device.type == "cuda"))
    compile_plan = CompilePlan(enabled=scope != "eager", scope="regional" if scope == "eager" else scope)
    model, opt = prepare_fsdp2(
        acc, model, opt, ("LlamaDecoderLayer",), sharding=sharding, compile_plan=compile_plan
    )
    settings = StepSettings(plan_loss(model, 1024 if loss_path == "chunked" else 0), max_grad_norm=1.0)
    batches = [packed_batch(args.seq, model.config.vocab_size, i) for i in range(args.warmup + args.steps)]
    counts = [batch_counts(b, flops) for b in batches[args.warmup :]]
    watch = CompileWatch(enabled=scope != "eager").start()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)

    def step(i: int) -> Any:  # the library's own step: the one every recipe runs
        return train_step(model, opt, None, [batches[i]], settings, device)

    start = time.perf_counter()
    outs = [step(i) for i in range(args.warmup)]  # compile happens here: not timed
    sync(device)
    warmup_s = time.perf_counter() - start
    compiled = watch.take()
    start = time.perf_counter()
    for i in range(args.warmup, args.warmup + args.steps):
        outs.append(step(i))
    sync(device)
    seconds = time.perf_counter() - start
    out = outs[-1]
    return {
        # every step's loss, read after the clock stopped (a read waits for the device)
        "losses": [o.loss() for o in outs],
        "layers": model.config.num_hidden_layers,
        **summarize(counts, seconds),
        "max_mem_allocated_gib": max_mem_gib(device),
        "final_loss": out.loss(),
        "compile_s": compiled.get("compile_s", 0.0),
        # recompiles during the timed steps (their time is in step_s): should be 0
        "recompiles_timed": watch.take().get("recompiles", 0.0) - compiled.get("recompiles", 0.0),
        "recompiles_total": compiled.get("recompiles", 0.0),
        "warmup_s": warmup_s,
    }


def release(acc: Any) -> None:
    """Free a configuration's model and optimizer (accelerate keeps references to what it prepared)."""
    acc._models.clear()
    acc._optimizers.clear()
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


# ---------------------------------------------------------------------------------------------- TRL


def trl_config_file() -> Path | None:
    """TRL's own accelerate config for FSDP2 (``trl/accelerate_configs/fsdp2.yaml``), None without TRL."""
    spec = importlib.util.find_spec("trl")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(next(iter(spec.submodule_search_locations))) / "accelerate_configs" / "fsdp2.yaml"
    return path if path.exists() else None


def trl_unavailable(kernels: str, on_cuda: bool) -> str | None:
    """Why a TRL runner cannot run here (None: it can)."""
    missing = [name for name in ("trl", "datasets") if importlib.util.find_spec(name) is None]
    if missing:
        return f"{' and '.join(missing)} not installed (pip install trl==1.16.0 datasets)"
    if trl_config_file() is None:
        return "trl is installed without its accelerate_configs/fsdp2.yaml"
    if kernels == "liger":
        reasons = [] if on_cuda else ["Liger's Triton kernels need a CUDA device (none in this run)"]
        if importlib.util.find_spec("liger_kernel") is None:
            reasons.append("liger-kernel not installed (pip install liger-kernel)")
        if reasons:
            return "; ".join(reasons)
    return None


def save_model_folder(args: argparse.Namespace, device: torch.device, folder: Path) -> None:
    """The runners' random init (same config, seed and device), saved as a model folder TRL loads by path,
    with a word-level tokenizer that only names the pad and eos tokens (the data are token ids)."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast

    model = build(args, device)
    model.save_pretrained(folder)
    del model
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    words = Tokenizer(WordLevel({"<pad>": 0, "<eos>": 1, "<unk>": 2}, unk_token="<unk>"))
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=words, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>"
    )
    tokenizer.save_pretrained(folder)


def trl_launch_command(args: argparse.Namespace, item: str, folder: Path, out: Path, port: int) -> list[str]:
    """``accelerate launch`` with TRL's FSDP2 config file on one process, running this script's TRL child."""
    config_file = trl_config_file()
    assert config_file is not None  # checked by trl_unavailable
    return [
        sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(config_file),
        "--num_processes", "1", "--num_machines", "1", "--main_process_port", str(port),
        "--mixed_precision", "no" if args.cpu else "bf16", "--dynamo_backend", "no",
        # CPU: the threads this process computes with (accelerate launch would give a GPU-style launch one)
        *(["--num_cpu_threads_per_process", str(torch.get_num_threads())] if args.cpu else []),
        __file__, "--trl-child", item, "--trl-model", str(folder), "--trl-out", str(out),
        "--shape", args.shape, "--seq", str(args.seq), "--warmup", str(args.warmup), "--steps", str(args.steps),
        *(["--cpu"] if args.cpu else []),
    ]  # fmt: skip


def fsdp_on_gloo() -> None:
    """CPU only: mark Accelerate's shared state FSDP before the Trainer builds its Accelerator.

    Accelerate turns FSDP on only for GPU-like distributed types; on CPU it would train an unsharded copy.
    The plugin is built from the variables ``accelerate launch`` set from TRL's FSDP2 file, and the
    Trainer is told to use this state (``accelerator_config={"use_configured_state": True}``): its
    Accelerator then prepares the model through the same FSDP2 path as on a GPU, on gloo.
    """
    from accelerate import PartialState
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

    state = PartialState(cpu=True)
    state._shared_state["distributed_type"] = DistributedType.FSDP
    state._shared_state["fsdp_plugin"] = FullyShardedDataParallelPlugin()


def trl_child(args: argparse.Namespace) -> None:
    """One TRL runner, in the process ``accelerate launch`` started: writes its raw measurements as JSON."""
    from accelerate.utils import DistributedType
    from datasets import Dataset
    from torch.distributed.tensor import DTensor
    from transformers import TrainerCallback
    from trl import SFTConfig, SFTTrainer

    from hf_fsdp2.observe.flops import flops_model, non_embedding_params

    kernels, ac = args.trl_child.split(":")
    on_cpu = args.cpu or not torch.cuda.is_available()
    if on_cpu:
        fsdp_on_gloo()
    vocab = SHAPES[args.shape]["vocab_size"]
    total = args.warmup + args.steps
    dataset = Dataset.from_dict(trl_rows(args.seq, vocab, total))
    work = Path(args.trl_out).parent
    settings: dict[str, Any] = {
        "packing": True,
        "packing_strategy": "bfd",
        "padding_free": True,
        "dataset_kwargs": {"skip_prepare_dataset": True},  # the rows come packed: the same for every runner
        "train_sampling_strategy": "sequential",  # step i trains on row i, as the hf_fsdp2 runners do
        "max_length": args.seq,
        "per_device_train_batch_size": 1,
        "gradient_accumulation_steps": 1,
        "gradient_checkpointing": ac == "full",
        "use_liger_kernel": kernels == "liger",
        "bf16": not on_cpu,
        "model_init_kwargs": {"attn_implementation": "sdpa", "dtype": "float32"},
        "learning_rate": LR,
        "adam_beta1": BETAS[0],
        "adam_beta2": BETAS[1],
        "adam_epsilon": EPS,
        "weight_decay": 0.0,
        "lr_scheduler_type": "constant",
        "warmup_steps": 0,
        "max_grad_norm": 1.0,
        "max_steps": total,
        "logging_steps": 1,
        "save_strategy": "no",
        "report_to": "none",
        "disable_tqdm": True,
        "seed": 0,
    }
    placement: dict[str, Any] = (
        {"use_cpu": True, "accelerator_config": {"use_configured_state": True}} if on_cpu else {}
    )
    config = SFTConfig(output_dir=str(work / f"trl-{kernels}-{ac}"), **settings, **placement)
    ends: list[float] = []
    device = torch.device("cpu") if on_cpu else torch.device("cuda", torch.cuda.current_device())

    class StepEnds(TrainerCallback):
        """The same clock as the hf_fsdp2 runners: a step ends when the device is done with it."""

        def on_train_begin(self, *a: Any, **k: Any) -> None:
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)

        def on_step_end(self, *a: Any, **k: Any) -> None:
            sync(device)
            ends.append(time.perf_counter())

    trainer = SFTTrainer(model=args.trl_model, args=config, train_dataset=dataset, callbacks=[StepEnds()])
    model = trainer.model
    flops = flops_model(model.config, non_embedding_params(model))
    collate = trainer.data_collator
    counts: list[tuple[int, int, float]] = []

    def counting_collator(examples: list[dict[str, Any]]) -> dict[str, Any]:
        # Counts what TRL's own collator hands the model, in the order the steps consume it.
        batch = collate(examples)
        counts.append(batch_counts(batch, flops))
        return batch

    trainer.data_collator = counting_collator
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    if len(ends) != total or len(counts) < total or len(losses) != total:
        raise RuntimeError(
            f"TRL ran {len(ends)} steps, {len(counts)} batches, {len(losses)} losses for {total}"
        )
    w = args.warmup
    sharded = any(isinstance(p, DTensor) for p in trainer.model.parameters())
    result = {
        **summarize(counts[w:total], ends[-1] - ends[w - 1]),
        "max_mem_allocated_gib": max_mem_gib(device),
        "final_loss": losses[-1],
        "fsdp2_sharded": bool(
            sharded
            and trainer.accelerator.distributed_type == DistributedType.FSDP
            and trainer.accelerator.is_fsdp2
        ),
        "settings": {**settings, **placement},
        "torch_threads": torch.get_num_threads(),
    }
    Path(args.trl_out).write_text(json.dumps(result))


def run_trl(
    args: argparse.Namespace, item: str, folder: Path, work: Path, timeout_s: float
) -> dict[str, Any]:
    """Launch one TRL runner (a fresh ``accelerate launch`` process) and read its measurements back; the
    process (the launcher and its child: one process group) is stopped after ``timeout_s``."""
    out = work / f"trl-{item.replace(':', '-')}.json"
    out.unlink(missing_ok=True)
    cmd = trl_launch_command(args, item, folder, out, free_port())
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in LAUNCH_VARS and not k.startswith(("ACCELERATE_", "FSDP_"))
    }
    env.update({"PYTHONPATH": os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]), "HF_HUB_OFFLINE": "1",
                "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1"})  # fmt: skip
    if args.cpu:
        env["CUDA_VISIBLE_DEVICES"] = ""
    launch = "accelerate launch " + " ".join(cmd[3:])
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)  # fmt: skip
    try:
        log, _ = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        log, _ = proc.communicate()
        return {"error": f"stopped after {timeout_s:.0f} s: {log[-1000:]}", "launch": launch}
    if proc.returncode != 0 or not out.exists():
        oom = "out of memory" in log.lower()
        error = "out of memory" if oom else f"exit code {proc.returncode}"
        return {"error": f"{error}: {log[-1500:]}", "launch": launch}
    return {**json.loads(out.read_text()), "launch": launch}


# ---------------------------------------------------------------------------------------------- driver


def add_ratios(results: list[dict[str, Any]]) -> str | None:
    """``x_trl`` on every measured entry: its tokens/s over the best TRL runner's. Returns that runner."""
    trl = [r for r in results if r["runner"] == "trl" and "tokens_per_s" in r]
    if not trl:
        return None
    best = max(trl, key=lambda r: r["tokens_per_s"])
    for r in results:
        if "tokens_per_s" in r:
            r["x_trl"] = r["tokens_per_s"] / best["tokens_per_s"]
    return str(best["name"])


def print_table(report: dict[str, Any]) -> None:
    def num(value: Any, fmt: str) -> str:
        return "-" if value is None else format(value, fmt)

    print(f"\n| runner | tokens/s | target tok/s | step s | TFLOP/s | MFU spec | MFU matmul | max mem GiB "
          f"| final loss | x TRL |\n|{'---|' * 10}")  # fmt: skip
    for r in report["results"]:
        if "tokens_per_s" not in r:
            why = " ".join(str(r.get("skipped") or r.get("error", "")).split())
            print(f"| {r['name']} | {why[:200]} |")
            continue
        print(f"| {r['name']} | {r['tokens_per_s']:,.0f} | {r['target_tokens_per_s']:,.0f} | {r['step_s']:.3f} "
              f"| {r['tflops']:.3g} | {num(r['mfu_vs_spec'], '.1%')} | {num(r['mfu_vs_measured_matmul'], '.1%')} "
              f"| {num(r['max_mem_allocated_gib'], '.1f')} | {r['final_loss']:.4f} "
              f"| {num(r.get('x_trl'), '.2f')} |")  # fmt: skip
    print(
        f"\nbest TRL runner: {report['trl_baseline']}; wall {report['wall_s']:.0f} s of {report['budget_s']:.0f} s"
    )


# --quick: the smallest run that still says something about the GPU path (one H200, ~1-2 min): the 1B
# shape at seq 4096, eager beside regional compile (chunked loss, no AC), 2 + 5 steps, no TRL runner.
QUICK = {"configs": "eager:none:chunked,regional:none:chunked", "trl": "", "warmup": 2, "steps": 5,
         "budget_s": 150.0}  # fmt: skip
COMPILE_SCOPES, LOSS_PATHS = ("eager", "regional", "model"), ("plain", "chunked")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line, with ``--smoke`` / ``--quick`` applied and every runner spec checked.

    Raises:
        SystemExit: on a bad flag or runner spec (argparse's usage error, exit code 2).
    """
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--configs", default=DEFAULT_CONFIGS, help="hf_fsdp2 runners, compile:ac:loss, comma-separated"
    )
    ap.add_argument(
        "--trl", default=DEFAULT_TRL, help="TRL runners, kernels:ac (none|liger : none|full); '' for none"
    )
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--shape", choices=sorted(SHAPES), default="1b")
    ap.add_argument("--cpu", action="store_true", help="run on CPU (gloo) even with a GPU visible")
    ap.add_argument(
        "--smoke", action="store_true", help="tiny shape on CPU, 1+1 steps: checks the script only"
    )
    ap.add_argument(
        "--quick",
        action="store_true",
        help=f"the smallest meaningful GPU run (~1-2 min): {QUICK} unless given explicitly",
    )
    ap.add_argument("--budget-s", type=float, default=400.0, help="wall-clock budget of the runners")
    ap.add_argument("--trl-timeout-s", type=float, default=180.0, help="a TRL runner is stopped after this")
    ap.add_argument(
        "--work", default=None, help="folder for the saved model and TRL's files (default: a temp dir)"
    )
    ap.add_argument("--out", default=None, help="write the JSON report here")
    ap.add_argument("--trl-child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--trl-model", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--trl-out", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))
    from hf_fsdp2.config.plans import AC_MODES

    if args.quick:
        for key, value in QUICK.items():
            if getattr(args, key) == ap.get_default(key):  # a flag given explicitly wins
                setattr(args, key, value)
    if args.smoke:
        args.seq, args.warmup, args.steps, args.shape, args.cpu = min(args.seq, 256), 1, 1, "tiny", True
    if args.warmup < 1 or args.steps < 1:
        ap.error(
            "--warmup and --steps must be at least 1 (the clock starts at the end of the last warm-up step)"
        )
    bad_trl = [item for item in args.trl.split(",") if item and (len(item.split(":")) != 2
               or item.split(":")[0] not in ("none", "liger") or item.split(":")[1] not in ("none", "full"))]  # fmt: skip
    if bad_trl:
        ap.error(f"--trl {bad_trl}: each TRL runner is kernels:ac, kernels none|liger, ac none|full")
    bad = [item for item in args.configs.split(",") if item and (len(item.split(":")) != 3
           or item.split(":")[0] not in COMPILE_SCOPES or item.split(":")[1] not in AC_MODES
           or item.split(":")[2] not in LOSS_PATHS)]  # fmt: skip
    if bad:
        ap.error(
            f"--configs {bad}: each hf_fsdp2 runner is compile:ac:loss, compile {'|'.join(COMPILE_SCOPES)}, "
            f"ac {'|'.join(AC_MODES)}, loss {'|'.join(LOSS_PATHS)}"
        )
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.trl_child:
        trl_child(args)
        sys.stdout.flush()
        os._exit(0)  # no interpreter finalization after a distributed run
    started = time.perf_counter()
    deadline = started + args.budget_s
    from hf_fsdp2.config.plans import CompilePlan, ShardingPlan
    from hf_fsdp2.observe.flops import peak_flops_for
    from hf_fsdp2.parallel.accelerator import build_accelerator

    acc = build_accelerator(
        ShardingPlan(),
        mixed_precision="no" if args.cpu else "bf16",
        compile_plan=CompilePlan(),
        force_cpu=args.cpu,
    )
    device = acc.device
    if device.type != "cuda" and not args.cpu:
        sys.exit(
            "no GPU visible: add --cpu (e.g. --cpu --shape small --seq 1024), or --smoke to check the script"
        )
    peak_mm = matmul_peak(device, 8192)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    spec = peak_flops_for(name) if device.type == "cuda" else None
    print(f"device {name}; measured bf16 matmul {peak_mm / 1e12:.0f} TFLOP/s; seq {args.seq}; "
          f"{args.warmup} warm-up + {args.steps} timed steps per runner; budget {args.budget_s:.0f} s",
          flush=True)  # fmt: skip
    runners = [("trl", item) for item in args.trl.split(",") if item]
    runners += [("hf_fsdp2", item) for item in args.configs.split(",") if item]
    work = Path(args.work or tempfile.mkdtemp(prefix="gpu_bench_"))
    work.mkdir(parents=True, exist_ok=True)
    folder = work / "model"
    results: list[dict[str, Any]] = []
    longest = 0.0
    for runner, item in runners:
        entry: dict[str, Any] = {"runner": runner, "config": item, "name": f"{runner} {item}"}
        results.append(entry)
        start = time.perf_counter()
        left = deadline - start
        if runner == "trl":
            reason = trl_unavailable(item.split(":")[0], device.type == "cuda")
            if reason:
                entry["skipped"] = reason
                print(json.dumps(entry), flush=True)
                continue
        if left < max(longest, 1.0):
            entry["skipped"] = (
                f"time budget: {left:.0f} s left, the longest runner so far took {longest:.0f} s"
            )
            print(json.dumps(entry), flush=True)
            continue
        if runner == "trl":
            if not folder.exists():
                save_model_folder(args, device, folder)
            timeout = min(args.trl_timeout_s, deadline - time.perf_counter())
            entry.update(run_trl(args, item, folder, work, timeout))
        else:
            try:
                entry.update(run_config(acc, args, item))
            except torch.OutOfMemoryError as err:  # a configuration that does not fit is a result too
                entry["error"] = f"out of memory: {str(err)[:200]}"
            release(acc)
        if "tokens_per_s" in entry:
            entry["mfu_vs_spec"] = entry["tflops"] * 1e12 / spec if spec else None
            entry["mfu_vs_measured_matmul"] = entry["tflops"] * 1e12 / peak_mm if peak_mm == peak_mm else None
        entry["wall_s"] = time.perf_counter() - start
        longest = max(longest, entry["wall_s"])
        print(json.dumps(entry), flush=True)
    report = {
        "device": name,
        "matmul_tflops": peak_mm / 1e12,
        "spec_tflops": spec / 1e12 if spec else None,
        "seq": args.seq,
        "shape": args.shape,
        "warmup": args.warmup,
        "steps": args.steps,
        "budget_s": args.budget_s,
        "torch_threads": torch.get_num_threads(),
        "trl_baseline": add_ratios(results),
        "results": results,
    }
    shutil.rmtree(folder if args.work else work, ignore_errors=True)
    report["wall_s"] = time.perf_counter() - started
    print_table(report)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(report, indent=1))
    acc.end_training()


if __name__ == "__main__":
    main()
