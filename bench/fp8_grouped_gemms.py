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
from disagmoe_ds.fp8.quantize import Quantized, quantize


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
    p.add_argument(
        "--candidates",
        action="store_true",
        help="also time other FP8 kernels: torch's with its small tile, inductor's autotuned Triton",
    )
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
    candidates = {"fp8": scaled_grouped_mm}
    if a.candidates:
        candidates["fp8 small tile"] = small_tile
        candidates["fp8 autotuned"] = torch.compile(scaled_grouped_mm, mode="max-autotune-no-cudagraphs", dynamic=False)
    print(f"{'GEMM':<12} {'bf16 ms':>8}" + "".join(f" {n + ' ms':>18}" for n in candidates) + "  (speedup vs bf16)")
    for name, (width, wshape) in gemms.items():
        x = torch.randn(rows, width, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(*wshape, device="cuda", dtype=torch.bfloat16)
        qx, qw = quantize(x, -1), quantize(w, -1)
        bf16 = timed_ms(partial(F.grouped_mm, x, w.transpose(-2, -1), offs=offsets))
        cells, reference = [], scaled_grouped_mm(qx, qw, offsets, torch.bfloat16)
        for fn in candidates.values():
            torch.testing.assert_close(fn(qx, qw, offsets, torch.bfloat16), reference, rtol=1e-2, atol=1e-2)
            ms = timed_ms(partial(fn, qx, qw, offsets, torch.bfloat16))
            cells.append(f" {ms:9.3f} ({bf16 / ms:4.2f}x)")
        print(f"{name:<12} {bf16:8.3f}" + "".join(cells))


def small_tile(a: Quantized, b: Quantized, offsets: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """torch's kernel with its 64 x 128 tile: torch picks its tile from the mean rows per group (rows / groups), so the
    weights are passed as 2e - 1 overlapping groups, the odd ones empty (never read), which halves the mean."""
    e, n, k = b.data.shape
    data = b.data.as_strided((2 * e - 1, n, k), (n * k // 2, k, 1))
    scale = b.scale.squeeze(-1).as_strided((2 * e - 1, n), (n // 2, 1))
    offs = offsets.repeat_interleave(2)[:-1]
    return torch._scaled_grouped_mm(
        a.data, data.transpose(-2, -1), scale_a=a.scale.squeeze(-1), scale_b=scale, offs=offs, out_dtype=out_dtype
    )


if __name__ == "__main__":
    main()
