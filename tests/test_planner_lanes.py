"""Issue 28: A-lanes of s x t ranks (DeepSpeed-Ulysses SP x Megatron-style TP) in the AF-Pipe search: memory,
compute and communication per rank, validity, the search's monotonicity, the CLI and the ds_config refusal (pure
Python, a few seconds)."""

from __future__ import annotations

import json
import re
from dataclasses import replace
from pathlib import Path

import pytest

from disagmoe_ds.errors import ConfigError
from disagmoe_ds.layout import Layout
from disagmoe_ds.planner import Efficiency, Rates, save_cluster
from disagmoe_ds.planner.allocator import PlanRequest, best_af, shortlist
from disagmoe_ds.planner.attention_lanes import (
    lane_comm_s,
    lane_options,
    lane_refusal,
    ulysses_bytes_per_token,
    ulysses_forward_bytes,
)
from disagmoe_ds.planner.memory import attention_rank_memory, ffn_rank_memory
from disagmoe_ds.planner.model import load_model_spec
from disagmoe_ds.planner.placement import Placement
from disagmoe_ds.planner.runtime_files import ds_config
from disagmoe_ds.planner.task_costs import af_task_costs
from disagmoe_ds.planner.variants import search_options
from disagmoe_ds.planner.workload import Workload
from tests.test_planner import mid_model, run_cli, small_cluster

ROOT = Path(__file__).resolve().parents[1]
LAYOUT = Layout(attention_gpus=8, ffn_gpus=8, num_layers=8, num_experts=16, depth=2)  # 4 ranks per A-group


def lane(s: int, t: int, **kw) -> Workload:
    return Workload(4096, 1, sequence_parallel=s, tensor_parallel=t, **kw)


def test_lane_memory_divides_activations_by_s_t_and_parameters_by_t():
    spec = mid_model()
    plain, sp, tp = (attention_rank_memory(spec, LAYOUT, lane(s, t)) for s, t in ((1, 1), (2, 1), (1, 2)))
    assert sp.activations_per_micro_batch == pytest.approx(plain.activations_per_micro_batch / 2)
    assert tp.activations_per_micro_batch == pytest.approx(plain.activations_per_micro_batch / 2)
    assert sp.state == pytest.approx(plain.state)  # Ulysses replicates the weights: ZeRO over d x s = 4 ranks as before
    # TP halves the parameters and ZeRO shards the 12 B over d x s = 2 ranks instead of 4: (2 + 2 + 6) / 2 = 5 B
    assert tp.state / plain.state == pytest.approx((2 + 2 + 12 / 2) / 2 / (2 + 2 + 12 / 4))
    full = attention_rank_memory(spec, LAYOUT, lane(2, 2, recompute="full"))
    plain_full = attention_rank_memory(spec, LAYOUT, lane(1, 1, recompute="full"))
    assert full.activations_per_micro_batch == pytest.approx(plain_full.activations_per_micro_batch / 4)
    # the F side sees the d lanes' tokens: half the lanes, half the tokens per micro-batch
    f_plain, f_sp = (ffn_rank_memory(spec, LAYOUT, lane(s, 1)) for s in (1, 2))
    assert f_sp.activations_per_micro_batch == pytest.approx(f_plain.activations_per_micro_batch / 2)


def test_ulysses_all_to_all_bytes_by_hand():
    spec = mid_model()  # 16 query heads, 4 KV heads of 64, bf16
    # per token and TP rank: q 16 x 64 x 2 = 2048 B, K + V 2 x 4 x 64 x 2 = 1024 B, the output back 2048 B
    assert ulysses_bytes_per_token(spec, 2, 1) == 5120
    # (s - 1)/s of the rank's T/s = 2048 tokens: 0.5 x 2048 x 5120
    assert ulysses_forward_bytes(spec, lane(2, 1)) == 0.5 * 2048 * 5120
    # s = 8 > 4 KV heads: each K/V head goes twice; 7/8 of 512 tokens x (2048 + 2 x 1024 + 2048)
    assert ulysses_bytes_per_token(spec, 8, 1) == 6144
    assert ulysses_forward_bytes(spec, lane(8, 1)) == 7 / 8 * 512 * 6144
    # TP 2 halves a rank's heads and bytes per token
    assert ulysses_bytes_per_token(spec, 2, 2) == 2560
    rates = Rates.from_cluster(small_cluster(), Efficiency())
    fwd, bwd = lane_comm_s(spec, lane(2, 1), rates, layer=0, lane_bw=100e9)
    assert fwd == pytest.approx(0.5 * 2048 * 5120 / 100e9) and bwd == pytest.approx(2 * fwd)  # exposed, 2x backward
    _, bwd_full = lane_comm_s(spec, lane(2, 1, recompute="full"), rates, layer=0, lane_bw=100e9)
    assert bwd_full == pytest.approx(3 * fwd)  # the recomputed forward's all-to-alls again
    assert lane_comm_s(spec, lane(1, 1), rates, layer=0, lane_bw=100e9) == (0.0, 0.0)


