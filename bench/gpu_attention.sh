#!/usr/bin/env bash
# GPT-OSS's sink attention on one GPU, "disagmoe.attention" auto (flex_attention on CUDA) against eager, in one call
# of under 10 minutes, DeepSpeed from ./.whl:
#   1. check_sink_attention.py: eager and flex_attention, fp32 and bf16, against the fp32 eager step
#   2. correctness of the split on CUDA with auto (flex_attention) against HF with it (disagmoe_ds.models.check,
#      tiny-gpt-oss at 256 tokens, 8-token windows: fp32, bf16, bf16 compiled as jobs run it), and the graphed parts
#      of GPT-OSS bit-identical to the parts (tests/test_graphs.py)
#   3. bench_e2e.py, the co-located mode on one GPU: 2 layers of GPT-OSS-120B's shape with GPT-OSS-20B's 32 experts
#      (the same attention; 128 experts do not fit one GPU's training state), 4 x 1 x SEQ tokens a step, compiled,
#      --attention eager against auto, then auto with CUDA graphs; then the first step's loss of each, uncompiled
# Every step runs under `timeout`, capped by BUDGET_S seconds from the start (default 560). Writes to $OUT: env.txt,
# session.txt (each command, its output, exit code and seconds), checks.jsonl, e2e-<variant>.json.
# Usage: bash bench/gpu_attention.sh [SEQ]
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
SEQ=${1:-4096}
BUDGET_S=${BUDGET_S:-560}
LOG=$OUT/session.txt
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  python -c "import torch, transformers, deepspeed; print(torch.__version__, transformers.__version__, deepspeed.__version__)"
} > "$OUT/env.txt" 2>&1
source "$(dirname "$0")/gpu_step.sh"  # step LIMIT_S COMMAND...
step 60 python bench/check_sink_attention.py --seq-len 512
for dt in fp32 bf16 "bf16 --compile"; do
  check="python -m disagmoe_ds.models.check --model hf_models/tiny-gpt-oss --seq-len 256 --dtype $dt --device cuda"
  step 90 bash -c "$check --json >> '$OUT/checks.jsonl'"
done
step 120 python -m pytest -q -x tests/test_graphs.py -k "gpt-oss"
MODEL=/tmp/gpt-oss-32-experts
mkdir -p $MODEL && python -c "
import json; c = json.load(open('hf_models/GPT-OSS-120B/config.json')); c['num_local_experts'] = 32
json.dump(c, open('$MODEL/config.json', 'w'), indent=1)"
E2E="bench/bench_e2e.py --model $MODEL --layers 2 --world-size 1 --seq-len $SEQ --global-batch 4 --micro-batch-size 1 --methods colocated --compile --warmup 2 --steps 3"
step 150 torchrun --nproc_per_node 1 $E2E --attention eager --json "$OUT/e2e-eager.json"
step 150 torchrun --nproc_per_node 1 $E2E --json "$OUT/e2e-auto.json"
step 150 torchrun --nproc_per_node 1 $E2E --cuda-graphs --json "$OUT/e2e-auto-graphs.json"
FIRST="${E2E/--compile --warmup 2 --steps 3/--warmup 0 --steps 1}"
step 60 torchrun --nproc_per_node 1 $FIRST --attention eager --json "$OUT/first-eager.json"
step 60 torchrun --nproc_per_node 1 $FIRST --json "$OUT/first-auto.json"
echo "### done after ${SECONDS} s" >> "$LOG"
awk '/^###/ {table = 0; print; next} /^(model|method|variant) / {table = 1} /^\{"dtype/ {print} table' "$LOG" | cut -c1-300
[ -f "$OUT/checks.jsonl" ] && cut -c1-400 "$OUT/checks.jsonl"
exit 0
