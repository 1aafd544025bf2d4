"""Expert-path micro-benchmark: one MoE layer's routed experts (forward + backward) against HF's, compiled.

    PYTHONPATH=$PWD python bench/bench_experts.py --tokens 8192 --hidden 2048 --inter 768 --experts 128 --top-k 8

(the defaults: Qwen3-30B-A3B's sizes). Variants in ``--paths`` (default all), on the same routed tokens (one rank
holding every expert, random weights):

    gemm-only      the two grouped GEMMs on pre-sorted rows (the floor: no permutation, no activation)
    hf-grouped     HF's experts module (``Qwen3MoeExperts``) with its ``grouped_mm`` implementation
    hf-compiled    the same module under ``torch.compile`` (default options): the reference
    ours           ``grouped_gated_experts`` (sort, gather, two grouped GEMMs, elementwise middle, gather-sum)
    inductor-compiled  the same with ``compiled_elementwise()``'s middle compiled by inductor instead of its Triton
                   kernels (``TritonSwiGLUOr.fallback``)
    ours-compiled  ``compiled_elementwise()``, as an expert shard of a ``"compile": true`` job runs it (the middle's
                   forward and backward as Triton kernels on CUDA, ``models/triton_swiglu.py``; the un-permute
                   fused by ``torch.compile``)
    capacity-compiled  the same rows as a message at a fixed capacity (``"capacity_factor"``, default 1.25 here):
                   padded with that share of rows whose ids are all the sentinel, and only a bound on the pairs
                   (``bounded``: buffers at the bound, masks past the real pairs); its TFLOP/s count the real pairs

Prints ms, TFLOP/s (3 x 6 * pairs * H * I) and each variant's speed over hf-compiled's (time of hf-compiled /
time of the variant; ``vs_hf_compiled`` in the JSON written by ``--json``). bf16 on CUDA, fp32 on CPU. A variant
that cannot run is a row marked failed with its error's first line, and the exit code is 1. Timed as
``bench_layer.py`` times (gradients set to None each step, steps back to back, compilation in the warm-up);
``--compile-backend`` as there.
"""

from __future__ import annotations

import argparse
import json
import sys
import traceback
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_layer import compile_backend, first_line, fresh_grads, print_profile, time_step  # noqa: E402

from disagmoe_ds.models import grouped_experts  # noqa: E402

VARIANTS = ("gemm-only", "hf-grouped", "hf-compiled", "ours", "inductor-compiled", "ours-compiled", "capacity-compiled")
REFERENCE = "hf-compiled"


def make_inputs(args, device: str, dtype: torch.dtype):
    g = torch.Generator(device="cpu").manual_seed(0)
    x = (torch.randn(args.tokens, args.hidden, generator=g) * 0.5).to(device, dtype).requires_grad_()
    logits = torch.randn(args.tokens, args.experts, generator=g)
    w, idx = torch.softmax(logits, -1).topk(args.top_k, dim=-1)
    gate_up = (torch.randn(args.experts, 2 * args.inter, args.hidden, generator=g) * 0.02).to(device, dtype)
    down = (torch.randn(args.experts, args.hidden, args.inter, generator=g) * 0.02).to(device, dtype)
    return x, idx.to(device), w.to(device, dtype).requires_grad_(), gate_up.requires_grad_(), down.requires_grad_()


def step_ours(x, idx, w, gate_up, down, grad, elementwise):
    fresh_grads(x, w, gate_up, down)
    pairs = idx.numel()  # known to the host, as the M2N header gives it
    out = grouped_experts.grouped_gated_experts(x, idx, w, gate_up, down, F.silu, pairs, elementwise)
    out.backward(grad)


def step_bounded(x, idx, w, gate_up, down, grad, elementwise, bound):
    fresh_grads(x, w, gate_up, down)
    out = grouped_experts.grouped_gated_experts(x, idx, w, gate_up, down, F.silu, bound, elementwise, bounded=True)
    out.backward(grad)


def padded(inputs: dict, num_experts: int, factor: float) -> tuple:
    """``inputs``' rows padded to ``factor`` times as many (every id the sentinel), and the pair bound."""
    x, idx, w, grad = (inputs[k] for k in ("x", "idx", "w", "grad"))
    pad = round(x.shape[0] * (factor - 1))
    x_pad = torch.cat([x.detach(), x.new_zeros(pad, x.shape[1])]).requires_grad_()
    idx_pad = torch.cat([idx, idx.new_full((pad, idx.shape[1]), num_experts)])
    w_pad = torch.cat([w.detach(), w.new_zeros(pad, w.shape[1])]).requires_grad_()
    return x_pad, idx_pad, w_pad, torch.cat([grad, grad.new_zeros(pad, grad.shape[1])]), round(idx.numel() * factor)


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


