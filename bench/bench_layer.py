"""Per-layer training throughput: our attention part + expert part versus HF's own decoder layer, compiled.

    PYTHONPATH=$PWD python bench/bench_layer.py --model hf_models/Qwen3-30B-A3B --seq-len 4096 --batch 2

For each model and sequence length it builds ONE decoder layer at real size (bf16 on CUDA, fp32 on CPU; SDPA
attention; weights random, only the config is read; with hyper-connections, DeepSeek-V4's, the layer's input is its
streams, [B, S, hc, H], and a hash-routed layer gets random token ids) and times forward + backward of each path in
``--paths`` (default all):

    hf-eager      HF ``XDecoderLayer`` with the per-expert Python loop (``experts_implementation="eager"``)
    hf-grouped    HF ``XDecoderLayer`` with ``grouped_mm`` experts
    hf-compiled   the same layer under ``torch.compile`` (default options, the whole layer): the reference
    hf-graphed    the same under ``mode="reduce-overhead"`` (inductor's CUDA graph trees, forward and backward)
    ours          ``AttentionPart`` -> dispatch plan -> ``ExpertShard`` (all experts, one rank) -> combine
    ours-compiled the same under ``compile_stage`` as a ``"compile": true`` job runs it (attention part; the
                  experts' activation/gating/weighting, on CUDA as Triton kernels, and un-permute)
    ours-graphed  ours-compiled with the attention part and the expert shard replayed as CUDA graphs, as a
                  ``"cuda_graphs": true`` job runs them (``models.graphs``; the step's few ops between them stay eager)
    inductor-compiled  ours-compiled with the experts' middle compiled by inductor instead of the Triton kernels
    selective-compiled  ours-compiled with selective recompute (``"selective_recompute": true``, ``models.recompute``):
                  what rebuilding the attention block and the experts' gate/up outputs costs, and the memory it saves
    floor         only the library calls every path makes, on the layer's shapes: each linear layer of the
                  attention side (projections, router, shared experts) on an input of its own, SDPA (causal), and
                  the experts' two grouped GEMMs on rows already sorted, as many per expert as the layer's router
                  sends it (the same batch and weights as the other paths), each with its backward. No norm,
                  rotary, routing, permutation or activation: the time no implementation built on these kernels
                  can beat, so its ``vs_hf_compiled`` is the most any can gain over compiled HF
    ours-fp8-compiled  ours-compiled with ``"fp8": true``: the experts' grouped GEMMs and the attention side's
                  projections in FP8 (``disagmoe_ds.fp8``: e4m3, rowwise power-of-two scales, all three GEMMs;
                  the router and the LM head stay high precision; projections too narrow to pay stay bf16,
                  ``fp8.shapes``; the experts in FP8 at any width), the quantization compiled into the parts, on
                  CUDA the experts' middle writing the FP8 operands of the GEMMs after it
                  (``models.fp8_experts``); every weight cast to FP8 in every call: a step of one micro-batch
    ours-fp8-once-compiled  the lever as a run configures it by default: ours-fp8-compiled inside one optimizer
                  step's scope (``fp8.weight_cache``: the expert weights' FP8 copies made once, in the warm-up, and
                  reused, as every micro-batch of a step after its first runs them; a step of K micro-batches costs
                  about (K - 1) of these and one ours-fp8-compiled), the experts in FP8 only where their width pays
                  (``"fp8_expert_bf16_width"``; their rows FP8 values either way, as the lever sends them)
    ours-fp8-once-unfused-compiled  ours-fp8-once-compiled with the experts in FP8 at any width and their FP8
                  operands quantized in passes of their own after the Triton middle (as before
                  ``models.fp8_experts``)
    ours-fp8-once-all-compiled  ours-fp8-once-compiled with every aligned projection and the experts in FP8,
                  narrow ones too (both widths 0, as before the shape rules)
    ours-fp8-once-experts-compiled  ours-fp8-once-compiled with the attention side's projections all in bf16 and
                  the routed experts' GEMMs in FP8 at any width: FP8 on the experts alone
    hf-fp8-compiled  hf-compiled with torchao's FP8 training on the layer's attention projections and shared
                  experts (``Float8TrainingOpConfig``, rowwise; not the router): the strongest FP8 a user of HF
                  has (CUDA and torchao only). Not its routed experts: torchao's FP8 grouped GEMM needs each
                  expert's token group padded to 16 rows (its weight-gradient GEMM asserts on the device
                  otherwise, which ends the process), and HF's experts do not pad (measured, torchao 0.18)

and prints tokens/s, TFLOP/s, MFU (model FLOPs, Megatron convention: active experts, causal attention,
training = 3x forward; peak 989 TFLOP/s bf16 dense for H100/H200-class GPUs) and each path's tokens/s over
hf-compiled's at the same model and sequence length (``vs_hf_compiled`` in the JSON; null, printed ``-``, when
hf-compiled did not run), and on CUDA the memory the built path holds (``built``: its weights, and for ours the HF
layer it was split from, which a run does not keep), the peak memory of the path's steps and the activations one step
holds for its backward (``HeldActivations``), and the share of the timed step the GPU sat idle waiting for the host
(``idle``: against the same steps queued behind a GPU sleep, ``queued_ahead_seconds``). ``--json`` writes the
rows, rewritten after every row so that a run cut short keeps what it measured; ``--profile`` prints the top CUDA
kernels of every path (to compare them kernel by kernel).

A path that cannot run (a layer that does not compile, out of memory) is a row marked failed with its error's
first line (the traceback goes to stderr); the other paths still run, and the exit code is 1.

Dynamo's caches are reset before and after every compiled path, so each is compiled for its own shapes whatever
ran before it. ``--compile-backend aot_eager`` (CPU tests) traces and differentiates the same graphs without
inductor's code generation; the default, inductor, is what the numbers mean.

Timing is that of a training loop: every step starts with the gradients set to None (``zero_grad``'s default, so
the weight gradients are written, not accumulated) and steps run back to back, the device synchronised only at
the ends of each timed window (the host launches ahead, as it does in training). Compilation happens in the
warm-up steps and is not timed.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import gc
import json
import statistics
import sys
import time
import traceback
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import torch
import torch.nn.functional as F

from disagmoe_ds.comm.routing import combine, count_ids, pack, plan_dispatch
from disagmoe_ds.fp8.quantize import round_trip
from disagmoe_ds.fp8.shapes import BF16_WIDTH, EXPERT_BF16_WIDTH
from disagmoe_ds.fp8.weight_cache import cast_once_per_step
from disagmoe_ds.models import grouped_experts
from disagmoe_ds.models import hyper_connections as hc
from disagmoe_ds.models.context import build_context
from disagmoe_ds.models.expert_shard import ExpertShard
from disagmoe_ds.models.families import family_of, router_of
from disagmoe_ds.models.graphs import graph_stages
from disagmoe_ds.models.loading import load_config
from disagmoe_ds.models.moe_pattern import token_routed_layers
from disagmoe_ds.models.one_layer import one_layer_model
from disagmoe_ds.models.parts import AttentionStage, ExpertStage, compile_stage, fp8_stage
from disagmoe_ds.models.recompute import apply_selective_recompute
from disagmoe_ds.planner.model import load_model_spec

PEAK_TFLOPS = 989.0
PATHS = (
    "hf-eager",
    "hf-grouped",
    "hf-compiled",
    "hf-graphed",
    "ours",
    "ours-compiled",
    "ours-graphed",
    "inductor-compiled",
    "selective-compiled",
    "floor",
    "ours-fp8-compiled",
    "ours-fp8-once-compiled",
    "ours-fp8-once-unfused-compiled",
    "ours-fp8-once-all-compiled",
    "ours-fp8-once-experts-compiled",
    "hf-fp8-compiled",
)
CUDA_ONLY = ("hf-graphed", "ours-graphed", "hf-fp8-compiled")
REFERENCE = "hf-compiled"


def paths_for(device: str) -> list[str]:
    """The default paths on ``device``: every path, less the CUDA-only ones on a CPU."""
    return [p for p in PATHS if device == "cuda" or p not in CUDA_ONLY]


def fresh_grads(*tensors: torch.Tensor) -> None:
    """Start a step as a training loop does after ``zero_grad()``: gradients None, so they are written, not added."""
    for t in tensors:
        t.grad = None


@contextlib.contextmanager
def compile_backend(backend: str):
    """Within: ``torch.compile`` calls that name no backend use ``backend`` (nothing changes for ``"inductor"``,
    the default). ``compiled_elementwise`` is re-made inside, and forgotten on leaving, so its process-wide cache
    never hands another caller functions compiled with a test backend."""
    if backend == "inductor":
        yield
        return
    original = torch.compile
    torch.compile = functools.partial(original, backend=backend)
    grouped_experts.compiled_elementwise.cache_clear()
    try:
        yield
    finally:
        torch.compile = original
        grouped_experts.compiled_elementwise.cache_clear()


class HeldActivations:
    """CUDA bytes a step holds when its backward starts beyond what it held when it started: the activations kept
    for the backward, i.e. what each micro-batch in flight costs a pipeline (recompute shrinks it)."""

    active = False
    start = held = 0

    @classmethod
    def begin(cls) -> None:
        if cls.active:
            cls.start = torch.cuda.memory_allocated()

    @classmethod
    def end(cls) -> None:
        if cls.active:
            cls.held = torch.cuda.memory_allocated() - cls.start

    @classmethod
    def measure(cls, step, args) -> float:
        """GiB held by one ``step(*args)``."""
        cls.active = True
        try:
            step(*args)
            torch.cuda.synchronize()
        finally:
            cls.active = False
        return cls.held / 2**30


def _hf_step(model, h_BSH, ctx, grad_BSH):
    fresh_grads(h_BSH, *model.parameters())
    HeldActivations.begin()
    out = model.model.layers[0](
        h_BSH,
        **({} if ctx.token_ids is None else {"input_ids": ctx.token_ids}),  # a hash-routed layer's token ids
        attention_mask=ctx.mask_for(model.config, 0),
        position_embeddings=ctx.position_embeddings,
        position_ids=ctx.position_ids,
    )
    HeldActivations.end()
    out.backward(grad_BSH)


def _hf_graphed_step(model, h_BSH, ctx, grad_BSH):
    torch.compiler.cudagraph_mark_step_begin()  # a new step: the graph trees may reuse the last step's outputs
    _hf_step(model, h_BSH, ctx, grad_BSH)


def _ours_step(parts, h_BSH, ctx, grad_BSH):
    attention_part, shard, params, config, fp8_rows = parts
    fresh_grads(h_BSH, *params)
    HeldActivations.begin()
    out = attention_part(h_BSH, ctx, config)
    plan = plan_dispatch(out.topk_idx_TK, 1, shard.num_local)
    ((x_RH, w_RK),) = pack(out.x_TH, out.topk_w_TK, plan)
    x_RH = round_trip(x_RH) if fp8_rows else x_RH  # the rows the FP8 lever sends
    y_RH = shard(x_RH, plan.local_idx_RK[0], w_RK, plan.pairs[0])
    HeldActivations.end()
    hc.add_routed(out.residual_BSH, out.routed_w_BSC, combine([y_RH], plan)).backward(grad_BSH)


def _floor_step(weights, inputs, grads, sdpa_gqa):
    fresh_grads(*weights, *inputs)
    *linear_ins, q, k, v, x_PH, h_PI, offsets_e = inputs
    *linear_ws, gate_up_eFH, down_eHI = weights
    outs = [F.linear(x, w) for x, w in zip(linear_ins, linear_ws, strict=True)]
    outs.append(F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=sdpa_gqa))
    outs.append(F.grouped_mm(x_PH, gate_up_eFH.transpose(1, 2), offs=offsets_e))
    outs.append(F.grouped_mm(h_PI, down_eHI.transpose(1, 2), offs=offsets_e))
    torch.autograd.backward(outs, grads)


def floor_args(model, spec, batch: int, seq_len: int, idx_TK: torch.Tensor) -> tuple:
    """``_floor_step``'s arguments: the layer's own weights, fresh inputs and output gradients, and the grouped
    GEMMs' row counts from ``idx_TK``, the layer's routing (an even split would flatter the floor: CUTLASS tiles
    rows in clusters of 256, so counts of exactly 512 per expert waste nothing, counts around 512 do)."""
    if model.config.model_type not in grouped_experts.GATED_FUSED_FAMILIES:
        raise ValueError(f"the floor path needs HF's fused gate/up expert tensors, not {model.config.model_type}'s")
    layer, T = model.model.layers[0], batch * seq_len
    leaf = functools.partial(torch.randn, device=model.device, dtype=model.dtype, requires_grad=True)
    linears = [m for name, m in layer.named_modules() if isinstance(m, torch.nn.Linear) and ".experts" not in name]
    router = router_of(family_of(model.config), layer)
    linear_ws = [m.weight for m in linears] + [router.weight]
    a = spec.attention
    q = leaf(batch, a.num_heads, seq_len, a.head_dim)
    k = leaf(batch, a.num_kv_heads, seq_len, a.head_dim)
    v = leaf(batch, a.num_kv_heads, seq_len, a.v_head_dim)
    experts = layer.mlp.experts
    P = idx_TK.numel()
    offsets_e = count_ids(idx_TK, spec.num_experts).cumsum(0).int()
    inputs = [leaf(T, w.shape[1]) for w in linear_ws] + [q, k, v, leaf(P, spec.hidden_size)]
    inputs += [leaf(P, experts.down_proj.shape[2]), offsets_e]
    weights = [*linear_ws, experts.gate_up_proj, experts.down_proj]
    outs_shapes = [(T, w.shape[0]) for w in linear_ws] + [(batch, a.num_heads, seq_len, a.v_head_dim)]
    outs_shapes += [(P, experts.gate_up_proj.shape[1]), (P, spec.hidden_size)]
    grads = [torch.randn(shape, device=model.device, dtype=model.dtype) for shape in outs_shapes]
    return weights, inputs, grads, a.num_kv_heads != a.num_heads


def graphed_layer(attention: AttentionStage, experts: ExpertStage, h_BSH: torch.Tensor, ctx) -> tuple:
    """The layer's attention part and expert shard as CUDA graphs (one slot each: a step runs one micro-batch)."""
    graphs = graph_stages(lambda layer: 1, attention=attention, experts=experts)
    graphs.capture_attention(attention, batch=h_BSH.shape[0], seq_len=h_BSH.shape[1], positions=[None])
    with torch.no_grad():
        out = attention.part(0)(h_BSH, ctx, attention.config)
    rows, top_k = out.topk_idx_TK.shape
    graphs.capture_shards(experts, rows=rows, top_k=top_k, weight_dtype=out.topk_w_TK.dtype)
    return graphs.part(attention, 0), graphs.shard(experts, 0)


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


