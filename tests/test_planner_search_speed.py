"""The AF-Pipe search made cheap without changing a result: the generator's simulation replicated on indices
(``planner/ring_sim.py``), the memoised per-layer costs, and the search's bound-ordered stop, each checked against
the slow reference path (pure Python, a few seconds)."""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import replace

import pytest

import disagmoe_ds.planner.zerobubble as zerobubble
from disagmoe_ds.planner import Efficiency, Rates
from disagmoe_ds.planner.allocator import (
    AfPlan,
    PlanRequest,
    af_candidates,
    best_af,
    best_tokens_per_s,
    to_simulate,
)
from disagmoe_ds.planner.ring_sim import RingRun, cap_bound_s, run_ring
from disagmoe_ds.planner.simulate import simulate_af
from disagmoe_ds.planner.task_costs import af_task_costs
from disagmoe_ds.planner.workload import Workload
from disagmoe_ds.schedule import Costs, PipeShape, build_graph
from disagmoe_ds.schedule.generator import _Simulation
from tests.test_planner import mid_model, small_cluster

_TIMES = ("a_fwd", "a_bwd", "f_fwd", "f_bwd", "head_fwd", "head_bwd")
_LINKS = ("m2n", "n2m", "resid", "m2n_grad", "n2m_grad", "resid_grad")


def _random_case(rng: random.Random) -> tuple[PipeShape, int, Costs, int] | None:
    p = rng.choice((1, 2, 3, 4))
    layers = p * rng.randint(1, 3)
    moe = tuple(rng.random() < 0.8 for _ in range(layers))
    if not all(any(moe[g::p]) for g in range(p)):
        return None
    kw = {k: rng.random() + 0.1 for k in _TIMES}
    kw |= {k: rng.choice((0.0, 0.5, rng.random())) for k in _LINKS}  # ties and free links too
    if rng.random() < 0.5:  # a split backward, some W tasks free
        kw |= {k: rng.choice((0.0, rng.random())) for k in ("a_wgt", "f_wgt", "head_wgt")}
    overrides = {("A_fwd", 0): 2.0, ("m2n", layers - 1): 0.25, ("A_wgt", layers): 0.5} if rng.random() < 0.5 else {}
    cap = rng.randint(1, 2 * (2 * p + 1))
    return PipeShape(p, layers, moe), rng.randint(1, 10), Costs(**kw, overrides=overrides), cap


def test_ring_replica_gives_the_generators_every_interval():
    rng, checked = random.Random(7), 0
    while checked < 80:
        case = _random_case(rng)
        if case is None:
            continue
        shape, micro_batches, costs, cap = case
        _, compute, transfers = _Simulation(build_graph(shape, micro_batches), costs, cap).run()
        run = run_ring(shape, micro_batches, costs, cap=cap, intervals=True)
        assert run.compute == tuple((t, s, e) for t, (s, e) in compute.items()), case  # same order, same floats
        assert run.transfers == tuple((m, s, e) for m, (s, e) in transfers.items()), case
        assert run.step_s == max(end for _, end in compute.values())
        assert cap_bound_s(shape, micro_batches, costs, cap=cap) <= run.step_s  # the pruning's bound is one
        checked += 1


def _generator_run(shape: PipeShape, micro_batches: int, costs: Costs, *, cap: int, intervals: bool = False) -> RingRun:
    """``run_ring`` through the generator itself: the reference the search used to run."""
    _, compute, transfers = _Simulation(build_graph(shape, micro_batches), costs, cap).run()
    busy = dict.fromkeys(shape.workers, 0.0)
    for task, (start, end) in compute.items():
        busy[shape.worker_of(task)] += end - start
    step = max(end for _, end in compute.values())
    spans = tuple((t, s, e) for t, (s, e) in compute.items()), tuple((m, s, e) for m, (s, e) in transfers.items())
    return RingRun(step, busy, *spans)


def _reference_plan(req: PlanRequest, c, splits: tuple[bool, ...], exposed: bool) -> AfPlan:
    """The search's candidate simulation before it was memoised: every cap and form, simulated in full."""
    ring, best = 2 * c.layout.depth + 1, None
    for split in splits:
        cand = replace(c, work=replace(c.work, split_backward=split))
        costs = af_task_costs(req.spec, c.layout, cand.work, placement=c.placement, rates=req.rates, nics=c.nics)
        for cap in sorted({min(c.max_in_flight, c.micro_batches, k * ring) for k in (1, 2)}):
            sim = simulate_af(
                req.spec, c.layout, costs, micro_batches=c.micro_batches, max_in_flight=cap, exposed_comm=exposed
            )
            plan = AfPlan(cand, sim, cap)
            if best is None or plan.step_time_s < 0.99 * best.step_time_s:
                best = plan
    assert best is not None
    return best


