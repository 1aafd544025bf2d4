"""Check that the split model (attention parts + R expert shards) reproduces the HF model on one batch.

    python -m disagmoe_ds.models.check --model hf_models/tiny-qwen3-moe --shards 2

Prints a JSON summary (max abs diff of logits, loss and every gradient; in bf16 also both models' logits against the
fp32 model's) and exits 0 only if all are within tolerance.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch
from torch import nn

from disagmoe_ds.models.attention_kernel import ATTENTION_KERNELS, use_attention
from disagmoe_ds.models.loading import load_model
from disagmoe_ds.models.parts import compile_stage
from disagmoe_ds.models.skew import skew_router
from disagmoe_ds.models.split import SplitModel, hf_reference_loss

# Max abs differences allowed. fp32: only sums are re-associated. bf16: rounding differences of that
# re-association can flip a near-tied top-k choice of a token (seen on DeepSeek-V3's sigmoid router on the H200:
# logits 0.06 off on one token while the loss moved by 4e-4), so bf16 bounds are per metric.
TOLERANCE = {
    "fp32": {"logits": 1e-5, "loss": 1e-5, "grads": 1e-5},
    "bf16": {"logits": 1e-1, "loss": 1e-2, "grads": 5e-2},
}
# bf16 logits past their bound still pass where the split's are no further from the fp32 model's than HF's bf16 ones,
# within this factor: HF's eager bf16 rounds softmaxes and norms that a compiled part keeps in fp32 (tiny GPT-OSS at
# 256 tokens: HF bf16 0.13-0.22 from fp32, the compiled split 0.13-0.15, so 0.12-0.22 apart).
AS_CLOSE_TO_FP32 = 1.25
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def compare(
    model_dir: str, shards: int, dtype: str, seq_len: int, batch: int, seed: int, device: str = "cpu",
    compile: bool = False, skew: bool = False, attention: str = "auto",
) -> dict:  # fmt: skip
    """``compile``: the split runs as a ``"compile": true`` job's parts do (``compile_stage``: inductor, and on
    CUDA in bf16 the experts' Triton kernels); ``skew``: every token's first choice is expert 0 (``skew_router``);
    ``attention``: the attention function, as a job's ``"disagmoe.attention"`` picks it, of both (that it equals
    HF's default is ``bench/check_sink_attention.py``'s question)."""
    ref, src = (load_model(model_dir, dtype=DTYPES[dtype], seed=seed) for _ in range(2))
    for model in (ref, src):
        use_attention(model, attention, torch.device(device))
    if skew:
        skew_router(ref)
        skew_router(src)
    nn.Module.to(ref, device)  # in place; transformers' decorator on PreTrainedModel.to types self as an argument
    split = SplitModel(src, shards).to(device)
    if compile:
        compile_stage(split)
    torch.manual_seed(seed)
    input_ids = torch.randint(0, ref.config.vocab_size, (batch, seq_len), device=device)
    out_ref = ref(input_ids=input_ids, labels=input_ids)
    ref_loss = hf_reference_loss(ref, out_ref)
    out_split = split(input_ids, labels=input_ids)
    ref_loss.backward()
    out_split.loss.backward()
    # Frozen parameters (ERNIE's correction bias) have no gradient in either.
    ref_grads = {n: p for n, p in ref.named_parameters() if p.requires_grad}
    grads = split.hf_named_grads()
    diffs = {
        "logits": (out_ref.logits.float() - out_split.logits.float()).abs().max().item(),
        "loss": abs(ref_loss.item() - out_split.loss.item()),
        "grads": max(_grad_diff(n, grads[n], p.grad) for n, p in ref_grads.items()),
    }
    within = {k: v <= TOLERANCE[dtype][k] for k, v in diffs.items()}
    to_fp32 = {}
    if dtype == "bf16":  # logits past their bound pass where no further from the fp32 model's than HF's bf16 ones
        exact = _fp32_logits(model_dir, seed, device, attention, skew, input_ids)
        to_fp32 = {
            name: (out.logits.float() - exact).abs().max().item()
            for name, out in (("hf", out_ref), ("split", out_split))
        }
        within["logits"] = within["logits"] or to_fp32["split"] <= AS_CLOSE_TO_FP32 * to_fp32["hf"]
    ok = all(within.values())
    return {
        "model": model_dir,
        "device": device,
        "shards": shards,
        "dtype": dtype,
        "compiled": compile,
        "attention": src.config._attn_implementation,
        "skewed": skew,
        "reference_loss": out_ref.loss.item(),
        **diffs,
        **({"logits_to_fp32": to_fp32} if to_fp32 else {}),
        "pass": ok,
    }


def _fp32_logits(
    model_dir: str, seed: int, device: str, attention: str, skew: bool, input_ids: torch.Tensor
) -> torch.Tensor:
    """The logits of HF's model in fp32 (same weights, routing and attention function) on ``input_ids``."""
    exact = load_model(model_dir, dtype=torch.float32, seed=seed)
    use_attention(exact, attention, torch.device(device))
    if skew:
        skew_router(exact)
    nn.Module.to(exact, device)
    with torch.no_grad():
        return exact(input_ids=input_ids).logits.float()


def _grad_diff(name: str, mine: torch.Tensor | None, ref: torch.Tensor | None) -> float:
    """The largest difference of two gradients of ``name``; both sides must have one."""
    if mine is None or ref is None:
        raise ValueError(f"{name} has a gradient on one side only (split: {mine is not None}, HF: {ref is not None})")
    return (mine.float() - ref.float()).abs().max().item()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="hf_models/tiny-qwen3-moe", help="HF model dir or config-only dir")
    parser.add_argument("--shards", type=int, default=2, help="expert shards per layer (as if on this many ranks)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    parser.add_argument("--seq-len", type=int, default=32)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--compile", action="store_true", help="compile the split's parts as a compiled job does")
    parser.add_argument("--skew", action="store_true", help="route every token to expert 0 first (both models)")
    parser.add_argument("--attention", choices=ATTENTION_KERNELS, default="auto", help="the attention function of both")
    parser.add_argument("--json", action="store_true", help="print the summary on one line")
    args = parser.parse_args(argv)
    summary = compare(
        args.model,
        args.shards,
        args.dtype,
        args.seq_len,
        args.batch,
        args.seed,
        args.device,
        args.compile,
        args.skew,
        args.attention,
    )
    print(json.dumps(summary, indent=None if args.json else 2))
    return 0 if summary["pass"] else 1


if __name__ == "__main__":
    sys.exit(main())
