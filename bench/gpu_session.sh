#!/usr/bin/env bash
# One GPU session: correctness of the split on CUDA, then the per-layer benchmark. Writes three files to $OUT:
# env.txt, checks.jsonl, layer_bench.{txt,json}.   Usage: bash bench/gpu_session.sh "MODELS" "SEQS" [--no-check]
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
MODELS=${1:-"hf_models/Qwen3-30B-A3B hf_models/Mixtral-8x7B hf_models/DeepSeek-V3"}
SEQS=${2:-4096}
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  python -c "import torch, transformers, deepspeed; print(torch.__version__, transformers.__version__, deepspeed.__version__)"
} > "$OUT/env.txt" 2>&1
if [ "${3:-}" != "--no-check" ]; then
  for fam in qwen2-moe qwen3-moe mixtral deepseek-v2 deepseek-v3 gpt-oss olmoe; do
    for dt in fp32 bf16; do
      timeout 120 python -m disagmoe_ds.models.check --model hf_models/tiny-$fam --shards 2 --dtype $dt --device cuda \
        --json 2>/dev/null >> "$OUT/checks.jsonl"
    done
  done
fi
timeout 480 python bench/bench_layer.py --model $MODELS --seq-len $SEQS --batch 2 --profile \
  --json "$OUT/layer_bench.json" > "$OUT/layer_bench.txt" 2>&1
grep -A 12 "^model " "$OUT/layer_bench.txt"; [ -f "$OUT/checks.jsonl" ] && grep -c '"pass": true' "$OUT/checks.jsonl"
