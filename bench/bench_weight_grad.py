"""The routed experts' weight gradient on one GPU: bf16 ``F.grouped_mm(dy^T, x)`` (groups along the reduction)
against FP8 (``fp8.group_columns.grouped_weight_grad``: both operands quantized per expert and channel by the Triton
kernel, then ``torch._scaled_grouped_mm``), at the expert shapes of one MoE layer.

Prints one row per model, projection and layout: ms of the bf16 GEMM, of the two FP8 quantizations, of the FP8 GEMM,
the FP8 total and bf16 / FP8 (CUDA events, median of --iters), and the FP8 result's relative error against the bf16
one (norm of the difference over the norm: e4m3's rounding, a few percent). Exit status 1 if any error is past --tol.

    python bench/bench_weight_grad.py [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

from disagmoe_ds.fp8.group_columns import grouped_weight_grad, quantize_group_columns

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_block_mm import timed  # noqa: E402  (median ms, peak GiB, last result)

# (model, projection, N = dW's rows, K = its columns, experts, routed rows per expert)
SHAPES = [
    ("DeepSeek-V3, one GPU", "gate_up", 4096, 7168, 256, 128),
    ("DeepSeek-V3, one GPU", "down", 7168, 2048, 256, 128),
    ("DeepSeek-V3, EP 32 shard", "gate_up", 4096, 7168, 8, 4096),
    ("DeepSeek-V3, EP 32 shard", "down", 7168, 2048, 8, 4096),
    ("Qwen3-30B-A3B, one GPU", "gate_up", 1536, 2048, 128, 256),
    ("Qwen3-30B-A3B, one GPU", "down", 2048, 768, 128, 256),
]


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """||got - want|| / ||want||, one expert at a time (a float32 copy of a whole layer's dW would not fit)."""
    diff = sum(float((g.float() - w.float()).square().sum()) for g, w in zip(got, want, strict=True))
    return (diff / sum(float(w.float().square().sum()) for w in want)) ** 0.5


def row(model: str, name: str, n: int, k: int, experts: int, per_expert: int, iters: int) -> dict:
    torch.manual_seed(0)
    counts = torch.poisson(torch.full((experts,), float(per_expert))).int()
    offsets = counts.cumsum(0).to(device="cuda", dtype=torch.int32)
    rows = int(counts.sum())
    dy = torch.randn(rows, n, device="cuda").bfloat16()
    x = torch.randn(rows, k, device="cuda").bfloat16()
    bf16 = F.grouped_mm(dy.t(), x, offs=offsets)
    fp8 = grouped_weight_grad(dy, x, offsets)
    error = relative_error(fp8, bf16)
    del bf16, fp8
    q_dy, q_x = quantize_group_columns(dy, offsets), quantize_group_columns(x, offsets)

    def gemm() -> torch.Tensor:
        return torch._scaled_grouped_mm(
            q_dy.data, q_x.data.t(), q_dy.scale.flatten(), q_x.scale.flatten(), offs=q_dy.offsets, out_dtype=dy.dtype
        )

    ms = {
        "bf16": timed(lambda: F.grouped_mm(dy.t(), x, offs=offsets), iters)[0],
        "quantize": timed(lambda: (quantize_group_columns(dy, offsets), quantize_group_columns(x, offsets)), iters)[0],
        "fp8_gemm": timed(gemm, iters)[0],
        "fp8": timed(lambda: grouped_weight_grad(dy, x, offsets), iters)[0],
    }
    return {"model": model, "projection": name, "n": n, "k": k, "experts": experts, "rows": rows, "ms": ms,
            "error": error}  # fmt: skip


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--tol", type=float, default=0.1, help="largest relative error accepted (e4m3: a few percent)")
    p.add_argument("--json", metavar="PATH")
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("no CUDA device", file=sys.stderr)
        return 2
    print(f"{'model':>26} {'dW':>8} {'experts':>7} {'rows':>7} {'bf16 ms':>8} {'quant. ms':>9} {'FP8 GEMM':>8} "
          f"{'FP8 ms':>7} {'ratio':>6} {'rel. error':>10}")  # fmt: skip
    table = []
    for shape in SHAPES:
        r = row(*shape, a.iters)
        ms = r["ms"]
        print(f"{r['model']:>26} {r['projection']:>8} {r['experts']:7d} {r['rows']:7,d} {ms['bf16']:8.2f} "
              f"{ms['quantize']:9.2f} {ms['fp8_gemm']:8.2f} {ms['fp8']:7.2f} {ms['bf16'] / ms['fp8']:5.2f}x "
              f"{r['error']:10.2e}")  # fmt: skip
        table.append(r)
        torch.cuda.empty_cache()
    if a.json:
        with open(a.json, "w") as f:
            json.dump(table, f, indent=1)
    failed = [r for r in table if r["error"] > a.tol]
    print(f"FP8 weight gradient against bf16: {'ok' if not failed else 'FAILED'} (tolerance {a.tol:g})")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
