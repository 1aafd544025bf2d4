#!/usr/bin/env bash
# Two or more GPUs of one host: the runtimes on NCCL against HF, one short training job under the deepspeed
# launcher, then the exchange and end-to-end benchmarks. Writes to $OUT: env.txt, multi.txt (every command and its
# output), exchange.json, e2e.json, timeline-afpipe.json (and one per method).
# Usage: bash bench/gpu_multi.sh [E2E_MODEL] [E2E_LAYERS]        (about 8 minutes on 2 H200s)
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
MODEL=${1:-hf_models/Qwen3-30B-A3B}
LAYERS=${2:-4}
G=$(python -c "import torch; print(torch.cuda.device_count())")
H=$((G / 2))
LOG=$OUT/multi.txt
{ nvidia-smi topo -m
  python -c "import torch, transformers, deepspeed; print(torch.__version__, transformers.__version__, deepspeed.__version__)"
} > "$OUT/env.txt" 2>&1
step() {  # step TIMEOUT_S COMMAND...: run, log the command, its output and its exit code
  local limit=$1; shift
  echo "### $*" >> "$LOG"
  local t0=$SECONDS
  timeout "$limit" "$@" >> "$LOG" 2>&1
  echo "### exit $? after $((SECONDS - t0)) s" >> "$LOG"
}
verify() { step 240 torchrun --nproc_per_node "$G" -m disagmoe_ds.verify --json --attention-gpus "$H" --ffn-gpus "$H" "$@"; }
# 1. AF-Pipe on NCCL against the single-process HF model (the reference runs on rank 0's CPU)
verify --model hf_models/tiny-qwen3-moe --micro-batches 3
verify --model hf_models/tiny-qwen2-moe --micro-batches 4 --zero 1
verify --model hf_models/tiny-deepseek-v3 --micro-batches 3 --zero 2 --skew
verify --model hf_models/tiny-mixtral --micro-batches 3 --dtype bf16 --zero 1
step 240 torchrun --nproc_per_node "$G" -m disagmoe_ds.colocated.verify --json --world-size "$G" --ep-size "$G" \
  --model hf_models/tiny-qwen3-moe --micro-batches 3
# 2. The README's training job under the deepspeed launcher, on the GPUs
step 300 deepspeed --num_gpus "$G" run_pretrain.py --steps 30 --save-dir /tmp/run --save-every 15
step 120 deepspeed --num_gpus "$G" run_pretrain.py --steps 40 --save-dir /tmp/run --resume
# 3. M2N/N2M versus all-to-all of the same bytes (Qwen3-30B-A3B routing, 8K tokens per lane)
step 300 python bench/bench_exchange.py --attention-gpus "$H" --ffn-gpus "$H" --json "$OUT/exchange.json"
# 4. End to end: AF-Pipe versus co-located EP versus DeepSpeed-MoE, same model, GPUs and tokens
step 600 python bench/bench_e2e.py --model "$MODEL" --layers "$LAYERS" --world-size "$G" --seq-len 4096 \
  --global-batch $((4 * G)) --json "$OUT/e2e.json" --timeline "$OUT/timeline.json"
grep -E '^###|"pass"|tokens/s|GB/s' "$LOG" | cut -c1-300
