"""The strongest co-located baseline: what Megatron-LM users run for MoE (pure Python).

Every rank holds attention and a slice of the experts. On top of the plain EP+DP interleaved 1F1B
(``stages.baseline_chunk_costs``), this searches what Megatron-Core offers and models each from first
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
  of t and c; each rank dispatches its B*s/(t c) tokens top_k times (Megatron's all-to-all dispatcher).
* **Distributed optimizer** over all data-parallel ranks: dense state over W/(pp t), expert state over
  W/(pp ep) (``memory.baseline_rank_memory``).
* **All-to-all overlap** "paired" (Megatron's combined 1F1B EP overlap, DualPipe's idea): in the steady
  state a forward chunk of one micro-batch and a backward chunk of another run as one unit, each one's
  dispatch/combine hidden behind the other's compute: the unit takes max(compute, all-to-all). It costs one
  more chunk of activations (one more warm-up forward). Warm-up and cool-down keep the partial overlap.
* **Recompute** none, selective (``recompute.py``) or full, as for AF-Pipe.

Not modelled (each would make the baseline slower, so leaving it out keeps the baseline strong): GEMM
efficiency loss of smaller TP shards, SM contention between overlapped communication and compute, routing
imbalance. Not searched: uneven pipeline stages (DeepSeek-V3's 61 layers allow only pp = 1 here).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, replace

from disagmoe_ds.planner.cluster import Cluster, Rates
from disagmoe_ds.planner.memory import RankMemory, Workload, baseline_rank_memory
from disagmoe_ds.planner.model import ACT_BYTES, ModelSpec
from disagmoe_ds.planner.simulate import Op, SimResult, _input_ready, megatron_order
from disagmoe_ds.planner.stages import (
    BaselineChunkCosts,
    alltoall_s,
    attention_call_s,
    baseline_sync_s,
    expert_call_s,
    exposed_sync_s,
    head_call_s,
)

OVERLAPS = ("partial", "paired")
CONTEXT_PARALLEL = (1, 2, 4, 8, 16)
# The planner's compute efficiency holds for GEMMs that fill the GPU: with 128 x 256 output tiles over 132 SMs a
# projection of N = 2048-8192 columns needs about 1K rows to give every SM a tile. TP x CP shards the rows
# (tokens) of a micro-batch, so shapes leaving fewer than this many tokens per rank are not searched.
MIN_ROWS_PER_RANK = 1024


@dataclass(frozen=True)
class Shape:
    """A co-located configuration: pipeline (pp x vpp), tensor, context and expert parallel, a2a overlap."""

    pp: int
    vpp: int
    tp: int
    cp: int
    ep: int
    overlap: str

    def describe(self) -> str:
        return f"TP {self.tp} CP {self.cp} EP {self.ep} PP {self.pp} x v {self.vpp}, a2a overlap {self.overlap}"


@dataclass(frozen=True)
class ColocatedCosts(BaselineChunkCosts):
    """Per-chunk costs with the raw all-to-all (for paired overlap) and the exposed TP/CP communication."""

    fwd_a2a: tuple[float, ...] = ()
    bwd_a2a: tuple[float, ...] = ()
    fwd_other: tuple[float, ...] = ()
    bwd_other: tuple[float, ...] = ()


def tp_options(spec: ModelSpec, gpus_per_node: int) -> list[int]:
    """TP sizes inside a node that divide the query heads and (GQA) the KV heads, as Megatron requires."""
    a = spec.attention
    heads = (a.num_heads, a.num_kv_heads) if a.kind == "gqa" else (a.num_heads,)
    return [t for t in (1, 2, 4, 8) if t <= gpus_per_node and all(h % t == 0 for h in heads)]


def kv_bytes_per_token(spec: ModelSpec, tp: int) -> float:
    """K and V of one token on one TP rank, the tensors ring attention passes around (bf16)."""
    a = spec.attention
    if a.kind == "gqa":
        return 2 * ACT_BYTES * a.num_kv_heads * a.head_dim / tp
    return ACT_BYTES * a.num_heads * (a.head_dim + a.v_head_dim) / tp


def tp_cp_exposed_s(
    spec: ModelSpec, work: Workload, shape: Shape, *, layer: int, cluster: Cluster, rates: Rates
) -> tuple[float, float]:
    """(forward, backward) seconds of TP and CP communication of one layer not hidden behind its compute."""
    t, c = shape.tp, shape.cp
    tokens = work.tokens_per_micro_batch / (t * c)
    core_flops = tokens * spec.attention_core_flops(work.seq_len, layer)
    core = rates.attention_fwd.seconds(0.0, core_flops, calls=0)
    linear = rates.attention_fwd.seconds(tokens * spec.attention_side_flops(work.seq_len, layer) - core_flops, calls=0)
    blocks = 1 + (1 if spec.shared_intermediate or not spec.moe_layers[layer] else 0)
    tp_bytes = blocks * 2 * (t - 1) / t * (work.tokens_per_micro_batch / c) * ACT_BYTES * spec.hidden_size
    tp_s = tp_bytes / rates.nvlink_bw
    cp_bytes = (c - 1) / c * work.tokens_per_micro_batch * kv_bytes_per_token(spec, t)
    nic_per_gpu = cluster.nics_per_node * rates.nic_bw / cluster.gpus_per_node
    cp_rate = rates.nvlink_bw if t * c <= cluster.gpus_per_node else nic_per_gpu
    cp_s = cp_bytes / cp_rate if c > 1 else 0.0
    fwd = max(0.0, tp_s - linear) + max(0.0, cp_s - core)
    bwd = max(0.0, 1.5 * tp_s - 2 * linear) + max(0.0, 2 * cp_s - 2 * core)
    return fwd, bwd


def colocated_costs(
    spec: ModelSpec, work: Workload, shape: Shape, *, cluster: Cluster, rates: Rates, overlap: float
) -> ColocatedCosts:
    """Per-chunk compute, exposed communication (alone) and raw all-to-all (paired) of one rank."""
    t, c = shape.tp, shape.cp
    tokens = work.tokens_per_micro_batch / (t * c)
    a2a = alltoall_s(spec, work, ep=shape.ep, cluster=cluster, rates=rates) / (t * c)
    shared = rates.attention_fwd.per_flop * tokens * spec.shared_flops()
    alone = max(0.0, 2 * a2a - min(2 * a2a, overlap * 2 * a2a + shared))
    per_chunk = spec.num_layers // (shape.pp * shape.vpp)
    rows: dict[str, list[float]] = {k: [] for k in ("fc", "bc", "fx", "bx", "fa", "ba", "fo", "bo")}
    for start in range(0, spec.num_layers, per_chunk):
        layers = range(start, start + per_chunk)
        fc = bc = fo = bo = 0.0
        for i in layers:
            for fwd, bwd in (
                attention_call_s(spec, rates, seq_len=work.seq_len, layer=i, tokens=tokens, recompute=work.recompute),
                expert_call_s(spec, rates, layer=i, tokens=tokens, recompute=work.recompute),
            ):
                fc, bc = fc + fwd, bc + bwd
            other = tp_cp_exposed_s(spec, work, shape, layer=i, cluster=cluster, rates=rates)
            fo, bo = fo + other[0], bo + other[1]
        if start + per_chunk == spec.num_layers:
            head = head_call_s(spec, rates, tokens=tokens)
            fc, bc = fc + head[0], bc + head[1]
        moe = sum(spec.moe_layers[start : start + per_chunk])
        redo = 2 if work.recompute == "full" else 1  # full recompute re-runs the forward all-to-alls
        for key, value in zip(
            rows, (fc, bc, moe * alone + fo, redo * moe * alone + bo, moe * 2 * a2a, redo * moe * 2 * a2a, fo, bo)
        ):
            rows[key].append(value)
    p2p = _stage_p2p_s(spec, work, shape, cluster=cluster, rates=rates)
    r = {k: tuple(v) for k, v in rows.items()}
    return ColocatedCosts(r["fc"], r["bc"], r["fx"], r["bx"], a2a, p2p, r["fa"], r["ba"], r["fo"], r["bo"])


def _stage_p2p_s(spec: ModelSpec, work: Workload, shape: Shape, *, cluster: Cluster, rates: Rates) -> float:
    """Stage-to-stage hand-off of a rank's B*s*H/(t c) slice: through NICs when a stage fills whole nodes."""
    if shape.pp == 1:
        return 0.0
    nbytes = work.tokens_per_micro_batch / (shape.tp * shape.cp) * ACT_BYTES * spec.hidden_size
    if cluster.world_size // shape.pp >= cluster.gpus_per_node:
        return nbytes / (cluster.nics_per_node * rates.nic_bw / cluster.gpus_per_node)
    return nbytes / rates.nvlink_bw