def queued_ahead_seconds(step, *args, iters: int, sleep_cycles: int = 2_000_000_000) -> float | None:
    """Seconds per ``step(*args)`` with the host far ahead: the steps are queued behind a GPU sleep (about a second)
    and timed from its end, so the GPU never waits for a launch; None if the host did not finish queueing before
    the sleep ended (a step that syncs with the device, or a sleep too short). The timed step's time less this is
    the time the GPU sat idle waiting for the host (``idle``), measured without a profiler (which slows replayed
    CUDA graphs, section 14 of docs/performance-log.md)."""
    torch.cuda.synchronize()
    slept, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(sleep_cycles)
    slept.record()
    for _ in range(iters):
        step(*args)
    end.record()
    ahead = not slept.query()
    torch.cuda.synchronize()
    return slept.elapsed_time(end) / 1e3 / iters if ahead else None


def first_line(error: BaseException) -> str:
    """``Type: first line of the message``; dynamo's ``backend='inductor' raised:`` wrapper adds the line after it."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    text = lines[0] if lines else ""
    if text.endswith("raised:") and len(lines) > 1:
        text = f"{text} {lines[1]}"
    return f"{type(error).__name__}: {text}"[:300]


def _without_triton(stage: ExpertStage) -> None:
    """The stage's shards run their middle as inductor compiled it, not as ``triton_swiglu``'s kernels."""
    for shard in stage.modules():
        if isinstance(shard, ExpertShard):
            shard.elementwise = shard.elementwise.without_triton()


def _unfused_fp8_middle(stage: ExpertStage) -> None:
    """The stage's FP8 shards run the same Triton middle, but not as ``fp8_experts``' node: its output and its
    gradient quantized in passes of their own (``grouped_experts.fused_fp8_middle`` fuses a ``TritonSwiGLUOr`` only)."""
    for shard in stage.modules():
        if isinstance(shard, ExpertShard) and isinstance(shard.elementwise.gated, grouped_experts.TritonSwiGLUOr):
            shard.elementwise = replace(shard.elementwise, gated=functools.partial(shard.elementwise.gated.__call__))


def torchao_fp8(layer: torch.nn.Module) -> None:
    """torchao's rowwise FP8 training on an HF decoder layer, in place: the parameters of its attention projections
    and shared experts become torchao's training tensors, whose GEMMs run in FP8; the router and the routed experts
    (see the module docstring) stay in the model's dtype."""
    from torchao.prototype.moe_training.config import Float8TrainingOpConfig
    from torchao.quantization import quantize_

    parts = {"self_attn", "mlp.shared_expert", "mlp.shared_experts"}
    quantize_(layer, Float8TrainingOpConfig(), filter_fn=lambda module, fqn: fqn in parts)


