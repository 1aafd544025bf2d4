"""The grouped-GEMM expert path equals HF's per-expert loop (the slow, obviously correct reference)."""

from __future__ import annotations

import pytest
import torch

from disagmoe_ds.afpipe.expert_runner import warm_up_cases, warm_up_ids
from disagmoe_ds.models import grouped_experts
from disagmoe_ds.models.grouped_experts import GATED_FUSED_FAMILIES
from disagmoe_ds.models.loading import load_model
from disagmoe_ds.models.parts import ExpertStage, compile_stage

FAMILY_DIRS = {
    "qwen2_moe": "qwen2-moe",
    "qwen3_moe": "qwen3-moe",
    "mixtral": "mixtral",
    "olmoe": "olmoe",
    "deepseek_v2": "deepseek-v2",
    "deepseek_v3": "deepseek-v3",
    "deepseek_v32": "deepseek-v32",
    "glm4_moe": "glm4-moe",
    "qwen3_next": "qwen3-next",
    "qwen3_5_moe_text": "qwen3.5-moe",
    "ernie4_5_moe": "ernie4.5-moe",
    "hunyuan_v1_moe": "hunyuan-v1-moe",
    "dots1": "dots1",
    "minimax_m2": "minimax-m2",
    "deepseek_v4": "deepseek-v4",
}
TOL = 1e-5  # fp32; only the GEMM kernels and the summation order differ


def _routed_case(tiny_checkpoint, family: str, case: str, **overrides):
    """A shard of half the experts of ``family``'s first MoE layer and routed rows for ``case``."""
    model = load_model(tiny_checkpoint(FAMILY_DIRS[family], **overrides))
    model.set_experts_implementation("eager")  # the per-expert loop
    layer = next(i for i, lay in enumerate(model.model.layers) if hasattr(lay.mlp, "experts"))
    num_experts = model.model.layers[layer].mlp.experts.gate_up_proj.shape[0]
    half = num_experts // 2
    shard = ExpertStage(model, (layer,), 0, half).shard(layer)  # half the experts: ids >= half are sentinels
    torch.manual_seed(0)
    rows, k = (0 if case == "empty" else 9), 2
    high = num_experts if case == "sentinels" else half
    idx = torch.randint(0, high, (rows, k)).clamp(max=half)  # values == half are the sentinel
    if case == "one-expert":
        idx[:, 0] = 1
    x = torch.randn(rows, model.config.hidden_size, requires_grad=True)
    w = torch.rand(rows, k, requires_grad=True)
    return shard, x, idx, w, int((idx < half).sum())


def _assert_close(shard, x, w, fast, ref, tol: float = TOL) -> None:
    assert (fast - ref).abs().max().item() <= tol
    g = torch.randn_like(fast)
    grads_fast = torch.autograd.grad(fast, [x, w, *shard.parameters()], g, allow_unused=True)
    grads_ref = torch.autograd.grad(ref, [x, w, *shard.parameters()], g, allow_unused=True)
    for a, b in zip(grads_fast, grads_ref):
        a = torch.zeros_like(b) if a is None and b is not None else a
        b = torch.zeros_like(a) if b is None and a is not None else b
        if a is not None:
            assert (a - b).abs().max().item() <= tol


@pytest.mark.parametrize("family", GATED_FUSED_FAMILIES)
@pytest.mark.parametrize("case", ["random", "sentinels", "one-expert", "empty"])
@pytest.mark.parametrize("pairs_known", [False, True], ids=["pairs-read", "pairs-given"])
def test_grouped_equals_hf_loop(tiny_checkpoint, family, case, pairs_known):
    shard, x, idx, w, num_pairs = _routed_case(tiny_checkpoint, family, case)
    fast = shard(x, idx, w, num_pairs if pairs_known else None)
    ref = shard.forward_hf(x, idx, w)
    if x.shape[0] == 0:
        assert fast.shape == ref.shape == (0, x.shape[1])
        return
    _assert_close(shard, x, w, fast, ref)


