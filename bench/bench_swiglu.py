"""The experts' SwiGLU middle alone: Triton's kernels (``models/triton_swiglu.py``) against inductor's.

    PYTHONPATH=$PWD python bench/bench_swiglu.py        # the three widths of docs/performance-log.md section 10
    PYTHONPATH=$PWD python bench/bench_swiglu.py --sweep # and every candidate tile, best three per kernel

Each size is PAIRSxI: (row, expert) pairs and the expert intermediate width; the defaults are Qwen3-30B-A3B
(65,536 x 768), Mixtral-8x7B (16,384 x 14,336) and DeepSeek-V3 (65,536 x 2,048) at 8,192 tokens. Times forward
and forward + backward of ``grouped_experts._gated_eager`` under ``torch.compile`` (what the compiled shards ran
before) and of the Triton kernels with the tiles they ship, on the same inputs; prints ms, the speed-up of forward
+ backward, and the largest difference from inductor's output relative to its largest value. bf16 on CUDA.
``--device cpu`` runs the kernels in Triton's interpreter (set ``TRITON_INTERPRET=1``): for tests, not for times.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_layer import time_step  # noqa: E402

from disagmoe_ds.models import grouped_experts, triton_swiglu  # noqa: E402

SIZES = ("65536x768", "16384x14336", "65536x2048")
CANDIDATE_TILES = [  # (BLOCK_P, BLOCK_I, num_warps): the sweep behind triton_swiglu's choice
    (1, 1024, 4), (2, 512, 4), (4, 256, 4), (8, 256, 4), (8, 128, 4), (4, 512, 8),
    (8, 512, 8), (16, 256, 8), (16, 128, 4), (2, 1024, 8), (32, 64, 4),
]  # fmt: skip


def _inputs(pairs: int, inter: int, device: str, dtype: torch.dtype, w_dtype: torch.dtype):
    g = torch.Generator(device="cpu").manual_seed(0)
    gate_up = torch.randn(pairs, 2 * inter, generator=g).to(device, dtype)
    w = torch.rand(pairs, generator=g).to(device, w_dtype)
    d_hidden = (torch.randn(pairs, inter, generator=g) * 1e-2).to(device, dtype)
    return gate_up, w, d_hidden


def _relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want.float()).abs().max() / want.float().abs().max().clamp_min(1e-30)).item()


def bench_size(pairs: int, inter: int, a) -> dict:
    dtype = torch.bfloat16 if a.device == "cuda" else torch.float32
    w_dtype = torch.float32 if a.w_dtype == "fp32" else dtype
    gate_up, w, d_hidden = _inputs(pairs, inter, a.device, dtype, w_dtype)
    # Each width compiles from scratch, as one model's job does: sharing dynamo's cache across the sizes would make
    # the widths dynamic from the second size on, and inductor's kernels slower (Mixtral's width: 2.5x).
    torch._dynamo.reset()
    compiled = torch.compile(grouped_experts._gated_eager, backend=a.compile_backend)

    def inductor_step():
        gu, wl = gate_up.detach().requires_grad_(), w.detach().requires_grad_()
        compiled(gu, wl, F.silu).backward(d_hidden)
        return gu.grad, wl.grad

    def triton_step(tiles=None):
        return triton_swiglu.swiglu_backward(gate_up, w, d_hidden, tiles)

    def ms(fn) -> float:
        return time_step(fn, warmup=a.warmup, iters=a.iters, device=a.device) * 1e3

    d_gate_up, d_w = inductor_step()
    hidden = compiled(gate_up, w, F.silu)
    ours = (triton_swiglu.swiglu_forward(gate_up, w), *triton_step())
    row = {
        "pairs": pairs,
        "inter": inter,
        "error": max(_relative_error(o, r) for o, r in zip(ours, (hidden, d_gate_up, d_w), strict=True)),
        "inductor_fwd_ms": ms(lambda: compiled(gate_up, w, F.silu)),
        "inductor_fwd_bwd_ms": ms(inductor_step),
        "triton_fwd_ms": ms(lambda: triton_swiglu.swiglu_forward(gate_up, w)),
        "triton_bwd_ms": ms(triton_step),
    }
    row["triton_fwd_bwd_ms"] = row["triton_fwd_ms"] + row["triton_bwd_ms"]
    row["speedup"] = row["inductor_fwd_bwd_ms"] / row["triton_fwd_bwd_ms"]
    if a.sweep:
        sweep = [dict(zip(("BLOCK_P", "BLOCK_I", "num_warps"), c, strict=True)) for c in CANDIDATE_TILES]
        for kernel, run in (
            ("fwd", lambda t: triton_swiglu.swiglu_forward(gate_up, w, t)),
            ("bwd", lambda t: triton_step(t)),
        ):
            timed = sorted(((ms(lambda t=t, run=run: run(t)), t) for t in sweep), key=lambda r: r[0])
            row[f"best_{kernel}"] = [{"ms": t_ms, **t} for t_ms, t in timed[:3]]
    return row


def print_table(rows: list[dict]) -> None:
    print(f"{'pairs x I':<14}{'inductor fwd':>14}{'fwd+bwd':>10}{'triton fwd':>12}{'bwd':>8}{'fwd+bwd':>10}"
          f"{'speed-up':>10}{'rel. diff':>11}")  # fmt: skip
    for r in rows:
        print(
            f"{r['pairs']}x{r['inter']:<{13 - len(str(r['pairs']))}}{r['inductor_fwd_ms']:>14.3f}"
            f"{r['inductor_fwd_bwd_ms']:>10.3f}{r['triton_fwd_ms']:>12.3f}{r['triton_bwd_ms']:>8.3f}"
            f"{r['triton_fwd_bwd_ms']:>10.3f}{r['speedup']:>9.2f}x{r['error']:>11.1e}",
            flush=True,
        )
        for kernel in ("fwd", "bwd"):
            if f"best_{kernel}" in r:
                best = ", ".join(
                    f"{b['ms']:.3f} ms ({b['BLOCK_P']}, {b['BLOCK_I']}, {b['num_warps']})" for b in r[f"best_{kernel}"]
                )
                print(f"    best {kernel} tiles (BLOCK_P, BLOCK_I, warps): {best}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", nargs="+", default=list(SIZES), metavar="PAIRSxI")
    p.add_argument("--w-dtype", choices=("bf16", "fp32"), default="bf16", help="routing weights (fp32: Mixtral, DSV3)")
    p.add_argument("--sweep", action="store_true", help="also time every candidate tile of both kernels")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--compile-backend", default="inductor", help="torch.compile backend (aot_eager: CPU tests)")
    p.add_argument("--json", metavar="PATH")
    a = p.parse_args(argv)
    rows = []
    for size in a.sizes:
        pairs, inter = (int(n) for n in size.lower().split("x"))
        rows.append(bench_size(pairs, inter, a))
    print_table(rows)
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
