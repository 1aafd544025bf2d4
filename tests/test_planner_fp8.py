"""``disagmoe-plan --fp8`` (issue 42): the FP8 lever priced in both systems. The exchange's x payload halves, the FP8
GEMMs run at bf16 time over the measured factors (checked against hand arithmetic from ``FP8_SPEEDUP``), the
quantize passes are one read + write per element at HBM bandwidth, a written ds_config carries the lever, and bf16
plans are what they were (every other planner test pins them)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from disagmoe_ds.capabilities.rules import check
from disagmoe_ds.config import DisagMoEConfig
from disagmoe_ds.config.levers import job_of
from disagmoe_ds.planner.cli import build_parser, main
from disagmoe_ds.planner.cluster import Efficiency, preset
from disagmoe_ds.planner.colocated_costs import alltoall_s
from disagmoe_ds.planner.fp8_costs import PASS_BYTES, Fp8, a_side_passes, expert_lever, expert_passes, fp8_speedup
from disagmoe_ds.planner.gemm_efficiency import shape_rates
from disagmoe_ds.planner.lora import LoRA
from disagmoe_ds.planner.model import load_model_spec
from disagmoe_ds.planner.part_times import attention_call_s, attention_wgrad_s, expert_call_s, expert_wgrad_s
from disagmoe_ds.planner.plans import AfPlan, BaselinePlan
from disagmoe_ds.planner.report import _fp8_text
from disagmoe_ds.planner.workload import Workload

MODELS = Path(__file__).resolve().parent.parent / "hf_models"


def _spec(name: str):
    return load_model_spec(MODELS / name)


@pytest.mark.parametrize("name", ["Qwen3-30B-A3B", "DeepSeek-V3"])
def test_the_m2n_payload_halves_under_fp8_and_nothing_else_moves(name):
    spec = _spec(name)
    h, k = spec.hidden_size, spec.top_k
    bf16, fp8 = spec.wire_bytes_per_token(8), spec.wire_bytes_per_token(8, fp8=True)
    ranks = spec.distinct_ranks_per_token(8)
    assert bf16.m2n == pytest.approx(ranks * (2 * h + 8 * k))  # bf16 row, int32 id and fp32 weight per expert
    assert fp8.m2n == pytest.approx(ranks * (h + 4 + 8 * k))  # e4m3 row and its float32 scale
    assert (fp8.m2n - ranks * 8 * k) / (bf16.m2n - ranks * 8 * k) == pytest.approx((h + 4) / (2 * h))
    for channel in ("n2m", "n2m_grad", "m2n_grad", "resid", "resid_grad"):  # the combine and grads stay bf16
        assert getattr(fp8, channel) == getattr(bf16, channel), channel


def test_the_co_located_dispatch_halves_and_its_combine_does_not():
    spec, cluster = _spec("DeepSeek-V3"), preset("h800", 32)
    rates, work = shape_rates(cluster, Efficiency(), spec), Workload(4096, 1)
    for dispatcher in ("alltoall", "deepep"):
        bf16 = alltoall_s(spec, work, ep=64, cluster=cluster, rates=rates, dispatcher=dispatcher)
        fp8 = alltoall_s(spec, work, ep=64, cluster=cluster, rates=rates, dispatcher=dispatcher, fp8=True)
        assert fp8 / bf16 == pytest.approx((7168 + 4 + 4) / (2 * 7168 + 4))  # a copy: row (+ scale) + probability


# (model, expert width I, hand arithmetic from FP8_SPEEDUP: gate_up is 4HI of an expert's 6HI FLOPs, down 2HI)
EXPERT_SHARES = [
    ("Qwen3-30B-A3B", 768, 4 / 6 / 1.27 + 2 / 6 / 1.06),  # 0.8394
    ("DeepSeek-V3", 2048, 4 / 6 / 1.42 + 2 / 6 / 1.34),  # 0.7182
]


@pytest.mark.parametrize(("name", "width", "share"), EXPERT_SHARES)
def test_the_expert_gemms_drop_by_the_tables_factors_and_their_weight_grads_do_not(name, width, share):
    spec = _spec(name)
    assert spec.expert_intermediate == width
    rates, tokens, layer = shape_rates(preset("h800", 4), Efficiency(), spec), 8192.0, spec.num_layers - 1
    fp8 = Fp8(shards=8)
    passes = expert_passes(spec, rates, assignments=tokens * spec.top_k, fp8=fp8)
    fwd, bwd = expert_call_s(spec, rates, layer=layer, tokens=tokens, recompute="none")
    fwd8, bwd8 = expert_call_s(spec, rates, layer=layer, tokens=tokens, recompute="none", fp8=fp8)
    wgrad = expert_wgrad_s(spec, rates, layer=layer, tokens=tokens)
    wgrad8 = expert_wgrad_s(spec, rates, layer=layer, tokens=tokens, fp8=fp8)
    assert (fwd8 - passes.fwd) / fwd == pytest.approx(share)
    assert passes.wgrad == pytest.approx(passes.dgrad)  # the experts' dW stays bf16: its input dequantized, H a row
    assert wgrad8 == pytest.approx(wgrad + passes.wgrad)
    assert (bwd8 - passes.bwd - wgrad) / (bwd - wgrad) == pytest.approx(share)  # input grads at the forward's factor


def test_the_projections_drop_by_the_dense_factor_and_the_router_does_not():
    spec = _spec("Qwen3-30B-A3B")
    rates, tokens, layer = shape_rates(preset("h800", 4), Efficiency(), spec), 4096.0, 0
    h, q, kv = spec.hidden_size, 32 * 128, 4 * 128  # 32 query heads, 4 KV heads of 128; no shared experts
    projections, router = 2 * (h * q + 2 * h * kv + q * h), 2 * h * spec.num_experts
    assert fp8_speedup("projection") == 1.77
    every = Fp8(bf16_width=0)  # every projection in FP8, narrow as Qwen3-30B-A3B's are (the shape rule's test below)
    passes = a_side_passes(spec, rates, layer=layer, tokens=tokens, lora=Workload(1, 1).lora, fp8=every)
    fwd, _ = attention_call_s(spec, rates, seq_len=4096, layer=layer, tokens=tokens, recompute="none")
    fwd8, _ = attention_call_s(spec, rates, seq_len=4096, layer=layer, tokens=tokens, recompute="none", fp8=every)
    saved = rates.attention_fwd.per_flop * tokens * projections * (1 - 1 / 1.77)
    assert fwd - (fwd8 - passes.fwd) == pytest.approx(saved)
    assert router == spec.router_flops()  # priced at the bf16 rate: the difference above is the projections' alone
    wgrad = attention_wgrad_s(spec, rates, layer=layer, tokens=tokens)
    wgrad8 = attention_wgrad_s(spec, rates, layer=layer, tokens=tokens, fp8=every)
    assert wgrad - (wgrad8 - passes.wgrad) == pytest.approx(saved)  # the weight grads are FP8 on the attention side


@pytest.mark.parametrize("name", ["Qwen3-30B-A3B", "DeepSeek-V3"])
def test_the_planner_prices_fp8_only_on_projections_the_runtime_puts_in_fp8(name):
    """The shape rule the runtime applies (``fp8.shapes.fp8_pays``, ``"fp8_bf16_width"``): Qwen3-30B-A3B's attention
    (H = 2,048) stays bf16, so FP8 saves nothing on it and adds only the exchange's pass over the routed rows;
    DeepSeek-V3's projections save by exactly those past 2,048 wide, each priced at the dense factor."""
    from disagmoe_ds.fp8.shapes import fp8_pays
    from disagmoe_ds.planner.lora import mixer_projections, mlp_projections

    spec = _spec(name)
    rates, tokens, layer = shape_rates(preset("h800", 4), Efficiency(), spec), 4096.0, spec.num_layers - 1
    wide = [(k, n) for k, n in mixer_projections(spec, layer) + mlp_projections(spec, layer) if fp8_pays(k, n)]
    assert (name == "DeepSeek-V3") == bool(wide)  # DeepSeek-V3's output projection, 16,384 -> 7,168, and its kv_b
    passes = a_side_passes(spec, rates, layer=layer, tokens=tokens, lora=Workload(1, 1).lora, fp8=Fp8())
    fwd, _ = attention_call_s(spec, rates, seq_len=4096, layer=layer, tokens=tokens, recompute="none")
    fwd8, _ = attention_call_s(spec, rates, seq_len=4096, layer=layer, tokens=tokens, recompute="none", fp8=Fp8())
    saved = rates.attention_fwd.per_flop * tokens * sum(2 * k * n for k, n in wide) * (1 - 1 / 1.77)
    assert fwd - (fwd8 - passes.fwd) == pytest.approx(saved)
    exchange, weights = tokens * spec.hidden_size, sum(k * n for k, n in wide)
    assert passes.fwd * rates.hbm_bw == pytest.approx(
        PASS_BYTES * (tokens * sum(k for k, _ in wide) + exchange + weights)
    )