def _poisoning_tail(grouped_mm):
    """``_grouped_mm`` whose output rows past the last offset are NaN: what a CUDA kernel may leave in rows it
    never writes (CPU's fills them), so the bounded path must mask them, not multiply them by zero."""

    def poisoned(x_PD, w_eDN, offsets_e):
        out = grouped_mm(x_PD, w_eDN, offsets_e).clone()
        if out.dim() == 2:  # rows (not the per-expert weight gradients of the recomputed backward)
            out[int(offsets_e[-1]) :] = float("nan")
        return out

    return poisoned


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3"])
@pytest.mark.parametrize("case", ["random", "sentinels", "one-expert", "empty"])
@pytest.mark.parametrize("recompute", [False, True], ids=["saved", "recomputed"])
def test_bounded_pairs_equal_hf_loop(tiny_checkpoint, monkeypatch, family, case, recompute):
    """At a fixed capacity (``routing.Capacity``) the shard gets only a bound on its pairs, padded with sentinel
    rows: the grouped path sizes its buffers by the bound and still gives HF's outputs and gradients, with the
    unwritten GEMM rows poisoned, a fully padded row included."""
    monkeypatch.setattr(grouped_experts, "_grouped_mm", _poisoning_tail(grouped_experts._grouped_mm))
    shard, x, idx, w, num_pairs = _routed_case(tiny_checkpoint, family, case)
    half = shard.num_local
    pad = 3  # padding rows: every id the sentinel, weight 0 (what a lane sends below the capacity)
    x = torch.cat([x.detach(), torch.randn(pad, x.shape[1])]).requires_grad_()
    idx = torch.cat([idx, torch.full((pad, idx.shape[1]), half)])
    w = torch.cat([w.detach(), torch.zeros(pad, w.shape[1])]).requires_grad_()
    shard.recompute = recompute
    fast = shard(x, idx, w, num_pairs + 5, bounded=True)  # "empty": padding only, no real pair at all
    assert torch.isfinite(fast).all() and not fast[-pad:].any()
    _assert_close(shard, x, w, fast, shard.forward_hf(x, idx, w) + x * 0)  # + x * 0: a graph when nothing routes


@pytest.mark.parametrize("recompute", [False, True], ids=["saved", "recomputed"])
def test_clamped_swiglu_equals_hf_loop(tiny_checkpoint, recompute):
    """DeepSeek-V4 clamps its SwiGLU (``swiglu_limit``; HF's ``_apply_gate``): at a limit most gate and up values
    exceed, the grouped path (and its recomputed middle) still gives HF's outputs and gradients."""
    shard, x, idx, w, num_pairs = _routed_case(tiny_checkpoint, "deepseek_v4", "random", swiglu_limit=0.05)
    x = (x.detach() * 3).requires_grad_()  # gate/up values of about 0.5: most clamped
    gate_up = x @ shard.experts.gate_up_proj[0].t()
    assert (gate_up.abs() > 0.05).float().mean() > 0.5
    shard.recompute = recompute
    _assert_close(shard, x, w, shard(x, idx, w, num_pairs), shard.forward_hf(x, idx, w))


def test_bounded_pairs_past_the_bound_are_dropped_not_a_crash(tiny_checkpoint):
    """An overflow (more real pairs than the bound) computes the first pairs only; the step that saw it is run
    again at a larger capacity, so the result only has to be finite."""
    shard, x, idx, w, num_pairs = _routed_case(tiny_checkpoint, "qwen3_moe", "random")
    out = shard(x, idx, w, num_pairs - 4, bounded=True)
    assert out.shape == x.shape and torch.isfinite(out).all()
    out.sum().backward()


@pytest.mark.parametrize("case", ["random", "sentinels"])
def test_compiled_fusions_equal_eager(tiny_checkpoint, case):
    """``compile_stage`` (fused activation and gather-sum un-permute, held by the shard) computes what the eager
    path does, and changes no other shard."""
    shard, x, idx, w, _ = _routed_case(tiny_checkpoint, "qwen3_moe", case)
    other, *_ = _routed_case(tiny_checkpoint, "qwen3_moe", case)
    # The row count changes between micro-batches: the compiled graphs go dynamic after the first change.
    calls = [(x[:r], idx[:r], w[:r], int((idx[:r] < shard.num_local).sum())) for r in (9, 7, 5)]
    eager = [shard(*call) for call in calls]
    compile_stage(shard)
    assert shard.elementwise is grouped_experts.compiled_elementwise()
    assert other.elementwise is grouped_experts.EAGER
    for call, ref in zip(calls, eager, strict=True):
        _assert_close(shard, x, w, shard(*call), ref)