def _reference_best_af(req: PlanRequest) -> AfPlan | None:
    """Every shortlisted family simulated (no stop on the bound), through the generator."""
    candidates, _ = af_candidates(req)
    listed = to_simulate(candidates, req.simulate_per_variant_set)
    splits = (False, True) if "split_backward" in req.af_variants else (False,)
    best = None
    for c in sorted(listed, key=lambda c: -best_tokens_per_s(c)):
        plan = _reference_plan(req, c, splits, exposed=False)
        best = plan if best is None or plan.tokens_per_s > best.tokens_per_s else best
    if best is None:
        return None
    return _reference_plan(req, best.candidate, (best.candidate.work.split_backward,), exposed=True)


def _request(**kw) -> PlanRequest:
    cluster = small_cluster(**kw.pop("cluster", {}))
    base = PlanRequest(mid_model(), cluster, Rates.from_cluster(cluster, Efficiency()), Workload(4096, 1), 32)
    return replace(base, **kw)


@pytest.mark.parametrize(
    "req",
    [
        _request(cluster={"hbm_bytes": 20e9, "nic_bw": 5e9}, simulate_per_variant_set=1),  # TP 2 lanes win here
        _request(cluster={"nic_bw": 25e9}, global_batch=64),
        _request(cluster={"hbm_bytes": 30e9}, work=Workload(8192, 1), sequence_parallel=(1, 2), tensor_parallel=(1,)),
        _request(cluster={"nic_bw": 2e9}, global_batch=64, simulate_per_variant_set=2),
    ],
    ids=["small-hbm-slow-nic", "roomy", "8k-sp", "socket-nic"],
)
def test_search_gives_the_unpruned_generator_searchs_plan(req, monkeypatch):
    fast, _ = best_af(req)
    monkeypatch.setattr(zerobubble, "run_ring", _generator_run)
    slow = _reference_best_af(req)
    assert fast is not None and slow is not None
    assert fast.candidate == slow.candidate and fast.in_flight == slow.in_flight
    assert fast.sim == slow.sim  # the step, its fractions and the whole timeline
    assert fast.step_time_s == slow.step_time_s


def test_memoised_group_compute_is_the_per_group_sum():
    from disagmoe_ds.layout import Layout
    from disagmoe_ds.planner.attention_lanes import data_lanes, lane_attention_call_s, rank_tokens
    from disagmoe_ds.planner.part_times import expert_call_s, head_call_s
    from disagmoe_ds.planner.stages import _group_compute_per_micro_batch

    spec, req = mid_model(), _request()
    for depth, s, t, recompute in ((1, 1, 1, "none"), (2, 2, 1, "selective"), (2, 1, 2, "full"), (4, 2, 2, "none")):
        layout = Layout(16, 16, spec.num_layers, spec.num_experts, depth=depth)
        work = Workload(4096, 1, recompute=recompute, sequence_parallel=s, tensor_parallel=t)
        f_tokens = data_lanes(layout, work) * work.tokens_per_micro_batch / layout.ffn_ranks_per_group
        a_worst = f_worst = 0.0
        for g in range(depth):  # the sums as the roofline made them before the per-layer cache
            layers = layout.layers_of_group(g)
            a = sum(sum(lane_attention_call_s(spec, req.rates, work, layer=i, lane_bw=1e11)) for i in layers)
            a += sum(head_call_s(spec, req.rates, tokens=rank_tokens(work))) if g == layout.head_group else 0.0
            f = sum(sum(expert_call_s(spec, req.rates, layer=i, tokens=f_tokens, recompute=recompute)) for i in layers)
            a_worst, f_worst = max(a_worst, a), max(f_worst, f)
        got = _group_compute_per_micro_batch(spec, layout, work, recompute, req.rates, 1e11)
        assert got == (a_worst, f_worst)  # exactly: the same additions in the same order


def test_memory_cached_per_side_is_each_sides_own():
    from disagmoe_ds.planner.memory import attention_rank_memory, ffn_rank_memory

    req = _request(cluster={"hbm_bytes": 20e9, "nic_bw": 5e9})
    candidates, _ = af_candidates(req)
    assert {c.work.zero_of("ffn") for c in candidates} == {1, 2, 3}  # the variants whose memory the sides share
    assert {c.work.lane_size for c in candidates} >= {1, 2, 4} and any(c.work.offload != (0, 0) for c in candidates)
    for c in candidates[::7]:
        assert c.memory_attention == attention_rank_memory(req.spec, c.layout, c.work)
        assert c.memory_ffn == ffn_rank_memory(req.spec, c.layout, c.work)


