"""The adaptive worker allocator (paper section 6): choose M:N, the NIC split, depth p, expert-DP and the
micro-batches, and compare with the best co-located EP+DP interleaved-1F1B configuration (pure Python).

Search (the DisagMoE paper's allocator, re-implemented): enumerate every attention/FFN split
M + N = W, every depth p dividing L, every expert-DP that the ``Layout`` accepts, both placements and every
NIC split they allow (``placement.py``). Reject what does not divide or does not fit memory; rank the rest
by the roofline bottleneck T* = max(T_a, T_f) (paper section 4.3) plus the exposed gradient sync and the optimizer
step (``optimizer_step.py``), after
those that fit a full ring of micro-batches in flight; simulate the best of each (depth, placement,
recompute) family with the AF-Pipe schedule generator and keep the highest throughput (equivalently MFU,
the paper's second criterion). The co-located baseline is searched the same way (``best_baseline``).
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import replace
from functools import lru_cache

from disagmoe_ds.capabilities.rules import Job, refusals
from disagmoe_ds.errors import LayoutError
from disagmoe_ds.layout import Layout
from disagmoe_ds.planner.af_simulation import Memo, bound_tokens_per_s, forms, simulate_candidate
from disagmoe_ds.planner.attention_lanes import data_lanes, lane_spans
from disagmoe_ds.planner.colocated import ColocatedCandidate, colocated_candidates, divisors, simulate_colocated
from disagmoe_ds.planner.colocated_costs import Shape
from disagmoe_ds.planner.fp8_costs import experts_in_fp8
from disagmoe_ds.planner.grad_sync import af_sync_s
from disagmoe_ds.planner.memory import RankMemory, attention_rank_memory, ffn_rank_memory
from disagmoe_ds.planner.model import ModelSpec
from disagmoe_ds.planner.optimizer_step import af_optimizer_s
from disagmoe_ds.planner.pipeline_split import chunk_sizes
from disagmoe_ds.planner.placement import Placement, placements
from disagmoe_ds.planner.plans import (
    PAYS_THRESHOLD,
    SIDES,
    AfCandidate,
    AfPlan,
    BaselinePlan,
    PlanRequest,
    PlanResult,
)
from disagmoe_ds.planner.recompute import Recompute
from disagmoe_ds.planner.stages import af_roofline
from disagmoe_ds.planner.training_state import ffn_host_state_bytes
from disagmoe_ds.planner.variants import POLICIES, dominated, memory_variants, offload_share, savings, search_options
from disagmoe_ds.planner.workload import Workload

__all__ = [  # the types live in plans.py, the candidate simulation in af_simulation.py; imported from here as before
    "PAYS_THRESHOLD",
    "AfCandidate",
    "AfPlan",
    "BaselinePlan",
    "PlanRequest",
    "PlanResult",
    "best_af",
    "best_baseline",
    "best_runnable_colocated",
    "plan",
    "simulate_candidate",
]


# ----- AF-Pipe search -----
def _layouts(req: PlanRequest, counter: Counter) -> list[Layout]:
    """Every layout the Layout class accepts (placements filter the splits further)."""
    spec, world = req.spec, req.cluster.world_size
    out = []
    for m in range(1, world) if req.attention_gpus is None else (req.attention_gpus,):
        n = world - m
        for p in divisors(spec.num_layers):
            if m % p or n % p:
                counter["depth does not divide M or N"] += 1
                continue
            if not all(any(spec.moe_layers[g::p]) for g in range(p)):
                counter["an F-group would own no MoE layer"] += 1
                continue
            for edp in divisors(n // p):
                try:
                    layout = Layout(m, n, spec.num_layers, spec.num_experts, depth=p, expert_data_parallel=edp)
                except LayoutError:
                    counter["experts do not divide over the F-group"] += 1
                    continue
                out += [layout, *_node_deduplicated(layout, req.cluster.gpus_per_node)]
    return out


def _node_deduplicated(layout: Layout, gpus_per_node: int) -> list[Layout]:
    """The layout with the node-deduplicated exchange, its nodes the most ep ranks a node holds (gcd of the ep size
    and the GPUs a node); none where that is one rank: nothing to share. Placements decide whether they fit."""
    node = math.gcd(layout.ep_size, gpus_per_node)
    return [replace(layout, node_dedup=node)] if node > 1 else []


def af_candidates(req: PlanRequest) -> tuple[list[AfCandidate], Counter]:
    """All feasible AF-Pipe candidates (memory-checked), and a count of rejections by reason: every layout with
    every A-lane shape (s, t) that divides its A-groups, and the variants each needs."""
    rejected: Counter = Counter()
    out: list[AfCandidate] = []
    lanes = req.lane_options
    if not lanes:
        rejected["no A-lane shape (s x t) of those asked fits the model and sequence"] += 1
    for layout in _layouts(req, rejected):
        for s, t in lanes:
            if layout.lanes % (s * t):
                rejected["the A-lane (s x t) does not divide an A-group"] += 1
                continue
            base = replace(req.work, sequence_parallel=s, tensor_parallel=t)
            out += _lane_candidates(req, layout, base, rejected)
    return out, rejected


def _lane_candidates(req: PlanRequest, layout: Layout, base: Workload, rejected: Counter) -> list[AfCandidate]:
    """The candidates of one layout and A-lane shape: each memory variant that a cheaper one does not make moot."""
    micro_batches = max(1, round(req.global_batch / (data_lanes(layout, base) * base.micro_batch_size)))
    roomy: list[Workload] = []
    out: list[AfCandidate] = []
    enough = 2 * (2 * layout.depth + 1)  # twice the ring in flight: more memory buys no speed
    for work in _variants(base, req.recompute_options, req.af_variants, experts_in_fp8(req.spec, base)):
        if dominated(work, roomy) or _needless_recompute(req, layout, work, enough):
            continue
        fitted = _fit_memory(req, layout, work, micro_batches)
        if fitted is None:
            rejected[f"does not fit memory (recompute {work.recompute_name})"] += 1
            continue
        for work_fit, mem_a, mem_f, cap in fitted:
            out += _placed(req, layout, work_fit, micro_batches, (mem_a, mem_f), cap, rejected)
            if cap >= enough:
                roomy.append(work)
    return out


def _needless_recompute(req: PlanRequest, layout: Layout, work: Workload, enough: int) -> bool:
    """A per-side variant that recomputes on a side whose memory holds ``enough`` micro-batches under a cheaper policy
    the search tries there: that variant (the other side as it is) is tried too, costs less and fits at least as
    many."""
    if not work.per_side_recompute:
        return False
    for k, side in enumerate(SIDES):
        mine, other = work.recompute_of(side), work.recompute_of(SIDES[1 - k])
        for cheaper in (p for p in req.recompute_options if POLICIES.index(p) < POLICIES.index(mine)):
            less = work.with_recompute(*((cheaper, other) if k == 0 else (other, cheaper)))
            if _memory(req.spec, layout, less)[k].max_in_flight(req.rates.side(side).usable_hbm) >= enough:
                return True
    return False


@lru_cache(maxsize=256)  # one ladder per lane shape, asked for by every layout
def _variants(
    base: Workload, recompute: tuple[Recompute, ...], allowed: frozenset[str], expert_copies: bool
) -> tuple[Workload, ...]:
    return tuple(memory_variants(base, recompute, allowed, expert_copies))


def _fit_memory(
    req: PlanRequest, layout: Layout, work: Workload, micro_batches: int
) -> list[tuple[Workload, RankMemory, RankMemory, int]] | None:
    """The variant as is (if at least one micro-batch fits) and, where offload is allowed and the ring is
    short of 2p + 1 micro-batches, with the smallest offload shares that fill it; None if neither fits."""
    out: list[tuple[Workload, RankMemory, RankMemory, int]] = []
    usable, usable_f = req.rates.usable_hbm, req.rates.side("ffn").usable_hbm
    host_state = req.cluster.gpus_per_node * _host_state(req.spec, layout, work)  # a node of F ranks
    if host_state > req.cluster.host_bytes:
        return None
    mem_a, mem_f = _memory(req.spec, layout, work)
    cap = min(mem_a.max_in_flight(usable), mem_f.max_in_flight(usable_f))
    if cap >= 1:
        out.append((work, mem_a, mem_f, cap))
    ring = min(micro_batches, 2 * layout.depth + 1)
    if "offload" in req.af_variants and cap < ring:
        shares = (
            offload_share(mem_a, layers=layout.layers_per_group, target=ring, usable=usable),
            offload_share(mem_f, layers=layout.layers_per_group, target=ring, usable=usable_f),
        )
        if shares[0] is not None and shares[1] is not None:
            off = replace(work, offload=(shares[0], shares[1]))
            mem_a, mem_f = _memory(req.spec, layout, off)
            off_cap = min(mem_a.max_in_flight(usable), mem_f.max_in_flight(usable_f))
            host = host_state + (
                req.cluster.gpus_per_node * ring * max(mem_a.offloaded_per_micro_batch, mem_f.offloaded_per_micro_batch)
            )
            if off_cap >= ring and host <= req.cluster.host_bytes:
                out.append((off, mem_a, mem_f, off_cap))
    return out or None


def _host_state(spec: ModelSpec, layout: Layout, work: Workload) -> float:
    """Host bytes of the busiest F rank's optimizer state where it is in host memory (0 where it is not)."""
    return max(ffn_host_state_bytes(spec, layout, work, g) for g in range(layout.depth))


