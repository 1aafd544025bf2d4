"""disagmoe-plan: FLOP/param/memory model, allocator decisions, both simulators, the CLI and the profile command."""

from __future__ import annotations

import doctest
import importlib
import itertools
import json
import math
import os
import pkgutil
import re
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

import disagmoe_ds.planner as planner_package
from disagmoe_ds.config import DisagMoEConfig
from disagmoe_ds.errors import ConfigError, UnsupportedModelError
from disagmoe_ds.layout import Layout
from disagmoe_ds.planner import (
    Cluster,
    Efficiency,
    ModelSpec,
    PartModel,
    PlanRequest,
    Precision,
    Rates,
    Workload,
    causal_pairs,
    load_cluster,
    load_model_spec,
    megatron_order,
    plan,
    preset,
    save_cluster,
    simulate_baseline,
)
from disagmoe_ds.planner.cli import main
from disagmoe_ds.planner.memory import attention_rank_memory, ffn_rank_memory
from disagmoe_ds.planner.runtime_costs import runtime_costs
from disagmoe_ds.planner.simulate import BaselineChunkCosts, baseline_closed_form
from disagmoe_ds.schedule import PipeShape, check_streams, generate

ROOT = Path(__file__).resolve().parent.parent
TINY = ("qwen2-moe", "qwen3-moe", "mixtral", "deepseek-v2", "deepseek-v3", "gpt-oss", "olmoe")
TINY += ("qwen3-next", "qwen3.5-moe")  # hybrid: linear-attention layers beside full ones
TINY += ("ernie4.5-moe", "hunyuan-v1-moe", "dots1", "minimax-m2")
TINY += ("deepseek-v4",)  # hyper-connections (attn_hc, ffn_hc, hc_head), compressors and indexers
# FLOP identities are exact integer arithmetic up to float rounding of the s^2/2 term.
FLOP_RTOL = 1e-12
# The bound for the memory model against what PyTorch allocates.
MEMORY_RTOL = 0.15

TINY_QWEN3 = {
    "model_type": "qwen3_moe",
    "hidden_size": 64,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "vocab_size": 128,
    "intermediate_size": 96,
    "moe_intermediate_size": 32,
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "mlp_only_layers": [0],
}


# ----- FLOPs -----
def test_flops_by_hand_on_a_tiny_config():
    spec = ModelSpec.from_config(TINY_QWEN3)
    s = 16
    # q, k, v, o: 2*64*64 + 2*2*64*32 + 2*64*64
    assert spec.attention_projection_flops() == 8192 + 8192 + 8192
    # s^2/2 = 128 pairs per sequence -> 8 per token; a pair costs 2 * 4 heads * (16 + 16)
    assert spec.attention_core_flops(s, 1) == 8 * 256
    assert spec.router_flops() == 2 * 64 * 8
    assert spec.routed_flops_per_token() == 2 * 6 * 64 * 32
    assert spec.dense_mlp_flops() == 6 * 64 * 96
    assert spec.moe_layers == (False, True, True, True)
    dense_layer = 24576 + 2048 + 36864
    moe_layer_a, moe_layer_f = 24576 + 2048 + 1024, 24576
    assert spec.attention_side_flops(s, 0) == dense_layer and spec.expert_side_flops(0) == 0
    assert spec.attention_side_flops(s, 1) == moe_layer_a and spec.expert_side_flops(1) == moe_layer_f
    head = 2 * 64 * 128
    assert spec.step_flops_per_token(s) == 3 * (dense_layer + 3 * (moe_layer_a + moe_layer_f) + head)


def test_causal_convention_halves_the_square_and_windows_cap_it():
    assert causal_pairs(4096) == 4096**2 / 2
    assert causal_pairs(100, window=128) == 100**2 / 2  # window longer than the sequence: plain causal
    assert causal_pairs(4096, window=128) == 4096 * 128 - 128**2 / 2
    spec = load_model_spec(ROOT / "hf_models" / "GPT-OSS-120B")
    assert spec.windows[:4] == (128, 0, 128, 0)
    assert spec.attention_core_flops(8192, 0) < spec.attention_core_flops(8192, 1) / 30


def megatron_flops_per_token(
    s: int, *, h: int, layers: int, heads: int, groups: int, head_dim: int, ffn: int, k: int, vocab: int
) -> float:
    """Megatron-LM num_floating_point_operations / (batch * s): Narayanan et al. 2021 with GQA, SwiGLU (3/2),
    MoE with k active experts and the causal half of the attention matrix."""
    q = heads * head_dim
    attention = (1 + groups / heads + s / h / 2) * q / h
    mlp = ffn / h * k * 3 / 2
    logit = vocab / (2 * layers * h)
    return 12 * layers * h * h * (attention + mlp + logit)


def test_flops_match_megatron_closed_form_for_qwen3_235b_like():
    cfg = dict(json.loads((ROOT / "hf_models" / "Qwen3-235B-A22B" / "config.json").read_text()))
    spec = ModelSpec.from_config(cfg)
    for s in (4096, 32768):
        closed = megatron_flops_per_token(
            s, h=4096, layers=94, heads=64, groups=4, head_dim=128, ffn=1536, k=8, vocab=151936
        )
        router = 3 * 2 * 4096 * 128 * 94  # the planner counts the router GEMM, Megatron's formula does not
        assert math.isclose(spec.step_flops_per_token(s), closed + router, rel_tol=FLOP_RTOL)


def test_flops_match_megatron_mla_closed_form_for_deepseek_v3_like():
    cfg = {
        "model_type": "deepseek_v3",
        "hidden_size": 7168,
        "num_hidden_layers": 61,
        "num_attention_heads": 128,
        "vocab_size": 129280,
        "intermediate_size": 18432,
        "moe_intermediate_size": 2048,
        "n_routed_experts": 256,
        "n_shared_experts": 1,
        "num_experts_per_tok": 8,
        "first_k_dense_replace": 3,
        "q_lora_rank": 1536,
        "kv_lora_rank": 512,
        "qk_rope_head_dim": 64,
        "qk_nope_head_dim": 128,
        "v_head_dim": 128,
    }
    spec = ModelSpec.from_config(cfg)
    h, n, qr, kvr, dn, dr, dv, s = 7168, 128, 1536, 512, 128, 64, 128, 4096
    # Megatron-LM's multi_latent_attention term without its "+1" norm terms, per layer and token, forward MACs
    mla = (
        qr * (h + n * (dn + dr))
        + kvr * (h + n * (dn + dv))
        + h * dr
        + n * dv * h
        + s * n * (dn + dr) / 2
        + s * n * dv / 2
    )
    dense_mlp, moe_mlp = 3 * h * 18432, 3 * h * 2048 * (8 + 1) + h * 256  # routed + shared, plus the router
    closed = 6 * (61 * mla + 3 * dense_mlp + 58 * moe_mlp + h * 129280)
    assert math.isclose(spec.step_flops_per_token(s), closed, rel_tol=FLOP_RTOL)


# ----- parameters and memory -----
def build_tiny(family: str, device: str = "cpu"):
    transformers = pytest.importorskip("transformers")
    torch = pytest.importorskip("torch")
    config = transformers.AutoConfig.from_pretrained(ROOT / "hf_models" / f"tiny-{family}")
    torch.manual_seed(0)
    with torch.device(device):
        return transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)