def test_compiled_fusions_stay_compiled_across_the_warm_up_cases(tiny_checkpoint):
    """Forward and backward over every row/pair case the expert runner warms up: the compiled gather-and-sum keeps
    within dynamo's recompile limit (past it, a case silently runs eager for the rest of the job, as the gradient
    flag of its input once made it on 4 H200s)."""
    shard, *_ = _routed_case(tiny_checkpoint, "qwen3_moe", "random")
    compile_stage(shard)
    torch._dynamo.reset()
    hidden, top_k = shard.experts.gate_up_proj.shape[-1], 2
    for rows, pattern in warm_up_cases(16):
        x = torch.randn(rows, hidden, requires_grad=True)
        idx = warm_up_ids(rows, top_k, shard.num_local, pattern, x.device)
        w = torch.rand(rows, top_k, requires_grad=True)
        out = shard(x, idx, w, int((idx < shard.num_local).sum()))
        torch.autograd.grad(out.sum(), [x, w], allow_unused=True)
    entries = torch._dynamo.eval_frame._debug_get_cache_entry_list(grouped_experts._sum_slots_fusable.__code__)
    assert 0 < len(entries) < torch._dynamo.config.recompile_limit


@pytest.mark.parametrize("family", GATED_FUSED_FAMILIES)
def test_every_grouped_family_gets_the_triton_middle(tiny_checkpoint, family):
    """Every grouped family's activation is one the Triton SwiGLU computes, so on CUDA none falls back unnoticed
    (a transformers release that renamed its SiLU class would otherwise slow them silently)."""
    shard, *_ = _routed_case(tiny_checkpoint, family, "random")
    assert grouped_experts.is_silu(shard.experts.act_fn)
    assert not grouped_experts.is_silu(torch.nn.GELU())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the unwritten GEMM rows are a CUDA kernel's (0 GPUs)")
@pytest.mark.parametrize("case", ["sentinels", "empty"])
@pytest.mark.parametrize("recompute", [False, True], ids=["saved", "recomputed"])
def test_bounded_pairs_on_cuda_equal_exact_pairs(tiny_checkpoint, case, recompute):
    """On a GPU in bf16, where the grouped GEMMs really leave the rows past the real pairs unwritten: a padded
    message at a bound gives the outputs and gradients of the same rows with their exact pair count ("empty":
    padding only, the one case where a sum reads an unwritten row)."""
    shard, x, idx, w, num_pairs = _routed_case(tiny_checkpoint, "qwen3_moe", case)
    shard = shard.to("cuda", torch.bfloat16)
    shard.recompute = recompute
    pad = 5
    x = torch.cat([x.detach(), torch.randn(pad, x.shape[1])]).to("cuda", torch.bfloat16).requires_grad_()
    idx = torch.cat([idx, torch.full((pad, idx.shape[1]), shard.num_local)]).cuda()
    w = torch.cat([w.detach(), torch.zeros(pad, w.shape[1])]).cuda().requires_grad_()
    g = torch.randn(x.shape, device="cuda", dtype=torch.bfloat16)
    outs = []
    for pairs, bounded in ((num_pairs, False), (num_pairs + 7, True)):
        y = shard(x, idx, w, pairs, bounded=bounded)
        inputs = [x, w, *shard.parameters()]
        grads = torch.autograd.grad(y, inputs, g, allow_unused=True)  # "empty", exact: w unused
        outs.append([y, *(torch.zeros_like(t) if d is None else d for t, d in zip(inputs, grads))])
    for exact, padded in zip(*outs, strict=True):
        assert torch.isfinite(padded).all() and torch.allclose(exact.float(), padded.float(), atol=1e-2, rtol=1e-2)
