#!/usr/bin/env bash
# Two or more GPUs of one host, in two parts that each fit a 10-minute call:
#   check  the runtimes on NCCL against HF, and the README's job under the deepspeed launcher (about 4 min)
#   bench  M2N/N2M against all-to-all, then end to end: AF-Pipe, co-located EP, DeepSpeed-MoE, with timelines,
#          and again compiled (about 8 min on 2 H200s)
# Writes to $OUT: env.txt, multi.txt (every command, its output and exit code) and, for bench, exchange.json,
# e2e.json, e2e-compiled.json, timeline-<method>.json. Every step has its own time limit.
# Usage: bash bench/gpu_multi.sh check|bench [E2E_MODEL] [E2E_LAYERS]
set -u
PART=${1:?usage: bash bench/gpu_multi.sh check|bench [E2E_MODEL] [E2E_LAYERS]}
MODEL=${2:-hf_models/Qwen3-30B-A3B}
LAYERS=${3:-4}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
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
verify() { step 90 torchrun --nproc_per_node "$G" -m disagmoe_ds.verify --json --attention-gpus "$H" --ffn-gpus "$H" "$@"; }
e2e() {
  step "$1" python bench/bench_e2e.py --model "$MODEL" --layers "$LAYERS" --world-size "$G" --seq-len 4096 \
    --global-batch $((4 * G)) --warmup 1 --steps 3 "${@:2}"
}
if [ "$PART" = check ]; then
  # AF-Pipe and co-located on NCCL against the single-process HF model (the reference runs on rank 0's CPU)
  verify --model hf_models/tiny-qwen3-moe --micro-batches 3
  verify --model hf_models/tiny-qwen2-moe --micro-batches 4 --zero 1
  verify --model hf_models/tiny-deepseek-v3 --micro-batches 3 --zero 2 --skew
  verify --model hf_models/tiny-mixtral --micro-batches 3 --dtype bf16 --zero 1
  step 90 torchrun --nproc_per_node "$G" -m disagmoe_ds.colocated.verify --json --world-size "$G" --ep-size "$G" \
    --model hf_models/tiny-qwen3-moe --micro-batches 3
  # The README's training job under the deepspeed launcher, then an exact resume
  job=(run_pretrain.py --attention-gpus "$H" --ffn-gpus "$H" --save-dir /tmp/run)
  step 120 deepspeed --num_gpus "$G" "${job[@]}" --steps 30 --save-every 15
  step 90 deepspeed --num_gpus "$G" "${job[@]}" --steps 40 --resume
elif [ "$PART" = bench ]; then
  step 90 python bench/bench_exchange.py --attention-gpus "$H" --ffn-gpus "$H" --json "$OUT/exchange.json"
  e2e 240 --json "$OUT/e2e.json" --timeline "$OUT/timeline.json"
  e2e 200 --methods afpipe colocated --compile --json "$OUT/e2e-compiled.json"
fi
grep -E '^###|"pass"|tokens/s|GB/s|^  rank|^    rank' "$LOG" | cut -c1-300
