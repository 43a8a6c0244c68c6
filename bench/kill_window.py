"""Preemption inside the kill window, measured: the recipe on 2 gloo ranks (torchrun), SIGTERM to one rank after a
few steps, and the figures the run reports: a step, a save (measured), the verdict against ``kill_window``, and the
seconds from the SIGTERM to the ranks' clean stop with a checkpoint (docs/restarts.md).

    .venv/bin/python bench/kill_window.py                      # the embedded SmolLM2-135M-Instruct (fp32)
    .venv/bin/python bench/kill_window.py --model tiny         # a 0.3M-parameter Llama (what the tests train)

Prints a Markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]


def _model(kind: str, root: Path) -> Path:
    if kind == "smollm2":
        from hf_fsdp2.demo.assets import ensure_smollm2

        return ensure_smollm2()
    sys.path.insert(0, str(REPO / "tests"))
    from support.tiny import make_tiny_llama_dir

    return make_tiny_llama_dir(root / "model", seed=4)


def _data(path: Path, n: int = 64) -> Path:
    words = [
        "alpha",
        "bravo",
        "charlie",
        "delta",
        "echo",
        "foxtrot",
        "golf",
        "hotel",
        "india",
        "juliet",
        "kilo",
        "lima",
        "mike",
    ]
    with path.open("w") as f:
        for i in range(n):
            text = " ".join(words[(i + k) % len(words)] for k in range(8 + i % 9))
            f.write(
                json.dumps(
                    {
                        "messages": [
                            {"role": "user", "content": text},
                            {"role": "assistant", "content": text[::-1]},
                        ]
                    }
                )
                + "\n"
            )
    return path


def _ranks(launcher: int) -> list[int]:
    """torchrun's children (its agent forks the ranks directly)."""
    found = []
    for task in Path(f"/proc/{launcher}/task").iterdir():
        found += [int(c) for c in (task / "children").read_text().split()]
    return sorted(found)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", choices=["smollm2", "tiny"], default="smollm2")
    parser.add_argument("--sigterm_after", type=int, default=3, help="steps logged before the SIGTERM")
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="kill-window-"))
    recipe = root / "r.yaml"
    recipe.write_text(
        yaml.safe_dump(
            {
                "model_name_or_path": str(_model(args.model, root)),
                "dataset_name": str(_data(root / "chat.jsonl")),
                "output_dir": str(root / "run"),
                "max_steps": 200,
                "save_steps": 2,
                "per_device_train_batch_size": 2,
                "max_length": 128,
                "logging_steps": 1,
                "mixed_precision": "no",
                "export_verify": False,
            }
        )
    )
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), "HF_HUB_OFFLINE": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(port)]
    cmd += [str(REPO / "recipes" / "sft.py"), "--config", str(recipe)]
    log = root / "log.txt"
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT)
        metrics = root / "run" / "metrics.jsonl"
        while proc.poll() is None:
            if metrics.is_file() and len(metrics.read_text().splitlines()) >= args.sigterm_after:
                break
            time.sleep(0.2)
        sent = time.time()
        os.kill(_ranks(proc.pid)[-1], signal.SIGTERM)  # one rank, as a preempted node's
        proc.wait(timeout=600)
        ended = time.time()
    text = log.read_text()
    verdict = re.search(r"preemption: .*", text)
    stopped = re.search(r"SIGTERM: saved checkpoint-(\d+) and stopped ([0-9.]+) s after the signal", text)
    steps = re.findall(r"step_time ([0-9.]+)s", text)
    print(
        "| model | step (s) | the run's verdict | SIGTERM -> stopped, as the run measured it | ... as seen from here |"
    )
    print("|---|---|---|---|---|")
    print(
        f"| {args.model} | {', '.join(steps[:4])} | {verdict[0] if verdict else '(none)'} | "
        f"{(stopped[2] + ' s (checkpoint-' + stopped[1] + ')') if stopped else '(not stopped: status ' + str(proc.returncode) + ')'} | "
        f"{ended - sent:.1f} s to the launcher's exit (status {proc.returncode}) |"
    )


if __name__ == "__main__":
    main()
