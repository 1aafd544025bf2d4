#!/usr/bin/env bash
# The FP8 session on one GPU, in two calls of under 10 minutes, torchao and DeepSpeed from ./.whl:
#   1. (layer) check_fp8_cuda.py (torch's FP8 kernels against the CPU emulation; the experts' fused FP8 middle bit
#      for bit against the unfused path and fp8.quantize), bench_weight_grad.py (the experts' dW in FP8 against
#      bf16), then bench_layer.py per model and batch (1 and 2 x SEQ
#      tokens): HF's layer compiled in bf16 and with torchao's rowwise FP8 training, ours compiled in bf16 and with
#      "fp8": true (weights cast once a step: fused middle and shape rule; the middle unfused; every projection in
#      FP8; and weights cast in every call)
#   2. (e2e) 300 steps of the default job's model on the bundled corpus in bf16 and in FP8 (every projection: no
#      shape rule), the same seed: the final losses; then bench_e2e.py, the co-located mode on one GPU, 4 real-size
#      layers, 8 x 1 x SEQ tokens a step, bf16 and --fp8 (full training and LoRA rank 16), as far as the budget allows
#   3. (base) bench_block_mm.py (the FP8 base's expert kernel against dequantizing, one DeepSeek-V3 layer's shard), then
#      LoRA rank 16 over the first 4 layers of DeepSeek-V3 (random weights, bench/random_slice.py), its base in bf16
#      and converted to FP8 blocks (disagmoe-convert to-fp8): run_pretrain.py's log (the base's bytes per parameter,
#      tokens/s, peak memory) for each; needs about 45 GB of disk; then check_fp8_cuda.py (QUICK=1: no tile sweep, EP 32
#      row or check)
# Every step runs under `timeout`, capped by BUDGET_S seconds from the start (default 560). Writes to $OUT: env.txt,
# session.txt (each command, its output, exit code and seconds), layer-<model>-b<batch>.json, e2e-<variant>.json.
# Usage: [BATCHES="1 2"] [LIMIT_S=240] [PATHS="..."] [CHECKS=0] [CONVERGE=0] [VARIANTS="bf16 fp8"] [QUICK=1]
#        bash bench/gpu_fp8.sh layer|e2e|base ["MODELS"] [SEQ]
# The fused middle and the shape rule on one GPU, in one call:
#   BATCHES=1 bash bench/gpu_fp8.sh layer hf_models/Qwen3-30B-A3B
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
PART=$1
MODELS=${2:-"hf_models/DeepSeek-V3 hf_models/Qwen3-30B-A3B"}
SEQ=${3:-4096}
BUDGET_S=${BUDGET_S:-560}
LOG=$OUT/session.txt
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD
# DeepSeek-V3's FP8 layer (67 GiB at its peak) ran out of an H100's memory to fragmentation after the other paths
# in one process (performance-log section 35); expandable segments fit it
export PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  python -c "import torch, transformers, deepspeed, torchao; print(torch.__version__, transformers.__version__, deepspeed.__version__, torchao.__version__)"
} > "$OUT/env.txt" 2>&1
source "$(dirname "$0")/gpu_step.sh"  # step LIMIT_S COMMAND...
if [ "$PART" = layer ] && [ "${CHECKS:-1}" = 1 ]; then
  step 180 python bench/check_fp8_cuda.py  # torch's FP8 kernels against the CPU emulation
  step 120 python bench/bench_weight_grad.py --json "$OUT/weight-grad.json"  # the experts' FP8 dW against bf16
fi
PATHS=${PATHS:-"hf-compiled ours-compiled ours-fp8-once-compiled ours-fp8-once-unfused-compiled \
ours-fp8-once-all-compiled ours-fp8-compiled hf-fp8-compiled"}
[ "$PART" = layer ] && for model in $MODELS; do
  for batch in ${BATCHES:-1 2}; do
    step "${LIMIT_S:-240}" python bench/bench_layer.py --model "$model" --seq-len "$SEQ" --batch $batch --layer 3 \
      --paths $PATHS --json "$OUT/layer-$(basename "$model")-b$batch.json"
  done
