"""The strongest co-located baseline: what Megatron-LM users run for MoE (pure Python).

Every rank holds attention and a slice of the experts. On top of the plain EP+DP interleaved 1F1B
(``--baseline ep``: t = c = 1, partial overlap), this searches what Megatron-Core offers and models each from first
principles (bytes over links, FLOPs over rates; nothing is fitted to make either system win):

* **Tensor parallel** t (with sequence parallel; 1, 2, 4, 8 inside a node, dividing the query and KV heads):
  attention, shared experts, dense MLPs and the vocabulary are split t ways, as are all activations. Per
  TP block the forward all-gathers and reduce-scatters the B*s*H/cp bf16 hidden state, the backward does
  three (the extra all-gather re-gathers the input for the weight gradient); each moves (t-1)/t of the
  tensor over NVLink. With ``--tp-comm-overlap`` these pipeline with the block's GEMMs, so only the part
  longer than the GEMMs is exposed.
* **Context parallel** c (1-16, ring attention with the load-balanced causal split): each layer's forward
  passes (c-1)/c of the sequence's K and V around the ring (MLA: the up-projected per-head K and V), the
  backward K, V again plus dK, dV; over NVLink while t*c fits a node, else the NICs. The ring overlaps the
  attention core, so only the part longer than the core is exposed.
* **MoE parallel folding**: experts use EP ep with expert-TP 1 over the W/pp ranks of a stage independently
  of t and c; each rank dispatches its B*s/(t c) tokens with Megatron's all-to-all dispatcher (top_k copies) or
  DeepEP's (once per destination node; ``colocated_costs.alltoall_s``).
* **Distributed optimizer** over all data-parallel ranks: dense state over W/(pp t), expert state over
  W/(pp ep), with Megatron's fp32 main grads (``memory.baseline_rank_memory``).
* **Pipeline stages** pp x vpp, any pp up to L: uneven first and last stages where pp x vpp does not divide L
  (``pipeline_split``).
* **All-to-all overlap** "paired" (Megatron's combined 1F1B EP overlap, DualPipe's idea): in the steady
  state a forward chunk of one micro-batch and a backward chunk of another run as one unit, hiding
  ``A2A_HIDDEN_SHARE`` of the smaller of its compute and all-to-all (Megatron's measured gain, not their max).
  Only where Megatron allows it (``paired_allowed``). It costs pp more chunks of activations (warm-up
  forwards). Outside it nothing hides but the shared experts (``--baseline-overlap`` 0).
* **Recompute** none, selective (``recompute.py``) or full, as for AF-Pipe.

Compute runs at the per-shape shares of ``gemm_efficiency`` (or a profile's measured parts); routing imbalance is
an input (``Rates.routing_imbalance``). docs/planner.md section 8 holds the result against published runs.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, replace
from functools import lru_cache

from disagmoe_ds.planner.attention_lanes import lane_refusal
from disagmoe_ds.planner.cluster import Cluster, Rates
from disagmoe_ds.planner.colocated_costs import ColocatedCosts, Shape, colocated_costs, tp_options
from disagmoe_ds.planner.fp8_costs import experts_in_fp8
from disagmoe_ds.planner.gemm_efficiency import MIN_ROWS_PER_RANK
from disagmoe_ds.planner.grad_sync import baseline_sync_s, exposed_sync_s
from disagmoe_ds.planner.memory import RankMemory, baseline_rank_memory
from disagmoe_ds.planner.model import ModelSpec
from disagmoe_ds.planner.optimizer_step import baseline_optimizer_s
from disagmoe_ds.planner.pipeline_split import chunk_sizes
from disagmoe_ds.planner.recompute import Recompute
from disagmoe_ds.planner.simulate import Op, SimResult, input_ready, megatron_order, run_in_order
from disagmoe_ds.planner.workload import Workload

OVERLAPS = ("partial", "paired")
# The combined 1F1B all-to-all overlap (``paired``) hides this share of what it could hide, min(compute, a2a) of a
# fused unit: max(compute, a2a) would credit Qwen3-235B-A22B's published run +22-39% where Megatron measured
# +12.7% (19.7 -> 17.6 s; +3.7-7.8% on a DeepSeek-V3 proxy): SM contention and the dependencies inside a layer
# leave most of it exposed. Calibrated on that run (docs/planner.md section 8).
A2A_HIDDEN_SHARE = 0.45
CONTEXT_PARALLEL = (1, 2, 4, 8, 16)


# ----- schedule -----
def paired_order(pp: int, vpp: int, micro_batches: int, rank: int) -> list[tuple[Op, ...]]:
    """Megatron's (interleaved) 1F1B order with one more warm-up forward, the steady state's forward and
    backward fused into one unit (combined 1F1B), as single-op units otherwise.

    >>> [len(u) for u in paired_order(1, 1, 3, 0)]
    [1, 2, 2, 1]
    >>> [len(u) for u in paired_order(2, 1, 4, 0)]
    [1, 1, 1, 2, 1, 1, 1]
    >>> sum(len(u) == 1 for u in paired_order(2, 2, 4, 0)[:8])  # interleaved: pp more warm-up forwards
    7
    """
    plain = megatron_order(pp, vpp, micro_batches, rank)
    forwards = [o for o in plain if o.forward]
    backwards = [o for o in plain if not o.forward]
    first_backward = sum(1 for o in plain[: plain.index(backwards[0])] if o.forward)  # Megatron's warm-up + 1
    # A fused unit hands its forward on only when it ends, so each rank runs pp - rank - 1 more warm-up forwards
    # (the next stage's units then never wait for this one's); the last forward before the first backward
    # already pairs with it in Megatron's steady state. Interleaved, pp more (fewer deadlock: a chunk's backward
    # can wait on a forward of the same round that a later fused unit would hold back).
    warm = min(len(forwards), first_backward + (pp - rank - 1 if vpp == 1 else pp))
    units: list[tuple[Op, ...]] = [(f,) for f in forwards[:warm]]
    steady = min(len(forwards) - warm, len(backwards))
    units += [(forwards[warm + k], backwards[k]) for k in range(steady)]
    return units + [(b,) for b in backwards[steady:]]


def simulate_colocated(costs: ColocatedCosts, *, shape: Shape, micro_batches: int) -> SimResult:
    """Co-located pipeline step (plain 1F1B or paired); compute, exposed communication and bubble shares."""
    timed = _run(costs, shape, micro_batches)
    zero = (0.0,) * len(costs.fwd_comm)
    free_costs = replace(
        costs, fwd_comm=zero, bwd_comm=zero, fwd_a2a=zero, bwd_a2a=zero, fwd_other=zero, bwd_other=zero, p2p_s=0.0
    )
    step = max(end for end, _ in timed)
    return SimResult.from_steps(
        f"co-located ({shape.describe()}, {micro_batches} micro-batches)",
        step_s=step,
        free_step_s=max(end for end, _ in _run(free_costs, shape, micro_batches)),
        compute_fraction=sum(c for _, c in timed) / (shape.pp * step),
    )


def _unit_s(costs: ColocatedCosts, unit: tuple[Op, ...], stage: list[int]) -> tuple[float, float]:
    """(duration, compute) of a unit: one op with its exposed communication, or a fused forward/backward pair
    whose all-to-alls hide behind each other's compute."""
    if len(unit) == 1:
        op, s = unit[0], stage[0]
        comp = (costs.fwd_compute if op.forward else costs.bwd_compute)[s]
        return comp + (costs.fwd_comm if op.forward else costs.bwd_comm)[s], comp
    f, b = stage
    comp = costs.fwd_compute[f] + costs.bwd_compute[b]
    a2a = costs.fwd_a2a[f] + costs.bwd_a2a[b]
    return paired_unit_s(comp, a2a) + costs.fwd_other[f] + costs.bwd_other[b], comp