# ----- schedule -----
def paired_order(pp: int, vpp: int, micro_batches: int, rank: int) -> list[tuple[Op, ...]]:
    """Megatron's (interleaved) 1F1B order with one more warm-up forward, the steady state's forward and
    backward fused into one unit (combined 1F1B), as single-op units otherwise.

    >>> [len(u) for u in paired_order(1, 1, 3, 0)]
    [1, 2, 2, 1]
    >>> [len(u) for u in paired_order(2, 1, 4, 0)]
    [1, 1, 1, 2, 1, 1, 1]
    """
    plain = megatron_order(pp, vpp, micro_batches, rank)
    forwards = [o for o in plain if o.forward]
    backwards = [o for o in plain if not o.forward]
    first_backward = sum(1 for o in plain[: plain.index(backwards[0])] if o.forward)  # Megatron's warm-up + 1
    # A fused unit hands its forward on only when it ends, so each rank runs pp - rank - 1 more warm-up forwards
    # (the next stage's units then never wait for this one's); the last forward before the first backward
    # already pairs with it in Megatron's steady state.
    warm = min(len(forwards), first_backward + pp - rank - 1)
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
    free_step = max(end for end, _ in _run(free_costs, shape, micro_batches))
    return SimResult(
        system=f"co-located ({shape.describe()}, {micro_batches} micro-batches)",
        step_time_s=step,
        compute_fraction=sum(c for _, c in timed) / (shape.pp * step),
        exposed_comm_fraction=max(0.0, step - free_step) / step,
        events=(),
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
    return max(comp, a2a) + costs.fwd_other[f] + costs.bwd_other[b], comp


def _run(costs: ColocatedCosts, shape: Shape, micro_batches: int) -> list[tuple[float, float]]:
    """(end, compute seconds) per unit; every unit waits for its ops' inputs (``simulate._input_ready``)."""
    pp, vpp = shape.pp, shape.vpp
    if shape.overlap == "paired":
        orders = [paired_order(pp, vpp, micro_batches, r) for r in range(pp)]
    else:
        orders = [[(o,) for o in megatron_order(pp, vpp, micro_batches, r)] for r in range(pp)]
    done: dict[tuple[bool, int, int], float] = {}
    free, pos, out, last = [0.0] * pp, [0] * pp, [], pp * vpp - 1
    while any(pos[r] < len(orders[r]) for r in range(pp)):
        progressed = False
        for r in range(pp):
            if pos[r] == len(orders[r]):
                continue
            unit = orders[r][pos[r]]
            stages = [op.chunk * pp + r for op in unit]
            ready = [_input_ready(done, op, s, last, pp, costs.p2p_s) for op, s in zip(unit, stages)]
            if any(x is None for x in ready):
                continue
            duration, comp = _unit_s(costs, unit, stages)
            end = max(free[r], *ready) + duration  # type: ignore[type-var]
            for op, s in zip(unit, stages):
                done[op.forward, s, op.micro_batch] = end
            free[r] = end
            out.append((end, comp))
            pos[r] += 1
            progressed = True
        if not progressed:
            raise RuntimeError(f"co-located simulation deadlocked ({shape.describe()})")
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
    replicas: int  # model replicas W / (pp tp cp)
    sync_s: float

    @property
    def tokens(self) -> int:
        return self.micro_batches * self.replicas * self.work.tokens_per_micro_batch

    @property
    def pp(self) -> int:
        return self.shape.pp

    @property
    def vpp(self) -> int:
        return self.shape.vpp

    @property
    def ep(self) -> int:
        return self.shape.ep

    @property
    def data_parallel(self) -> int:
        """Model replicas (data parallel) W / (pp tp cp)."""
        return self.replicas

    @property
    def exposed_sync_s(self) -> float:
        return exposed_sync_s(self.sync_s, self.micro_batches * sum(self.costs.bwd_compute) / self.shape.pp)

    @property
    def estimate_s(self) -> float:
        """(m v + pp - 1) x the slowest chunk's fwd+bwd unit, plus hops and sync: for ranking."""
        units = []
        for i in range(len(self.costs.fwd_compute)):
            comp = self.costs.fwd_compute[i] + self.costs.bwd_compute[i]
            other = self.costs.fwd_other[i] + self.costs.bwd_other[i]
            if self.shape.overlap == "paired":
                units.append(max(comp, self.costs.fwd_a2a[i] + self.costs.bwd_a2a[i]) + other)
            else:
                units.append(comp + self.costs.fwd_comm[i] + self.costs.bwd_comm[i])
        s = self.shape
        hops = 2 * (s.pp - 1) * self.costs.p2p_s
        return (self.micro_batches * s.vpp + s.pp - 1) * max(units) + hops + self.exposed_sync_s


def shapes(
    spec: ModelSpec, cluster: Cluster, seq_len: int, *, micro_batch_size: int, ep: int | None, strongest: bool
) -> Iterator[Shape]:
    """Every shape that divides: plain EP (t = c = 1, partial overlap) or, if ``strongest``, TP, CP and overlap."""
    world = cluster.world_size
    tps = tp_options(spec, cluster.gpus_per_node) if strongest else [1]
    cps = [c for c in CONTEXT_PARALLEL if seq_len % (2 * c) == 0] if strongest else [1]
    rows = seq_len * micro_batch_size
    overlaps = OVERLAPS if strongest else ("partial",)
    for pp in (p for p in _divisors(spec.num_layers) if world % p == 0):
        eps = [e for e in _divisors(spec.num_experts) if (world // pp) % e == 0 and e in (ep or e,)]
        for vpp in (v for v in _divisors(spec.num_layers // pp) if v <= 8 and (v == 1 or pp > 1)):
            for t in tps:
                for c in (
                    c for c in cps if world % (pp * t * c) == 0 and rows // (t * c) >= min(rows, MIN_ROWS_PER_RANK)
                ):
                    for e in eps:
                        for ov in overlaps if vpp == 1 else ("partial",):  # paired: see module docstring
                            yield Shape(pp, vpp, t, c, e, ov)


def colocated_candidates(
    spec: ModelSpec,
    cluster: Cluster,
    rates: Rates,
    work: Workload,
    *,
    global_batch: int,
    overlap: float,
    ep: int | None = None,
    strongest: bool = True,
) -> tuple[list[ColocatedCandidate], Counter]:
    """Configurations that divide and fit memory, each with the cheapest recompute policy that fits."""
    policies = ("none", "selective", "full") if strongest else ("none", "full")
    rejected: Counter = Counter()
    out = []
    for shape in shapes(
        spec, cluster, work.seq_len, micro_batch_size=work.micro_batch_size, ep=ep, strongest=strongest
    ):
        replicas = cluster.world_size // (shape.pp * shape.tp * shape.cp)
        micro_batches = max(1, round(global_batch / (replicas * work.micro_batch_size)))
        if shape.vpp > 1:
            micro_batches = max(shape.pp, -(-micro_batches // shape.pp) * shape.pp)  # Megatron: a multiple of pp
        alive = _chunks_alive(shape, micro_batches)
        for rc in policies:
            w = replace(work, recompute=rc)
            mem = baseline_rank_memory(
                spec,
                w,
                world_size=cluster.world_size,
                pp=shape.pp,
                vpp=shape.vpp,
                ep=shape.ep,
                chunks_alive=alive,
                tp=shape.tp,
                cp=shape.cp,
            )
            if mem.total > rates.usable_hbm:
                rejected[f"does not fit memory (recompute {rc})"] += 1
                continue
            costs = colocated_costs(spec, w, shape, cluster=cluster, rates=rates, overlap=overlap)
            sync = baseline_sync_s(
                spec, w, pp=shape.pp, vpp=shape.vpp, ep=shape.ep, cluster=cluster, rates=rates, tp=shape.tp
            )
            out.append(ColocatedCandidate(shape, w, micro_batches, mem, costs, replicas, sync))
            break
    return out, rejected


def _chunks_alive(shape: Shape, micro_batches: int) -> int:
    """Chunks alive on the first rank at the end of the warm-up, plus one (plus one more when paired)."""
    pp, vpp = shape.pp, shape.vpp
    warm = pp - 1 if vpp == 1 else (pp - 1) * 2 + (vpp - 1) * pp
    return min(warm + (pp if shape.overlap == "paired" else 0), micro_batches * vpp) + 1


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]