def test_the_bounds_skip_simulations_here(monkeypatch):
    import disagmoe_ds.planner.af_simulation as af_simulation
    from disagmoe_ds.planner.af_simulation import bound_tokens_per_s, forms

    calls: list[int] = []
    simulate = af_simulation._simulate
    monkeypatch.setattr(af_simulation, "_simulate", lambda *a, **kw: calls.append(1) or simulate(*a, **kw))
    best_af(_request(cluster={"hbm_bytes": 20e9, "nic_bw": 5e9}, simulate_per_variant_set=1))
    assert len(calls) < 2 * 2 * 2  # 2 families x 2 forms x 2 caps unpruned: the T* stop and the kept-plan skip fired
    cluster = {"hbm_bytes": 30e9, "nic_bw": 25e9}
    req = _request(cluster=cluster, work=Workload(8192, 1), sequence_parallel=(1, 2), tensor_parallel=(1,))
    best, _ = best_af(req)
    assert best is not None
    candidates, _ = af_candidates(req)
    skipped = [  # families the in-flight bound rules out although T* alone would have simulated them
        c
        for c in candidates
        if best_tokens_per_s(c) > best.tokens_per_s >= bound_tokens_per_s(c, forms(req, c, (False, True)))
    ]
    assert skipped


def test_simulation_order_keeps_the_first_of_equally_fast_plans(monkeypatch):
    """best_af simulates the most promising family first but must return what the T*-ordered loop returned: the
    earliest, in T* order, of the fastest plans. Random bounds and rates on a coarse grid, so that ties happen."""
    from types import SimpleNamespace

    import disagmoe_ds.planner.allocator as allocator

    rng = random.Random(3)
    req = _request()
    for _ in range(300):
        n = rng.randint(1, 8)
        rates = [rng.choice((1.0, 2.0, 3.0)) for _ in range(n)]
        fakes = [
            SimpleNamespace(
                name=k,
                tokens=1.0,
                roofline=SimpleNamespace(bottleneck_s=1 / (rates[k] + rng.choice((0.0, 1.0, 2.0))) / 2),
                exposed_sync_s=0.0,
                optimizer_step_s=0.0,
                rate=rates[k],
                bound=rates[k] + rng.choice((0.0, 0.5, 1.0)),  # an upper bound, sometimes exact
                work=SimpleNamespace(split_backward=False),
            )
            for k in range(n)
        ]
        for f in fakes:  # T*'s bound is never below the in-flight one
            f.roofline.bottleneck_s = min(f.roofline.bottleneck_s, 1 / f.bound)
        simulated: list[int] = []

        def simulate(req, c, *, exposed_comm=False, splits=(), memo=None, shapes=None, simulated=simulated):
            simulated.append(c.name)
            return SimpleNamespace(tokens_per_s=c.rate, candidate=c)

        monkeypatch.setattr(allocator, "af_candidates", lambda req: ([], Counter()))
        monkeypatch.setattr(allocator, "to_simulate", lambda candidates, top, fakes=fakes: list(fakes))
        monkeypatch.setattr(allocator, "forms", lambda req, c, splits: c)
        monkeypatch.setattr(allocator, "bound_tokens_per_s", lambda c, shapes: c.bound)
        monkeypatch.setattr(allocator, "simulate_candidate", simulate)
        plan, _ = allocator.best_af(req)
        order = sorted(fakes, key=lambda c: -allocator.best_tokens_per_s(c))  # the loop's order before
        expected = max(order, key=lambda c: c.rate)  # the first of the fastest
        assert plan.candidate.name == expected.name
        assert len(set(simulated[:-1])) == len(simulated) - 1  # each simulated once, then the kept one again


@pytest.mark.parametrize("kind", ["strongest", "ep", "deepspeed"])
@pytest.mark.parametrize("seq_len", [1024, 8192])
def test_the_baseline_search_skips_only_what_cannot_win(kind, seq_len):
    """Each co-located candidate's ``bound_s`` is at most its simulated step, and the pruned search finds the plan
    that simulating every candidate finds, simulating fewer."""
    from disagmoe_ds.planner.allocator import BaselinePlan, baseline_candidates, best_baseline
    from disagmoe_ds.planner.colocated import simulate_colocated

    cluster = small_cluster(nodes=4)
    req = PlanRequest(mid_model(), cluster, Rates.from_cluster(cluster, Efficiency()), Workload(seq_len, 1), 64)
    req = replace(req, baseline=kind)
    candidates, _ = baseline_candidates(req)
    every = [
        BaselinePlan(c, simulate_colocated(c.costs, shape=c.shape, micro_batches=c.micro_batches)) for c in candidates
    ]
    assert len(every) > 6  # more than the old search's six
    for p in every:
        assert p.candidate.bound_s <= p.step_time_s * (1 + 1e-12), p.candidate.shape
    best, _ = best_baseline(req)
    assert best is not None and best.tokens_per_s == max(p.tokens_per_s for p in every)
    skipped = sum(best.tokens_per_s >= c.tokens / c.bound_s for c in candidates)
    assert skipped > 0
