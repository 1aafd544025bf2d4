#!/usr/bin/env bash
# Two or more GPUs of one host, in parts that each fit a 10-minute call:
#   check     the runtimes on NCCL against HF (4 families), and the README's job under the deepspeed launcher
#   exchange  M2N/N2M against all_to_all_single of the same bytes
#   e2e       AF-Pipe against co-located EP-all and EP-1 (the strongest co-located run on few GPUs) on the balanced
#             model, compiled from cold caches, with timelines
#   profile   the planner's part profile (eager and compiled parts) on GPU 0, for predicting the e2e rows
#   variants  on NCCL against HF: the mailbox's late sends (bench/verify_late_sends.py), the memory levers
#             (split backward at ZeRO 1 and 2, selective recompute, ZeRO-3 on the expert side, the expert side's
#             optimizer in host memory) and, from 3 GPUs,
#             SP and TP lanes of 2 ranks (GPT-OSS's: flex_attention with its sinks on the traded heads)
#   levers    each memory lever's AF-Pipe step beside plain AF-Pipe on the balanced model, compiled, with timelines
#   lanes     plain, SP 2 and TP 2 A-lanes at a long sequence (LANES_SEQ), step time and peak memory (4+ GPUs)
#   dedup     the node-deduplicated exchange (4+ GPUs, the expert side's G/2 ranks as two "nodes" of G/4): parity on
#             NCCL against HF, then AF-Pipe with and without it beside co-located EP over all GPUs and AutoEP.
#             NCCL picks one transport per process, so under "socket" the in-node all-to-all crosses sockets too
#             (the dedup's worst case); under "nvlink" the exchange does not (its best): run both
#   pipeline  co-located pipeline stages (4+ GPUs): PP 2 x EP 2, PP 2 x VPP 2 x EP 2, TP 2 and PP 2 x SP 2 on NCCL
#             against HF, then the pipeline's and TP 2's steps beside co-located EP x DP over all GPUs, AF-Pipe and
#             AutoEP on the balanced model
# TRANSPORT: nvlink (NCCL's default between GPUs of one host), iblike (NCCL_P2P_DISABLE=1: NCCL's shared-memory
# transport through host memory, meant to sit near a cluster's 25-50 GB/s per GPU across nodes; IBLIKE_ENV replaces
# it, e.g. IBLIKE_ENV="NCCL_MAX_NCHANNELS=2" for NVLink on fewer channels) or socket (NCCL_P2P_DISABLE=1
# NCCL_SHM_DISABLE=1 NCCL_SOCKET_IFNAME=lo: NCCL's network transport, where a large send waits for its receive as
# between nodes). Every part first measures the link (bench/link_probe.py) into link-<transport>.json and its log.
# Writes to $OUT: env.txt, multi-<part>-<transport>.txt (every command, its output and exit code), and for
# exchange and e2e, <part>-<transport>.json and timeline-<transport>-<method>.json; profile-{eager,compiled}.json.
# E2E_DEPTH: AF-Pipe's depth p in the e2e part (default 1; the planner's choice for the GPU count and transport:
# `disagmoe-plan --model ... --cluster ...` prints it).
# Usage: bash bench/gpu_multi.sh check|exchange|e2e|profile|variants|levers|lanes|dedup|pipeline [nvlink|iblike|socket] [E2E_MODEL]
#        [GLOBAL_BATCH] [E2E_DEPTH]
set -u
PART=${1:?usage: bash bench/gpu_multi.sh check|exchange|e2e|profile|variants|levers|lanes|dedup|pipeline [nvlink|iblike|socket] [E2E_MODEL] [GLOBAL_BATCH] [E2E_DEPTH]}
TRANSPORT=${2:-nvlink}
MODEL=${3:-hf_models/Qwen3-30B-A3B-balanced}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
G=$(python -c "import torch; print(torch.cuda.device_count())")
H=$((G / 2))
BATCH=${4:-$((4 * G))}
DEPTH=${5:-1}
case $TRANSPORT in
  nvlink) ;;
  # shellcheck disable=SC2086
  iblike) export ${IBLIKE_ENV:-NCCL_P2P_DISABLE=1} ;;
  socket) export NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1 NCCL_SOCKET_IFNAME=lo ;;
  *) echo "TRANSPORT must be nvlink, iblike or socket, got $TRANSPORT" >&2; exit 2 ;;