def test_parameter_counts_equal_hf_for_every_family():
    for family in TINY:
        model = build_tiny(family, device="meta")  # shapes only
        spec = load_model_spec(ROOT / "hf_models" / f"tiny-{family}")
        assert spec.total_params() == sum(p.numel() for p in model.parameters()), family
        experts = sum(p.numel() for name, p in model.named_parameters() if ".mlp.experts." in name)
        assert experts == spec.num_moe_layers * spec.num_experts * spec.expert_params(), family


def test_memory_estimate_within_15_percent_of_torch_adamw():
    torch = pytest.importorskip("torch")
    model = build_tiny("qwen3-moe")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids = torch.randint(0, 128, (2, 16))
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    tensors = [p for p in model.parameters()] + [p.grad for p in model.parameters() if p.grad is not None]
    tensors += [t for state in optimizer.state.values() for t in state.values() if torch.is_tensor(t)]
    measured = sum(t.numel() * t.element_size() for t in tensors)
    spec = load_model_spec(ROOT / "hf_models" / "tiny-qwen3-moe")
    layout = Layout(1, 1, spec.num_layers, spec.num_experts)
    work = Workload(16, 2, zero_stage=0, precision="fp32")
    estimate = attention_rank_memory(spec, layout, work).state + ffn_rank_memory(spec, layout, work).state
    assert abs(estimate - measured) / measured < MEMORY_RTOL


def test_zero_sharding_and_state_bytes():
    bf16 = Precision.named("bf16")
    assert bf16.per_param(zero_stage=0, dp=8) == 16
    assert bf16.per_param(zero_stage=1, dp=4) == 2 + 2 + 12 / 4
    assert bf16.per_param(zero_stage=2, dp=4) == 2 + (2 + 12) / 4
    assert bf16.per_param(zero_stage=3, dp=4) == 16 / 4
    with pytest.raises(ConfigError, match="0, 1, 2 or 3"):
        bf16.per_param(zero_stage=4, dp=2)