def paired_unit_s(compute: float, a2a: float) -> float:
    """A fused forward/backward unit: its compute and all-to-all, less the share ``A2A_HIDDEN_SHARE`` of what
    could hide (the smaller of the two) that Megatron's combined 1F1B actually hides."""
    return compute + a2a - A2A_HIDDEN_SHARE * min(compute, a2a)


def paired_allowed(shape: Shape, recompute: str) -> bool:
    """Megatron-Core refuses the combined 1F1B all-to-all overlap with full recompute, and with pipeline stages
    unless they are virtual (``--overlap-moe-expert-parallel-comm`` needs pp == 1 or vpp > 1)."""
    return recompute != "full" and (shape.pp == 1 or shape.vpp > 1)


@lru_cache(maxsize=256)  # each simulation runs twice (with and without communication), every cap alike
def _orders(pp: int, vpp: int, micro_batches: int, paired: bool) -> tuple[tuple[tuple[Op, ...], ...], ...]:
    """Every pipeline rank's units in order: fused pairs (``paired_order``) or single ops (``megatron_order``)."""
    if paired:
        return tuple(tuple(paired_order(pp, vpp, micro_batches, r)) for r in range(pp))
    return tuple(tuple((o,) for o in megatron_order(pp, vpp, micro_batches, r)) for r in range(pp))