esac
LOG=$OUT/multi-$PART-$TRANSPORT.txt
{ nvidia-smi topo -m
  python -c "import torch, transformers, deepspeed; print(torch.__version__, transformers.__version__, deepspeed.__version__)"
} > "$OUT/env.txt" 2>&1
step() {  # step TIMEOUT_S COMMAND...: run, log the command, its output and its exit code
  local limit=$1; shift
  echo "### [$TRANSPORT] $*" >> "$LOG"
  local t0=$SECONDS
  timeout "$limit" "$@" >> "$LOG" 2>&1
  echo "### exit $? after $((SECONDS - t0)) s" >> "$LOG"
}
step 60 torchrun --nproc_per_node 2 bench/link_probe.py --json "$OUT/link-$TRANSPORT.json"  # the link under it all
case $PART in
check)
  # AF-Pipe and co-located on NCCL against the single-process HF model (the reference runs on rank 0's CPU): the
  # four family cases on the first layout, then one case each (in turn) on the other (M N p EDP) layouts of this
  # GPU count: depth, lanes, expert parallelism and expert replicas
  cases=("--model hf_models/tiny-qwen3-moe --micro-batches 3"
         "--model hf_models/tiny-qwen2-moe --micro-batches 4 --zero 1 --packed"
         "--model hf_models/tiny-deepseek-v3 --micro-batches 3 --zero 2 --skew"
         "--model hf_models/tiny-mixtral --micro-batches 3 --dtype bf16 --zero 1")
  case $G in
    2) layouts=("1 1 1 1") ;;
    4) layouts=("2 2 1 1" "2 2 2 1" "2 2 1 2" "1 3 1 3") ;;
    *) layouts=("$H $H 1 1" "$H $H 2 1" "3 $((G - 3)) 1 $((G - 3))" "2 $((G - 2)) 1 $(((G - 2) / 2))") ;;
  esac
  for i in "${!layouts[@]}"; do
    read -r m n p edp <<< "${layouts[$i]}"
    picked=("${cases[@]}"); [ "$i" -gt 0 ] && picked=("${cases[$((i % ${#cases[@]}))]}")
    for case_ in "${picked[@]}"; do
      # shellcheck disable=SC2086
      step 90 torchrun --nproc_per_node "$G" -m disagmoe_ds.afpipe.verify --json --attention-gpus "$m" --ffn-gpus "$n" \
        --depth "$p" --expert-data-parallel "$edp" $case_
    done
  done
  step 90 torchrun --nproc_per_node "$G" -m disagmoe_ds.colocated.verify --json --world-size "$G" --ep-size "$G" \
    --model hf_models/tiny-qwen3-moe --micro-batches 3
  # The README's training job under the deepspeed launcher, then an exact resume
  job=(run_pretrain.py --attention-gpus "$H" --ffn-gpus "$H" --save-dir /tmp/run)
  step 120 deepspeed --num_gpus "$G" "${job[@]}" --steps 30 --save-every 15
  step 90 deepspeed --num_gpus "$G" "${job[@]}" --steps 40 --resume
  ;;
exchange)
  step 120 python bench/bench_exchange.py --attention-gpus "$H" --ffn-gpus "$H" --json "$OUT/exchange-$TRANSPORT.json"
  ;;
e2e)
  export TORCHINDUCTOR_CACHE_DIR=$(mktemp -d)  # cold caches: compile time is part of what a user sees first
  step 400 python bench/bench_e2e.py --model "$MODEL" --layers 0 --world-size "$G" --seq-len 4096 \
    --global-batch "$BATCH" --warmup 2 --steps 4 --methods afpipe colocated --ep-size "$G" 1 --depth "$DEPTH" \
    --compile --json "$OUT/e2e-$TRANSPORT.json" --timeline "$OUT/timeline-$TRANSPORT.json"
  ;;