@pytest.mark.parametrize("name", ["Qwen3-30B-A3B", "Qwen3-235B-A22B", "DeepSeek-V3", "Mixtral-8x7B"])
def test_the_planner_prices_fp8_experts_only_where_the_runtime_runs_them(name):
    """The experts' shape rule (``fp8.shapes.experts_fp8_pay``): the planner's verdict is the runtime's, from the
    same config, and experts left in bf16 cost under ``--fp8`` what they cost in bf16."""
    from disagmoe_ds.models.loading import load_config
    from disagmoe_ds.models.parts import experts_in_fp8

    spec, work = _spec(name), Workload(4096, 1, fp8=True)
    lever = expert_lever(spec, work, 8)
    assert (
        (lever is not None) == experts_in_fp8(load_config(MODELS / name)) == (name in ("DeepSeek-V3", "Mixtral-8x7B"))
    )
    assert expert_lever(spec, Workload(4096, 1, fp8=True, fp8_expert_bf16_width=0), 8) is not None
    assert expert_lever(spec, Workload(4096, 1), 8) is None
    assert ("experts' GEMMs stay bf16" in _fp8_text(spec, work)) == (lever is None)  # the plan's workload line


def test_a_quantize_pass_reads_two_bytes_and_writes_one_per_element_at_hbm_bandwidth():
    spec = _spec("Qwen3-30B-A3B")
    rates, h, i = shape_rates(preset("h800", 4), Efficiency(), spec), 2048, 768
    assert PASS_BYTES == 3
    one, two = (expert_passes(spec, rates, assignments=a, fp8=Fp8(4)) for a in (1.0, 2.0))
    # per assignment: the received row dequantized and gate_up's input quantized (2H); down's input comes out of the
    # SwiGLU middle in FP8 (models.fp8_experts); in the input-grad only down's output grad is quantized (H), and the
    # weight-grad dequantizes gate_up's input (H)
    assert one.fwd * rates.hbm_bw == pytest.approx(3 * 2 * h)  # no weights: they are cast once a step
    assert (one.dgrad * rates.hbm_bw, one.wgrad * rates.hbm_bw) == pytest.approx((3 * h, 3 * h))
    # LoRA on the experts takes the unfused path: the middle's quantizations are passes of their own (I, 2I)
    adapted = expert_passes(spec, rates, assignments=1.0, fp8=Fp8(4), lora=LoRA(rank=8))
    assert (adapted.fwd * rates.hbm_bw, adapted.bwd * rates.hbm_bw) == pytest.approx(
        (3 * (2 * h + i), 3 * (2 * h + 2 * i))
    )


