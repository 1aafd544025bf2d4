"""The frozen FP8 base's expert products on one GPU: the Triton kernel that reads e4m3 tiles (``fp8.triton_block_mm``)
against dequantizing the weight and calling ``F.grouped_mm`` (the generic path), forward (x W^T) and input gradient
(dy W), at one MoE layer's shard with DeepSeek-V3's 128 x 128 blocks.

Prints one row per direction and tile configuration: milliseconds of each path (CUDA events, median of --iters),
the ratio, the kernel's relative error against the generic path (norm of the difference over the norm) and the
peak memory each path allocates beyond its inputs. Exit status 1 if any error is past --tol.

    python bench/bench_block_mm.py [--experts 256 --n 4096 --k 7168 --rows-per-expert 128] [--sweep] [--json PATH]
"""

from __future__ import annotations

import argparse
import functools
import json
import sys

import torch
import torch.nn.functional as F

from disagmoe_ds.fp8 import triton_block_mm
from disagmoe_ds.fp8.blocks import _dequantized
from disagmoe_ds.fp8.quantize import E4M3

SWEEP = [
    {"BLOCK_M": 64, "BLOCK_OUT": 128, "BLOCK_RED": 64, "num_warps": 4, "num_stages": 4},
    {"BLOCK_M": 128, "BLOCK_OUT": 128, "BLOCK_RED": 64, "num_warps": 8, "num_stages": 3},
    {"BLOCK_M": 64, "BLOCK_OUT": 128, "BLOCK_RED": 128, "num_warps": 4, "num_stages": 3},
    {"BLOCK_M": 128, "BLOCK_OUT": 128, "BLOCK_RED": 128, "num_warps": 8, "num_stages": 3},
    {"BLOCK_M": 64, "BLOCK_OUT": 64, "BLOCK_RED": 128, "num_warps": 4, "num_stages": 4},
]


def random_fp8(shape: tuple[int, ...], device: str) -> torch.Tensor:
    """e4m3 bytes of magnitudes up to 240 and either sign, never NaN (built from bytes: no float32 copy)."""
    magnitude = torch.randint(0, 0x78, shape, dtype=torch.uint8, device=device)
    sign = torch.randint(0, 2, shape, dtype=torch.uint8, device=device) << 7
    return (magnitude | sign).view(E4M3)


def timed(fn, iters: int) -> tuple[float, float, torch.Tensor]:
    """(median ms, peak GiB allocated beyond what was allocated before, result)."""
    out = fn()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        out = fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    peak = (torch.cuda.max_memory_allocated() - base) / 2**30
    return sorted(times)[len(times) // 2], peak, out


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--experts", type=int, default=256)
    p.add_argument("--n", type=int, default=4096, help="the weight's output rows (gate/up: 2 x intermediate)")
    p.add_argument("--k", type=int, default=7168, help="the weight's input columns (hidden)")
    p.add_argument("--rows-per-expert", type=int, default=128, help="routed rows per expert (4,096 tokens x 8 / 256)")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--sweep", action="store_true", help="time every tile configuration of SWEEP")
    p.add_argument("--tol", type=float, default=0.01)
    p.add_argument("--json", metavar="PATH")
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("no CUDA device", file=sys.stderr)
        return 2
    torch.manual_seed(0)
    block = (128, 128)
    data = random_fp8((a.experts, a.n, a.k), "cuda")
    scale_inv = torch.rand(a.experts, a.n // 128, a.k // 128, device="cuda") / 240
    counts = torch.poisson(torch.full((a.experts,), float(a.rows_per_expert))).int()
    offsets = counts.cumsum(0).to(device="cuda", dtype=torch.int32)
    rows = int(counts.sum())
    inputs = {fwd: torch.randn(rows, a.k if fwd else a.n, device="cuda").bfloat16() for fwd in (True, False)}

    def generic(transposed: bool) -> torch.Tensor:
        w = _dequantized(data, scale_inv, block, torch.bfloat16)
        return F.grouped_mm(inputs[transposed], w.transpose(1, 2) if transposed else w, offs=offsets)

    def kernel(transposed: bool, tiles: dict) -> torch.Tensor:
        x = inputs[transposed]
        return triton_block_mm.grouped_block_mm(x, data, scale_inv, block, offsets, transposed=transposed, tiles=tiles)

    table, failed = [], False
    print(f"{a.experts} experts x [{a.n}, {a.k}] e4m3, {rows:,} rows; blocks 128 x 128")
    print(f"{'direction':>10} {'tiles':>28} {'generic ms':>10} {'kernel ms':>9} {'ratio':>6} {'rel. error':>10} "
          f"{'generic GiB':>11} {'kernel GiB':>10}")  # fmt: skip
    for transposed in (True, False):
        ms_g, gib_g, want = timed(functools.partial(generic, transposed), a.iters)
        for tiles in SWEEP if a.sweep else [triton_block_mm.TILES]:
            ms_k, gib_k, got = timed(functools.partial(kernel, transposed, tiles), a.iters)
            error = ((got.float() - want.float()).norm() / want.float().norm()).item()
            failed |= error > a.tol
            name = "forward" if transposed else "input grad"
            shape = "{BLOCK_M}x{BLOCK_OUT}x{BLOCK_RED} w{num_warps} s{num_stages}".format(**tiles)
            print(f"{name:>10} {shape:>28} {ms_g:10.2f} {ms_k:9.2f} {ms_g / ms_k:5.2f}x {error:10.2e} {gib_g:11.2f} "
                  f"{gib_k:10.2f}")  # fmt: skip
            table.append({"direction": name, "tiles": tiles, "generic_ms": ms_g, "kernel_ms": ms_k, "error": error,
                          "generic_gib": gib_g, "kernel_gib": gib_k})  # fmt: skip
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"experts": a.experts, "n": a.n, "k": a.k, "rows": rows, "rows_table": table}, f, indent=1)
    print(f"kernel against the generic path: {'ok' if not failed else 'FAILED'} (tolerance {a.tol:g})")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