lanes)
  # AF-Pipe's A-lanes at a long sequence: plain lanes, Ulysses SP 2 and TP 2 (from 4 GPUs: 2 attention ranks a lane),
  # step time and peak memory side by side (the e2e rows' model; LANES_SEQ tokens a sequence, default 16384)
  export TORCHINDUCTOR_CACHE_DIR=$(mktemp -d)
  for lane in "" "--sequence-parallel 2" "--tensor-parallel 2"; do
    name=$(echo "${lane:-plain}" | tr -d ' -' | sed 's/parallel//')
    # shellcheck disable=SC2086
    step 400 python bench/bench_e2e.py --model "$MODEL" --layers 0 --world-size "$G" --seq-len "${LANES_SEQ:-16384}" \
      --global-batch "$H" --warmup 2 --steps 4 --methods afpipe --attention-gpus "$H" --ffn-gpus "$H" $lane \
      --compile --json "$OUT/lanes-$name-$TRANSPORT.json"
  done
  ;;
profile)
  for parts in eager compiled; do
    factory=disagmoe_ds.models.one_layer:$([ $parts = eager ] && echo disagmoe_parts || echo compiled_disagmoe_parts)
    step 200 python -m disagmoe_ds.planner.cli profile --model "$MODEL" --seq-len 2048,4096,8192 --parts "$factory" \
      --out "$OUT/profile-$parts.json"
  done
  ;;
variants)
  edp=$((G > 2 ? G - 1 : 1))  # the expert side's replicas: ZeRO-3 really shards from 3 GPUs on
  for landing in second-poll never; do
    step 90 torchrun --nproc_per_node "$G" bench/verify_late_sends.py "$landing" --json --attention-gpus "$H" \
      --ffn-gpus "$H" --model hf_models/tiny-qwen3-moe --micro-batches 3 --zero 1
  done
  levers=("--attention-gpus $H --ffn-gpus $H --model hf_models/tiny-qwen3-moe --split-backward --zero 1"
          "--attention-gpus $H --ffn-gpus $H --model hf_models/tiny-mixtral --split-backward --zero 2 --dtype bf16"
          "--attention-gpus $H --ffn-gpus $H --model hf_models/tiny-deepseek-v3 --selective-recompute --zero 1 --skew"
          "--attention-gpus 1 --ffn-gpus $((G - 1)) --expert-data-parallel $edp --model hf_models/tiny-qwen3-moe \
           --zero-stage 1 3 --skew"
          "--attention-gpus $H --ffn-gpus $H --model hf_models/tiny-qwen3-moe --zero-stage 1 2 \
           --offload-optimizer false true")
  if [ "$G" -ge 3 ]; then  # A-lanes of 2 ranks (2 attention GPUs and at least one expert GPU)
    levers+=("--attention-gpus 2 --ffn-gpus $((G - 2)) --model hf_models/tiny-qwen3-moe --sequence-parallel 2 --zero 2"
             "--attention-gpus 2 --ffn-gpus $((G - 2)) --model hf_models/tiny-qwen3-moe --tensor-parallel 2 --zero 2"
             "--attention-gpus 2 --ffn-gpus $((G - 2)) --model hf_models/tiny-deepseek-v3 --tensor-parallel 2 \
              --zero 1 --dtype bf16"
             "--attention-gpus 2 --ffn-gpus $((G - 2)) --model hf_models/tiny-gpt-oss --sequence-parallel 2 --zero 1"
             "--attention-gpus 2 --ffn-gpus $((G - 2)) --model hf_models/tiny-gpt-oss --tensor-parallel 2 --zero 1")
  fi
  for lever in "${levers[@]}"; do
    # shellcheck disable=SC2086
    step 90 torchrun --nproc_per_node "$G" -m disagmoe_ds.afpipe.verify --json --micro-batches 3 $lever
  done
  ;;