def _memory(spec: ModelSpec, layout: Layout, work: Workload) -> tuple[RankMemory, RankMemory]:
    """(A rank, F rank) memory, each cached on a workload holding only what its side reads: the variants of a layout
    differ in the other side's ZeRO stage or offload share, and the F side sees an A-lane's size only (its tokens),
    so most of them share one (``memory.py``'s and ``training_state.py``'s functions, exactly)."""
    a, f = _side_works(work)
    return _attention_memory(spec, layout, a), _ffn_memory(spec, layout, f)


@lru_cache(maxsize=65536)
def _side_works(work: Workload) -> tuple[Workload, Workload]:
    """``work`` with what the A side's memory does not read set to defaults, and the same for the F side (each side's
    recompute policy as the one for both)."""
    a = replace(
        work.with_recompute(*[work.recompute_of("attention")] * 2),
        ffn_zero_stage=None,
        offload=(work.offload[0], 0.0),
        split_backward=False,
        ffn_optimizer_on_host=False,
    )
    f = replace(
        work.with_recompute(*[work.recompute_of("ffn")] * 2),
        attention_zero_stage=None,
        offload=(0.0, work.offload[1]),
        split_backward=False,
        sequence_parallel=work.lane_size,
        tensor_parallel=1,
    )
    return a, f


