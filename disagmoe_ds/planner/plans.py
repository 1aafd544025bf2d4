"""The search's requests, candidates and plans (``allocator.py`` searches them; pure Python)."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field, replace
from typing import Generic, Literal, TypeVar

from disagmoe_ds.layout import Layout
from disagmoe_ds.planner.attention_lanes import DEGREES, data_lanes, lane_options
from disagmoe_ds.planner.cluster import Cluster, Rates
from disagmoe_ds.planner.colocated import ColocatedCandidate
from disagmoe_ds.planner.colocated_costs import Shape
from disagmoe_ds.planner.grad_sync import exposed_sync_s
from disagmoe_ds.planner.memory import RankMemory
from disagmoe_ds.planner.model import ModelSpec
from disagmoe_ds.planner.placement import Placement
from disagmoe_ds.planner.recompute import Recompute
from disagmoe_ds.planner.simulate import SimResult
from disagmoe_ds.planner.stages import AfRoofline, compute_multiplier
from disagmoe_ds.planner.variants import VARIANTS
from disagmoe_ds.planner.workload import Workload

SIDES = ("attention", "ffn")
PAYS_THRESHOLD = 1.05  # below this predicted speed-up, disaggregation is not worth its complexity


@dataclass(frozen=True)
class PlanRequest:
    """Everything the allocator needs.

    Args:
        global_batch: sequences per step (both systems are compared per token, so rounding is harmless).
        recompute: "none", "full" or "auto" (full recompute only where nothing fits without it).
        granularity: contiguous placements move the split in steps of this many GPUs (gpus_per_node: whole nodes).
        placement: "contiguous", "spread" or "auto" (both; see ``placement.py``).
        baseline_overlap: share of the co-located all-to-all hidden behind compute (besides shared experts).
        baseline_ep: pin the co-located expert-parallel size (None: search it).
        simulate_per_variant_set: AF-Pipe families simulated per set of variants (``shortlist``).
        baseline: "strongest" (TP, CP, selective recompute, paired all-to-all overlap; ``colocated.py``) or
            "ep" (plain EP+DP interleaved 1F1B with partial overlap).
        af_variants: the AF-Pipe variants to try (``variants.VARIANTS``; ``variants.PAPER`` for none).
        baseline_dispatcher: "alltoall" or "deepep" (None: ``dispatcher``).
        baseline_layout: price the co-located baseline at this shape instead of searching (``baseline_layout.py``).
        baseline_recompute: the co-located recompute policy (None: the cheapest that fits).
        sequence_parallel, tensor_parallel: the A-lane degrees s and t to try (``attention_lanes.py``), each pair
            where the model and the A-group allow it.
        attention_gpus: a fixed split, M attention GPUs on the first nodes (a fleet of two GPU types, ``fleet.py``,
            whose expert side's rates are ``rates.ffn``); None: searched.
        baseline_sinks: the co-located baseline's kernel for learned attention sinks (``baseline_rates``); None: by
            ``baseline``.
    """

    spec: ModelSpec
    cluster: Cluster
    rates: Rates
    work: Workload
    global_batch: int
    recompute: Recompute | Literal["auto"] = "auto"
    granularity: int = 1
    placement: str = "auto"
    baseline_overlap: float = 0.0
    baseline_ep: int | None = None
    simulate_per_variant_set: int = 2
    baseline: Literal["strongest", "ep", "deepspeed"] = "strongest"
    af_variants: frozenset[str] = frozenset(VARIANTS)
    baseline_dispatcher: str | None = None
    baseline_layout: Shape | None = None
    baseline_recompute: Recompute | None = None
    sequence_parallel: tuple[int, ...] = DEGREES
    tensor_parallel: tuple[int, ...] = DEGREES
    attention_gpus: int | None = None
    baseline_sinks: Literal["fused", "flex"] | None = None

    @property
    def baseline_rates(self) -> Rates:
        """The co-located baseline's rates. A model with learned sinks runs them through flex_attention in this
        project's runtimes and in HF's model (``rates.sink_core``, what a DeepSpeed user has); a Megatron-style baseline
        ("strongest", "ep") runs Transformer Engine's fused cuDNN kernel (cuDNN 9.13.1 on), priced as any fused core."""
        kernel = self.baseline_sinks or ("flex" if self.baseline == "deepspeed" else "fused")
        return self.rates if kernel == "flex" else replace(self.rates, sink_core=())

    @property
    def lane_options(self) -> list[tuple[int, int]]:
        """The (s, t) pairs of A-lanes this model and sequence allow among those asked for."""
        return lane_options(
            self.spec,
            tokens=self.work.tokens_per_micro_batch,
            gpus_per_node=self.cluster.gpus_per_node,
            sp=self.sequence_parallel,
            tp=self.tensor_parallel,
        )

    @property
    def dispatcher(self) -> str:
        """The co-located token dispatcher: as asked, else DeepEP's for the strongest baseline, the plain
        all-to-all for ``--baseline ep``."""
        if self.baseline_dispatcher:
            return self.baseline_dispatcher
        return "deepep" if self.baseline == "strongest" else "alltoall"

    @property
    def recompute_options(self) -> tuple[Recompute, ...]:
        """AF-Pipe recompute policies to try: auto means all (selective only if that variant is allowed)."""
        if self.recompute != "auto":
            return (self.recompute,)
        return ("none", "selective", "full") if "selective" in self.af_variants else ("none", "full")


@dataclass(frozen=True)
class AfCandidate:
    """A feasible AF-Pipe layout with its NIC split, roofline, memory (1 micro-batch in flight) and sync."""

    layout: Layout
    placement: Placement
    nics: tuple[int, int]
    work: Workload
    micro_batches: int
    max_in_flight: int
    roofline: AfRoofline
    memory_attention: RankMemory
    memory_ffn: RankMemory
    sync_s: tuple[float, float]  # gradient sync per step: A lane, F rank
    optimizer_s: tuple[float, float]  # optimizer step: A lane, F rank

    @property
    def optimizer_step_s(self) -> float:
        """The sides step in parallel after the global gradient norm: the step waits for the slower one."""
        return max(self.optimizer_s)

    @property
    def tokens(self) -> int:
        return self.micro_batches * data_lanes(self.layout, self.work) * self.work.tokens_per_micro_batch

    @property
    def exposed_sync_s(self) -> float:
        """The slower side's gradient sync that does not hide behind its backward compute."""
        shares = [(compute_multiplier(self.work, side) - 1) / compute_multiplier(self.work, side) for side in SIDES]
        sides = zip(self.sync_s, shares, (self.roofline.attention, self.roofline.ffn))
        return max(exposed_sync_s(sync, share * side.compute_s) for sync, share, side in sides)


Candidate = TypeVar("Candidate", AfCandidate, ColocatedCandidate)


@dataclass(frozen=True)
class SimulatedPlan(Generic[Candidate]):
    """A candidate of either system with its simulated step; both are compared by tokens per second."""

    candidate: Candidate
    sim: SimResult

    @property
    def step_time_s(self) -> float:
        """Simulated step plus the exposed gradient sync and the optimizer step."""
        return self.sim.step_time_s + self.candidate.exposed_sync_s + self.candidate.optimizer_step_s

    @property
    def tokens_per_s(self) -> float:
        return self.candidate.tokens / self.step_time_s


@dataclass(frozen=True)
class AfPlan(SimulatedPlan[AfCandidate]):
    """A simulated AF-Pipe plan. ``step_time_s`` is never below the roofline bottleneck T*."""

    in_flight: int

    @property
    def step_time_s(self) -> float:
        """Simulated step (at least the roofline T*) plus the exposed gradient sync and the slower side's optimizer
        step."""
        c = self.candidate
        return max(self.sim.step_time_s, c.roofline.bottleneck_s) + c.exposed_sync_s + c.optimizer_step_s


@dataclass(frozen=True)
class BaselinePlan(SimulatedPlan[ColocatedCandidate]):
    """A simulated co-located plan."""


@dataclass(frozen=True)
class PlanResult:
    """The chosen AF-Pipe plan and co-located baseline (None where nothing fits), with rejection counts."""

    request: PlanRequest
    af: AfPlan | None
    baseline: BaselinePlan | None
    rejected: Counter = field(default_factory=Counter)
    baseline_rejected: Counter = field(default_factory=Counter)

    @property
    def speedup(self) -> float | None:
        """Throughput ratio AF-Pipe / co-located (tokens per second; equal to step-time ratio at equal batch)."""
        if self.af is None or self.baseline is None:
            return None
        return self.af.tokens_per_s / self.baseline.tokens_per_s

    @property
    def pays(self) -> bool:
        return self.af is not None and (self.speedup is None or self.speedup >= PAYS_THRESHOLD)

    def mfu(self, step_s: float, tokens: int) -> float:
        """Model FLOPs utilisation of a step of ``step_s`` seconds over ``tokens`` tokens on the whole cluster."""
        req = self.request
        flops = req.spec.step_flops_per_token(req.work.seq_len) * tokens
        return flops / (step_s * req.cluster.world_size * req.cluster.peak_flops)