def build_variant(name: str, a, inputs: dict, backend: str):
    """``(step, args)`` of one variant, compiled where its name says so."""
    x, idx, w, gate_up, down, grad = (inputs[k] for k in ("x", "idx", "w", "gate_up", "down", "grad"))
    if name.endswith("compiled"):
        torch._dynamo.reset()
    if name == "gemm-only":
        return step_gemm_only, (inputs["x_sorted"], inputs["offsets"], gate_up, down, inputs["grad_sorted"])
    if name.startswith("hf"):
        module = hf_module(a, gate_up, down, x.device, x.dtype)
        if name == "hf-compiled":
            with compile_backend(backend):
                module.compile()
        return step_hf, (module, x, idx, w, grad)
    if name == "capacity-compiled":
        with compile_backend(backend):
            elementwise = grouped_experts.compiled_elementwise()
        x_pad, idx_pad, w_pad, grad_pad, bound = padded(inputs, a.experts, a.capacity_factor)
        return step_bounded, (x_pad, idx_pad, w_pad, gate_up, down, grad_pad, elementwise, bound)
    if name in ("ours-compiled", "inductor-compiled"):
        with compile_backend(backend):
            elementwise = grouped_experts.compiled_elementwise()
        if name == "inductor-compiled":
            elementwise = elementwise.without_triton()
    else:
        elementwise = grouped_experts.EAGER
    return step_ours, (x, idx, w, gate_up, down, grad, elementwise)


def print_table(rows: list[dict]) -> None:
    print(f"{'variant':<16}{'ms':>10}{'TFLOP/s':>10}{'vs hf-compiled':>16}")
    for r in rows:
        if r["error"]:
            print(f"{r['variant']:<16}  failed: {r['error']}")
            continue
        ratio = f"{r['vs_hf_compiled']:>15.2f}x" if r["vs_hf_compiled"] else f"{'-':>16}"
        print(f"{r['variant']:<16}{r['ms']:>10.3f}{r['tflops']:>10.1f}{ratio}", flush=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--inter", type=int, default=768)
    p.add_argument("--experts", type=int, default=128)
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--warmup", type=int, default=3, help="untimed steps first (compilation happens in them)")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="cuda: bf16; cpu: fp32")
    p.add_argument(
        "--paths", nargs="+", default=list(VARIANTS), choices=VARIANTS, metavar="PATH", help=", ".join(VARIANTS)
    )
    p.add_argument("--compile-backend", default="inductor", help="torch.compile backend (aot_eager: CPU tests)")
    p.add_argument("--capacity-factor", type=float, default=1.25, help="capacity-compiled's padding (rows and pairs)")
    p.add_argument("--json", metavar="PATH")
    p.add_argument("--profile", action="store_true", help="print the top CUDA kernels of our paths and gemm-only")
    a = p.parse_args(argv)
    dtype = torch.bfloat16 if a.device == "cuda" else torch.float32
    x, idx, w, gate_up, down = make_inputs(a, a.device, dtype)
    order = torch.argsort(idx.reshape(-1), stable=True)
    counts = torch.bincount(idx.reshape(-1), minlength=a.experts)
    x_sorted = x.detach().index_select(0, order // a.top_k).requires_grad_()
    inputs = {
        "x": x,
        "idx": idx,
        "w": w,
        "gate_up": gate_up,
        "down": down,
        "grad": torch.randn_like(x) * 1e-3,
        "x_sorted": x_sorted,
        "offsets": torch.cumsum(counts, 0, dtype=torch.int32),
        "grad_sorted": torch.randn_like(x_sorted) * 1e-3,
    }
    flops = 3 * 6 * a.tokens * a.top_k * a.hidden * a.inter
    rows, built = [], {}
    for name in a.paths:
        row = {"variant": name, "ms": None, "tflops": None, "vs_hf_compiled": None, "error": None}
        try:
            step, args = built[name] = build_variant(name, a, inputs, a.compile_backend)
            seconds = time_step(step, *args, warmup=a.warmup, iters=a.iters, device=a.device)
            row.update(ms=seconds * 1e3, tflops=flops / seconds / 1e12)
        except Exception as error:  # a variant that cannot run is a row of the table, not the end of the run
            traceback.print_exc()
            row["error"] = first_line(error)
        rows.append(row)
    ref = next((r["ms"] for r in rows if r["variant"] == REFERENCE and r["ms"]), None)
    for r in rows:
        r["vs_hf_compiled"] = ref / r["ms"] if ref and r["ms"] else None
    if a.profile and a.device == "cuda":
        for name in ("gemm-only", "inductor-compiled", "ours-compiled"):
            if name in built:
                print(f"--- {name}")
                print_profile(*built[name])
    print_table(rows)
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=2))
    return 1 if any(r["error"] for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