_attention_memory = lru_cache(maxsize=65536)(attention_rank_memory)
_ffn_memory = lru_cache(maxsize=65536)(ffn_rank_memory)


def _placed(
    req: PlanRequest,
    layout: Layout,
    work: Workload,
    micro_batches: int,
    memory: tuple[RankMemory, RankMemory],
    cap: int,
    rejected: Counter,
) -> list[AfCandidate]:
    """One candidate per placement and NIC split of ``layout`` under ``work``."""
    places = placements(req.cluster, layout.attention_gpus, req.placement, req.granularity)
    s, t = work.sequence_parallel, work.tensor_parallel
    if any(lane_spans(layout, pl, s, t)[1] for pl in places):
        rejected["a TP group would span nodes"] += 1
        places = [pl for pl in places if not lane_spans(layout, pl, s, t)[1]]
    if any(_node_spans(layout, pl) for pl in places):
        rejected["a node_dedup group would span nodes"] += 1
        places = [pl for pl in places if not _node_spans(layout, pl)]
    options = [(pl, nics) for pl in places for nics in pl.nic_splits(req.cluster, layout.attention_gpus)]
    if not options:
        rejected["no placement gives each side a NIC (a shared node with one NIC)"] += 1
    offloaded = (memory[0].offloaded_per_micro_batch, memory[1].offloaded_per_micro_batch)
    optimizer = af_optimizer_s(req.spec, layout, work, req.rates)
    out = []
    for place, nics in options:
        roof = af_roofline(
            req.spec,
            layout,
            work,
            placement=place,
            rates=req.rates,
            nics=nics,
            micro_batches=micro_batches,
            offloaded=offloaded,
        )
        sync = af_sync_s(req.spec, layout, work, placement=place, rates=req.rates, nics=nics)
        out.append(AfCandidate(layout, place, nics, work, micro_batches, cap, roof, *memory, sync, optimizer))
    return out


