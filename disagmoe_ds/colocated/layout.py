"""Where every rank sits in co-located mode, and the mode's own knobs (pure Python).

Every rank holds the attention side of its pipeline stage's layers (data parallel over the stage's D = W / pp
ranks) and a 1/ep slice of each of those layers' routed experts; with one stage (``pp_size`` 1, the default) that
is every layer, and the stage is the whole job. Rank order is Megatron-Core's, pipeline outermost: stage s holds
ranks ``[s * D, (s + 1) * D)``, and rank ``s * D + d`` is lane d of its stage, the lane that hands its micro-batches
on to lane d of the next. Inside a stage it is DeepSpeed's "E + D" order: the expert-parallel index runs fastest,
so an expert-parallel (EP) group is a run of ``ep_size`` consecutive ranks (inside a node, where a node's GPUs
divide ``ep_size``) and the ranks holding the same expert slice (its expert-data-parallel replicas, EDP) are strided
by ``ep_size``.

>>> lay = ColocatedLayout(world_size=4, ep_size=2, num_experts=8)
>>> lay.ep_group_ranks(1), lay.edp_group_ranks(1), lay.expert_range(lay.ep_rank(3))
((2, 3), (1, 3), range(4, 8))
>>> lay.role_of(3)
RankRole(role='attention', group=0, index=3, ep_rank=1, edp_rank=1)
>>> lay.group_ranks().expert_parallel, lay.group_ranks().expert_data_parallel
(((0, 1), (2, 3)), ((0, 2), (1, 3)))
>>> ColocatedConfig(world_size=6).layout(num_experts=8, num_layers=2).ep_size  # default: the largest dividing both
2
>>> pipe = ColocatedLayout(world_size=8, ep_size=2, num_experts=8, stage_layers=(3, 2, 2, 1))
>>> pipe.role_of(5), pipe.chunk_layers(1), pipe.pipeline_peers(5)
(RankRole(role='attention', group=2, index=1, ep_rank=1, edp_rank=0), (range(3, 5),), (1, 3, 5, 7))
>>> ColocatedLayout(world_size=4, ep_size=1, num_experts=8, stage_layers=(1, 2, 2, 1), virtual_stages=2).chunk_layers(0)
(range(0, 1), range(3, 5))
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any, ClassVar

from disagmoe_ds.config import SECTION, Accumulation, FineTuning, Kernels, Recompute, Watchdog, effective_zero_stage
from disagmoe_ds.config.sections import TRANSPORT_NAMES, LaneSlices
from disagmoe_ds.errors import ConfigError, LayoutError
from disagmoe_ds.layout import ExpertSlices, GroupRanks, RankRole, consecutive_runs


@dataclass(frozen=True, kw_only=True)
class ColocatedConfig(LaneSlices, FineTuning, Recompute, Kernels, Watchdog, Accumulation):
    """The co-located EP+DP run: its own rank counts, and the sections both modes read (``config``'s
    ``Accumulation``, ``Watchdog``, ``Kernels``, ``Recompute``, ``FineTuning``: micro-batches per step per rank, the
    communication timeout, ``compile``/``cuda_graphs``, what the attention parts and expert shards rebuild in
    backward, LoRA), and ``LaneSlices``: s x t consecutive ranks of a stage holding one micro-batch in slices
    (Ulysses, and TP with sequence parallelism on the attention side; their tokens go to the experts as any rank's).

    Attributes:
        world_size: W, ranks in the job; every rank is an attention lane and an expert-parallel rank.
        ep_size: expert-parallel ranks that together hold one copy of a stage's experts; divides the stage's ranks
            and the expert count, and is a multiple of ``tensor_parallel`` (an expert slice's replicas then share a
            TP rank). None: the largest such size (``gcd(W / pp_size, num_experts)``), fixed by ``layout``.
        pp_size: pipeline stages over the decoder layers (1F1B); each holds W / pp_size ranks.
        virtual_stages: v, chunks of layers per stage (Megatron-Core's interleaved 1F1B): the layers are split into
            pp_size x v virtual stages, virtual stage ``k * pp_size + s`` being stage s's chunk k; micro_batches
            must then be a multiple of pp_size.
        stage_layers: decoder layers per virtual stage, in execution order (uneven stages: say fewer on the first
            and last, which hold the embedding and the head; either may hold none). None: as even as the layer count
            allows, the earlier stages taking the remainder.
        transport: how the stages hand micro-batches on (``config.sections.TRANSPORT_NAMES``: ``rendezvous`` is
            the CPU test stand-in with NCCL's network semantics).
    """

    world_size: int = 1
    ep_size: int | None = None
    pp_size: int = 1
    virtual_stages: int = 1
    stage_layers: tuple[int, ...] | None = None
    transport: str = "auto"

    def _named(self, key: str) -> str:
        return f"colocated.{key}"

    def _check(self) -> None:
        self._positive("world_size", int)
        self._positive("ep_size", int, optional=True)
        self._positive("pp_size", int)
        self._positive("virtual_stages", int)
        if self.virtual_stages > 1 and (self.pp_size == 1 or self.micro_batches % self.pp_size):
            raise LayoutError(
                f"virtual_stages {self.virtual_stages} interleave the chunks of pipeline stages in groups of pp_size "
                f"micro-batches: they need pp_size > 1 (got {self.pp_size}) and micro_batches a multiple of it "
                f"(got {self.micro_batches})"
            )
        if self.world_size % self.pp_size:
            raise LayoutError(
                f"pp_size ({self.pp_size}) must divide world_size ({self.world_size}): every pipeline stage holds "
                f"the same number of ranks; pick a pp_size that divides it"
            )
        if self.stage_size % self.lane_slices:
            raise LayoutError(
                f"sequence_parallel x tensor_parallel ({self.lane_slices}) must divide the {self.stage_size} ranks of "
                "a pipeline stage: that many consecutive ranks hold one micro-batch in slices"
            )
        if self.ep_size is not None and self.ep_size % self.tensor_parallel:
            raise LayoutError(
                f"tensor_parallel ({self.tensor_parallel}) must divide ep_size ({self.ep_size}): the replicas of an "
                "expert slice then hold the same attention shards (one DeepSpeed job per TP rank)"
            )
        if self.ep_size is not None and self.stage_size % self.ep_size:
            ranks = f"world_size ({self.world_size})"
            if self.pp_size > 1:
                ranks = f"the {self.stage_size} ranks of a pipeline stage ({self.world_size} / pp_size {self.pp_size})"
            raise LayoutError(
                f"ep_size ({self.ep_size}) must divide {ranks}: they form expert-data-parallel replicas of the "
                f"experts; pick an ep_size that divides it"
            )
        stages = self.pp_size * self.virtual_stages
        if self.stage_layers is not None and len(self.stage_layers) != stages:
            raise LayoutError(
                f"stage_layers {list(self.stage_layers)} names {len(self.stage_layers)} stages, pp_size x "
                f"virtual_stages is {stages}: give one layer count per (virtual) stage"
            )
        if self.transport not in TRANSPORT_NAMES:
            raise ConfigError(
                f"{self._named('transport')} must be one of {list(TRANSPORT_NAMES)}, got {self.transport!r}"
            )

    @property
    def stage_size(self) -> int:
        """D, the ranks of one pipeline stage (all W with one stage)."""
        return self.world_size // self.pp_size

    def zero_stage_of(self, side: str, ds_config: dict[str, Any]) -> int:
        """Either side's ZeRO stage: ``zero_optimization.stage``, the stage of the one engine a rank has over both
        kinds of parameters (``config.effective_zero_stage``); a per-side stage in the section is refused."""
        del side
        _refuse_per_side(ds_config, "zero_stage", '"zero_optimization.stage" (--zero)')
        return effective_zero_stage(ds_config)

    def offload_optimizer_of(self, side: str, ds_config: dict[str, Any]) -> bool:
        """Whether the one engine keeps its optimizer on the host (``zero_optimization.offload_optimizer``); a
        per-side switch in the section is refused."""
        del side
        _refuse_per_side(ds_config, "offload_optimizer", '"zero_optimization.offload_optimizer"')
        return bool(ds_config.get("zero_optimization", {}).get("offload_optimizer"))

    @property
    def lanes(self) -> int:
        """Attention ranks of a stage (its lanes)."""
        return self.stage_size

    @property
    def lane_slices(self) -> int:
        """Consecutive lanes that hold one micro-batch, each a slice of its sequence: s x t."""
        return self.sequence_parallel * self.tensor_parallel

    @property
    def batch_lanes(self) -> int:
        """The lanes that read distinct micro-batches (as ``layout.RankCounts``'s): a stage's ranks / (s t); lane d
        of every stage reads the same ones."""
        return self.stage_size // self.lane_slices

    def batch_lane_of(self, lane: int) -> int:
        return lane // self.lane_slices

    def layout(self, *, num_experts: int, num_layers: int) -> ColocatedLayout:
        ep_size = self.ep_size if self.ep_size is not None else math.gcd(self.stage_size, num_experts)
        if ep_size % self.tensor_parallel:
            raise LayoutError(
                f"tensor_parallel ({self.tensor_parallel}) must divide ep_size ({ep_size}, the largest dividing a "
                f"stage's {self.stage_size} ranks and the {num_experts} experts): pick a tensor_parallel that does"
            )
        stages = self.pp_size * self.virtual_stages
        stage_layers = self.stage_layers if self.stage_layers is not None else even_split(num_layers, stages)
        if sum(stage_layers) != num_layers or min(stage_layers) < 0:
            raise LayoutError(
                f"stage_layers {list(stage_layers)} must give each of {stages} pipeline stages a layer count "
                f"(0: the embedding or the head alone) and add up to the model's {num_layers} decoder layers"
            )
        return ColocatedLayout(
            world_size=self.world_size,
            ep_size=ep_size,
            num_experts=num_experts,
            stage_layers=stage_layers if self.pp_size > 1 else (),
            virtual_stages=self.virtual_stages,
            sequence_parallel=self.sequence_parallel,
            tensor_parallel=self.tensor_parallel,
        )

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def even_split(num_layers: int, stages: int) -> tuple[int, ...]:
    """``num_layers`` over ``stages`` as evenly as they go, the earlier stages taking the remainder (the last holds
    the head).

    >>> even_split(10, 4)
    (3, 3, 2, 2)
    """
    base, extra = divmod(num_layers, stages)
    return tuple(base + (stage < extra) for stage in range(stages))


@dataclass(frozen=True, kw_only=True)
class ColocatedLayout(ExpertSlices):
    """A validated co-located layout: W ranks in ``pp_size`` pipeline stages, each of ``virtual_stages`` chunks of
    layers (``stage_layers``: the layer count of each virtual stage, in execution order; none: one stage of every
    layer), EP groups of ``ep_size`` ranks inside a stage, E routed experts per MoE layer; s x t consecutive lanes
    of a stage hold one micro-batch in slices (``sequence_parallel`` s, ``tensor_parallel`` t: s TP groups of t
    consecutive lanes, the lanes of one TP rank across them an SP group, as an AF-Pipe A-group's).

    With t > 1 a stage's ranks of one TP rank (every t-th) are one data-parallel DeepSpeed job (they hold the same
    attention shards; ``t`` divides ``ep_size``, so an expert slice's replicas are among them) with its own
    checkpoint directory.

    It also says what a checkpoint records of it (``layout.JobLayout``): the mode, the values a resume must match,
    and one DeepSpeed directory per stage (a stage's ranks are one data-parallel DeepSpeed job whose MoE
    checkpointing writes each expert's file once, from its first replica).
    """

    world_size: int
    ep_size: int
    num_experts: int
    stage_layers: tuple[int, ...] = ()
    virtual_stages: int = 1
    sequence_parallel: int = 1
    tensor_parallel: int = 1

    mode: ClassVar[str] = "colocated"
    relayout_hint: ClassVar[str] = "resume with the same --world-size, --ep-size and pipeline stages"

    def __post_init__(self) -> None:
        if self.world_size % self.pp_size:
            raise LayoutError(f"{self.pp_size} pipeline stages must divide world_size ({self.world_size})")
        if self.stage_size % self.ep_size:
            raise LayoutError(f"ep_size ({self.ep_size}) must divide a stage's ranks ({self.stage_size})")
        if self.stage_size % (self.sequence_parallel * self.tensor_parallel) or self.ep_size % self.tensor_parallel:
            raise LayoutError(
                f"sequence_parallel x tensor_parallel ({self.sequence_parallel * self.tensor_parallel}) must divide a "
                f"stage's ranks ({self.stage_size}) and tensor_parallel ep_size ({self.ep_size})"
            )
        self._check_even_split(
            f"ep_size ({self.ep_size}): every expert-parallel rank holds the same number of experts",
            "choose an ep_size that divides it",
        )

    @property
    def pp_size(self) -> int:
        return max(len(self.stage_layers) // self.virtual_stages, 1)

    @property
    def stage_size(self) -> int:
        """D, the ranks of one pipeline stage."""
        return self.world_size // self.pp_size

    def stage_of(self, rank: int) -> int:
        return rank // self.stage_size

    def chunk_layers(self, stage: int) -> tuple[range, ...]:
        """The decoder layers of each chunk of pipeline stage ``stage``: chunk k is virtual stage
        ``k * pp_size + stage``."""
        if not self.stage_layers:
            raise LayoutError("chunk_layers needs the layer counts of a pipelined layout")
        starts = [sum(self.stage_layers[:v]) for v in range(len(self.stage_layers))]
        virtual = [k * self.pp_size + stage for k in range(self.virtual_stages)]
        return tuple(range(starts[v], starts[v] + self.stage_layers[v]) for v in virtual)

    def pipeline_peers(self, rank: int) -> tuple[int, ...]:
        """The ranks, one per stage, that hand ``rank``'s lane's micro-batches on, first stage to last."""
        lane = rank % self.stage_size
        return tuple(stage * self.stage_size + lane for stage in range(self.pp_size))

    def ep_rank(self, rank: int) -> int:
        return rank % self.ep_size

    def edp_rank(self, rank: int) -> int:
        """Which replica of the stage's experts ``rank`` belongs to (the index of its EP group in the stage)."""
        return rank % self.stage_size // self.ep_size

    @property
    def expert_data_parallel(self) -> int:
        """Replicas of each expert slice (= number of EP groups of a stage)."""
        return self.stage_size // self.ep_size

    @property
    def expert_group_name(self) -> str:
        """The name DeepSpeed keys its expert groups and expert parameters by (``MoE.expert_group_name``)."""
        return f"ep_size_{self.ep_size}"

    def ep_group_ranks(self, replica: int, stage: int = 0) -> tuple[int, ...]:
        """The ranks of ``stage`` that together hold one full copy of its experts (they exchange tokens)."""
        first = stage * self.stage_size + replica * self.ep_size
        return tuple(range(first, first + self.ep_size))

    def edp_group_ranks(self, ep_rank: int, stage: int = 0) -> tuple[int, ...]:
        """The ranks of ``stage`` that hold the same expert slice (they reduce its gradients)."""
        first = stage * self.stage_size
        return tuple(range(first + ep_rank, first + self.stage_size, self.ep_size))

    def group_ranks(self) -> GroupRanks:
        """Per stage, its ranks as one data-parallel group (with TP, those of each TP rank), then the EP groups,
        then the EDP groups (with one stage and no TP, the ranks of DeepSpeed's
        ``_create_expert_and_data_parallel(ep_size)``: E + D), then the lanes' groups as ``layout.Layout``'s: SP
        groups, TP groups, and with both the s x t lanes of each micro-batch."""
        stages = [tuple(range(s * self.stage_size, (s + 1) * self.stage_size)) for s in range(self.pp_size)]
        s, t = self.sequence_parallel, self.tensor_parallel
        batch = consecutive_runs(stages, s * t)  # the lanes of one micro-batch
        return GroupRanks(
            data_parallel=tuple(ranks[r::t] for ranks in stages for r in range(t)),
            expert_parallel=tuple(
                self.ep_group_ranks(r, st) for st in range(self.pp_size) for r in range(self.expert_data_parallel)
            ),
            expert_data_parallel=tuple(
                self.edp_group_ranks(e, st) for st in range(self.pp_size) for e in range(self.ep_size)
            ),
            sequence_parallel=tuple(run[r::t] for run in batch for r in range(t)) if s > 1 else (),
            tensor_parallel=consecutive_runs(stages, t),
            lane_slices=batch if s > 1 and t > 1 else (),
        )

    def tp_rank_of(self, role: RankRole) -> int:
        """Which attention-head shard a rank holds (0 without tensor parallelism)."""
        return role.index % self.tensor_parallel

    def role_of(self, rank: int) -> RankRole:
        """A co-located rank is lane ``rank % D`` of its stage's attention group (``group``: the stage; every
        stage's lanes read data) and holds expert slice ``ep_rank`` of the stage's replica ``edp_rank``."""
        if not 0 <= rank < self.world_size:
            raise LayoutError(f"rank {rank} is outside the co-located layout's world of {self.world_size} ranks")
        return RankRole(
            "attention",
            group=self.stage_of(rank),
            index=rank % self.stage_size,
            ep_rank=self.ep_rank(rank),
            edp_rank=self.edp_rank(rank),
        )

    def check_world_size(self, world_size: int) -> None:
        if world_size != self.world_size:
            raise LayoutError(
                f"world size {world_size} does not match the co-located layout's world_size {self.world_size}; "
                f"launch {self.world_size} ranks or change world_size"
            )

    # ----- what a checkpoint records (layout.JobLayout) -----
    def manifest_layout(self) -> dict[str, Any]:
        saved: dict[str, Any] = {
            "world_size": self.world_size,
            "ep_size": self.ep_size,
            "num_experts": self.num_experts,
        }
        if self.stage_layers:
            saved["stage_layers"] = list(self.stage_layers)
        if self.tensor_parallel > 1:  # the shards' shapes differ
            saved["tensor_parallel"] = self.tensor_parallel
        return saved | ({"virtual_stages": self.virtual_stages} if self.virtual_stages > 1 else {})

    def checkpoint_dir(self, role: RankRole) -> str:
        # one DeepSpeed job per stage (and TP rank): its ranks save into one directory
        job = f"colocated_stage{role.group}" if self.stage_layers else "colocated"
        return job + (f"_tp{self.tp_rank_of(role)}" if self.tensor_parallel > 1 else "")

    def describe(self) -> str:
        ranks = f"{self.world_size} ranks"
        if self.stage_layers:
            chunks = f" x {self.virtual_stages} virtual" if self.virtual_stages > 1 else ""
            ranks += (
                f" in {self.pp_size}{chunks} pipeline stages of {self.stage_size} (layers {list(self.stage_layers)})"
            )
        lanes = "".join(
            f", {name} {n}" for name, n in (("SP", self.sequence_parallel), ("TP", self.tensor_parallel)) if n > 1
        )
        return (
            f"co-located EP+DP: {ranks}, EP {self.ep_size} x EDP {self.expert_data_parallel}{lanes}, "
            f"{self.experts_per_rank} experts per rank"
        )


def _refuse_per_side(ds_config: dict[str, Any], key: str, instead: str) -> None:
    """A per-side ZeRO setting of the section, which a co-located rank's one engine cannot take."""
    if ds_config.get(SECTION, {}).get(key):
        raise ConfigError(
            f'"{SECTION}.{key}" is set per side of a disaggregated job; a co-located rank has one engine over both '
            f"kinds of parameters: set {instead} instead"
        )