def test_the_expert_weights_are_cast_once_a_step_and_their_copies_held_for_it():
    """The F rank's step carries two passes over its expert weights (rowwise and transposed, 3 B each) and its memory
    their two FP8 bytes a parameter; the A rank's step and the bf16 plan are unchanged. Qwen3-30B-A3B's experts run
    FP8 here only with ``"fp8_expert_bf16_width"`` 0: by the default rule they stay bf16, with nothing of it."""
    from disagmoe_ds.layout import Layout
    from disagmoe_ds.planner.memory import ffn_rank_memory
    from disagmoe_ds.planner.optimizer_step import af_optimizer_s
    from disagmoe_ds.planner.training_state import ffn_rank_params

    spec = _spec("Qwen3-30B-A3B")
    rates = shape_rates(preset("h800", 4), Efficiency(), spec)
    layout = Layout(attention_gpus=16, ffn_gpus=16, depth=4, num_layers=48, num_experts=128)
    work, work8 = Workload(4096, 1), Workload(4096, 1, fp8=True, fp8_expert_bf16_width=0)
    weights = ffn_rank_params(spec, layout, 0).trained  # 12 layers x 32 experts, all trained
    by_rule = Workload(4096, 1, fp8=True)
    assert af_optimizer_s(spec, layout, by_rule, rates) == af_optimizer_s(spec, layout, work, rates)
    assert ffn_rank_memory(spec, layout, by_rule) == ffn_rank_memory(spec, layout, work)
    (a, f), (a8, f8) = af_optimizer_s(spec, layout, work, rates), af_optimizer_s(spec, layout, work8, rates)
    assert a8 == a and (f8 - f) * rates.hbm_bw == pytest.approx(2 * 3 * weights)
    mem, mem8 = ffn_rank_memory(spec, layout, work), ffn_rank_memory(spec, layout, work8)
    assert mem8.state - mem.state == pytest.approx(2 * weights)
    # the rows kept for dW: each received row once in e4m3 with its scale (H + 4 bytes), not each pair's 2H bytes,
    # with selective recompute too (the FP8 node re-runs the gate/up GEMM from those bytes)
    assignments = 4 * 4096 * spec.top_k / 4  # an A-group's 4 lanes of 4,096 tokens, over its F-group's EP 4
    received = 4 * 4096 * spec.distinct_ranks_per_token(4) / 4
    saving = 12 * (assignments * 2 * 2048 - received * (2048 + 4))  # its 12 layers
    assert mem.activations_per_micro_batch - mem8.activations_per_micro_batch == pytest.approx(saving)
    selective = Workload(4096, 1, fp8=True, fp8_expert_bf16_width=0, recompute="selective")
    selective16 = Workload(4096, 1, recompute="selective")
    assert ffn_rank_memory(spec, layout, selective16).activations_per_micro_batch - ffn_rank_memory(
        spec, layout, selective
    ).activations_per_micro_batch == pytest.approx(saving)