def projection_bf16_width(name: str, fp8_bf16_width: int) -> int:
    """The projections' shape rule an FP8 path runs: the -all path has every projection in FP8, the -experts path
    none, the others ``fp8_bf16_width``."""
    return {"ours-fp8-once-all-compiled": 0, "ours-fp8-once-experts-compiled": 1 << 30}.get(name, fp8_bf16_width)


def build_path(
    name: str,
    model_dir: str,
    spec,
    seq_len: int,
    batch: int,
    *,
    device: str,
    backend: str,
    layer: int = 0,
    fp8_bf16_width: int = BF16_WIDTH,
):
    """``(step, args)`` of one path, compiled where its name says so. Every path gets the same weights and batch
    (the same seed), so the same routing: expert GEMM times depend on how evenly the tokens spread."""
    torch.manual_seed(0)
    experts = "eager" if name == "hf-eager" else "grouped_mm"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    model = one_layer_model(load_config(model_dir), device=device, dtype=dtype, experts=experts, layer=layer)
    hyper = family_of(model.config).hyper  # hyper-connections: the layer's residual has streams, [B, S, hc, H]
    h_BSH = torch.randn(batch, seq_len, model.config.hidden_size, device=device, dtype=model.dtype) * 0.5
    h_BSH = hc.expand(h_BSH, None if hyper is None else hyper.streams(model.config)).requires_grad_()
    grad_BSH = torch.randn_like(h_BSH) * 1e-3
    ctx = build_context(model.config, model.model.rotary_emb, h_BSH, None)
    if any(token_routed_layers(model.config.to_dict())):  # DeepSeek-V4's hash-routed layers route by token id
        ctx = replace(ctx, token_ids=torch.randint(model.config.vocab_size, (batch, seq_len), device=device))
    if name.endswith(("compiled", "graphed")):
        torch._dynamo.reset()
    if name in (
        "ours",
        "ours-compiled",
        "ours-graphed",
        "inductor-compiled",
        "selective-compiled",
        "ours-fp8-compiled",
        "ours-fp8-once-compiled",
        "ours-fp8-once-unfused-compiled",
        "ours-fp8-once-all-compiled",
        "ours-fp8-once-experts-compiled",
    ):
        attention = AttentionStage(model, (0,), with_embedding=False, with_head=False)
        expert_stage = ExpertStage(model, (0,), 0, spec.num_experts)
        if name.startswith("ours-fp8"):  # the widths past which a projection runs in FP8, and the experts
            fp8_stage(attention, projection_bf16_width(name, fp8_bf16_width))
            fp8_stage(expert_stage, expert_bf16_width=EXPERT_BF16_WIDTH if name == "ours-fp8-once-compiled" else 0)
        if name == "selective-compiled":
            apply_selective_recompute(attention)
            apply_selective_recompute(expert_stage)
        if name != "ours":
            with compile_backend(backend):
                compile_stage(attention)
                compile_stage(expert_stage)
            if name == "inductor-compiled":
                _without_triton(expert_stage)
            if name == "ours-fp8-once-unfused-compiled":
                _unfused_fp8_middle(expert_stage)
        params = [*attention.parameters(), *expert_stage.parameters()]
        part, shard = attention.part(0), expert_stage.shard(0)
        if name == "ours-graphed":
            part, shard = graphed_layer(attention, expert_stage, h_BSH, ctx)
        parts = (part, shard, params, model.config, name.startswith("ours-fp8"))
        return _ours_step, (parts, h_BSH, ctx, grad_BSH)
    if name == "floor":
        attention = AttentionStage(model, (0,), with_embedding=False, with_head=False)
        with torch.no_grad():
            idx_TK = attention.part(0)(h_BSH, ctx, model.config).topk_idx_TK
        return _floor_step, floor_args(model, spec, batch, seq_len, idx_TK)
    if name == "hf-fp8-compiled":
        torchao_fp8(model.model.layers[0])
    if name in ("hf-compiled", "hf-fp8-compiled"):
        with compile_backend(backend):
            model.model.layers[0].compile()
    if name == "hf-graphed":
        model.model.layers[0].compile(mode="reduce-overhead")
        return _hf_graphed_step, (model, h_BSH, ctx, grad_BSH)
    return _hf_step, (model, h_BSH, ctx, grad_BSH)