def test_each_sp_rank_exchanges_its_own_tokens_and_computes_its_share():
    spec, cluster = mid_model(), small_cluster()
    rates = Rates.from_cluster(cluster, Efficiency())
    place = Placement.contiguous(cluster.nodes, cluster.gpus_per_node)
    costs = {s: af_task_costs(spec, LAYOUT, lane(s, 1), placement=place, rates=rates, nics=(4, 4)) for s in (1, 2, 4)}
    for s in (2, 4):  # an A-group's micro-batch holds d = 4/s lanes' tokens, each rank sending its own T/s
        assert costs[s].per_layer["m2n"][1] == pytest.approx(costs[1].per_layer["m2n"][1] / s)
        assert costs[s].per_layer["F_fwd"][1] == pytest.approx(costs[1].per_layer["F_fwd"][1] / s)
        assert costs[s].per_layer["A_fwd"][1] > costs[1].per_layer["A_fwd"][1] / s  # 1/s of the FLOPs + all-to-alls
    comm = lane_comm_s(spec, lane(2, 1), rates, layer=1, lane_bw=rates.nvlink_bw)[0]  # the lane sits in one node
    assert costs[2].per_layer["A_fwd"][1] - comm == pytest.approx(costs[1].per_layer["A_fwd"][1] / 2)


def test_lane_refusals_name_what_does_not_divide():
    spec = mid_model()
    kw = {"tokens": 8192, "gpus_per_node": 8}
    assert lane_refusal(spec, 2, 2, **kw) is None and lane_refusal(spec, 8, 1, **kw) is None  # 8 = 2 x 4 KV heads
    assert "query heads" in lane_refusal(mid_model(num_attention_heads=12, num_key_value_heads=4), 8, 1, **kw)
    assert "KV heads" in lane_refusal(mid_model(num_attention_heads=12, num_key_value_heads=6), 4, 1, **kw)
    assert "TP" in lane_refusal(spec, 1, 8, **kw)  # 4 KV heads do not split over TP 8
    assert "tokens per rank" in lane_refusal(spec, 4, 2, tokens=4096, gpus_per_node=8)
    mla = load_model_spec(ROOT / "hf_models" / "tiny-deepseek-v3")  # MLA, 4 heads
    assert lane_refusal(mla, 4, 1, **kw) is None and "query heads" in lane_refusal(mla, 8, 1, **kw)
    linear = load_model_spec(ROOT / "hf_models" / "tiny-qwen3-next")
    assert "linear-attention" in lane_refusal(linear, 2, 1, **kw)
    assert lane_options(spec, tokens=4096, gpus_per_node=4) == [(1, 1), (1, 2), (2, 1), (1, 4), (2, 2), (4, 1)]


def test_more_lane_options_never_give_a_slower_af_pipe_plan():
    spec, cluster = mid_model(), small_cluster(hbm_bytes=20e9, nic_bw=5e9)
    req = PlanRequest(
        spec, cluster, Rates.from_cluster(cluster, Efficiency()), Workload(4096, 1), global_batch=32,
        simulate_per_variant_set=1,
    )  # fmt: skip
    sets = [((1,), (1,)), ((1, 2), (1,)), ((1,), (1, 2)), ((1, 2, 4), (1, 2, 4))]
    rate = {}
    for sp, tp in sets:
        af, _ = best_af(replace(req, sequence_parallel=sp, tensor_parallel=tp))
        rate[sp, tp] = af.tokens_per_s if af else 0.0
    for small in sets:
        for big in sets:
            if set(small[0]) <= set(big[0]) and set(small[1]) <= set(big[1]):
                assert rate[big] >= rate[small] * (1 - 1e-9), (small, big)
    assert rate[(1,), (1, 2)] > rate[(1,), (1,)]  # here TP 2 lanes pay: the lanes are not a no-op


def test_lane_shortlist_of_an_option_subset_is_the_full_shortlist_restricted_to_it():
    import itertools
    import random
    from types import SimpleNamespace

    def fake(s: int, t: int, resend: bool, filled: bool) -> SimpleNamespace:
        work = Workload(4096, 1, resend=resend, sequence_parallel=s, tensor_parallel=t)
        return SimpleNamespace(
            work=work, max_in_flight=5 if filled else 1, micro_batches=8, layout=SimpleNamespace(depth=2)
        )

    shapes = [(1, 1), (2, 1), (1, 2), (4, 1), (2, 2)]
    names = ("resend", "sp2", "sp4", "tp2")
    allowed_sets = [frozenset(c) for r in range(5) for c in itertools.combinations(names, r)]
    rng = random.Random(1)
    for _ in range(40):
        ranked = [fake(*rng.choice(shapes), rng.random() < 0.5, rng.random() < 0.7) for _ in range(rng.randint(1, 12))]
        ranked.sort(key=lambda c: c.max_in_flight < 5)
        for top in (1, 2):
            full = shortlist(ranked, top)
            for allowed in allowed_sets:
                mine = [c for c in ranked if search_options(c.work) <= allowed]
                assert shortlist(mine, top) == [c for c in full if c in mine]


