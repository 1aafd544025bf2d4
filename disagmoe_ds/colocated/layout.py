"""Where every rank sits in co-located EP+DP mode, and the mode's own knobs (pure Python).

Every rank holds the whole attention side (data parallel over all W ranks) and a 1/ep slice of every MoE layer's
routed experts. Rank order is DeepSpeed's "E + D" order: the expert-parallel index runs fastest, so an
expert-parallel (EP) group is a run of ``ep_size`` consecutive ranks and the ranks holding the same expert slice
(its expert-data-parallel replicas, EDP) are strided by ``ep_size``.

>>> lay = ColocatedLayout(world_size=4, ep_size=2, num_experts=8)
>>> lay.ep_group_ranks(1), lay.edp_group_ranks(1), lay.expert_range(lay.ep_rank(3))
((2, 3), (1, 3), range(4, 8))
>>> lay.role_of(3)
RankRole(role='attention', group=0, index=3, ep_rank=1, edp_rank=1)
>>> lay.group_ranks().expert_parallel, lay.group_ranks().expert_data_parallel
(((0, 1), (2, 3)), ((0, 2), (1, 3)))
>>> ColocatedConfig(world_size=6).layout(num_experts=8).ep_size  # default: the largest that divides both
2
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any, ClassVar

from disagmoe_ds.config import SECTION, Accumulation, FineTuning, Kernels, Watchdog, effective_zero_stage
from disagmoe_ds.errors import ConfigError, LayoutError
from disagmoe_ds.layout import ExpertSlices, GroupRanks, RankRole


@dataclass(frozen=True, kw_only=True)
class ColocatedConfig(FineTuning, Kernels, Watchdog, Accumulation):
    """The co-located EP+DP run: its own rank counts, and the sections both modes read (``config``'s
    ``Accumulation``, ``Watchdog``, ``Kernels``, ``FineTuning``: micro-batches per step per rank, the communication
    timeout, ``compile``/``cuda_graphs``, LoRA).

    Attributes:
        world_size: W, ranks in the job; every rank is an attention lane and an expert-parallel rank.
        ep_size: expert-parallel ranks that together hold one copy of every MoE layer's experts; divides W and the
            expert count. None: the largest such size (``gcd(W, num_experts)``), fixed by ``layout``.
    """

    world_size: int = 1
    ep_size: int | None = None

    def _named(self, key: str) -> str:
        return f"colocated.{key}"

    def _check(self) -> None:
        self._positive("world_size", int)
        self._positive("ep_size", int, optional=True)
        if self.ep_size is not None and self.world_size % self.ep_size:
            raise LayoutError(
                f"ep_size ({self.ep_size}) must divide world_size ({self.world_size}): the ranks form "
                f"world_size / ep_size expert-data-parallel replicas of the experts; pick an ep_size that divides it"
            )

    def zero_stage_of(self, side: str, ds_config: dict[str, Any]) -> int:
        """Either side's ZeRO stage: ``zero_optimization.stage``, the stage of the one engine a rank has over both
        kinds of parameters (``config.effective_zero_stage``); a per-side stage in the section is refused."""
        del side
        if ds_config.get(SECTION, {}).get("zero_stage"):
            raise ConfigError(
                f'"{SECTION}.zero_stage" sets a ZeRO stage per side of a disaggregated job; a co-located rank has one '
                'engine over both kinds of parameters: set "zero_optimization.stage" (--zero) instead'
            )
        return effective_zero_stage(ds_config)

    @property
    def lanes(self) -> int:
        """Data-parallel attention ranks (how many distinct batches one step consumes): every rank."""
        return self.world_size

    @property
    def batch_lanes(self) -> int:
        """The ranks that read distinct micro-batches: every rank (as ``layout.RankCounts``'s, with no sequence
        parallelism)."""
        return self.world_size

    def batch_lane_of(self, lane: int) -> int:
        return lane

    def layout(self, *, num_experts: int) -> ColocatedLayout:
        ep_size = self.ep_size if self.ep_size is not None else math.gcd(self.world_size, num_experts)
        return ColocatedLayout(world_size=self.world_size, ep_size=ep_size, num_experts=num_experts)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True, kw_only=True)
class ColocatedLayout(ExpertSlices):
    """A validated co-located layout: W ranks, EP groups of ``ep_size`` ranks, E routed experts per MoE layer.

    It also says what a checkpoint records of it (``layout.JobLayout``): the mode, the values a
    resume must match, and one DeepSpeed directory for the whole job (all ranks are one data-parallel DeepSpeed job
    whose MoE checkpointing writes each expert's file once, from its first replica).
    """

    world_size: int
    ep_size: int
    num_experts: int

    mode: ClassVar[str] = "colocated"
    relayout_hint: ClassVar[str] = "resume with the same --world-size and --ep-size"

    def __post_init__(self) -> None:
        if self.world_size % self.ep_size:
            raise LayoutError(f"ep_size ({self.ep_size}) must divide world_size ({self.world_size})")
        self._check_even_split(
            f"ep_size ({self.ep_size}): every expert-parallel rank holds the same number of experts",
            "choose an ep_size that divides it",
        )

    def ep_rank(self, rank: int) -> int:
        return rank % self.ep_size

    def edp_rank(self, rank: int) -> int:
        """Which replica of the experts ``rank`` belongs to (the index of its EP group)."""
        return rank // self.ep_size

    @property
    def expert_data_parallel(self) -> int:
        """Replicas of each expert slice (= number of EP groups)."""
        return self.world_size // self.ep_size

    @property
    def expert_group_name(self) -> str:
        """The name DeepSpeed keys its expert groups and expert parameters by (``MoE.expert_group_name``)."""
        return f"ep_size_{self.ep_size}"

    def ep_group_ranks(self, replica: int) -> tuple[int, ...]:
        """The ranks that together hold one full copy of the experts (they exchange tokens)."""
        return tuple(range(replica * self.ep_size, (replica + 1) * self.ep_size))

    def edp_group_ranks(self, ep_rank: int) -> tuple[int, ...]:
        """The ranks that hold the same expert slice (they reduce its gradients)."""
        return tuple(range(ep_rank, self.world_size, self.ep_size))

    def group_ranks(self) -> GroupRanks:
        """All W ranks in one data-parallel group (the attention side), the EP groups, then the EDP groups: the ranks
        of DeepSpeed's ``_create_expert_and_data_parallel(ep_size)`` (E + D order)."""
        return GroupRanks(
            data_parallel=(tuple(range(self.world_size)),),
            expert_parallel=tuple(self.ep_group_ranks(r) for r in range(self.expert_data_parallel)),
            expert_data_parallel=tuple(self.edp_group_ranks(e) for e in range(self.ep_size)),
        )

    def role_of(self, rank: int) -> RankRole:
        """Every co-located rank is lane ``rank`` of the one attention group (it reads data and holds the embedding)
        and holds expert slice ``ep_rank`` of replica ``edp_rank``."""
        if not 0 <= rank < self.world_size:
            raise LayoutError(f"rank {rank} is outside the co-located layout's world of {self.world_size} ranks")
        return RankRole("attention", group=0, index=rank, ep_rank=self.ep_rank(rank), edp_rank=self.edp_rank(rank))

    def check_world_size(self, world_size: int) -> None:
        if world_size != self.world_size:
            raise LayoutError(
                f"world size {world_size} does not match the co-located layout's world_size {self.world_size}; "
                f"launch {self.world_size} ranks or change world_size"
            )

    # ----- what a checkpoint records (layout.JobLayout) -----
    def manifest_layout(self) -> dict[str, int]:
        return {"world_size": self.world_size, "ep_size": self.ep_size, "num_experts": self.num_experts}

    def checkpoint_dir(self, role: RankRole) -> str:
        del role  # one DeepSpeed job: every rank saves into the same directory
        return "colocated"

    def describe(self) -> str:
        return (
            f"co-located EP+DP: {self.world_size} ranks, EP {self.ep_size} x EDP {self.expert_data_parallel}, "
            f"{self.experts_per_rank} experts per rank"
        )
