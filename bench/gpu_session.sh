#!/usr/bin/env bash
# One GPU session: correctness of the split on CUDA, then the per-layer benchmark (results under $OUT).
# Usage (on the GPU machine, after the wheelhouse install line): bash bench/gpu_session.sh [seq ...]
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$OUT/gpu.txt"
python -c "import torch, transformers, deepspeed; print(torch.__version__, transformers.__version__, deepspeed.__version__)" >> "$OUT/gpu.txt" 2>&1
for fam in qwen2-moe qwen3-moe mixtral deepseek-v2 deepseek-v3 gpt-oss olmoe; do
  for dt in fp32 bf16; do
    timeout 120 python -m disagmoe_ds.models.check --model hf_models/tiny-$fam --shards 2 --dtype $dt --device cuda \
      > "$OUT/check_${fam}_${dt}.json" 2> "$OUT/check_${fam}_${dt}.err"
  done
done
SEQS=${*:-4096}
timeout 420 python bench/bench_layer.py --model hf_models/Qwen3-30B-A3B hf_models/Mixtral-8x7B hf_models/DeepSeek-V3 \
  --seq-len $SEQS --batch 2 --profile --json "$OUT/layer_bench.json" > "$OUT/layer_bench.txt" 2> "$OUT/layer_bench.err"
tail -20 "$OUT/layer_bench.txt"; grep -h '"pass"' "$OUT"/check_*.json | sort | uniq -c