def test_a_token_goes_to_an_ffn_rank_once():
    spec = ModelSpec.from_config(TINY_QWEN3)  # 8 experts, top-2
    for ep in (1, 2, 4, 8):
        local = 8 // ep
        combos = list(itertools.combinations(range(8), 2))
        exact = sum(len({e // local for e in c}) for c in combos) / len(combos)
        assert math.isclose(spec.distinct_ranks_per_token(ep), exact)
    wire = spec.wire_bytes_per_token(8)
    assert wire.n2m == spec.distinct_ranks_per_token(8) * 2 * 64


def test_unsupported_and_malformed_configs_name_the_field():
    with pytest.raises(UnsupportedModelError, match="llama"):
        ModelSpec.from_config({"model_type": "llama"})
    with pytest.raises(ConfigError, match="num_experts_per_tok"):
        ModelSpec.from_config({k: v for k, v in TINY_QWEN3.items() if k != "num_experts_per_tok"})


# ----- cluster -----
def test_cluster_presets_and_json_round_trip(tmp_path):
    h200 = preset("h200", nodes=2)
    assert (h200.world_size, h200.total_nics, h200.nic_bw) == (16, 16, 50e9)
    path = tmp_path / "cluster.json"
    save_cluster(h200, path)
    assert load_cluster(str(path)) == h200
    assert load_cluster(str(path), nodes=4).nodes == 4
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({**h200.to_dict(), "nic_bw": -1}))
    with pytest.raises(ConfigError, match="nic_bw"):
        load_cluster(str(bad))
    bad.write_text(json.dumps({**h200.to_dict(), "nic_speed": 1}))
    with pytest.raises(ConfigError, match="unknown cluster field"):
        load_cluster(str(bad))
    with pytest.raises(ConfigError, match="needs --nodes"):
        load_cluster("h800")


# ----- simulators -----
@pytest.mark.parametrize("pp,vpp,m", [(1, 1, 4), (4, 1, 8), (4, 1, 2), (4, 2, 8), (2, 3, 4), (8, 4, 16)])
def test_baseline_1f1b_equals_closed_form(pp, vpp, m):
    n = pp * vpp
    costs = BaselineChunkCosts((1.0,) * n, (2.0,) * n, (0.0,) * n, (0.0,) * n, 0.0, 0.0)
    result = simulate_baseline(costs, pp=pp, vpp=vpp, micro_batches=m)
    assert result.step_time_s == pytest.approx(baseline_closed_form(costs, pp=pp, vpp=vpp, micro_batches=m))
    assert result.bubble_fraction == pytest.approx((pp - 1) / (m * vpp + pp - 1))


def test_megatron_order_runs_every_chunk_once_and_exposes_comm():
    for pp, vpp, m, rank in [(4, 2, 8, 0), (4, 2, 8, 3), (2, 1, 5, 1)]:
        ops = megatron_order(pp, vpp, m, rank)
        assert sorted((o.forward, o.chunk, o.micro_batch) for o in ops) == sorted(
            (f, c, b) for f in (True, False) for c in range(vpp) for b in range(m)
        )
    costs = BaselineChunkCosts((1.0,) * 2, (2.0,) * 2, (0.5,) * 2, (0.5,) * 2, 0.25, 0.0)
    result = simulate_baseline(costs, pp=2, vpp=1, micro_batches=4)
    assert result.exposed_comm_fraction == pytest.approx(5 * 1.0 / result.step_time_s)


# ----- allocator -----
def small_cluster(**overrides) -> Cluster:
    base = Cluster(
        "test",
        nodes=2,
        gpus_per_node=4,
        peak_flops=400e12,
        hbm_bytes=80e9,
        nvlink_bw=200e9,
        nics_per_node=4,
        nic_bw=50e9,
    )
    return replace(base, **overrides)


MID_MODEL = {  # a 1B-parameter Qwen3-MoE config
    "model_type": "qwen3_moe",
    "hidden_size": 1024,
    "num_hidden_layers": 8,
    "num_attention_heads": 16,
    "num_key_value_heads": 4,
    "head_dim": 64,
    "vocab_size": 32000,
    "intermediate_size": 4096,
    "moe_intermediate_size": 512,
    "num_experts": 16,
    "num_experts_per_tok": 4,
}


def mid_model(**overrides) -> ModelSpec:
    return ModelSpec.from_config({**MID_MODEL, **overrides})


def plan_for(spec: ModelSpec, cluster: Cluster, seq_len: int, **kwargs):
    rates = Rates.from_cluster(cluster, Efficiency())
    req = PlanRequest(spec, cluster, rates, Workload(seq_len, 1), global_batch=8 * cluster.world_size, **kwargs)
    return plan(req)


def test_long_sequences_get_more_attention_gpus():
    spec, cluster = mid_model(), small_cluster()
    short, long = plan_for(spec, cluster, 1024), plan_for(spec, cluster, 32768)
    m_short = short.af.candidate.layout.attention_gpus
    m_long = long.af.candidate.layout.attention_gpus
    assert m_long > m_short
    ra = long.af.candidate.roofline
    assert ra.attention.flops / ra.ffn.flops > 3  # the s^2 core dominates at 32K


def test_compute_bound_split_follows_the_flop_ratio():
    spec, cluster = mid_model(), small_cluster(nic_bw=1e12, nvlink_bw=1e12)  # bandwidth is free
    result = plan_for(spec, cluster, 8192, placement="contiguous")
    c = result.af.candidate
    share = c.roofline.attention.flops / (c.roofline.attention.flops + c.roofline.ffn.flops)
    assert abs(c.layout.attention_gpus / cluster.world_size - share) <= 1.5 / cluster.world_size * c.layout.depth


def test_plans_divide_and_fit_memory():
    spec = mid_model(num_hidden_layers=6)
    cluster = small_cluster(hbm_bytes=3e9)
    result = plan_for(spec, cluster, 4096)
    c = result.af.candidate
    Layout(
        c.layout.attention_gpus,
        c.layout.ffn_gpus,
        spec.num_layers,
        spec.num_experts,
        depth=c.layout.depth,
        expert_data_parallel=c.layout.expert_data_parallel,
    )  # re-validates
    usable = result.request.rates.usable_hbm
    assert c.memory_attention.total_at(result.af.in_flight) <= usable
    assert c.memory_ffn.total_at(result.af.in_flight) <= usable
    assert result.baseline.candidate.memory.total <= usable
    assert result.rejected["does not fit memory (recompute none)"] > 0
    plain = {"sequence_parallel": (1,), "tensor_parallel": (1,)}  # TP lanes would fit: they shard the A side's state
    tiny_hbm = plan_for(spec, small_cluster(hbm_bytes=1e9), 4096, baseline="ep", **plain)
    assert tiny_hbm.af is None and tiny_hbm.baseline is None


def test_bandwidth_starved_cluster_says_disaggregation_does_not_pay():
    from disagmoe_ds.planner.verdict import verdict

    result = plan_for(mid_model(), small_cluster(nic_bw=0.5e9), 4096)
    head, reasons = verdict(result)
    assert not result.pays and result.speedup < 1
    assert "does not pay" in head and "co-located EP" in head
    assert any(re.search("dead zone|NICs", r) for r in reasons)


def test_one_node_with_one_nic_still_plans_af_pipe():
    """Both sides share the node, and no transfer crosses its single NIC: the split need not divide NICs."""
    one_node = small_cluster(nodes=1, gpus_per_node=2, nics_per_node=1)
    result = plan_for(mid_model(), one_node, 4096)
    assert (result.af.candidate.layout.attention_gpus, result.af.candidate.layout.ffn_gpus) == (1, 1)
    # Across nodes a shared node's only NIC cannot be split between the sides: said, not silently dropped.
    two_nodes = small_cluster(nodes=2, gpus_per_node=3, nics_per_node=1)
    rejected = plan_for(mid_model(num_hidden_layers=1), two_nodes, 4096, placement="contiguous").rejected
    assert rejected["no placement gives each side a NIC (a shared node with one NIC)"] > 0


# ----- CLI -----
def run_cli(capsys, *args: str) -> tuple[int, str, str]:
    rc = main(list(args))
    out, err = capsys.readouterr()
    return rc, out, err


def test_cli_json_and_written_files(tmp_path, capsys):
    cluster = tmp_path / "cluster.json"
    save_cluster(small_cluster(), cluster)
    ds, hosts, trace = tmp_path / "ds.json", tmp_path / "hostfile", tmp_path / "timeline.json"
    rc, out, _ = run_cli(
        capsys,
        "--model",
        str(ROOT / "hf_models" / "tiny-qwen3-moe"),
        "--seq-len",
        "256",
        "--micro-batch-size",
        "2",
        "--cluster",
        str(cluster),
        "--json",
        "--write-mode",
        "disaggregated",
        "--write-ds-config",
        str(ds),
        "--write-hostfile",
        str(hosts),
        "--timeline",
        str(trace),
    )
    assert rc == 0
    plan_json = json.loads(out)
    for key in (
        "attention_gpus",
        "ffn_gpus",
        "attention_nics",
        "ffn_nics",
        "depth",
        "micro_batches",
        "step_time_s",
        "baseline_step_time_s",
        "speedup",
    ):
        assert plan_json[key] is not None, key
    assert plan_json["attention_gpus"] + plan_json["ffn_gpus"] == 8
    written = json.loads(ds.read_text())
    section = written["disagmoe"]
    assert {"attention_gpus", "ffn_gpus", "depth", "micro_batches", "expert_data_parallel"} <= set(section)
    cfg = DisagMoEConfig.from_ds_config(written)  # the runtime takes the planner's section as it is
    assert cfg.world_size == 8 and cfg.cluster == str(cluster.resolve())
    lines = [ln for ln in hosts.read_text().splitlines() if ln and not ln.startswith("#")]
    assert all(re.match(r"^\S+\s+slots=\d+$", ln) for ln in lines) and len(lines) == 2
    assert "A0.lane0" in hosts.read_text().splitlines()[2]  # the first node starts with attention rank 0
    assert json.loads(trace.read_text())["traceEvents"]
    assert (tmp_path / "timeline-baseline.json").exists()


def test_cli_text_and_one_line_errors(capsys):
    model = str(ROOT / "hf_models" / "tiny-mixtral")
    rc, out, _ = run_cli(capsys, "--model", model, "--seq-len", "128", "--cluster", "h800", "--nodes", "1")
    assert rc == 0 and "AF-Pipe plan" in out and "verdict" in out
    rc, _, err = run_cli(capsys, "--model", "/nonexistent", "--seq-len", "128", "--nodes", "1")
    assert rc == 2 and err.count("\n") == 1 and "config.json" in err
    rc, _, err = run_cli(capsys, "--model", model, "--seq-len", "128", "--cluster", "v100", "--nodes", "1")
    assert rc == 2 and "h800" in err
    rc, _, err = run_cli(capsys, "--model", model, "--seq-len", "0", "--nodes", "1")
    assert rc == 2 and "--seq-len" in err


def test_cli_help_lists_every_flag(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    out = capsys.readouterr().out
    for flag in (
        "--model",
        "--seq-len",
        "--micro-batch-size",
        "--cluster",
        "--nodes",
        "--profile",
        "--json",
        "--write-ds-config",
        "--write-hostfile",
        "--timeline",
        "profile",
    ):
        assert flag in out


def test_planner_imports_neither_torch_nor_deepspeed():
    """Importing the planner and planning a tiny model (the CLI's whole path, JSON, ds_config and hostfile written)
    loads neither torch nor DeepSpeed, with or without ``DS_ACCELERATOR`` set (the package's DeepSpeed quieting
    asks torch only when DeepSpeed is imported); only ``profile.py`` imports torch, inside its measuring functions."""
    code = (
        "import contextlib, io, sys, tempfile; from pathlib import Path\n"
        "import disagmoe_ds.planner, disagmoe_ds.planner.profile\n"
        "from disagmoe_ds.planner.cli import main\n"
        "out = Path(tempfile.mkdtemp())\n"
        "with contextlib.redirect_stdout(io.StringIO()), contextlib.suppress(SystemExit):\n"
        "    main(['--help'])\n"
        "with contextlib.redirect_stdout(io.StringIO()):\n"
        "    main(['--model', 'hf_models/tiny-qwen3-moe', '--seq-len', '256', '--nodes', '1', '--json',\n"
        "          '--write-ds-config', str(out / 'ds.json'), '--write-hostfile', str(out / 'hosts')])\n"
        "assert (out / 'ds.json').is_file() and (out / 'hosts').is_file()\n"
        "print(sorted(m for m in ('torch', 'deepspeed', 'transformers') if m in sys.modules))"
    )
    env = {k: v for k, v in os.environ.items() if k != "DS_ACCELERATOR"}
    for extra in ({}, {"DS_ACCELERATOR": "cpu"}):
        run = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, env=env | extra, check=False
        )
        assert run.returncode == 0, run.stderr
        assert run.stdout.strip() == "[]", extra


def test_profile_fit_recovers_a_known_time_model():
    from disagmoe_ds.planner.profile_fit import fit_part

    true = PartModel(per_flop=1 / 400e12, per_core_flop=1 / 600e12, per_call=3e-4)
    points = [(lin, core, true.seconds(lin, core)) for lin, core in ((1e11, 1e11), (2e11, 4e11), (4e11, 16e11))]
    fit = fit_part(points)
    for got, want in (
        (fit.per_flop, true.per_flop),
        (fit.per_core_flop, true.per_core_flop),
        (fit.per_call, true.per_call),
    ):
        assert got == pytest.approx(want, rel=1e-6)
    one = fit_part(points[:1])  # a single point: one rate, no per-call term
    assert one.per_call == 0 and one.seconds(*points[0][:2]) == pytest.approx(points[0][2])


def test_profile_on_cpu_feeds_the_planner(tmp_path, capsys):
    pytest.importorskip("transformers")
    model = str(ROOT / "hf_models" / "tiny-qwen3-moe")
    profile = tmp_path / "profile.json"
    rc, out, _ = run_cli(
        capsys,
        "profile",
        "--model",
        model,
        "--seq-len",
        "32,64",
        "--out",
        str(profile),
        "--device",
        "cpu",
        "--dtype",
        "float32",
        "--warmup",
        "1",
        "--repeats",
        "1",
    )
    assert rc == 0 and "TFLOP/s" in out
    data = json.loads(profile.read_text())
    assert [pt["seq_len"] for pt in data["points"]] == [32, 64]
    assert data["points"][0]["attention"]["fwd_s"] > 0 and data["points"][1]["experts"]["bwd_s"] > 0
    rc, out, _ = run_cli(
        capsys,
        "profile",
        "--model",
        model,
        "--seq-len",
        "48",
        "--out",
        str(tmp_path / "p2.json"),
        "--device",
        "cpu",
        "--dtype",
        "float32",
        "--warmup",
        "0",
        "--repeats",
        "1",
        "--predict-from",
        str(profile),
    )
    assert rc == 0 and "predicted" in out and "error" in out
    rc, out, err = run_cli(
        capsys,
        "--model",
        model,
        "--seq-len",
        "128",
        "--cluster",
        "h800",
        "--nodes",
        "1",
        "--profile",
        str(profile),
        "--json",
    )
    assert rc == 0 and "profile of tiny-qwen3-moe" in json.loads(out)["rates"]
    assert "extrapolating" in err  # 128 lies outside the measured 32..64


# ----- issue 16: AF-Pipe variants and the strongest co-located baseline -----
def _af_setup(**work_kw):
    spec = ModelSpec.from_config(TINY_QWEN3)
    layout = Layout(4, 4, spec.num_layers, spec.num_experts, depth=2, expert_data_parallel=2)
    return spec, layout, Workload(1024, 2, **work_kw)


def test_selective_recompute_drops_the_listed_bytes_and_adds_their_flops():
    from disagmoe_ds.planner.part_times import attention_call_s, expert_call_s
    from disagmoe_ds.planner.recompute import (
        a_side_recompute_flops,
        a_side_saved_bytes,
        expert_recompute_flops_per_assignment,
        expert_saved_bytes_per_assignment,
    )

    spec, layout, work = _af_setup()
    sel = replace(work, recompute="selective")
    tokens = work.tokens_per_micro_batch
    # A side: the worst group keeps exactly the saved bytes less per layer (Q/K/V 16*4 + 2*2*16, output 64, LSE).
    saved_attention = 2 * (64 + 64 + 64) + 4 * 4
    assert a_side_saved_bytes(spec, 1) == saved_attention + 2 * 3 * 0  # Qwen3 MoE layer: no shared expert
    assert a_side_saved_bytes(spec, 0) == saved_attention + 2 * 3 * 96  # dense layer 0: its SwiGLU too
    full_a, sel_a = attention_rank_memory(spec, layout, work), attention_rank_memory(spec, layout, sel)
    group = max(range(2), key=lambda g: sum(spec.a_side_activation_bytes(i) for i in layout.layers_of_group(g)))
    dropped = sum(a_side_saved_bytes(spec, i) * tokens for i in layout.layers_of_group(group))
    assert full_a.activations_per_micro_batch - sel_a.activations_per_micro_batch == pytest.approx(dropped)
    # F side: 3 x I bf16 per (token, expert) assignment.
    assignments = layout.lanes * tokens / layout.expert_data_parallel * spec.top_k / layout.ep_size
    full_f, sel_f = ffn_rank_memory(spec, layout, work), ffn_rank_memory(spec, layout, sel)
    assert expert_saved_bytes_per_assignment(spec) == 2 * 3 * 32
    assert full_f.activations_per_micro_batch - sel_f.activations_per_micro_batch == pytest.approx(
        2 * assignments * expert_saved_bytes_per_assignment(spec)
    )
    # Time: the backward grows by exactly the recomputed forward FLOPs at the forward rate.
    rates = Rates.from_cluster(small_cluster(), Efficiency())
    per = rates.attention_fwd.per_flop
    _, none_bwd = attention_call_s(spec, rates, seq_len=1024, layer=1, tokens=tokens, recompute="none")
    _, sel_bwd = attention_call_s(spec, rates, seq_len=1024, layer=1, tokens=tokens, recompute="selective")
    linear, core = a_side_recompute_flops(spec, 1024, 1)
    assert linear == 2 * 64 * 64 + 4 * 64 * 32  # q, k, v projections
    # AF-Pipe's runtime checkpoints the attention block whole: o_proj is re-run too (no shared expert here).
    assert a_side_recompute_flops(spec, 1024, 1, whole_blocks=True) == (linear + 2 * 64 * 64, core)
    _, af_bwd = attention_call_s(
        spec, rates, seq_len=1024, layer=1, tokens=tokens, recompute="selective", whole_blocks=True
    )
    assert af_bwd - sel_bwd == pytest.approx(per * tokens * 2 * 64 * 64)
    assert sel_bwd - none_bwd == pytest.approx(per * tokens * (linear + core))
    _, e_none = expert_call_s(spec, rates, layer=1, tokens=tokens, recompute="none")
    _, e_sel = expert_call_s(spec, rates, layer=1, tokens=tokens, recompute="selective")
    assert e_sel - e_none == pytest.approx(per * tokens * spec.top_k * expert_recompute_flops_per_assignment(spec))


def test_resend_keeps_nothing_on_f_and_costs_one_more_m2n():
    """Resend as the runtime runs it: F holds no activation in flight under any recompute policy (one layer's full
    set, tokens included, is working memory while its backward re-runs the forward), and n2m_grad carries the
    m2n payload again."""
    from disagmoe_ds.planner.placement import Placement
    from disagmoe_ds.planner.stages import af_roofline
    from disagmoe_ds.planner.task_costs import af_task_costs

    for rc in ("none", "selective", "full"):
        spec, layout, work = _af_setup(recompute=rc)
        resend = replace(work, resend=True)
        mem, mem0 = ffn_rank_memory(spec, layout, resend), ffn_rank_memory(spec, layout, work)
        assert mem.activations_per_micro_batch == 0 and mem.max_in_flight(1e12) == 10**6  # F keeps nothing
        assert mem0.activations_per_micro_batch > 0
        assert mem.working >= ffn_rank_memory(spec, layout, replace(work, recompute="full")).working
        assert mem.state == mem0.state
    rates = Rates.from_cluster(small_cluster(), Efficiency())
    place = Placement.contiguous(2, 4)
    kw = {"placement": place, "rates": rates, "nics": (4, 4)}
    base, more = af_task_costs(spec, layout, work, **kw), af_task_costs(spec, layout, resend, **kw)
    wire = spec.wire_bytes_per_token(layout.ep_size)
    ratio = (wire.n2m_grad + wire.m2n) / wire.n2m_grad
    assert more.per_layer["n2m_grad"][1] == pytest.approx(base.per_layer["n2m_grad"][1] * ratio)
    roof = af_roofline(spec, layout, resend, micro_batches=4, **kw)
    roof0 = af_roofline(spec, layout, work, micro_batches=4, **kw)
    expected = max(wire.a_to_f + wire.m2n, wire.f_to_a) / max(wire.a_to_f, wire.f_to_a)
    assert roof.ffn.nic_bytes == pytest.approx(roof0.ffn.nic_bytes * expected)
    # p = 2: the tokens ride to A_next with the residual of every MoE layer and wait there for its backward
    moe = spec.moe_layers
    for i in range(spec.num_layers):
        extra = more.per_layer["resid"][i] - base.per_layer["resid"][i]
        assert extra == pytest.approx(base.per_layer["resid"][i] * wire.m2n / wire.resid if moe[i] else 0.0)
    a0, a1 = attention_rank_memory(spec, layout, work), attention_rank_memory(spec, layout, resend)
    kept = [
        sum(wire.m2n * work.tokens_per_micro_batch for i in layout.layers_of_group(g) if i and moe[i - 1])
        for g in (0, 1)
    ]
    assert a1.activations_per_micro_batch - a0.activations_per_micro_batch == pytest.approx(max(kept))


def test_resend_costs_exactly_one_more_expert_forward_in_the_f_backward():
    """The F backward with resend re-runs the expert forward once: plain backward + one forward whatever the
    recompute policy (selective's partial re-run is part of it; full recompute is not charged twice), in the
    simulator's task costs and in the roofline alike; the A side is untouched."""
    from disagmoe_ds.planner.part_times import expert_call_s
    from disagmoe_ds.planner.placement import Placement
    from disagmoe_ds.planner.stages import af_roofline, compute_multiplier
    from disagmoe_ds.planner.task_costs import af_task_costs

    spec, layout, plain = _af_setup()
    rates = Rates.from_cluster(small_cluster(), Efficiency())
    kw = {"placement": Placement.contiguous(2, 4), "rates": rates, "nics": (4, 4)}
    f_tokens = layout.lanes * plain.tokens_per_micro_batch / layout.ffn_ranks_per_group
    base = af_task_costs(spec, layout, plain, **kw)
    roof0 = af_roofline(spec, layout, plain, micro_batches=4, **kw)
    for rc in ("none", "selective", "full"):
        work = replace(plain, recompute=rc)
        costs = af_task_costs(spec, layout, replace(work, resend=True), **kw)
        for i in range(spec.num_layers):
            fwd, _ = expert_call_s(spec, rates, layer=i, tokens=f_tokens, recompute="none")
            assert costs.per_layer["F_bwd"][i] == pytest.approx(base.per_layer["F_bwd"][i] + fwd)
            assert costs.per_layer["F_fwd"][i] == pytest.approx(base.per_layer["F_fwd"][i])
            assert costs.per_layer["A_bwd"][i] == pytest.approx(
                af_task_costs(spec, layout, work, **kw).per_layer["A_bwd"][i]
            )
        assert any(costs.per_layer["F_bwd"][i] > base.per_layer["F_bwd"][i] for i in range(spec.num_layers))
        roof = af_roofline(spec, layout, replace(work, resend=True), micro_batches=4, **kw)
        assert roof.ffn.flops == pytest.approx(roof0.ffn.flops * 4 / 3)  # fwd + 2x bwd + the re-run forward
        assert roof.ffn.compute_s > roof0.ffn.compute_s
        assert compute_multiplier(replace(work, resend=True), "ffn") == 4
    full = replace(plain, recompute="full")
    assert af_task_costs(spec, layout, replace(full, resend=True), **kw).per_layer["F_bwd"] == pytest.approx(
        af_task_costs(spec, layout, full, **kw).per_layer["F_bwd"]
    )
    assert af_roofline(spec, layout, replace(full, resend=True), micro_batches=4, **kw).ffn.compute_s == pytest.approx(
        af_roofline(spec, layout, full, micro_batches=4, **kw).ffn.compute_s
    )
    # A split backward moves the same weight-gradient half of the experts off the critical path.
    split = af_task_costs(spec, layout, replace(plain, resend=True, split_backward=True), **kw)
    whole = af_task_costs(spec, layout, replace(plain, resend=True), **kw)
    for i in range(spec.num_layers):
        assert split.per_layer["F_bwd"][i] + split.wgrad["F"][i] == pytest.approx(whole.per_layer["F_bwd"][i])
    # ... except at ZeRO-3 on the F side, where the runtime keeps the experts' backward whole (afpipe.split_backward)
    zero3 = af_task_costs(spec, layout, replace(plain, resend=True, split_backward=True, ffn_zero_stage=3), **kw)
    assert not any(zero3.wgrad["F"]) and any(zero3.wgrad["A"])


def test_message_host_time_adds_to_every_exchanging_task():
    """``message_host_s``: two exchange operations per MoE task on each side (send one message, post one receive),
    two more per A task with p > 1 (the residual hand-off), two all-to-all calls per co-located MoE layer and pass
    at EP > 1; nothing at 0 (the default) and a negative value is refused."""
    from disagmoe_ds.planner.colocated_costs import Shape, colocated_costs
    from disagmoe_ds.planner.placement import Placement
    from disagmoe_ds.planner.task_costs import af_task_costs

    spec, layout, work = _af_setup()
    h = 3e-4
    kw = {"placement": Placement.contiguous(2, 4), "nics": (4, 4)}
    base = af_task_costs(spec, layout, work, rates=Rates.from_cluster(small_cluster(), Efficiency()), **kw)
    slow = Rates.from_cluster(small_cluster(message_host_s=h), Efficiency())
    more = af_task_costs(spec, layout, work, rates=slow, **kw)
    for i, moe in enumerate(spec.moe_layers):
        for kind, ops in (("A_fwd", 2 * moe + 2), ("A_bwd", 2 * moe + 2), ("F_fwd", 2 * moe), ("F_bwd", 2 * moe)):
            assert more.per_layer[kind][i] - base.per_layer[kind][i] == pytest.approx(ops * h)
    rates0 = Rates.from_cluster(small_cluster(), Efficiency())
    for ep, extra in ((1, 0.0), (2, 2 * h)):
        shape = Shape(tp=1, cp=1, ep=ep, pp=1, vpp=1, overlap="partial")
        c0 = colocated_costs(spec, work, shape, cluster=small_cluster(), rates=rates0, overlap=0.5)
        c1 = colocated_costs(spec, work, shape, cluster=small_cluster(), rates=slow, overlap=0.5)
        assert c1.fwd_compute[0] - c0.fwd_compute[0] == pytest.approx(extra * sum(spec.moe_layers))
    with pytest.raises(ConfigError, match="message_host_s"):
        small_cluster(message_host_s=-1.0)


def test_offload_is_limited_by_pcie_bandwidth():
    from disagmoe_ds.planner.placement import Placement
    from disagmoe_ds.planner.stages import af_roofline
    from disagmoe_ds.planner.variants import offload_share

    spec, layout, work = _af_setup()
    cluster = small_cluster()
    rates = Rates.from_cluster(cluster, Efficiency())
    mem = ffn_rank_memory(spec, layout, work)
    usable = mem.state + mem.working + 2.5 * mem.activations_per_micro_batch  # room for 2.5 micro-batches
    share = offload_share(mem, layers=layout.layers_per_group, target=5, usable=usable)
    assert share is not None and 0 < share < 1
    off = replace(work, offload=(0.0, share))
    assert ffn_rank_memory(spec, layout, off).total_at(5) <= usable  # the share really fits 5 in flight
    assert offload_share(mem, layers=layout.layers_per_group, target=5, usable=mem.state) is None
    kw = {"placement": Placement.contiguous(2, 4), "nics": (4, 4), "micro_batches": 8}
    offloaded = ffn_rank_memory(spec, layout, off).offloaded_per_micro_batch
    roof = af_roofline(spec, layout, off, rates=rates, offloaded=(0.0, offloaded), **kw)
    per_gpu_nic = roof.ffn.nic_bytes / layout.ffn_gpus
    assert roof.ffn.pcie_s == pytest.approx((per_gpu_nic + 8 * offloaded) / rates.pcie_bw)
    slow = af_roofline(
        spec, layout, off, rates=replace(rates, pcie_bw=rates.pcie_bw / 100), offloaded=(0.0, offloaded), **kw
    )
    assert slow.ffn.pcie_s == pytest.approx(100 * roof.ffn.pcie_s)
    assert slow.ffn.network_s == slow.ffn.pcie_s and slow.ffn.bound == "network"  # the host link bounds the side


def test_zero3_on_the_ffn_side_shards_parameters_and_pays_in_collectives():
    from disagmoe_ds.planner.stages import zero_micro_batch_bytes
    from disagmoe_ds.planner.training_state import ffn_rank_params

    spec, layout, work = _af_setup()
    z3 = replace(work, ffn_zero_stage=3)
    params = max(ffn_rank_params(spec, layout, g).trained for g in range(layout.depth))
    r = layout.expert_data_parallel
    assert ffn_rank_memory(spec, layout, work).state - ffn_rank_memory(spec, layout, z3).state == pytest.approx(
        params * ((2 + 2 + 12 / r) - 16 / r)
    )
    assert zero_micro_batch_bytes(params, r, 1, "bf16") == 0
    assert zero_micro_batch_bytes(params, r, 2, "bf16") == pytest.approx((r - 1) / r * params * 2)
    assert zero_micro_batch_bytes(params, r, 3, "bf16") == pytest.approx((r - 1) / r * params * 6)


def test_split_backward_reduces_to_the_generator_and_fills_bubbles():
    from disagmoe_ds.planner.zerobubble import simulate_split_backward
    from disagmoe_ds.schedule import Costs, PipeShape, generate

    shape = PipeShape(depth=2, num_layers=8, moe_layers=(True,) * 8)
    for m, cap in ((8, 5), (6, 2)):
        plain = generate(shape, m, costs=Costs(), max_in_flight=cap).step_time_s
        assert simulate_split_backward(shape, m, Costs(), cap=cap)[0] == plain
        # the same total work, half of each backward deferred
        half = Costs(a_bwd=1.0, f_bwd=1.0, head_bwd=1.0, a_wgt=1.0, f_wgt=1.0, head_wgt=1.0)
        step, busy, _ = simulate_split_backward(shape, m, half, cap=cap)
        assert step < plain
        assert max(busy.values()) <= 1.0 + 1e-9


def test_paired_overlap_hides_the_all_to_all_behind_the_other_micro_batch():
    from disagmoe_ds.planner.colocated import A2A_HIDDEN_SHARE, ColocatedCosts, Shape, simulate_colocated

    f, b, fa, ba, m = 1.0, 2.0, 1.5, 1.0, 6
    alone = 0.5  # what the partial overlap leaves exposed per op
    costs = ColocatedCosts((f,), (b,), (alone,), (alone,), 0.0, 0.0, (fa,), (ba,), (0.0,), (0.0,))
    partial = simulate_colocated(costs, shape=Shape(1, 1, 1, 1, 1, "partial"), micro_batches=m)
    paired = simulate_colocated(costs, shape=Shape(1, 1, 1, 1, 1, "paired"), micro_batches=m)
    assert partial.step_time_s == pytest.approx(m * (f + b + 2 * alone))
    # Megatron's measured gain, not max(compute, a2a): a share of the smaller of the two hides
    unit = f + b + fa + ba - A2A_HIDDEN_SHARE * min(f + b, fa + ba)
    assert paired.step_time_s == pytest.approx((f + alone) + (m - 1) * unit + (b + alone))
    assert max(f + b, fa + ba) < unit < f + b + fa + ba
    for pp in (2, 4):  # the extra warm-up keeps a pipeline of fused units as full as plain 1F1B
        n = pp
        uniform = ColocatedCosts((f,) * n, (b,) * n, (0.0,) * n, (0.0,) * n, 0.0, 0.0, *((0.0,) * n,) * 4)
        one = simulate_colocated(uniform, shape=Shape(pp, 1, 1, 1, 1, "paired"), micro_batches=16)
        assert one.step_time_s == pytest.approx((16 + pp - 1) * (f + b))


def test_tensor_and_context_parallel_split_activations_and_dense_state():
    from disagmoe_ds.planner.colocated_costs import Shape
    from disagmoe_ds.planner.memory import baseline_rank_memory

    spec = mid_model()
    kw = {"world_size": 64, "chunks_alive": 1}
    work = Workload(4096, 1)
    plain = baseline_rank_memory(spec, work, Shape(pp=1, vpp=1, tp=1, cp=1, ep=8, overlap="none"), **kw)
    sharded = baseline_rank_memory(spec, work, Shape(pp=1, vpp=1, tp=2, cp=2, ep=8, overlap="none"), **kw)
    assert sharded.activations_per_micro_batch == pytest.approx(plain.activations_per_micro_batch / 4)
    assert sharded.state < plain.state


def test_strongest_baseline_is_never_worse_than_plain_ep():
    from disagmoe_ds.planner.allocator import best_baseline

    for seq, cluster in ((2048, small_cluster()), (16384, small_cluster(nic_bw=5e9))):
        rates = Rates.from_cluster(cluster, Efficiency())
        req = PlanRequest(mid_model(), cluster, rates, Workload(seq, 1), global_batch=8 * cluster.world_size)
        strongest, plain = best_baseline(req)[0], best_baseline(replace(req, baseline="ep"))[0]
        assert strongest.tokens_per_s >= plain.tokens_per_s
    assert strongest.candidate.shape.overlap == "paired"  # slow NICs: the overlap is what wins


def test_paired_overlap_only_where_megatron_allows_it():
    from disagmoe_ds.planner.colocated import Shape, paired_allowed

    assert paired_allowed(Shape(1, 1, 1, 1, 8, "paired"), "selective")
    assert paired_allowed(Shape(4, 2, 1, 1, 8, "paired"), "none")
    assert not paired_allowed(Shape(4, 1, 1, 1, 8, "paired"), "none")  # PP > 1 needs virtual stages
    assert not paired_allowed(Shape(1, 1, 1, 1, 8, "paired"), "full")  # not with full recompute


def test_variant_ladder_stops_once_memory_is_roomy():
    from disagmoe_ds.planner.allocator import af_candidates
    from disagmoe_ds.planner.variants import PAPER

    spec, cluster = mid_model(), small_cluster()
    rates = Rates.from_cluster(cluster, Efficiency())
    req = PlanRequest(spec, cluster, rates, Workload(2048, 1), global_batch=64, sequence_parallel=(1,))
    req = replace(req, tensor_parallel=(1,))  # each A-lane shape climbs its own ladder (test_planner_lanes.py)
    paper, _ = af_candidates(replace(req, af_variants=PAPER))
    everything, _ = af_candidates(req)
    assert {c.work.variant for c in paper} <= {"recompute none, ZeRO 1/1", "recompute full, ZeRO 1/1"}
    # 80 GB for a 1.5B model: nothing needs saving, so no costlier variant is even tried.
    assert {c.work.variant for c in everything} == {"recompute none, ZeRO 1/1"}


@pytest.mark.parametrize("module", sorted(m.name for m in pkgutil.iter_modules(planner_package.__path__)))
def test_planner_doctests(module: str) -> None:
    assert doctest.testmod(importlib.import_module(f"disagmoe_ds.planner.{module}")).failed == 0


# ----- the runtime's schedule costs -----


@pytest.mark.parametrize(("m", "n", "p", "family"), [(1, 1, 1, "tiny-qwen3-moe"), (2, 2, 2, "tiny-qwen2-moe")])
def test_runtime_costs_give_one_valid_schedule_everywhere(m: int, n: int, p: int, family: str) -> None:
    """Every rank derives the costs alone: the same inputs must give the same streams, and they must be valid."""

    config = json.loads((ROOT / "hf_models" / family / "config.json").read_text())
    spec = ModelSpec.from_config(config)
    layout = Layout(attention_gpus=m, ffn_gpus=n, depth=p, num_layers=spec.num_layers, num_experts=spec.num_experts)
    shape = PipeShape(p, spec.num_layers, spec.moe_layers)
    streams = [
        generate(shape, 6, costs=runtime_costs(config, layout, seq_len=512, micro_batch_size=1)).streams
        for _ in range(2)
    ]
    assert streams[0] == streams[1]
    check_streams(streams[0])


def test_runtime_costs_follow_the_model() -> None:
    """The balanced model's two sides cost about the same per layer; the head costs what its vocabulary says."""

    config = json.loads((ROOT / "hf_models" / "Qwen3-30B-A3B-balanced" / "config.json").read_text())
    layout = Layout(attention_gpus=1, ffn_gpus=1, num_layers=8, num_experts=128)
    costs = runtime_costs(config, layout, seq_len=4096, micro_batch_size=1)
    assert 0.8 < costs.a_fwd / costs.f_fwd < 1.2 and costs.a_bwd == pytest.approx(2 * costs.a_fwd)
    # head forward = 2 * H * V FLOPs per token at the same rate as the parts
    assert costs.head_fwd / costs.a_fwd == pytest.approx(2 * 2048 * 16384 / 71.8e6, rel=0.05)
    assert 0 < costs.m2n < costs.a_fwd  # NVLink inside one node: a transfer is cheaper than the compute


def test_schedule_cluster_must_exist() -> None:
    with pytest.raises(ConfigError, match="cluster.*presets"):
        DisagMoEConfig(cluster="h900")
    with pytest.raises(ConfigError, match="profile.*disagmoe-plan profile"):
        DisagMoEConfig(profile="/nonexistent/profile.json")


# ----- the optimizer step and which link numbers win -----
def test_optimizer_step_scales_with_the_params_a_rank_steps():
    from disagmoe_ds.planner.colocated_costs import Shape
    from disagmoe_ds.planner.optimizer_step import (
        BYTES_PER_PARAM,
        af_optimizer_s,
        baseline_optimizer_s,
        optimizer_step_s,
        state_params,
    )

    # doctest-sized: 1e9 parameters of bf16 state at 1 TB/s, every byte counted: BYTES_PER_PARAM ms
    rates = Rates.from_cluster(small_cluster(hbm_bw=1e12), Efficiency(hbm=1.0))
    assert BYTES_PER_PARAM["bf16"] == pytest.approx(93.0, abs=0.1)  # the F rank's 104 ms on an H200 (module notes)
    assert optimizer_step_s(1e9, precision="bf16", rates=rates) == pytest.approx(BYTES_PER_PARAM["bf16"] / 1e3)
    assert optimizer_step_s(2e9, precision="bf16", rates=rates) == pytest.approx(2 * BYTES_PER_PARAM["bf16"] / 1e3)
    assert BYTES_PER_PARAM["fp32"] < BYTES_PER_PARAM["bf16"]  # no casts, no bf16 copy
    assert state_params(8e9, replicas=4, zero_stage=1) == 2e9 and state_params(8e9, replicas=4, zero_stage=0) == 8e9

    spec, work = mid_model(), Workload(4096, 1)
    expert_total = spec.num_moe_layers * spec.num_experts * spec.expert_params()
    for edp in (1, 2, 4):  # ZeRO-1 over the replicas: an F rank steps 1/N of the experts whatever EP x EDP is
        layout = Layout(2, 4, spec.num_layers, spec.num_experts, expert_data_parallel=edp)
        f = af_optimizer_s(spec, layout, work, rates)[1]
        assert f == pytest.approx(optimizer_step_s(expert_total / 4, precision="bf16", rates=rates))
        unsharded = af_optimizer_s(spec, layout, replace(work, ffn_zero_stage=0), rates)[1]
        assert unsharded == pytest.approx(edp * f)
    one_lane, two_lanes = (
        af_optimizer_s(spec, Layout(m, 4, spec.num_layers, spec.num_experts), work, rates)[0] for m in (1, 2)
    )
    assert two_lanes == pytest.approx(one_lane / 2)  # A state sharded over the lanes

    # co-located, one stage: the distributed optimizer gives every rank 1/W of all parameters
    def shape(ep: int) -> Shape:
        return Shape(pp=1, vpp=1, tp=1, cp=1, ep=ep, overlap="paired")

    for ep in (1, 2, 8):
        base = baseline_optimizer_s(spec, work, shape(ep), world_size=8, rates=rates)
        assert base == pytest.approx(optimizer_step_s(spec.total_params() / 8, precision="bf16", rates=rates))
    # without ZeRO every rank steps all dense parameters, and its EP 8 shard of the experts
    unsharded = spec.total_params() - expert_total + expert_total / 8
    assert baseline_optimizer_s(
        spec, replace(work, zero_stage=0), shape(8), world_size=8, rates=rates
    ) == pytest.approx(optimizer_step_s(unsharded, precision="bf16", rates=rates))


def test_af_pipe_step_waits_for_the_slower_sides_optimizer_and_co_located_adds_its_own():
    from disagmoe_ds.planner.plan_json import to_json

    spec, cluster = mid_model(), small_cluster()
    result = plan_for(spec, cluster, 4096)
    af, base = result.af, result.baseline
    c = af.candidate
    assert c.optimizer_s[1] > c.optimizer_s[0] > 0  # F ranks hold the experts' state
    assert c.optimizer_step_s == max(c.optimizer_s)
    assert af.step_time_s == pytest.approx(
        max(af.sim.step_time_s, c.roofline.bottleneck_s) + c.exposed_sync_s + c.optimizer_s[1]
    )
    b = base.candidate
    assert b.optimizer_step_s > 0
    assert base.step_time_s == pytest.approx(base.sim.step_time_s + b.exposed_sync_s + b.optimizer_step_s)
    # Slower HBM makes both steps longer by exactly their optimizer terms (same plans, nothing else moves).
    slow = plan_for(spec, replace(cluster, hbm_bw=cluster.hbm_bw / 2), 4096)
    assert slow.af.candidate.layout == c.layout
    assert slow.af.step_time_s == pytest.approx(af.step_time_s + c.optimizer_step_s)
    assert slow.baseline.step_time_s == pytest.approx(base.step_time_s + b.optimizer_step_s)
    plan_json = json.loads(json.dumps(to_json(result)))
    assert plan_json["optimizer_step_s"] == c.optimizer_step_s and plan_json["ffn"]["optimizer_s"] > 0
    assert plan_json["baseline"]["optimizer_step_s"] == b.optimizer_step_s


def test_cluster_hbm_bandwidth_defaults_by_kind(tmp_path):
    assert [preset(n, nodes=1).hbm_bw for n in ("h800", "h100", "h200")] == [3.35e12, 3.35e12, 4.8e12]
    path = tmp_path / "c.json"
    fields = {"name": "x", "nodes": 1, "gpus_per_node": 2, "peak_flops": 989e12, "nvlink_bw": 1e11}
    fields |= {"nics_per_node": 1, "nic_bw": 1e10}
    for hbm, want in ((143771 * 2**20, 4.8e12), (81559 * 2**20, 3.35e12)):  # a JSON without hbm_bw: by memory size
        path.write_text(json.dumps({**fields, "hbm_bytes": hbm}))
        assert load_cluster(str(path)).hbm_bw == want
    path.write_text(json.dumps({**fields, "hbm_bytes": 80e9, "hbm_bw": 2e12}))
    assert load_cluster(str(path)).hbm_bw == 2e12
    path.write_text(json.dumps({**fields, "hbm_bytes": 80e9, "hbm_bw": 0}))
    with pytest.raises(ConfigError, match="hbm_bw"):
        load_cluster(str(path))


def _profile_json(nvlink: float = 377e9) -> dict:
    from disagmoe_ds.planner.profile_fit import FORMAT

    model = {"per_flop": 1e-15, "per_core_flop": 1e-15, "per_call": 1e-4}
    parts = ("attention_fwd", "attention_bwd", "experts_fwd", "experts_bwd")
    return {
        "format": FORMAT,
        "model": "m",
        "model_type": "qwen3_moe",
        "device": "NVIDIA H200",
        "points": [{"seq_len": 4096}],
        "fit": {p: model for p in parts},
        "nvlink_bytes_per_s": nvlink,
        "nic_bytes_per_s": None,
    }


def test_a_cluster_json_describes_the_links_a_profile_only_replaces_a_presets():
    from disagmoe_ds.planner.profile_fit import rates_from_profile

    profile, eff = _profile_json(), Efficiency(nvlink=1.0)
    socket = small_cluster(nodes=1, gpus_per_node=2, nics_per_node=1, nvlink_bw=3.8e9, nic_bw=3.8e9)
    assert rates_from_profile(profile, socket, eff, measured_links=False).nvlink_bw == 3.8e9
    assert "links from the cluster" in rates_from_profile(profile, socket, eff, measured_links=False).source
    measured = rates_from_profile(profile, preset("h200", nodes=1), eff, measured_links=True)
    assert measured.nvlink_bw == 377e9 and "nvlink_bw from the profile" in measured.source
    assert measured.nic_bw == preset("h200", nodes=1).nic_bw * eff.network  # no NIC measurement: the preset's


def test_cli_profile_with_a_cluster_json_keeps_its_links(tmp_path, capsys):
    """The issue's bug: a 3.8 GB/s socket cluster planned exactly like NVLink, because the profile's measured
    NVLink replaced the cluster's link."""
    profile = tmp_path / "profile.json"
    profile.write_text(json.dumps(_profile_json()))
    steps = {}
    for name, bw in (("nvlink", 280e9), ("socket", 3.8e9)):
        path = tmp_path / f"{name}.json"
        two_h200s = small_cluster(name=name, nodes=1, gpus_per_node=2, nics_per_node=1, hbm_bytes=143771 * 2**20)
        save_cluster(replace(two_h200s, nvlink_bw=bw, nic_bw=bw), path)
        args = ("--model", str(ROOT / "hf_models" / "Qwen3-30B-A3B-balanced"), "--seq-len", "4096")
        args += ("--global-batch-size", "8")
        rc, out, _ = run_cli(capsys, *args, "--cluster", str(path), "--profile", str(profile), "--json")
        assert rc == 0 and "links from the cluster" in json.loads(out)["rates"]
        steps[name] = json.loads(out)["step_time_s"]
    assert steps["socket"] > 2 * steps["nvlink"]
    rc, out, _ = run_cli(capsys, *args, "--cluster", "h200", "--nodes", "1", "--profile", str(profile), "--json")
    assert rc == 0 and "nvlink_bw from the profile" in json.loads(out)["rates"]


def test_glm4_moe_reads_as_deepseek_mlp_with_gqa_attention() -> None:
    from disagmoe_ds.planner.hf_config import model_fields

    fields = model_fields(json.loads((ROOT / "hf_models" / "tiny-glm4-moe" / "config.json").read_text()))
    assert fields["moe_layers"] == (False, True, True, True)  # first_k_dense_replace = 1
    assert (fields["num_experts"], fields["top_k"], fields["expert_intermediate"]) == (8, 2, 32)
    assert (fields["shared_intermediate"], fields["dense_intermediate"]) == (32, 96)  # one shared expert
    attention = fields["attention"]
    assert (attention.kind, attention.num_heads, attention.num_kv_heads, attention.head_dim) == ("gqa", 4, 2, 16)
    assert attention.qk_norm == "head"  # use_qk_norm


@pytest.mark.parametrize("family", ["tiny-qwen3-next", "tiny-qwen3.5-moe"])
def test_linear_attention_layers_cost_linear_in_sequence_length(family: str) -> None:
    """Gated DeltaNet layers have their own term: per token it does not grow with the sequence (the full layers'
    softmax core does), and their projections and parameters are DeltaNet's, not the attention block's."""
    from disagmoe_ds.planner.model import ModelSpec

    spec = ModelSpec.from_config(json.loads((ROOT / "hf_models" / family / "config.json").read_text()))
    assert spec.linear_layers == (True, False, True, False)
    linear, full = 0, 1
    assert spec.attention_core_flops(4096, linear) == spec.attention_core_flops(65536, linear)
    assert spec.attention_core_flops(65536, full) == 16 * spec.attention_core_flops(4096, full)
    # hidden 64; q, k: 2 heads x 16, v, z: 4 heads x 16; conv over q, k, v (128 channels) of kernel 4
    assert spec.attention_projection_flops(linear) == 2 * 64 * (128 + 64 + 8) + 2 * 64 * 64 + 2 * 128 * 4
    assert spec.attention_projection_flops(full) == 2 * 64 * 128 + 4 * 64 * 32 + 2 * 64 * 64  # q and its gate
    # per token and value head: 2 * 64 * (3 * 16 + 2 * 16) within the chunk, 6 * 16 * 16 against the state
    assert spec.attention_core_flops(4096, linear) == 4 * (2 * 64 * 80 + 6 * 256)
    assert spec.attention_params(linear) != spec.attention_params(full)


def test_qwen3_5_hub_config_is_read_through_its_text_config() -> None:
    """The real-size Qwen3.5-35B-A3B config (the vision-language model's): its language model, every 4th layer
    full attention, and the parameters HF's causal LM built from it (on the meta device) has."""
    torch = pytest.importorskip("torch")
    from transformers import AutoModelForCausalLM

    from disagmoe_ds.models.loading import load_config

    spec = load_model_spec(ROOT / "hf_models" / "Qwen3.5-35B-A3B")
    assert (spec.model_type, spec.num_layers, spec.num_moe_layers) == ("qwen3_5_moe_text", 40, 40)
    assert [i for i, linear in enumerate(spec.linear_layers) if not linear] == list(range(3, 40, 4))
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(load_config(ROOT / "hf_models" / "Qwen3.5-35B-A3B"))
    assert spec.total_params() == sum(p.numel() for p in model.parameters())