@lru_cache(maxsize=65536)  # the search asks again for every variant of a layout
def _node_spans(layout: Layout, place: Placement) -> bool:
    m = layout.attention_gpus
    return any(place.spans_nodes(ranks, attention_gpus=m) for ranks in layout.group_ranks().exchange_nodes)


def fills_ring(c: AfCandidate) -> bool:
    """Memory admits the 2p + 1 micro-batches in flight that keep the 2p-stage ring busy (fewer when the step
    has fewer); below that the pipeline is latency-bound and the roofline is far too optimistic."""
    return c.max_in_flight >= min(c.micro_batches, 2 * c.layout.depth + 1)


def _rank_key(c: AfCandidate) -> tuple[bool, float, float, int]:
    """Ring-filling candidates first; then roofline bottleneck per token; then the most network slack
    (transfers hide better in the pipeline); then the most micro-batches that fit in flight."""
    network = max(c.roofline.attention.network_s, c.roofline.ffn.network_s)
    step = c.roofline.bottleneck_s + c.exposed_sync_s + c.optimizer_step_s
    return (not fills_ring(c), step / c.tokens, network / c.tokens, -c.max_in_flight)


def _family(c: AfCandidate) -> tuple:
    w = c.work
    lane = (w.sequence_parallel, w.tensor_parallel)
    return (
        c.layout.depth,
        c.placement.kind,
        lane,
        w.recompute_of("attention"),
        w.recompute_of("ffn"),
        w.resend,
        w.offload != (0.0, 0.0),
        savings(w),
        fills_ring(c),
        c.layout.node_dedup > 1,  # it moves time from the network to the F ranks' compute: the schedule decides
    )


def shortlist(ranked: list[AfCandidate], top: int) -> list[AfCandidate]:
    """The families to simulate: each one that is among the ``top`` best ranked of the families using a subset
    of its options (variants and A-lane degrees, ``variants.search_options``; the ring-filling ones only, where any
    of those does: a starved ring loses to a filled one).

    That is the union, over every set of allowed options, of what a search with only those options would
    simulate, so allowing more options never loses a plan a smaller set finds: the search is monotone in the
    options (a global top few is not: new families push the old winner out of the shortlist unsimulated)."""
    used = [search_options(c.work) for c in ranked]
    fills = [fills_ring(c) for c in ranked]
    subsets = {u: [v for v in set(used) if v <= u] for u in set(used)}  # a handful of option sets
    filling_sets = {u for u, f in zip(used, fills, strict=True) if f}
    # counts of the families seen so far (ranked order: up to c), all and ring-filling, per option set
    seen, seen_filling = Counter[frozenset[str]](), Counter[frozenset[str]]()
    out = []
    for c, u, f in zip(ranked, used, fills, strict=True):
        seen[u] += 1
        seen_filling[u] += f
        if not f and any(v in filling_sets for v in subsets[u]):
            continue
        if sum((seen_filling if f else seen)[v] for v in subsets[u]) <= top:
            out.append(c)
    return out


