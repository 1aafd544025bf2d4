"""Each expert grouped GEMM of one MoE layer, torch's FP8 kernel (rowwise scales, the layouts ``fp8.gemm`` passes)
against bf16 ``grouped_mm``, on one GPU: which of the four FP8 GEMMs pays at a model's shapes (no quantization timed).

    python bench/fp8_grouped_gemms.py --model hf_models/Qwen3-30B-A3B --tokens 4096
    python bench/fp8_grouped_gemms.py --shape 4096,1536,128,8   # H, expert width I, experts, top-k
"""

from __future__ import annotations

import argparse
import json
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F

from disagmoe_ds.fp8.gemm import scaled_grouped_mm
from disagmoe_ds.fp8.quantize import quantize


def timed_ms(fn, iters: int = 30) -> float:
    for _ in range(3):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--model", help="an HF model directory: its hidden size, expert width, experts and top-k")
    source.add_argument("--shape", help="H,I,E,K instead of a model's")
    p.add_argument("--tokens", type=int, default=4096)
    a = p.parse_args()
    if a.shape:
        h, f, e, k = (int(v) for v in a.shape.split(","))
    else:
        cfg = json.loads((Path(a.model) / "config.json").read_text())
        h, f = cfg["hidden_size"], cfg.get("moe_intermediate_size") or cfg["intermediate_size"]
        e, k = cfg.get("n_routed_experts") or cfg["num_experts"], cfg["num_experts_per_tok"]
    rows = a.tokens * k
    offsets = torch.arange(1, e + 1, device="cuda", dtype=torch.int32) * (rows // e)
    rows = int(offsets[-1])
    gemms = {  # name: (rows' width K, weights [e, N, K])
        "fwd gate_up": (h, (e, 2 * f, h)),
        "fwd down": (f, (e, h, f)),
        "dX down": (h, (e, f, h)),
        "dX gate_up": (2 * f, (e, h, 2 * f)),
    }
    print(f"{a.model or a.shape}: {rows} rows in {e} groups, H {h}, F {f}")
    print(f"{'GEMM':<12} {'bf16 ms':>8} {'fp8 ms':>8} {'speedup':>8}  TFLOP/s bf16 / fp8")
    for name, (width, wshape) in gemms.items():
        x = torch.randn(rows, width, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(*wshape, device="cuda", dtype=torch.bfloat16)
        qx, qw = quantize(x, -1), quantize(w, -1)
        bf16 = timed_ms(partial(F.grouped_mm, x, w.transpose(-2, -1), offs=offsets))
        fp8 = timed_ms(partial(scaled_grouped_mm, qx, qw, offsets, torch.bfloat16))
        tflops = [2 * rows * width * wshape[1] / ms / 1e9 for ms in (bf16, fp8)]
        print(f"{name:<12} {bf16:8.3f} {fp8:8.3f} {bf16 / fp8:7.2f}x  {tflops[0]:.0f} / {tflops[1]:.0f}")


if __name__ == "__main__":
    main()
