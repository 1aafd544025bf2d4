"""torch's FP8 kernels against the exact CPU emulation, on the shapes and layouts the FP8 lever gives them.

On CUDA ``disagmoe_ds.fp8`` multiplies with ``torch._scaled_mm`` / ``torch._scaled_grouped_mm`` on operands quantized
by compiled kernels (a transposed weight's copy written row-major by the quantization, the step's kept copies of
``fp8.weight_cache``); on a CPU the same FP8 values are dequantized and multiplied in float32. Both must agree up to
the order of the sums and the bf16 output's rounding: this runs a linear and a grouped expert projection forward and
backward on both devices, from the same bf16 inputs, per call and inside ``cast_once_per_step``, and prints each
result's relative error (norm of the difference over the norm of the CPU result). Exit status 1 past ``--tol``.

    python bench/check_fp8_cuda.py [--tol 0.01]
"""

from __future__ import annotations

import argparse
import contextlib
import sys

import torch

from disagmoe_ds.fp8.projections import fp8_grouped_mm, fp8_linear
from disagmoe_ds.fp8.quantize import round_trip
from disagmoe_ds.fp8.weight_cache import cast_once_per_step

# Expert rows per group: an empty expert and ragged groups; 8 groups of 64 rows on average (torch's small tile as
# they are), then 4 of 256 (each shown to torch as 3 groups, ``fp8.gemm.tile_split``).
COUNTS = {"8 experts": [0, 90, 3, 77, 128, 64, 100, 50], "4 experts, split": [300, 0, 500, 224]}


def results(device: str, cached: bool, counts: list[int]) -> dict[str, torch.Tensor]:
    """Outputs and gradients of one FP8 linear and one FP8 grouped projection on ``device``."""
    torch.manual_seed(0)
    rows = sum(counts)
    x = torch.randn(rows, 256, dtype=torch.bfloat16)
    w = torch.randn(384, 256, dtype=torch.bfloat16) / 16
    w_e = torch.randn(len(counts), 192, 384, dtype=torch.bfloat16) / 16  # [e, N, K]: HF's fused expert layout
    dy = torch.randn(rows, 192, dtype=torch.bfloat16)
    x = x.to(device).requires_grad_()
    w, w_e = (torch.nn.Parameter(t.to(device)) for t in (w, w_e))  # the weight cache keeps parameters only
    offsets = torch.tensor(counts).cumsum(0).to(device=device, dtype=torch.int32)
    with cast_once_per_step() if cached else contextlib.nullcontext():
        for _ in range(2):  # the second pass reads the kept copies
            h = round_trip(fp8_linear(x, w))  # the routed rows, as the lever sends them
            y = fp8_grouped_mm(h, w_e, offsets, fp8_rows=True)
            dx, dw, dw_e = torch.autograd.grad(y, [x, w, w_e], dy.to(device))
    return {"y": y, "dx": dx, "dw": dw, "dw_e": dw_e}


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tol", type=float, default=0.01, help="largest relative error accepted (default 0.01)")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to compare", file=sys.stderr)
        return 2
    worst = 0.0
    print(f"{'groups':>16} {'weights':>10} {'tensor':>6} {'rel. error':>10}")
    for groups, counts in COUNTS.items():
        for cached in (False, True):
            cpu, cuda = results("cpu", cached, counts), results("cuda", cached, counts)
            for name, want in cpu.items():
                got = cuda[name].float().cpu()
                error = ((got - want.float()).norm() / want.float().norm()).item()
                worst = max(worst, error)
                print(f"{groups:>16} {'kept' if cached else 'per call':>10} {name:>6} {error:10.2e}")
    print(f"worst {worst:.2e} (tolerance {args.tol:g}): {'ok' if worst <= args.tol else 'FAILED'}")
    return 0 if worst <= args.tol else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