def to_simulate(candidates: list[AfCandidate], per_variant_set: int) -> list[AfCandidate]:
    """The shortlisted families' (``shortlist``, each ranked by its best candidate) near ties (``near_ties``)."""
    families: dict[tuple, list[AfCandidate]] = {}
    for c in sorted(candidates, key=_rank_key):
        families.setdefault(_family(c), []).append(c)
    ranked = sorted((members[0] for members in families.values()), key=_rank_key)
    return [c for first in shortlist(ranked, per_variant_set) for c in near_ties(families[_family(first)])]


# Roofline steps this close apart are a tie only the schedule breaks: a family's members differ in M:N, expert-DP and
# NIC split, which move per-micro-batch transfers that the roofline's per-step sums do not see (planner.md 18).
NEAR_TIE = 0.01


def near_ties(members: list[AfCandidate]) -> list[AfCandidate]:
    """A family's members (ranked) whose roofline step is within ``NEAR_TIE`` of its first's."""
    first = _rank_key(members[0])[1]
    return [c for c in members if _rank_key(c)[1] <= first * (1 + NEAR_TIE)]


def best_tokens_per_s(c: AfCandidate) -> float:
    """An upper bound on any simulated plan of ``c``: its step is never below T* plus the sync and optimizer."""
    return c.tokens / (c.roofline.bottleneck_s + c.exposed_sync_s + c.optimizer_step_s)


def best_af(req: PlanRequest) -> tuple[AfPlan | None, Counter]:
    """The near ties of each (depth, placement, A-lane, variant) family's best roofline candidate, simulated
    (``to_simulate``); highest throughput wins, the earliest in ``best_tokens_per_s`` order on a tie. Candidates are
    simulated most promising first (by the tighter bound of ``af_simulation``) and skipped once that bound cannot
    beat the best plan so far, which gives the plan simulating all of them would."""
    candidates, rejected = af_candidates(req)
    listed = sorted(to_simulate(candidates, req.simulate_per_variant_set), key=lambda c: -best_tokens_per_s(c))
    splits = (False, True) if "split_backward" in req.af_variants else (False,)  # the split changes the schedule only
    bounded = [(i, c, forms(req, c, splits)) for i, c in enumerate(listed)]
    bounded.sort(key=lambda entry: -bound_tokens_per_s(entry[1], entry[2]))
    memo: Memo = {}
    best: tuple[float, int, AfPlan] | None = None  # (tokens/s, -position in ``listed``, plan): the larger wins
    for i, c, shapes in bounded:
        bound = bound_tokens_per_s(c, shapes)
        if best is not None and (bound, -i) < best[:2]:
            if bound < best[0]:
                break  # and so is every later one's
            continue  # at most a tie, and a later one
        plan = simulate_candidate(req, c, splits=splits, memo=memo, shapes=shapes)
        if best is None or (plan.tokens_per_s, -i) > best[:2]:
            best = (plan.tokens_per_s, -i, plan)
    if best is None:
        return None, rejected
    kept = best[2].candidate
    return simulate_candidate(req, kept, exposed_comm=True, splits=(kept.work.split_backward,), memo=memo), rejected


# ----- co-located baseline search (colocated.py) -----
def best_baseline(req: PlanRequest) -> tuple[BaselinePlan | None, Counter]:
    """The fastest simulated co-located configuration: plain EP+DP interleaved 1F1B (``req.baseline == "ep"``) or
    the strongest Megatron configuration. Every candidate counts; those whose lower bound (``bound_s``) cannot beat
    the fastest simulated so far are skipped, trying them in the order of their closed-form estimate."""
    candidates, rejected = baseline_candidates(req)
    best: BaselinePlan | None = None
    for c in sorted(candidates, key=lambda c: c.estimate_s / c.tokens):
        if best is not None and c.tokens / c.bound_s <= best.tokens_per_s:
            continue
        plan = BaselinePlan(c, simulate_colocated(c.costs, shape=c.shape, micro_batches=c.micro_batches))
        if best is None or plan.tokens_per_s > best.tokens_per_s:
            best = plan
    return best, rejected


