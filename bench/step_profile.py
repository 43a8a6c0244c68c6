"""Where a training step's time goes on CPU: data, forward + loss, backward, clipping, optimizer, the metrics,
and the collectives inside them, for the SFT recipe's own pieces on its default settings.

    torchrun --nproc_per_node 2 bench/step_profile.py            # 2 gloo ranks: collectives included
    python bench/step_profile.py --steps 6 --warmup 2 --hidden 64 --layers 2   # a quick look, one process

The model and data are trainer_bench.py's (a random-init Llama on the chatterbot dialogues, SmolLM2's
tokenizer). Steps ``warmup+1..steps`` run under ``torch.profiler`` (CPU activities); the table gives, per step
and in milliseconds (the slowest rank), the wall time of each ``hf_fsdp2/<phase>`` range that
``hf_fsdp2.train.step`` marks, the time spent in collectives (gloo ops, which overlap the phases they run in),
the time waiting for data, and what is left of the step (the observer: metrics, counting; the profiler's own
cost). JSON to ``--json``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
PHASES = ("count_tokens", "forward_loss", "backward", "clip_grad_norm", "optimizer_step")
COLLECTIVE_MARKS = ("allreduce", "allgather", "all_gather", "reduce_scatter", "broadcast", "gloo:")


def profile(args: argparse.Namespace) -> dict[str, Any]:
    import torch
    from torch.profiler import ProfilerActivity, record_function

    sys.path.insert(0, str(Path(__file__).parent))
    from trainer_bench import prepare, recipe_pieces, shared_settings

    from hf_fsdp2 import collectives
    from hf_fsdp2.train.step import train_step

    work = Path(args.work)
    if int(os.environ.get("RANK", "0")) == 0 and not (work / "model").is_dir():
        prepare(work, args)
    if "RANK" in os.environ:  # the other ranks wait for rank 0's files without a process group yet
        while not (work / "chat.jsonl").is_file() or not (work / "model" / "config.json").is_file():
            time.sleep(0.5)
        time.sleep(1.0)
    settings = shared_settings(args, work)
    out_dir = work / f"profile_{os.environ.get('WORLD_SIZE', '1')}"
    path = work / f"profile_{os.environ.get('RANK', '0')}.yaml"
    with recipe_pieces(settings, out_dir, json.loads(args.extra), path) as run:
        session, observer, batches = run.session, run.observer, run.batches

        def run_step(step: int) -> None:
            observer.start_step(step)
            with record_function("hf_fsdp2/data"):
                micro = [next(batches) for _ in range(run.cfg.train.gradient_accumulation_steps)]
            out = train_step(
                run.model.module, run.optimizer, run.scheduler, micro, run.step_settings, session.device
            )
            with record_function("hf_fsdp2/observer"):
                observer.end_step(step, micro, out, run.model.module, epoch=run.data.stream.epoch)

        for step in range(1, args.warmup + 1):
            run_step(step)
        measured = args.steps - args.warmup
        start = time.perf_counter()
        with torch.profiler.profile(activities=[ProfilerActivity.CPU]) as prof:
            for step in range(args.warmup + 1, args.steps + 1):
                run_step(step)
        wall = (time.perf_counter() - start) / measured
        events = prof.key_averages()
        ms: dict[str, float] = {}
        for phase in (*PHASES, "data", "observer"):
            ms[phase] = sum(e.cpu_time_total for e in events if e.key == f"hf_fsdp2/{phase}") / 1e3 / measured
        ms["collectives"] = (
            sum(e.self_cpu_time_total for e in events if any(m in e.key.lower() for m in COLLECTIVE_MARKS))
            / 1e3
            / measured
        )
        ms["step_wall"] = wall * 1e3
        ms["other"] = ms["step_wall"] - sum(ms[p] for p in (*PHASES, "data", "observer"))
        keys = sorted(ms)
        table = collectives.gather_rows([ms[k] for k in keys], session.device)  # [world, keys]
        slowest = int(table[:, keys.index("step_wall")].argmax())  # one rank's own breakdown: the slowest
        result = dict(zip(keys, table[slowest].tolist(), strict=True))
    return {
        "world_size": session.world,
        "steps_measured": measured,
        "ms_per_step": result,
        "extra": json.loads(args.extra),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--max-length", type=int, default=512)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--tokenizer", default="auto")
    ap.add_argument("--extra", default="{}", help="recipe keys as JSON, e.g. '{\"padding_free\": false}'")
    ap.add_argument("--work", default=str(REPO / "bench" / "out" / "step_profile"))
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    result = profile(args)
    if int(os.environ.get("RANK", "0")) == 0:
        ms = result["ms_per_step"]
        print(
            f"\nms per step (slowest of {result['world_size']} rank(s), {result['steps_measured']} steps profiled)"
        )
        for key in ("step_wall", "data", *PHASES, "observer", "other", "collectives"):
            note = "  (inside the phases above)" if key == "collectives" else ""
            print(f"  {key:16s} {ms[key]:9.1f}{note}")
        if args.json:
            Path(args.json).write_text(json.dumps(result, indent=1))
    sys.stdout.flush()
    os._exit(0)  # as the recipe: no interpreter finalization after a gloo run


if __name__ == "__main__":
    main()