def bench_model(
    model_dir: str,
    seq_len: int,
    batch: int,
    *,
    device: str,
    warmup: int,
    iters: int,
    profile: bool,
    paths: list[str],
    memory_peak: bool = False,
    backend: str = "inductor",
    layer: int = 0,
    fp8_bf16_width: int = BF16_WIDTH,
) -> Iterator[dict]:
    """One row per path, as each is measured (``vs_hf_compiled`` is filled in by ``add_ratios``); the model's
    layer ``layer`` (its attention type), named ``model:layer`` where it is not the first."""
    spec = load_model_spec(model_dir)
    flops_per_token = 3 * (spec.attention_side_flops(seq_len, layer) + spec.expert_side_flops(layer))
    tokens = batch * seq_len
    model_name = Path(model_dir).name + (f":{layer}" if layer else "")
    for name in paths:
        row = {"model": model_name, "layer": layer, "seq_len": seq_len, "batch": batch, "path": name}
        if name.startswith("ours-fp8"):
            row["fp8_bf16_width"] = projection_bf16_width(name, fp8_bf16_width)
        row.update(ms=None, tokens_per_s=None, tflops=None, mfu=None, vs_hf_compiled=None, error=None)
        row.update(built_gib=None, peak_gib=None, held_gib=None, idle=None)
        step = args = None
        scope = cast_once_per_step() if name.startswith("ours-fp8-once") else contextlib.nullcontext()
        with scope:
            try:
                step, args = build_path(
                    name, model_dir, spec, seq_len, batch, device=device, backend=backend, layer=layer,
                    fp8_bf16_width=fp8_bf16_width,
                )  # fmt: skip
                if device == "cuda":  # the steps' peak, not the building's (weights copied into stages)
                    row["built_gib"] = torch.cuda.memory_allocated() / 2**30
                    torch.cuda.reset_peak_memory_stats()
                seconds = time_step(step, *args, warmup=warmup, iters=iters, device=device)
                tflops = flops_per_token * tokens / seconds / 1e12
                row.update(ms=seconds * 1e3, tokens_per_s=tokens / seconds, tflops=tflops, mfu=tflops / PEAK_TFLOPS)
                if device == "cuda":
                    ahead = queued_ahead_seconds(step, *args, iters=iters)
                    row["idle"] = None if ahead is None else max(seconds - ahead, 0.0) / seconds
                    row["peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
                    row["held_gib"] = HeldActivations.measure(step, args)
                if profile and device == "cuda":
                    print(f"--- profile: {row['model']} {seq_len} {name}", flush=True)
                    print_profile(step, args, row["ms"])
                if memory_peak and device == "cuda":
                    print(f"--- memory: {row['model']} {seq_len} {name}", flush=True)
                    print_memory_peak(step, args)
            except Exception as error:  # a path that cannot run is a row of the table, not the end of the run
                traceback.print_exc()
                row["error"] = first_line(error)
        del step, args
        if name.endswith(("compiled", "graphed")):
            torch._dynamo.reset()  # its graphs, and what they hold, go before the next path builds its layer
        gc.collect()
        if device == "cuda":
            torch.cuda.empty_cache()
        yield row


def add_ratios(rows: list[dict]) -> None:
    """``vs_hf_compiled``: tokens/s over hf-compiled's at the same model and sequence length (None where either
    is missing)."""
    base = {(r["model"], r["seq_len"]): r["tokens_per_s"] for r in rows if r["path"] == REFERENCE}
    for r in rows:
        ref = base.get((r["model"], r["seq_len"]))
        r["vs_hf_compiled"] = r["tokens_per_s"] / ref if r["tokens_per_s"] and ref else None


KERNEL_CLASSES = (  # (class, substrings of the op that launched the kernel or of its name), first match wins
    ("expert grouped GEMMs", ("grouped_mm", "GroupProblemShape")),
    (
        "dense GEMMs",
        ("scaled_mm", "aten::mm", "aten::addmm", "aten::bmm", "aten::linear", "aten::matmul", "nvjet", "gemm"),
    ),
    ("SDPA", ("attention", "flash", "sdpa")),
    ("fused (inductor, Triton)", ("triton_", "_swiglu", "SwiGLU")),
    ("gathers, scatters, sort", ("index", "gather", "scatter", "sort", "searchsorted", "take")),
    ("copies, casts", ("copy", "aten::to", "contiguous", "clone", "cat")),
)


def kernel_class(op_name: str, kernel_name: str) -> str:
    """The class of kernel ``kernel_name`` launched inside op ``op_name`` (profile breakdown): by the op, else (a
    compiled graph's own kernels) by the kernel's name."""
    for name in (op_name, kernel_name):
        cls = next((cls for cls, keys in KERNEL_CLASSES if any(k in name for k in keys)), None)
        if cls:
            return cls
    return "other kernels"


def print_profile(step, args, step_ms: float | None = None, top: int = 25) -> None:
    """One step's kernel time by class (from the op that launched each kernel) and its top kernels; with the timed
    ``step_ms``, what the timed step takes beyond this kernel time (idle, and back-to-back steps running at lower
    clocks than this one)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        step(*args)
        torch.cuda.synchronize()
    by_class: dict[str, float] = {}
    by_kernel: dict[str, list[float]] = {}
    for op in prof.events():
        for kernel in op.kernels:
            ms = kernel.duration / 1e3
            cls = kernel_class(op.name, kernel.name)
            by_class[cls] = by_class.get(cls, 0.0) + ms
            by_kernel.setdefault(f"[{cls}] {kernel.name}", []).append(ms)
    busy = sum(by_class.values())
    print(f"{sum(map(len, by_kernel.values()))} kernels, {busy:.2f} ms of kernel time in one step")
    for cls, ms in sorted(by_class.items(), key=lambda kv: -kv[1]):
        print(f"  {ms:8.3f} ms  {ms / busy:6.1%}  {cls}")
    if step_ms is not None:
        print(f"  {step_ms - busy:8.3f} ms idle (the timed step, {step_ms:.2f} ms, less this kernel time)")
    print("  top kernels (total ms, calls):")
    for name, times in sorted(by_kernel.items(), key=lambda kv: -sum(kv[1]))[:top]:
        print(f"  {sum(times):8.3f} {len(times):4d}  {name[:150]}")
    sys.stdout.flush()


def largest_at_peak(trace: list[dict], top: int = 10) -> tuple[int, list[dict]]:
    """``(peak bytes, the ``top`` largest allocations alive then)`` of a CUDA allocator trace (the events of
    ``torch.cuda.memory._snapshot()["device_traces"]``: ``alloc`` and ``free_completed`` with ``addr`` and ``size``),
    counted from the trace's start."""
    size = peak = peak_at = 0
    live: dict[int, dict] = {}
    for i, event in enumerate(trace):
        if event["action"] == "alloc":
            live[event["addr"]] = event
            size += event["size"]
        elif event["action"] == "free_completed" and live.pop(event["addr"], None) is not None:
            size -= event["size"]
        if size > peak:
            peak, peak_at = size, i
    live = {}
    for event in trace[: peak_at + 1]:  # again, up to the peak
        if event["action"] == "alloc":
            live[event["addr"]] = event
        elif event["action"] == "free_completed":
            live.pop(event["addr"], None)
    return peak, sorted(live.values(), key=lambda e: -e["size"])[:top]


SOURCES = ("disagmoe_ds", "transformers", "bench")  # the frames print_memory_peak names an allocation by


def print_memory_peak(step, args, top: int = 12) -> None:
    """The largest allocations alive at one step's memory peak (above what the step started with), each with the
    innermost frame of this project, HF or the bench that made it ("autograd" where no Python frame did: a backward)."""
    torch.cuda.synchronize()
    torch.cuda.memory._record_memory_history(max_entries=1_000_000, stacks="python")
    try:
        step(*args)
        torch.cuda.synchronize()
        trace = torch.cuda.memory._snapshot()["device_traces"][torch.cuda.current_device()]
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    peak, largest = largest_at_peak(trace, top)
    print(f"  memory peak {peak / 2**30:.2f} GiB above the step's start; the largest allocations alive then:")
    for event in largest:
        ours = [f for f in event.get("frames", []) if any(k in f["filename"] for k in SOURCES)]
        where = f"{Path(ours[0]['filename']).name}:{ours[0]['line']} {ours[0]['name']}" if ours else "autograd"
        print(f"  {event['size'] / 2**30:8.3f} GiB  {where}")
    sys.stdout.flush()


def print_table(rows: list[dict]) -> None:
    header = (
        f"{'model':<18}{'seq':>6}{'path':>19}{'ms':>10}{'tok/s':>12}{'TFLOP/s':>10}{'MFU':>7}{'vs hf-compiled':>16}"
        f"{'built GiB':>10}{'peak GiB':>10}{'held GiB':>10}{'idle':>7}"
    )
    print(header)
    for r in rows:
        prefix = f"{r['model']:<18}{r['seq_len']:>6}{r['path']:>19}"
        if r["error"]:
            print(f"{prefix}  failed: {r['error']}")
            continue
        ratio = f"{r['vs_hf_compiled']:>15.2f}x" if r["vs_hf_compiled"] else f"{'-':>16}"
        memory = ("built_gib", "peak_gib", "held_gib")
        peak = "".join(f"{r[k]:>10.2f}" if r[k] is not None else f"{'-':>10}" for k in memory)
        idle = f"{r['idle']:>7.1%}" if r["idle"] is not None else f"{'-':>7}"
        print(
            f"{prefix}{r['ms']:>10.2f}{r['tokens_per_s']:>12.0f}{r['tflops']:>10.1f}{r['mfu']:>7.1%}{ratio}{peak}{idle}",
            flush=True,
        )


def _short(row: dict) -> str:
    return "failed" if row["error"] else f"{row['tokens_per_s']:.0f} tok/s"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", nargs="+", default=["hf_models/Qwen3-30B-A3B"], help="model config directories")
    p.add_argument("--seq-len", type=int, nargs="+", default=[4096])
    p.add_argument("--batch", type=int, default=2, help="sequences per step")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps first (compilation happens in them)")
    p.add_argument("--iters", type=int, default=10, help="steps per timed window (3 windows, median)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="cuda: bf16; cpu: fp32")
    p.add_argument("--profile", action="store_true", help="print the top CUDA kernels of every path")
    p.add_argument(
        "--memory-peak", action="store_true", help="print the largest allocations alive at each path's memory peak"
    )
    p.add_argument(
        "--paths",
        nargs="+",
        choices=PATHS,
        metavar="PATH",
        help=f"{', '.join(PATHS)} (default: all; on CPUs all but {', '.join(CUDA_ONLY)})",
    )
    p.add_argument("--compile-backend", default="inductor", help="torch.compile backend (aot_eager: CPU tests)")
    p.add_argument(
        "--layer",
        type=int,
        default=0,
        help="which of the model's layers to build, for its attention type (config.layer_types: Qwen3.5's "
        "full_attention layers are 3, 7, ...); always made MoE. Default 0",
    )
    p.add_argument(
        "--fp8-bf16-width",
        type=int,
        default=BF16_WIDTH,
        help="the FP8 paths' shape rule (the config's \"fp8_bf16_width\"): a projection with a side of at most this "
        f"stays bf16 (default {BF16_WIDTH}; the -all and -experts paths fix their own)",
    )
    p.add_argument("--json", metavar="PATH", help="also write the rows as JSON")
    a = p.parse_args(argv)
    a.paths = a.paths or paths_for(a.device)
    rows = []
    for model_dir in a.model:
        for seq_len in a.seq_len:
            for row in bench_model(
                model_dir,
                seq_len,
                a.batch,
                device=a.device,
                warmup=a.warmup,
                iters=a.iters,
                profile=a.profile,
                paths=a.paths,
                memory_peak=a.memory_peak,
                backend=a.compile_backend,
                layer=a.layer,
                fp8_bf16_width=a.fp8_bf16_width,
            ):
                rows.append(row)
                add_ratios(rows)
                print(f"{row['model']} {seq_len} {row['path']}: {_short(row)}", flush=True)
                if a.json:  # after every row: a run cut short keeps what it measured
                    Path(a.json).write_text(json.dumps(rows, indent=2))
    print_table(rows)
    return 1 if any(r["error"] for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