def baseline_candidates(req: PlanRequest) -> tuple[list[ColocatedCandidate], Counter]:
    """The request's co-located configurations that divide and fit, and what rejected the others."""
    return colocated_candidates(
        req.spec,
        req.cluster,
        req.baseline_rates,
        req.work,
        global_batch=req.global_batch,
        overlap=req.baseline_overlap,
        ep=req.baseline_ep,
        kind=req.baseline,
        dispatcher=req.dispatcher,
        only=req.baseline_layout,
        recompute=req.baseline_recompute,
    )


RUNNABLE_VPP = (1, 2, 3, 4)  # the virtual stages per stage best_runnable_colocated tries


def best_runnable_colocated(req: PlanRequest) -> BaselinePlan | None:
    """The fastest co-located configuration DisagMoE-DS's co-located mode runs (``run_pretrain.py --mode
    colocated``): EP x DP under ZeRO in PP stages of up to 4 virtual stages each, run (interleaved) 1F1B
    (Megatron's layer split, ``pipeline_split``), s x t ranks of a stage holding each micro-batch (Ulysses over s,
    TP with sequence parallel over t: ``req.lane_options``; ``colocated_refusal`` says which of them the runtime
    runs), the cheapest recompute policy that fits, a plain all-to-all. None: none fits."""
    W, layers, spec, lora = req.cluster.world_size, req.spec.num_layers, req.spec, req.work.lora.enabled
    stages = [(pp, v) for pp in divisors(W) for v in RUNNABLE_VPP if (v == 1 or pp > 1) and chunk_sizes(layers, pp, v)]
    shapes = [
        Shape(pp=pp, vpp=v, tp=t, cp=s, ep=e, overlap="partial", dispatcher="alltoall", ulysses=s > 1)
        for pp, v in stages
        for s, t in req.lane_options
        for e in divisors(spec.num_experts)
        if (W // pp) % e == 0 and (W // pp) % (s * t) == 0
    ]
    runnable = [s for s in shapes if colocated_refusal(s, spec.model_type, lora=lora) is None]
    ours = replace(req, baseline_recompute=None, baseline_sinks="flex")
    plans = [best_baseline(replace(ours, baseline_layout=s))[0] for s in runnable]
    return max((p for p in plans if p is not None), key=lambda p: p.tokens_per_s, default=None)


def colocated_refusal(shape: Shape, model_type: str, *, lora: bool) -> str | None:
    """What of a co-located configuration the runtime's co-located mode does not run (None: it runs it): that mode
    is EP x DP under ZeRO in pipeline stages (virtual ones too) run (interleaved) 1F1B, with any recompute policy,
    its lanes Ulysses over s and TP over t where t divides EP and the family and job allow them."""
    missing = [f"ring CP {shape.cp}"] if shape.cp > 1 and not shape.ulysses else []
    missing += [f"TP {shape.tp} beside EP {shape.ep} (TP must divide EP)"] if shape.ep % shape.tp else []
    ulysses = shape.cp if shape.ulysses else 1
    missing += lane_refusals(model_type, ulysses, shape.tp, lora=lora)
    return ", ".join(missing) or None


def lane_refusals(model_type: str, s: int, t: int, *, lora: bool) -> list[str]:
    """Why the runtime refuses lanes of Ulysses s x TP t for this family and job, one line each
    (``capabilities.rules``); empty: it runs them."""
    return [str(e) for e in refusals(Job.of(model_type, sequence_parallel=s, tensor_parallel=t, lora=lora))]


def plan(req: PlanRequest) -> PlanResult:
    """Best AF-Pipe plan, best co-located baseline, and what was rejected on the way."""
    af, rejected = best_af(req)
    baseline, baseline_rejected = best_baseline(req)
    return PlanResult(req, af, baseline, rejected, baseline_rejected)