def _run(costs: ColocatedCosts, shape: Shape, micro_batches: int) -> list[tuple[float, float]]:
    """(end, compute seconds) per unit; every unit waits for its ops' inputs (``simulate.input_ready``)."""
    pp, vpp = shape.pp, shape.vpp
    orders = _orders(pp, vpp, micro_batches, shape.overlap == "paired")
    done: dict[tuple[bool, int, int], float] = {}
    free, out, last = [0.0] * pp, [], pp * vpp - 1

    def start(r: int, unit: tuple[Op, ...]) -> bool:
        stages = [op.chunk * pp + r for op in unit]
        ready = [input_ready(done, op, s, last, pp, costs.p2p_s) for op, s in zip(unit, stages)]
        known = [x for x in ready if x is not None]
        if len(known) < len(ready):
            return False
        duration, comp = _unit_s(costs, unit, stages)
        end = max(free[r], *known) + duration
        for op, s in zip(unit, stages):
            done[op.forward, s, op.micro_batch] = end
        free[r] = end
        out.append((end, comp))
        return True

    run_in_order(orders, start, deadlock=f"co-located simulation deadlocked ({shape.describe()})")
    return out


# ----- search -----
@dataclass(frozen=True)
class ColocatedCandidate:
    """A co-located configuration that divides and fits memory, with its costs."""

    shape: Shape
    work: Workload
    micro_batches: int
    memory: RankMemory
    costs: ColocatedCosts
    replicas: int  # model replicas (data parallel) W / (pp tp cp)
    sync_s: float
    optimizer_step_s: float  # the heaviest stage's optimizer step, after the global gradient norm

    @property
    def tokens(self) -> int:
        return self.micro_batches * self.replicas * self.work.tokens_per_micro_batch

    @property
    def exposed_sync_s(self) -> float:
        return exposed_sync_s(self.sync_s, self.micro_batches * sum(self.costs.bwd_compute) / self.shape.pp)

    @property
    def bound_s(self) -> float:
        """A lower bound on the simulated step (``BaselinePlan.step_time_s``): the busiest pipeline rank's units run
        one after another, each op at least its compute and, fused into a pair, its exposed communication less the
        most a pair hides of its all-to-all (``paired_unit_s``); plus sync and optimizer step."""
        c, s = self.costs, self.shape
        floor = []
        for i in range(len(c.fwd_compute)):
            comm = c.fwd_comm[i] + c.bwd_comm[i]
            if s.overlap == "paired":
                hidden = A2A_HIDDEN_SHARE * (c.fwd_a2a[i] + c.bwd_a2a[i])
                comm = min(comm, c.fwd_other[i] + c.bwd_other[i] + c.fwd_a2a[i] + c.bwd_a2a[i] - hidden)
            floor.append(c.fwd_compute[i] + c.bwd_compute[i] + comm)
        busiest = max(sum(floor[chunk * s.pp + r] for chunk in range(s.vpp)) for r in range(s.pp))
        return self.micro_batches * busiest + self.exposed_sync_s + self.optimizer_step_s

    @property
    def estimate_s(self) -> float:
        """(m v + pp - 1) x the slowest chunk's fwd+bwd unit, plus hops, sync and optimizer step: for ranking."""
        units = []
        for i in range(len(self.costs.fwd_compute)):
            comp = self.costs.fwd_compute[i] + self.costs.bwd_compute[i]
            other = self.costs.fwd_other[i] + self.costs.bwd_other[i]
            if self.shape.overlap == "paired":
                units.append(paired_unit_s(comp, self.costs.fwd_a2a[i] + self.costs.bwd_a2a[i]) + other)
            else:
                units.append(comp + self.costs.fwd_comm[i] + self.costs.bwd_comm[i])
        s = self.shape
        hops = 2 * (s.pp - 1) * self.costs.p2p_s
        return (self.micro_batches * s.vpp + s.pp - 1) * max(units) + hops + self.exposed_sync_s + self.optimizer_step_s


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def shapes(
    spec: ModelSpec,
    cluster: Cluster,
    seq_len: int,
    *,
    micro_batch_size: int,
    ep: int | None,
    kind: str,
    dispatcher: str = "alltoall",
) -> Iterator[Shape]:
    """Every shape of a ``kind`` of baseline that splits: plain EP (t = c = 1, partial overlap), the strongest (TP,
    CP, overlap; PP need not divide the layer count: ``pipeline_split``'s smaller first and last stages), or what
    DeepSpeed runs on an HF MoE model (``deepspeed_shapes``)."""
    if kind == "deepspeed":
        yield from deepspeed_shapes(spec, cluster, seq_len * micro_batch_size, ep=ep)
        return
    strongest = kind == "strongest"
    world = cluster.world_size
    tps = tp_options(spec, cluster.gpus_per_node) if strongest else [1]
    cps = [c for c in CONTEXT_PARALLEL if seq_len % (2 * c) == 0] if strongest else [1]
    rows = seq_len * micro_batch_size
    overlaps = OVERLAPS if strongest else ("partial",)
    for pp in (p for p in divisors(world) if p <= spec.num_layers):
        eps = [e for e in divisors(spec.num_experts) if (world // pp) % e == 0 and e in (ep or e,)]
        for vpp in (v for v in range(1, 9) if (v == 1 or pp > 1) and chunk_sizes(spec.num_layers, pp, v)):
            for t in tps:
                for c in (
                    c for c in cps if world % (pp * t * c) == 0 and rows // (t * c) >= min(rows, MIN_ROWS_PER_RANK)
                ):
                    for e in eps:
                        for ov in overlaps:
                            yield Shape(pp, vpp, t, c, e, ov, dispatcher)


def deepspeed_shapes(spec: ModelSpec, cluster: Cluster, rows: int, *, ep: int | None) -> Iterator[Shape]:
    """What a DeepSpeed user runs on an HF MoE model: AutoEP's expert parallelism over ZeRO data parallelism, no
    pipeline stages, DeepSpeed-Ulysses over c ranks (its all-to-alls exposed: ``colocated_costs.tp_cp_exposed_s``) and
    AutoTP over t (t = 1 too: without AutoTP), AutoEP's all-to-all or, without AutoTP, its DeepEP transport
    (``"comm_backend": "deepep"``: one copy per destination node; it refuses folded TP), nothing overlapped but the
    shared experts, and bf16 gradients (DeepSpeed's, not Megatron's fp32 main grads). Only what DeepSpeed 0.19's
    AutoEP accepts (``module_inject.auto_ep_folding.validate_folding_global``): AutoTP with Ulysses is refused, and
    AutoTP needs an expert-parallel group of more than one rank."""
    world = cluster.world_size
    for t in tp_options(spec, cluster.gpus_per_node):  # 1 first: without AutoTP
        for c in CONTEXT_PARALLEL if t == 1 else (1,):
            fits = world % (t * c) == 0 and rows // (t * c) >= min(rows, MIN_ROWS_PER_RANK)
            if not fits or (c > 1 and lane_refusal(spec, c, t, tokens=rows, gpus_per_node=cluster.gpus_per_node)):
                continue
            for e in divisors(spec.num_experts):
                if world % e == 0 and e in (ep or e,) and (t == 1 or e > 1):
                    for dispatcher in ("alltoall", "deepep") if t == 1 and e > 1 else ("alltoall",):
                        yield Shape(1, 1, t, c, e, "partial", dispatcher, fp32_grads=False, ulysses=True)


def colocated_candidates(
    spec: ModelSpec,
    cluster: Cluster,
    rates: Rates,
    work: Workload,
    *,
    global_batch: int,
    overlap: float,
    ep: int | None = None,
    kind: str = "strongest",
    dispatcher: str = "alltoall",
    only: Shape | None = None,
    recompute: Recompute | None = None,
) -> tuple[list[ColocatedCandidate], Counter]:
    """Configurations that divide and fit memory, each with the cheapest recompute policy that fits (or
    ``recompute``); ``only`` prices that one shape instead of searching."""
    policies: tuple[Recompute, ...] = ("none", "selective", "full") if kind == "strongest" else ("none", "full")
    policies = (recompute,) if recompute else policies
    rejected: Counter = Counter()
    out = []
    found = (
        [only]
        if only
        else shapes(
            spec,
            cluster,
            work.seq_len,
            micro_batch_size=work.micro_batch_size,
            ep=ep,
            kind=kind,
            dispatcher=dispatcher,
        )
    )
    for shape in found:
        replicas = cluster.world_size // (shape.pp * shape.tp * shape.cp)
        micro_batches = max(1, round(global_batch / (replicas * work.micro_batch_size)))
        if shape.vpp > 1:
            micro_batches = max(shape.pp, -(-micro_batches // shape.pp) * shape.pp)  # Megatron: a multiple of pp
        alive = _chunks_alive(shape, micro_batches)
        for w in _memory_options(work, policies, zero2=kind == "deepspeed", expert_copies=experts_in_fp8(spec, work)):
            rc = w.recompute
            if shape.overlap == "paired" and not paired_allowed(shape, rc):
                rejected["Megatron refuses the 1F1B a2a overlap here (full recompute, or PP > 1 without VPP)"] += 1
                continue
            mem = baseline_rank_memory(spec, w, shape, world_size=cluster.world_size, chunks_alive=alive)
            if mem.total > rates.usable_hbm:
                rejected[f"does not fit memory (recompute {rc})"] += 1
                continue
            costs = colocated_costs(spec, w, shape, cluster=cluster, rates=rates, overlap=overlap)
            sync = baseline_sync_s(spec, w, shape, cluster=cluster, rates=rates, micro_batches=micro_batches)
            optimizer = baseline_optimizer_s(spec, w, shape, world_size=cluster.world_size, rates=rates)
            out.append(ColocatedCandidate(shape, w, micro_batches, mem, costs, replicas, sync, optimizer))
            break
    return out, rejected


def _memory_options(
    work: Workload, policies: Iterable[Recompute], *, zero2: bool = False, expert_copies: bool = True
) -> Iterator[Workload]:
    """``work`` under each recompute policy, cheapest first, each followed by ZeRO-2 where ``zero2`` (DeepSpeed's:
    gradients sharded too) and, where the step keeps FP8 copies of the expert weights (``expert_copies``), by the
    variant without them (``Workload.fp8_cast_per_call``)."""
    stages = (work.zero_stage, 2) if zero2 and work.zero_stage < 2 else (work.zero_stage,)
    for rc in policies:
        for stage in stages:
            w = replace(work, recompute=rc, zero_stage=stage)
            yield w
            if w.fp8_cast_once and expert_copies:
                yield replace(w, fp8_cast_per_call=True)


def _chunks_alive(shape: Shape, micro_batches: int) -> int:
    """Chunks alive on the first rank at the end of the warm-up, plus one (plus one more when paired)."""
    pp, vpp = shape.pp, shape.vpp
    warm = pp - 1 if vpp == 1 else (pp - 1) * 2 + (vpp - 1) * pp
    return min(warm + (pp if shape.overlap == "paired" else 0), micro_batches * vpp) + 1