def _cli(capsys, tmp_path, *extra: str) -> tuple[int, str, str]:
    cluster = tmp_path / "cluster.json"
    save_cluster(small_cluster(), cluster)
    model = str(ROOT / "hf_models" / "tiny-qwen3-moe")  # 4 heads, 2 KV heads
    flags = ("--model", model, "--seq-len", "2048", "--cluster", str(cluster), "--write-mode", "disaggregated")
    return run_cli(capsys, *flags, *extra)


def test_cli_fixes_s_and_t_and_shows_them(tmp_path, capsys):
    rc, out, _ = _cli(capsys, tmp_path, "--sequence-parallel", "2", "--tensor-parallel", "1", "--json")
    plan = json.loads(out)
    assert rc == 0 and (plan["sequence_parallel"], plan["tensor_parallel"]) == (2, 1)
    assert plan["lanes"] * 2 * plan["depth"] == plan["attention_gpus"] and "SP 2 x TP 1" in plan["variant"]
    rc, out, _ = _cli(capsys, tmp_path, "--sequence-parallel", "1", "--tensor-parallel", "2")
    assert rc == 0 and "lanes of SP 1 x TP 2" in out
    groups = next(line for line in out.splitlines() if line.strip().startswith("groups"))
    assert re.search(r"lanes of SP 1 x TP 2 {2,}\d+ x EP \d+", groups), groups  # the columns stay apart
    rc, _, err = _cli(capsys, tmp_path, "--sequence-parallel", "4")  # 2048 / 4 < 1024 tokens per rank
    assert rc == 2 and err.count("\n") == 1 and "--sequence-parallel 4" in err and "tokens per rank" in err


def test_write_ds_config_writes_the_lane_degree_the_runtime_runs(tmp_path, capsys):
    """The runtime runs SP lanes, TP lanes and SP x TP lanes: the written config names the degrees and loads as the
    runtime's section."""
    from disagmoe_ds.config import DisagMoEConfig

    ds = tmp_path / "ds.json"
    for s, t in ((2, 1), (1, 2)):
        rc, _, err = _cli(
            capsys, tmp_path, "--sequence-parallel", str(s), "--tensor-parallel", str(t), "--write-ds-config", str(ds)
        )
        assert rc == 0, err
        config = json.loads(ds.read_text())
        section = config["disagmoe"]
        assert section.get("sequence_parallel", 1) == s and section.get("tensor_parallel", 1) == t
        cfg = DisagMoEConfig.from_ds_config(config)
        assert cfg.lanes % (s * t) == 0 and cfg.batch_lanes == cfg.lanes // 2
        ds.unlink()
    both = ("--sequence-parallel", "2", "--tensor-parallel", "2", "--seq-len", "8192")  # 1024 tokens per rank
    rc, _, err = _cli(capsys, tmp_path, *both, "--write-ds-config", str(ds))
    section = json.loads(ds.read_text())["disagmoe"]
    assert rc == 0 and (section["sequence_parallel"], section["tensor_parallel"]) == (2, 2), err


def test_ds_config_writes_the_lane_once_the_runtime_runs_it(monkeypatch):
    from types import SimpleNamespace

    import disagmoe_ds.planner.runtime_files as runtime_files

    candidate = SimpleNamespace(layout=LAYOUT, micro_batches=8, work=lane(2, 2))
    request = SimpleNamespace(work=Workload(4096, 1), cluster=SimpleNamespace(name="h800"))
    result = SimpleNamespace(request=request, af=SimpleNamespace(candidate=candidate, in_flight=5))
    monkeypatch.setattr(runtime_files, "RUNTIME_LANE_FIELDS", frozenset())
    with pytest.raises(ConfigError, match="--sequence-parallel 1 --tensor-parallel 1"):
        ds_config(result)
    monkeypatch.setattr(runtime_files, "RUNTIME_LANE_FIELDS", frozenset({"sequence_parallel"}))
    with pytest.raises(ConfigError, match="does not run tensor parallel yet: pass --tensor-parallel 1"):
        ds_config(result)
    monkeypatch.setattr(runtime_files, "RUNTIME_LANE_FIELDS", frozenset({"sequence_parallel", "tensor_parallel"}))
    section = ds_config(result)["disagmoe"]
    assert (section["sequence_parallel"], section["tensor_parallel"]) == (2, 2)
    result.af.candidate.work = lane(1, 2)
    section = ds_config(result)["disagmoe"]
    assert section["tensor_parallel"] == 2 and "sequence_parallel" not in section
