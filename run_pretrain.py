"""Train a Hugging Face MoE model with its attention and its experts on disjoint groups of GPUs (DisagMoE-DS).

    # The embedded default: a tiny Qwen3-MoE-style model on the bundled Jane Austen corpus (SentencePiece
    # tokenizer trained once, cached in .cache/), 2 attention + 2 expert CPU ranks started by this script.
    python run_pretrain.py

    # Co-located EP+DP (every rank holds the attention side and a slice of the experts): one GPU, or the
    # baseline for side-by-side runs. --world-size ranks here (default 1), or the launcher's.
    python run_pretrain.py --mode colocated
    python run_pretrain.py --mode colocated --world-size 2 --ep-size 2
    torchrun --nproc_per_node 8 run_pretrain.py --mode colocated --deepspeed_config ds_configs/1node-8gpu-bf16.json

    # One node, 8 GPUs, bf16 + ZeRO-1: 4 attention GPUs + 4 expert GPUs (the split is in the ds_config).
    deepspeed --num_gpus 8 run_pretrain.py --deepspeed_config ds_configs/1node-8gpu-bf16.json \\
        --model hf_models/Qwen3-30B-A3B --data /data/corpus --seq-len 4096 --save-dir runs/q30 --save-every 500

    # Several nodes: check the hostfile against the layout, then launch.
    python run_pretrain.py --check-hostfile hostfiles/2nodes-16gpu --deepspeed_config ds_configs/2node-16gpu-bf16.json
    deepspeed --hostfile hostfiles/2nodes-16gpu run_pretrain.py --deepspeed_config ds_configs/2node-16gpu-bf16.json ...
    # or both in one: validate, then re-run this command under 'deepspeed --hostfile'
    python run_pretrain.py --hostfile hostfiles/2nodes-16gpu --deepspeed_config ds_configs/2node-16gpu-bf16.json ...

    # The same job through a launcher on one CPU host (no ssh): 4 ranks.
    deepspeed --num_gpus 4 run_pretrain.py --steps 20
    deepspeed --hostfile hostfiles/localhost-cpu --no_ssh_check --master_addr 127.0.0.1 run_pretrain.py
    torchrun --nproc_per_node 4 run_pretrain.py

    # Fine-tuning (the freezing is recorded: a resume keeps it), an exact resume, and an HF export at every save.
    python run_pretrain.py --init-from HF_DIR --sft --data chat.jsonl --freeze-router --lr 1e-5 --steps 500 \\
        --save-dir runs/ft --export-hf runs/ft-hf
    python run_pretrain.py --init-from HF_DIR --sft --data chat.jsonl --steps 800 --save-dir runs/ft --resume

    # The loss on held-out data every 100 steps (2% of --data's samples, never trained on), and once for a model.
    python run_pretrain.py --init-from HF_DIR --sft --data chat.jsonl --eval-split 0.02 --eval-every 100
    python run_pretrain.py --init-from runs/ft-hf --sft --data chat.jsonl --eval-split 0.02 --eval-only

Everything is checked (layout against the world size, data, checkpoint) before any rank starts, or under a
launcher by each rank after its imports, before it builds anything; a mistake is one line that says what to change.
"""

from __future__ import annotations

import sys
from pathlib import Path

from disagmoe_ds.train.flags import read_command_line

ROOT = Path(__file__).resolve().parent  # defaults (model, ds_config, tokenizer cache) live beside this file


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ns = read_command_line(argv, root=ROOT, description=__doc__)  # torch-free: --help and a bad flag answer at once
    from disagmoe_ds.train.run import run_job  # the job: torch, DeepSpeed, transformers

    return run_job(ns, argv, root=ROOT, script=Path(__file__))


if __name__ == "__main__":
    sys.exit(main())
