"""Per-layer training throughput: our attention part + expert part versus HF's own decoder layer.

    PYTHONPATH=$PWD python bench/bench_layer.py --model hf_models/Qwen3-30B-A3B --seq-len 4096 --batch 2

For each model and sequence length it builds ONE decoder layer at real size (bf16, SDPA attention) and times
forward + backward of:

    hf-eager      HF ``XDecoderLayer`` with the per-expert Python loop (``experts_implementation="eager"``)
    hf-grouped    HF ``XDecoderLayer`` with ``grouped_mm`` experts
    ours          ``AttentionPart`` -> dispatch plan -> ``ExpertShard`` (all experts, one rank) -> combine
    ours-compiled the same under ``torch.compile`` (attention part; the experts' activation/gating/weighting)

and prints tokens/s, TFLOP/s and MFU (model FLOPs, Megatron convention: active experts, causal attention,
training = 3x forward; peak 989 TFLOP/s bf16 dense for H100/H200-class GPUs). ``--json`` writes the table;
``--profile`` prints the top CUDA kernels of ``ours`` (where the time goes).

Timing is that of a training loop: every step starts with the gradients set to None (``zero_grad``'s default, so
the weight gradients are written, not accumulated) and steps run back to back, the device synchronised only at
the ends of each timed window (the host launches ahead, as it does in training).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from transformers import AutoConfig

from disagmoe_ds.comm.routing import combine, pack, plan_dispatch
from disagmoe_ds.engine.build import compile_stage
from disagmoe_ds.models.one_layer import one_layer_model
from disagmoe_ds.models.parts import AttentionStage, ExpertStage, build_context
from disagmoe_ds.planner.model import load_model_spec

PEAK_TFLOPS = 989.0


def fresh_grads(*tensors: torch.Tensor) -> None:
    """Start a step as a training loop does after ``zero_grad()``: gradients None, so they are written, not added."""
    for t in tensors:
        t.grad = None


def _hf_step(model, h_BSH, ctx, grad_BSH):
    fresh_grads(h_BSH, *model.parameters())
    out = model.model.layers[0](
        h_BSH,
        attention_mask=ctx.mask_for(model.config, 0),
        position_embeddings=ctx.position_embeddings,
        position_ids=ctx.position_ids,
    )
    out.backward(grad_BSH)


def _ours_step(parts, h_BSH, ctx, grad_BSH):
    attention_part, experts, config = parts
    fresh_grads(h_BSH, *attention_part.parameters(), *experts.parameters())
    out = attention_part(h_BSH, ctx, config)
    plan = plan_dispatch(out.topk_idx_TK, 1, experts.num_local)
    ((x_RH, w_RK),) = pack(out.x_TH, out.topk_w_TK, plan)
    y_RH = experts.shard(0)(x_RH, plan.local_idx_RK[0], w_RK, plan.pairs[0])
    (out.residual_BSH + combine([y_RH], plan).view_as(out.residual_BSH)).backward(grad_BSH)


def time_step(step, *args, warmup: int, iters: int, device: str, windows: int = 3) -> float:
    """Seconds per ``step(*args)``: the median over ``windows`` of the mean of ``iters`` back-to-back steps."""
    for _ in range(warmup):
        step(*args)
    times = []
    for _ in range(windows):
        if device == "cuda":
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(iters):
                step(*args)
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end) / 1e3 / iters)
        else:
            t0 = time.perf_counter()
            for _ in range(iters):
                step(*args)
            times.append((time.perf_counter() - t0) / iters)
    return statistics.median(times)


def bench_model(
    model_dir: str, seq_len: int, batch: int, *, device: str, warmup: int, iters: int, profile: bool, paths: list[str]
):
    spec = load_model_spec(model_dir)
    flops_per_token = 3 * (spec.attention_side_flops(seq_len, 0) + spec.expert_side_flops(0))
    tokens = batch * seq_len
    rows = []
    for name in paths:
        experts = "eager" if name == "hf-eager" else "grouped_mm"
        dtype = torch.bfloat16 if device == "cuda" else torch.float32
        model = one_layer_model(AutoConfig.from_pretrained(model_dir), device=device, dtype=dtype, experts=experts)
        h_BSH = torch.randn(batch, seq_len, model.config.hidden_size, device=device, dtype=model.dtype) * 0.5
        h_BSH.requires_grad_()
        grad_BSH = torch.randn_like(h_BSH) * 1e-3
        ctx = build_context(model.config, model.model.rotary_emb, h_BSH, None)
        if name.startswith("ours"):
            attention = AttentionStage(model, (0,), with_embedding=False, with_head=False)
            experts = ExpertStage(model, (0,), 0, spec.num_experts)
            if name == "ours-compiled":
                compile_stage(attention)
                compile_stage(experts)
            args = ((attention.part(0), experts, model.config), h_BSH, ctx, grad_BSH)
            step = _ours_step
        else:
            args, step = (model, h_BSH, ctx, grad_BSH), _hf_step
        seconds = time_step(step, *args, warmup=warmup, iters=iters, device=device)
        tflops = flops_per_token * tokens / seconds / 1e12
        rows.append(
            {
                "model": Path(model_dir).name,
                "seq_len": seq_len,
                "batch": batch,
                "path": name,
                "ms": seconds * 1e3,
                "tokens_per_s": tokens / seconds,
                "tflops": tflops,
                "mfu": tflops / PEAK_TFLOPS,
            }
        )
        if profile and name == paths[-1] and device == "cuda":
            print_profile(step, args)
        del model, args
        if device == "cuda":
            torch.cuda.empty_cache()
    return rows


def print_profile(step, args, top: int = 25) -> None:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        step(*args)
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    busy_ms = sum(e.device_time for e in kernels) / 1e3
    print(f"{len(kernels)} kernels, {busy_ms:.2f} ms of kernel time in one step", flush=True)
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=top), flush=True)


def print_table(rows: list[dict]) -> None:
    header = f"{'model':<18}{'seq':>6}{'path':>12}{'ms':>10}{'tok/s':>12}{'TFLOP/s':>10}{'MFU':>7}{'vs hf-grouped':>15}"
    print(header)
    base = {(r["model"], r["seq_len"]): r["tokens_per_s"] for r in rows if r["path"] == "hf-grouped"}
    for r in rows:
        ratio = r["tokens_per_s"] / base[(r["model"], r["seq_len"])]
        print(
            f"{r['model']:<18}{r['seq_len']:>6}{r['path']:>12}{r['ms']:>10.2f}{r['tokens_per_s']:>12.0f}"
            f"{r['tflops']:>10.1f}{r['mfu']:>7.1%}{ratio:>14.2f}x"
        )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", nargs="+", default=["hf_models/Qwen3-30B-A3B"], help="model config directories")
    p.add_argument("--seq-len", type=int, nargs="+", default=[4096])
    p.add_argument("--batch", type=int, default=2, help="sequences per step")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--profile", action="store_true", help="print the top kernels of the last path")
    p.add_argument("--paths", nargs="+", default=["hf-eager", "hf-grouped", "ours", "ours-compiled"])
    p.add_argument("--json", metavar="PATH", help="also write the rows as JSON")
    a = p.parse_args(argv)
    rows = []
    for model_dir in a.model:
        for seq_len in a.seq_len:
            new = bench_model(
                model_dir,
                seq_len,
                a.batch,
                device=a.device,
                warmup=a.warmup,
                iters=a.iters,
                profile=a.profile,
                paths=a.paths,
            )
            print(", ".join(f"{r['path']} {r['tokens_per_s']:.0f} tok/s" for r in new), flush=True)
            rows += new
    print_table(rows)
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
