"""Expert-path micro-benchmark: where the time of one MoE layer's routed experts goes (forward + backward).

    PYTHONPATH=$PWD python bench/bench_experts.py --tokens 8192 --hidden 2048 --inter 768 --experts 128 --top-k 8

Variants, all on the same routed tokens (one rank holding every expert):

    gemm-only      the two grouped GEMMs on pre-sorted rows (the floor: no permutation, no activation)
    hf-grouped     HF's ``grouped_mm`` experts implementation (Qwen3-MoE module)
    ours           ``grouped_gated_experts`` (sort, gather, two grouped GEMMs, fusable middle, gather-sum)
    ours-compiled  the same with the elementwise middle under ``torch.compile``

Prints ms, TFLOP/s (3 x 6 * pairs * H * I) and writes JSON with ``--json``. Timed as ``bench_layer.py`` times
(gradients set to None each step, steps back to back).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_layer import fresh_grads, print_profile, time_step  # noqa: E402

from disagmoe_ds.models import grouped_experts  # noqa: E402


def make_inputs(args, device: str, dtype: torch.dtype):
    g = torch.Generator(device="cpu").manual_seed(0)
    x = (torch.randn(args.tokens, args.hidden, generator=g) * 0.5).to(device, dtype).requires_grad_()
    logits = torch.randn(args.tokens, args.experts, generator=g)
    w, idx = torch.softmax(logits, -1).topk(args.top_k, dim=-1)
    gate_up = (torch.randn(args.experts, 2 * args.inter, args.hidden, generator=g) * 0.02).to(device, dtype)
    down = (torch.randn(args.experts, args.hidden, args.inter, generator=g) * 0.02).to(device, dtype)
    return x, idx.to(device), w.to(device, dtype).requires_grad_(), gate_up.requires_grad_(), down.requires_grad_()


def step_ours(x, idx, w, gate_up, down, grad):
    fresh_grads(x, w, gate_up, down)
    out = grouped_experts.grouped_gated_experts(x, idx, w, gate_up, down, F.silu, idx.numel())  # pairs: the header's
    out.backward(grad)


def step_gemm_only(x_sorted, offsets, gate_up, down, grad_sorted):
    fresh_grads(x_sorted, gate_up, down)
    h = F.grouped_mm(x_sorted, gate_up.transpose(1, 2), offs=offsets)
    out = F.grouped_mm(h[:, : h.shape[1] // 2], down.transpose(1, 2), offs=offsets)
    out.backward(grad_sorted)


def step_hf(module, x, idx, w, grad):
    fresh_grads(x, w, *module.parameters())
    module(x, idx, w).backward(grad)


def hf_module(args, gate_up, down, device, dtype):
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    config = Qwen3MoeConfig(hidden_size=args.hidden, moe_intermediate_size=args.inter, num_experts=args.experts)
    config._experts_implementation = "grouped_mm"
    with torch.device(device):
        module = Qwen3MoeExperts(config).to(dtype)
    module.gate_up_proj = torch.nn.Parameter(gate_up.detach().clone())
    module.down_proj = torch.nn.Parameter(down.detach().clone())
    return module


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--inter", type=int, default=768)
    p.add_argument("--experts", type=int, default=128)
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--json", metavar="PATH")
    p.add_argument("--profile", action="store_true", help="print the top CUDA kernels of gemm-only and ours")
    a = p.parse_args(argv)
    dtype = torch.bfloat16 if a.device == "cuda" else torch.float32
    x, idx, w, gate_up, down = make_inputs(a, a.device, dtype)
    grad = torch.randn_like(x) * 1e-3
    pairs = a.tokens * a.top_k
    flops = 3 * 6 * pairs * a.hidden * a.inter
    order = torch.argsort(idx.reshape(-1), stable=True)
    counts = torch.bincount(idx.reshape(-1), minlength=a.experts)
    offsets = torch.cumsum(counts, 0, dtype=torch.int32)
    x_sorted = x.detach().index_select(0, order // a.top_k).requires_grad_()
    grad_sorted = torch.randn_like(x_sorted) * 1e-3
    rows = []
    variants = {
        "gemm-only": (step_gemm_only, (x_sorted, offsets, gate_up, down, grad_sorted)),
        "hf-grouped": (step_hf, (hf_module(a, gate_up, down, a.device, dtype), x, idx, w, grad)),
        "ours": (step_ours, (x, idx, w, gate_up, down, grad)),
    }
    for name, (step, args) in variants.items():
        rows.append((name, time_step(step, *args, warmup=3, iters=a.iters, device=a.device)))
    grouped_experts.compile_elementwise()
    rows.append(("ours-compiled", time_step(step_ours, *variants["ours"][1], warmup=3, iters=a.iters, device=a.device)))
    if a.profile and a.device == "cuda":
        for name in ("gemm-only", "ours"):
            print(f"--- {name} (elementwise compiled)")
            print_profile(*variants[name])
    print(f"{'variant':<22}{'ms':>9}{'TFLOP/s':>10}")
    for name, seconds in rows:
        print(f"{name:<22}{seconds * 1e3:>9.3f}{flops / seconds / 1e12:>10.1f}")
    if a.json:
        Path(a.json).write_text(json.dumps([{"variant": n, "ms": s * 1e3} for n, s in rows], indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
