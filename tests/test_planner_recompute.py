"""The planner's recompute policy per side (issue 44): each side's memory and compute priced under its own policy, the
search trying the sides apart (``per_side_recompute``), and the written ds_config running the plan's policies
(pure Python, a few seconds)."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from disagmoe_ds.config import DisagMoEConfig
from disagmoe_ds.layout import Layout
from disagmoe_ds.planner import Efficiency, Rates, allocator
from disagmoe_ds.planner.allocator import PlanRequest, af_candidates, best_af
from disagmoe_ds.planner.attention_lanes import data_lanes
from disagmoe_ds.planner.cli import main
from disagmoe_ds.planner.cluster import save_cluster
from disagmoe_ds.planner.memory import attention_rank_memory, ffn_rank_memory
from disagmoe_ds.planner.part_times import attention_call_s, expert_call_s, head_call_s
from disagmoe_ds.planner.runtime_files import runtime_refusal
from disagmoe_ds.planner.stages import compute_multiplier, side_flops
from disagmoe_ds.planner.variants import PAPER, memory_variants, variants_used
from disagmoe_ds.planner.workload import Workload
from tests.test_planner import MID_MODEL, mid_model, small_cluster
from tests.test_planner_ds_config import _runtime_accepts, _written

PER_SIDE = frozenset({"per_side_recompute"})
# The constructed cell: 64 experts of a 1B-parameter model on 8 GPUs of 6 GB. The F side's expert state leaves room
# for one micro-batch's activations without recompute, short of the ring; the A side keeps all of its own.
MODEL = {**MID_MODEL, "num_experts": 64}


def _cell() -> PlanRequest:
    spec, cluster = mid_model(num_experts=64), small_cluster(hbm_bytes=6e9)
    rates = Rates.from_cluster(cluster, Efficiency())
    return PlanRequest(spec, cluster, rates, Workload(4096, 1), 32, sequence_parallel=(1,), tensor_parallel=(1,))


def test_a_workloads_sides_are_priced_each_under_its_own_policy():
    spec, layout = mid_model(), Layout(4, 4, 8, 16, depth=1)
    mixed = Workload(4096, 1).with_recompute("none", "full")
    none, full = Workload(4096, 1), Workload(4096, 1, recompute="full")
    assert (mixed.recompute_of("attention"), mixed.recompute_of("ffn"), mixed.variant) == (
        "none",
        "full",
        "recompute A none F full, ZeRO 1/1",
    )
    assert mixed.with_recompute("full", "full") == full  # one policy for both is the plain one, as before
    assert attention_rank_memory(spec, layout, mixed) == attention_rank_memory(spec, layout, none)
    assert ffn_rank_memory(spec, layout, mixed) == ffn_rank_memory(spec, layout, full)
    assert side_flops(spec, mixed) == (side_flops(spec, none)[0], side_flops(spec, full)[1])
    assert (compute_multiplier(mixed, "attention"), compute_multiplier(mixed, "ffn")) == (3, 4)
    sel = Workload(4096, 1).with_recompute("selective", "none")
    both = Workload(4096, 1, recompute="selective")
    assert side_flops(spec, sel) == (side_flops(spec, both)[0], side_flops(spec, none)[1])
    assert variants_used(sel) == {"selective", "per_side_recompute"}


def test_the_ladder_tries_the_sides_apart_only_where_allowed():
    base = Workload(4096, 1)
    paper = [w.variant for w in memory_variants(base, ("none", "full"), PAPER)]
    assert paper == ["recompute none, ZeRO 1/1", "recompute full, ZeRO 1/1"]  # the paper's: one policy
    mixed = memory_variants(base, ("none", "full"), PER_SIDE | {"resend"})
    assert [w.variant for w in mixed] == [
        "recompute none, ZeRO 1/1",
        "recompute none, resend, ZeRO 1/1",
        "recompute A none F full, ZeRO 1/1",
        "recompute A full F none, ZeRO 1/1",
        "recompute full, ZeRO 1/1",
        "recompute full, resend, ZeRO 1/1",
    ]  # cheapest first; no per-side policy with resend, under which F's policy changes nothing


def test_a_side_with_room_keeps_its_activations_while_the_expert_side_rebuilds(monkeypatch):
    # Plain exchange only: with the node-deduplicated one the cell is expert-bound and both policies tie (the search
    # then keeps the uniform one, listed first).
    monkeypatch.setattr(allocator, "_node_deduplicated", lambda layout, gpus_per_node: [])
    req = _cell()
    uniform, _ = best_af(replace(req, af_variants=PAPER))
    mixed, _ = best_af(replace(req, af_variants=PER_SIDE))
    assert uniform is not None and mixed is not None
    c, u = mixed.candidate, uniform.candidate
    assert (c.work.recompute_of("attention"), c.work.recompute_of("ffn")) == ("none", "full")
    assert u.work.variant == "recompute full, ZeRO 1/1" and c.layout == u.layout
    # Without recompute the F side holds fewer micro-batches than the ring's 2p + 1, the A side twice the ring.
    usable, none, ring = req.rates.usable_hbm, Workload(4096, 1), 2 * c.layout.depth + 1
    assert ffn_rank_memory(req.spec, c.layout, none).max_in_flight(usable) < ring
    assert attention_rank_memory(req.spec, c.layout, none).max_in_flight(usable) >= 2 * ring
    # Each side's compute by hand from the part times: the A side without the re-run forward, the F side with it.
    spec, rates, layout, mb = req.spec, req.rates, c.layout, c.micro_batches
    tokens, layers = req.work.tokens_per_micro_batch, layout.layers_of_group(0)
    f_tokens = data_lanes(layout, c.work) * tokens / layout.ffn_ranks_per_group
    a_fwd = [attention_call_s(spec, rates, seq_len=4096, layer=i, tokens=tokens, recompute="none",
                              whole_blocks=True)[0] for i in layers]  # fmt: skip
    a_bwd = [attention_call_s(spec, rates, seq_len=4096, layer=i, tokens=tokens, recompute="none",
                              whole_blocks=True)[1] for i in layers]  # fmt: skip
    head = sum(head_call_s(spec, rates, tokens=tokens))
    f_calls = [expert_call_s(spec, rates, layer=i, tokens=f_tokens, recompute="none") for i in layers]
    f_kept, f_rebuilt = sum(f + b for f, b in f_calls), sum(2 * f + b for f, b in f_calls)
    assert layout.depth == 1 and req.rates.message_host_s == 0
    assert c.roofline.attention.compute_s == pytest.approx(mb * (sum(a_fwd) + sum(a_bwd) + head), rel=1e-12)
    assert c.roofline.ffn.compute_s == pytest.approx(mb * f_rebuilt, rel=1e-12)
    assert u.roofline.attention.compute_s == pytest.approx(mb * (2 * sum(a_fwd) + sum(a_bwd) + head), rel=1e-12)
    assert u.roofline.ffn.compute_s == pytest.approx(mb * f_rebuilt, rel=1e-12)
    assert f_kept < f_rebuilt
    # The A side binds both plans, so the A side's re-run forward is what the per-side policy saves.
    assert c.roofline.attention.compute_s >= c.roofline.ffn.compute_s
    saved = mb * sum(a_fwd)
    assert u.roofline.bottleneck_s - c.roofline.bottleneck_s == pytest.approx(saved, rel=1e-9)
    assert mixed.step_time_s < uniform.step_time_s


def test_the_default_search_keeps_the_one_policy_plans_where_no_side_is_short():
    """The plain (mid_model, 80 GB) cell: nothing needs recompute, so no per-side variant is even tried."""
    req = replace(_cell(), spec=mid_model(), cluster=small_cluster())
    req = replace(req, rates=Rates.from_cluster(req.cluster, Efficiency()))
    candidates, _ = af_candidates(req)
    assert {c.work.variant for c in candidates} == {"recompute none, ZeRO 1/1"}


def test_a_per_side_variant_is_pruned_where_its_recomputing_side_has_room():
    candidates, _ = af_candidates(replace(_cell(), af_variants=PER_SIDE | {"selective"}))
    for c in candidates:  # the A side holds twice the ring without recompute in every layout of this cell that fits
        if c.work.per_side_recompute:
            assert c.work.recompute_of("attention") == "none", c.work.variant
    assert any(c.work.per_side_recompute for c in candidates)


@pytest.mark.parametrize(("attention", "ffn"), [("none", "full"), ("selective", "full"), ("full", "none")])
def test_the_written_ds_config_runs_each_sides_policy(attention, ffn):
    work = Workload(4096, 1).with_recompute(attention, ffn)
    assert runtime_refusal(work) is None
    written = _written(work, 2)
    section = written["disagmoe"]
    assert section["recompute"] == {"attention": attention, "ffn": ffn}
    assert "activation_checkpointing" not in section and "selective_recompute" not in section  # never both
    assert _runtime_accepts(written)
    cfg = DisagMoEConfig.from_ds_config(written)
    assert (cfg.recompute_of("attention"), cfg.recompute_of("ffn")) == (attention, ffn)


@pytest.mark.parametrize("policy", ["none", "selective", "full"])
def test_one_policy_for_both_sides_is_still_written_as_the_switch(policy):
    section = _written(Workload(4096, 1, recompute=policy), 1)["disagmoe"]
    assert "recompute" not in section
    assert (section["activation_checkpointing"], section["selective_recompute"]) == (
        policy == "full",
        policy == "selective",
    )


def test_the_cli_plans_names_and_writes_the_sides_policies(tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps(MODEL))
    save_cluster(small_cluster(hbm_bytes=6e9), tmp_path / "cluster.json")
    ds = tmp_path / "ds.json"
    flags = ["--model", str(tmp_path), "--cluster", str(tmp_path / "cluster.json"), "--seq-len", "4096",
             "--global-batch-size", "32", "--sequence-parallel", "1", "--tensor-parallel", "1", "--compute-efficiency",
             "0.6", "--variants", "per_side_recompute", "--write-mode", "disaggregated"]  # fmt: skip
    assert main([*flags, "--json", "--write-ds-config", str(ds)]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["recompute"] == "per side"
    assert (plan["attention"]["recompute"], plan["ffn"]["recompute"]) == ("none", "full")
    cfg = DisagMoEConfig.from_ds_config(json.loads(ds.read_text()))
    assert (cfg.recompute_of("attention"), cfg.recompute_of("ffn")) == ("none", "full")
    assert main(flags) == 0
    assert "recompute A none F full" in capsys.readouterr().out