done
E2E="bench/bench_e2e.py --model hf_models/Qwen3-30B-A3B --layers 4 --world-size 1 --seq-len $SEQ --global-batch 8 --micro-batch-size 1 --methods colocated --compile --warmup 2 --steps 3"
if [ "$PART" = e2e ] && [ "${CONVERGE:-1}" = 1 ]; then  # the convergence check: the default job's model, every projection in FP8
  python -c "import json; c = json.load(open('ds_configs/tiny-cpu.json')); c['disagmoe'].update(fp8_bf16_width=0, fp8_expert_bf16_width=0); \
json.dump(c, open('/tmp/fp8-every-width.json', 'w'))"
  for precision in bf16 fp8; do
    step 200 python run_pretrain.py --mode colocated --world-size 1 --steps 300 --dtype bf16 --zero 1 \
      --deepspeed_config /tmp/fp8-every-width.json $([ $precision = fp8 ] && echo --fp8) --log-every 50 \
      --metrics-file "$OUT/converge-$precision.jsonl"
  done
  python - "$OUT" >> "$LOG" <<'PY'
import json, sys
final = {}
for p in ("bf16", "fp8"):
    losses = [json.loads(line)["loss"] for line in open(f"{sys.argv[1]}/converge-{p}.jsonl")]
    final[p] = sum(losses[-20:]) / 20
    print(f"converge {p}: {len(losses)} steps, first {losses[0]:.4f}, max {max(losses):.4f}, last 20 {final[p]:.4f}")
print(f"converge FP8 / bf16 final loss: {final['fp8'] / final['bf16']:.4f}")
PY
fi
if [ "$PART" = e2e ]; then
  for variant in ${VARIANTS-bf16 fp8 bf16-lora fp8-lora}; do  # VARIANTS="" runs none
    flags=$(case $variant in fp8) echo --fp8;; bf16-lora) echo --lora-rank 16;; fp8-lora) echo --fp8 --lora-rank 16;; esac)
    step 140 torchrun --nproc_per_node 1 $E2E $flags --json "$OUT/e2e-$variant.json"
  done
fi
if [ "$PART" = base ]; then
  step 120 python bench/bench_block_mm.py $([ "${QUICK:-0}" = 1 ] || echo --sweep) --json "$OUT/block-mm.json"  # 256 experts
  [ "${QUICK:-0}" = 1 ] || step 60 python bench/bench_block_mm.py --experts 8 --rows-per-expert 4096 --json "$OUT/block-mm-ep32.json"  # EP 32
  SLICE=/tmp/slice-4
  step 150 python bench/random_slice.py --model "${SLICE_MODEL:-hf_models/DeepSeek-V3}" --layers 4 --out $SLICE
  step 150 python -m disagmoe_ds.convert to-fp8 --model $SLICE --out $SLICE-fp8 --device "${DEVICE:-cuda}"
  for base in $SLICE-fp8 $SLICE; do
    step 200 python run_pretrain.py --init-from $base --lora-rank 16 --mode colocated --world-size 1 --dtype bf16 --zero 1 \
      --seq-len "$SEQ" --micro-batch-size 1 --micro-batches 4 --steps 6 --log-every 1 \
      --metrics-file "$OUT/base-$(basename $base).jsonl"
  done
  [ "${QUICK:-0}" = 1 ] || step 180 python bench/check_fp8_cuda.py
fi
rm -f "$OUT"/*.svg  # run_pretrain's loss plots: the files that come back are few, and the .jsonl hold the same losses
echo "### done after ${SECONDS} s" >> "$LOG"
awk '/^###/ {table = 0; print; next} /^(worst|fused FP8 middle|FP8 weight gradient|rank 0: the LoRA|step |done:|kernel against|converge|  *(forward|input grad) )/ {print; next} /^(model|method|variant|  *model) / {table = 1} table' "$LOG" | cut -c1-300
exit 0
