"""GPT-OSS's sink attention through HF's flex_attention and its eager attention, on CUDA, each in fp32 and bf16,
against the fp32 eager step: loss and every gradient (the sinks' included) of one training step of a small GPT-OSS
model (alternating 128-token windows).

HF runs GPT-OSS eagerly unless told otherwise (no SDPA path takes sinks), writing and reading every layer's H x S x S
scores; flex_attention folds the sinks in afterwards from its log-sum-exp. This says whether that path is exact,
gradients included, before the runtime or the planner relies on it.

    PYTHONPATH=$PWD python bench/check_sink_attention.py [--seq-len 512]
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics

import torch
from transformers import AutoConfig, AutoModelForCausalLM

ROOT_MODEL = "hf_models/tiny-gpt-oss"


def step(model, ids: torch.Tensor) -> tuple[float, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return loss.item(), {n: p.grad.float() for n, p in model.named_parameters() if p.grad is not None}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seq-len", type=int, default=512)
    a = p.parse_args()
    config = AutoConfig.from_pretrained(ROOT_MODEL)
    config.sliding_window = 128
    torch.manual_seed(0)
    truth = AutoModelForCausalLM.from_config(config, attn_implementation="eager").cuda().train()
    with torch.no_grad():
        for layer in truth.model.layers:
            layer.self_attn.sinks.normal_(0.0, 2.0)  # sinks that matter (HF initialises them to zero)
    ids = torch.randint(0, config.vocab_size, (2, a.seq_len), device="cuda")
    loss_t, grads_t = step(truth, ids)
    rows = []
    for dtype in (torch.float32, torch.bfloat16):
        for kernel in ("eager", "flex_attention"):
            model = copy.deepcopy(truth).to(dtype)
            model.set_attn_implementation(kernel)
            loss, grads = step(model, ids)
            rel = {n: ((grads_t[n] - grads[n]).abs().max() / grads_t[n].abs().max()).item() for n in grads_t}
            worst = max(rel, key=rel.__getitem__)
            rows.append({
                "dtype": str(dtype), "attention": kernel, "loss_error": abs(loss - loss_t), "worst_grad": worst,
                "worst_rel": rel[worst], "sinks_rel": max(v for n, v in rel.items() if n.endswith("sinks")),
                "median_rel": statistics.median(rel.values()), "has_every_grad": grads.keys() == grads_t.keys(),
            })  # fmt: skip
    for row in rows:
        print(json.dumps(row))


if __name__ == "__main__":
    main()
