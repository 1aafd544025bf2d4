#!/usr/bin/env bash
# One GPU session, about 8 minutes on one H200 with compilation from cold caches:
#   1. bench_layer.py, one process per model: HF's layer (grouped_mm; and compiled, the reference) and ours (eager,
#      compiled with inductor's expert middle, compiled as jobs run it), seq SEQS x batch 2, with a profile of every
#      path (top CUDA kernels)
#   2. bench_experts.py: the experts alone at Qwen3-30B-A3B sizes, 8192 tokens, against HF's compiled experts
#   3. correctness of the split on CUDA (disagmoe_ds.models.check, 7 tiny families x fp32/bf16, and bf16 compiled as
#      jobs run it, Triton kernels included), unless --no-check
# Every step runs under `timeout`, at most its own limit and never past BUDGET_S seconds from the start (default
# 470); a step with under 20 s left is logged as skipped. Writes to $OUT: env.txt; session.txt (each command, its
# output, its exit code and seconds); layer_bench-<model>.json; experts_bench.json; checks.jsonl.
# Usage: bash bench/gpu_session.sh ["MODELS"] ["SEQS"] [--no-check]
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
MODELS=${1:-"hf_models/Qwen3-30B-A3B hf_models/Mixtral-8x7B hf_models/DeepSeek-V3"}
SEQS=${2:-4096}
BUDGET_S=${BUDGET_S:-470}
LOG=$OUT/session.txt
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  python -c "import torch, transformers, deepspeed; print(torch.__version__, transformers.__version__, deepspeed.__version__)"
} > "$OUT/env.txt" 2>&1
source "$(dirname "$0")/gpu_step.sh"  # step LIMIT_S COMMAND...
for model in $MODELS; do
  # no hf-eager: DeepSeek-V3's per-expert loop took 6 s a step
  step 200 python bench/bench_layer.py --model "$model" --seq-len $SEQS --batch 2 \
    --paths hf-grouped hf-compiled ours inductor-compiled ours-compiled --profile --json "$OUT/layer_bench-$(basename "$model").json"
done
step 120 python bench/bench_experts.py --tokens 8192 --json "$OUT/experts_bench.json"
if [ "${3:-}" != "--no-check" ]; then
  for fam in qwen2-moe qwen3-moe mixtral deepseek-v2 deepseek-v3 gpt-oss olmoe; do
    for dt in fp32 bf16 "bf16 --compile"; do
      check="python -m disagmoe_ds.models.check --model hf_models/tiny-$fam --shards 2 --dtype $dt --device cuda"
      step 60 bash -c "$check --json >> '$OUT/checks.jsonl'"  # stdout: one JSON line; stderr: the log
    done
  done
fi
echo "### done after ${SECONDS} s" >> "$LOG"
awk '/^###/ {table = 0; print; next} /^(model|variant) / {table = 1} table' "$LOG" | cut -c1-300  # steps, tables
[ -f "$OUT/checks.jsonl" ] && echo "checks passed: $(grep -c '"pass": true' "$OUT/checks.jsonl") of $(wc -l < "$OUT/checks.jsonl")"
exit 0