def _step(name: str, nodes: int, seq_len: int, *flags: str) -> tuple[AfPlan, BaselinePlan]:
    """(AF-Pipe, co-located) plan of a cell of the study (8 x H800 nodes), planned as `disagmoe-plan study [--fp8]`
    plans it (one simulated AF-Pipe family per variant set and plain A-lanes, for speed)."""
    from disagmoe_ds.planner.allocator import plan
    from disagmoe_ds.planner.study import Cell, cell_request

    cell, plain_lanes = Cell(name, nodes, seq_len), ((1,), (1,))
    result = plan(cell_request(cell, MODELS, per_variant_set=1, lanes=plain_lanes, fp8="--fp8" in flags))
    assert result.af is not None and result.baseline is not None
    return result.af, result.baseline


def test_an_fp8_plan_steps_faster_than_the_bf16_plan_on_the_studys_cluster():
    """DeepSeek-V3 on 32 nodes at 16K: both systems' steps drop. AF-Pipe's expert side, whose training state takes
    most of its memory, has no room for the step's FP8 weight copies and casts in every call; the baseline keeps them.
    AF-Pipe gains less (2.4%, the baseline 8.5%, at this test's plans) since the shape rule keeps DeepSeek-V3's
    narrow projections (q_a, kv_a, the shared expert: one side at most 2,048 wide) in bf16."""
    af, base = _step("DeepSeek-V3", 32, 16384)
    af8, base8 = _step("DeepSeek-V3", 32, 16384, "--fp8")
    assert af8.step_time_s < 0.985 * af.step_time_s and base8.step_time_s < 0.93 * base.step_time_s
    assert af8.candidate.work.fp8_cast_per_call and not base8.candidate.work.fp8_cast_per_call


