"""GPT-OSS's sink attention through HF's flex_attention against its eager attention, on CUDA: loss and every gradient
(the sinks' included) of one training step of a small GPT-OSS model (alternating 128-token windows), fp32 and bf16.

HF runs GPT-OSS eagerly unless told otherwise (no SDPA path takes sinks), writing and reading every layer's H x S x S
scores; flex_attention folds the sinks in afterwards from its log-sum-exp. This says whether that path is exact,
gradients included, before the runtime or the planner relies on it.

    PYTHONPATH=$PWD python bench/check_sink_attention.py [--seq-len 512]
"""

from __future__ import annotations

import argparse
import copy
import json

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
    rows = []
    for dtype in (torch.float32, torch.bfloat16):
        config = AutoConfig.from_pretrained(ROOT_MODEL)
        config.sliding_window = 128
        torch.manual_seed(0)
        eager = AutoModelForCausalLM.from_config(config, attn_implementation="eager", dtype=dtype).cuda().train()
        with torch.no_grad():
            for layer in eager.model.layers:
                layer.self_attn.sinks.normal_(0.0, 2.0)  # sinks that matter (HF initialises them to zero)
        flex = copy.deepcopy(eager)
        flex.config._attn_implementation = "flex_attention"
        for layer in flex.model.layers:
            layer.self_attn.config._attn_implementation = "flex_attention"
        ids = torch.randint(0, config.vocab_size, (2, a.seq_len), device="cuda")
        (loss_e, grads_e), (loss_f, grads_f) = step(eager, ids), step(flex, ids)
        worst = max(grads_e, key=lambda n: ((grads_e[n] - grads_f[n]).abs().max() / grads_e[n].abs().max()).item())
        sinks = [n for n in grads_e if n.endswith("sinks")]
        rows.append({
            "dtype": str(dtype), "loss_eager": loss_e, "loss_flex": loss_f,
            "worst_grad": worst,
            "worst_rel": ((grads_e[worst] - grads_f[worst]).abs().max() / grads_e[worst].abs().max()).item(),
            "sinks_rel": max(((grads_e[n] - grads_f[n]).abs().max() / grads_e[n].abs().max()).item() for n in sinks),
            "sinks_in_flex_grads": all(n in grads_f for n in sinks),
        })  # fmt: skip
    for row in rows:
        print(json.dumps(row))


if __name__ == "__main__":
    main()