levers)
  export TORCHINDUCTOR_CACHE_DIR=$(mktemp -d)
  for lever in "" --split-backward --selective-recompute "--zero-stage 1 2"; do
    name=$(echo "${lever:-plain}" | tr -d ' -')
    # shellcheck disable=SC2086
    step 150 python bench/bench_e2e.py --model "$MODEL" --layers 0 --world-size "$G" --seq-len 4096 \
      --global-batch "$BATCH" --warmup 2 --steps 3 --methods afpipe --depth "$DEPTH" --compile $lever \
      --json "$OUT/levers-$name-$TRANSPORT.json" --timeline "$OUT/timeline-$TRANSPORT-$name.json"
  done
  ;;
dedup)
  node=$((H / 2))
  for case_ in "--model hf_models/tiny-qwen3-moe --micro-batches 3 --zero 1 --skew" \
               "--model hf_models/tiny-deepseek-v3 --micro-batches 3 --zero 2 --dtype bf16"; do
    # shellcheck disable=SC2086
    step 90 torchrun --nproc_per_node "$G" -m disagmoe_ds.afpipe.verify --json --attention-gpus "$H" --ffn-gpus "$H" \
      --node-dedup "$node" $case_
  done
  export TORCHINDUCTOR_CACHE_DIR=$(mktemp -d)
  for dedup in 1 "$node"; do
    step 300 python bench/bench_e2e.py --model "$MODEL" --layers 0 --world-size "$G" --seq-len 4096 \
      --global-batch "$BATCH" --warmup 2 --steps 3 --methods afpipe --node-dedup "$dedup" --compile \
      --json "$OUT/dedup-$dedup-$TRANSPORT.json" --timeline "$OUT/timeline-$TRANSPORT-dedup$dedup.json"
  done
  step 300 python bench/bench_e2e.py --model "$MODEL" --layers 0 --world-size "$G" --seq-len 4096 \
    --global-batch "$BATCH" --warmup 2 --steps 3 --methods colocated autoep --ep-size "$G" --compile \
    --json "$OUT/dedup-colocated-$TRANSPORT.json"
  ;;
pipeline)
  for case_ in "--model hf_models/tiny-qwen3-moe --pp-size 2 --micro-batches 3 --zero 1 --skew" \
               "--model hf_models/tiny-deepseek-v3 --pp-size 2 --virtual-stages 2 --micro-batches 4 --zero 2 --dtype bf16" \
               "--model hf_models/tiny-qwen3-moe --tensor-parallel 2 --micro-batches 2 --zero 1" \
               "--model hf_models/tiny-qwen3-moe --sequence-parallel 2 --pp-size 2 --micro-batches 2 --zero 2"; do
    # shellcheck disable=SC2086
    step 90 torchrun --nproc_per_node "$G" -m disagmoe_ds.colocated.verify --json --world-size "$G" --ep-size 2 $case_
  done
  export TORCHINDUCTOR_CACHE_DIR=$(mktemp -d)
  for vpp in 1 2; do
    step 240 python bench/bench_e2e.py --model "$MODEL" --layers 0 --world-size "$G" --seq-len 4096 \
      --global-batch "$BATCH" --warmup 2 --steps 3 --methods pipeline --pp-size 2 --virtual-stages "$vpp" \
      --ep-size "$H" --compile --json "$OUT/pipeline-v$vpp-$TRANSPORT.json" \
      --timeline "$OUT/timeline-$TRANSPORT-pipeline-v$vpp.json"
  done
  step 240 python bench/bench_e2e.py --model "$MODEL" --layers 0 --world-size "$G" --seq-len 4096 \
    --global-batch "$BATCH" --warmup 2 --steps 3 --methods colocated --tensor-parallel 2 --ep-size "$G" --compile \
    --json "$OUT/colocated-tp2-$TRANSPORT.json"
  step 300 python bench/bench_e2e.py --model "$MODEL" --layers 0 --world-size "$G" --seq-len 4096 \
    --global-batch "$BATCH" --warmup 2 --steps 3 --methods colocated afpipe autoep --ep-size "$G" --compile \
    --json "$OUT/pipeline-others-$TRANSPORT.json"
  ;;
*) echo "PART must be check, exchange, e2e, profile, variants, levers, lanes, dedup or pipeline" >&2; exit 2 ;;
esac
grep -E '^###|^link:|"pass"|tokens/s|GB/s|^  rank|^    rank|Error|error:' "$LOG" | cut -c1-300