def _write(tmp_path: Path, capsys, *flags: str) -> dict:
    ds = tmp_path / "ds.json"
    model = str(MODELS / "DeepSeek-MoE-16B")
    rc = main(["--model", model, "--seq-len", "4096", "--nodes", "2", *flags, "--write-ds-config", str(ds)])
    assert rc == 0, capsys.readouterr().err
    return json.loads(ds.read_text())


@pytest.mark.parametrize("mode", ["disaggregated", "colocated"])
def test_a_written_ds_config_carries_fp8_and_the_runtime_accepts_it(tmp_path, capsys, mode):
    written = _write(tmp_path, capsys, "--fp8", "--write-mode", mode)
    assert written["disagmoe"]["fp8"] is True
    cfg = DisagMoEConfig.from_ds_config(written)
    assert cfg.fp8
    check(job_of(None, cfg, written))
    assert "fp8" not in _write(tmp_path, capsys, "--write-mode", mode)["disagmoe"]


def test_help_explains_the_flag_and_refused_families_are_refused(capsys):
    text = " ".join(build_parser().format_help().split())
    assert "--fp8 price the runtime's FP8 lever in both systems" in text
    assert 'writes "fp8": true' in text and "weight grads stay at the bf16 rate" in text
    rc = main(["--model", str(MODELS / "GPT-OSS-120B"), "--seq-len", "4096", "--nodes", "2", "--fp8"])
    assert rc == 2 and '--fp8: "disagmoe.fp8" does not work with the gpt_oss model' in capsys.readouterr().err


def test_each_fp8_memory_variant_comes_again_without_the_weight_copies_and_the_runtime_takes_it():
    from disagmoe_ds.planner.variants import memory_variants, savings

    bf16 = memory_variants(Workload(4096, 1), ("none", "full"), frozenset({"resend"}))
    fp8 = memory_variants(Workload(4096, 1, fp8=True), ("none", "full"), frozenset({"resend"}))
    assert len(fp8) == 2 * len(bf16) and sum(w.fp8_cast_per_call for w in fp8) == len(bf16)
    # experts left in bf16 by the shape rule keep no FP8 copies: no variant without them
    bf16_experts = memory_variants(Workload(4096, 1, fp8=True), ("none", "full"), frozenset({"resend"}), False)
    assert len(bf16_experts) == len(bf16) and not any(w.fp8_cast_per_call for w in bf16_experts)
    assert "FP8 cast per call" in savings(next(w for w in fp8 if w.fp8_cast_per_call))
    section = {"attention_gpus": 1, "ffn_gpus": 1, "fp8": True, "fp8_cast_per_call": True}
    cfg = DisagMoEConfig.from_ds_config({"disagmoe": section})
    assert cfg.fp8 and not cfg.fp8_cast_once


def test_the_co_located_plan_keeps_its_fp8_experts_rows_in_e4m3_too():
    """Both systems are priced alike: a co-located rank's FP8 experts keep their permuted input for dW in e4m3, H + 4
    bytes an assignment instead of 2H (TE's and our grouped GEMMs keep the FP8 operand), recompute none and
    selective; nothing changes where the experts stay bf16 or full recompute keeps only layer inputs."""
    from disagmoe_ds.planner.colocated_costs import Shape
    from disagmoe_ds.planner.memory import baseline_rank_memory

    spec = _spec("Qwen3-30B-A3B")
    shape = Shape(pp=1, vpp=1, tp=1, cp=1, ep=8, overlap="partial")

    def activations(**kw) -> float:
        return baseline_rank_memory(
            spec, Workload(4096, 1, **kw), shape, world_size=8, chunks_alive=1
        ).activations_per_micro_batch

    saving = 4096 * spec.top_k * (2 * 2048 - (2048 + 4)) * sum(spec.moe_layers)
    for recompute in ("none", "selective"):
        bf16 = activations(recompute=recompute)
        assert bf16 - activations(recompute=recompute, fp8=True, fp8_expert_bf16_width=0) == pytest.approx(saving)
        assert activations(recompute=recompute, fp8=True) == bf16  # the experts' rule keeps them bf16
    assert activations(recompute="full", fp8=True, fp8_expert_bf16_width=0) == activations(recompute="full")
