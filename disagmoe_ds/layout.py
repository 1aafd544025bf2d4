"""Where every rank sits: attention groups, FFN groups, lanes and expert shards (pure Python).

Rank order (global ranks):
    [0, M)        attention ranks; A-group g holds ranks g*d .. g*d + d - 1 (d = lanes per A-group)
    [M, M + N)    FFN ranks; F-group g holds a contiguous block of N/p ranks. Inside a block the
                  expert-parallel index runs fastest (DeepSpeed's "E + D" order), so an expert-parallel
                  group is a run of consecutive ranks and its expert-data-parallel replicas are strided.

Layer l is owned by A-group and F-group ``l % p``. The final norm, LM head and loss run on A-group
``L % p`` (A-group 0 when p divides L, which also keeps tied embeddings on one group).

>>> lay = Layout(attention_gpus=4, ffn_gpus=2, depth=2, num_layers=4, num_experts=8)
>>> lay.lanes, lay.ep_size, lay.layers_of_group(1)
(2, 1, (1, 3))
>>> lay.role_of(5)
RankRole(role='ffn', group=1, index=0, ep_rank=0, edp_rank=0)
>>> lay.group_ranks().data_parallel  # the lanes of A_0 and A_1, then each F rank alone (no expert replicas)
((0, 1), (2, 3), (4,), (5,))
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar, Literal, Protocol

from disagmoe_ds.errors import LayoutError

Role = Literal["attention", "ffn"]


class JobLayout(Protocol):
    """Either mode's layout (``Layout``, ``colocated.layout.ColocatedLayout``): what the shared runtime, the process
    groups and the checkpoints read of it."""

    mode: ClassVar[str]  # recorded in a checkpoint's manifest; a checkpoint loads only into a job of the same mode
    relayout_hint: ClassVar[str]  # how to continue from a checkpoint of another layout of the same mode

    @property
    def world_size(self) -> int: ...

    def role_of(self, rank: int) -> RankRole: ...

    def check_world_size(self, world_size: int) -> None: ...

    def group_ranks(self) -> GroupRanks: ...

    def describe(self) -> str: ...

    def manifest_layout(self) -> dict[str, int]:
        """The layout values a resume must match."""
        ...

    def checkpoint_dir(self, role: RankRole) -> str:
        """The directory (under a checkpoint's tag) of the DeepSpeed engine of a rank with this role."""
        ...


@dataclass(frozen=True)
class RankRole:
    """What one global rank does, in either mode. ``index`` is the lane (attention) or the rank inside the F-group; a
    co-located rank is lane ``index`` of the one attention group, holding expert slice ``ep_rank`` of replica
    ``edp_rank`` as well."""

    role: Role
    group: int
    index: int
    ep_rank: int = 0
    edp_rank: int = 0

    @property
    def is_attention(self) -> bool:
        return self.role == "attention"


@dataclass(frozen=True)
class GroupRanks:
    """The ranks of every process group a layout needs, per axis, in the order every rank creates them
    (``groups.build_process_groups``).

    Attributes:
        data_parallel: ranks holding replicas of the same parameters (DeepSpeed's data-parallel group).
        expert_parallel: ranks that together hold one copy of every expert and exchange tokens all-to-all.
        expert_data_parallel: ranks holding the same expert slice beside parameters of other replication (DeepSpeed's
            expert-data-parallel group).
        sequence_parallel: lanes that hold one micro-batch's sequence in slices (the Ulysses all-to-alls).
        tensor_parallel: lanes that hold one micro-batch's sequence in slices and the attention heads in shards.
        lane_slices: with both, the s x t lanes of one micro-batch (its slices, loss shares and router counts).
        exchange_nodes: with the node-deduplicated exchange, the expert-parallel ranks of one node (the all-to-all
            that fans a node's rows out to the ranks holding their experts).
    """

    data_parallel: tuple[tuple[int, ...], ...]
    expert_parallel: tuple[tuple[int, ...], ...] = ()
    expert_data_parallel: tuple[tuple[int, ...], ...] = ()
    sequence_parallel: tuple[tuple[int, ...], ...] = ()
    tensor_parallel: tuple[tuple[int, ...], ...] = ()
    lane_slices: tuple[tuple[int, ...], ...] = ()
    exchange_nodes: tuple[tuple[int, ...], ...] = ()


class RankCounts:
    """``world_size`` and ``lanes`` of what has ``attention_gpus``, ``ffn_gpus``, ``depth``, ``sequence_parallel``
    and ``tensor_parallel``: a ``Layout``, and the ``config.DisagMoEConfig`` that names one before the model is
    known."""

    attention_gpus: int
    ffn_gpus: int
    depth: int
    sequence_parallel: int
    tensor_parallel: int

    @property
    def world_size(self) -> int:
        return self.attention_gpus + self.ffn_gpus

    @property
    def lanes(self) -> int:
        """d: data-parallel attention ranks per A-group."""
        return self.attention_gpus // self.depth

    @property
    def lane_slices(self) -> int:
        """Consecutive lanes that hold one micro-batch, each a slice of its sequence: s x t."""
        return self.sequence_parallel * self.tensor_parallel

    @property
    def batch_lanes(self) -> int:
        """How many distinct micro-batches an A-group trains at once: d / (s t)."""
        return self.lanes // self.lane_slices

    def batch_lane_of(self, lane: int) -> int:
        """Which of them lane ``lane`` holds (a slice of)."""
        return lane // self.lane_slices


class ExpertSlices:
    """Which routed experts an expert-parallel rank holds, for what has ``num_experts`` and ``ep_size``: both modes'
    layouts (``Layout``, ``colocated.layout.ColocatedLayout``)."""

    num_experts: int
    if TYPE_CHECKING:  # a field of one mode's layout, derived in the other's

        @property
        def ep_size(self) -> int: ...

    @property
    def experts_per_rank(self) -> int:
        return self.num_experts // self.ep_size

    def expert_range(self, ep_rank: int) -> range:
        """Global ids of the routed experts held by expert-parallel rank ``ep_rank``."""
        start = ep_rank * self.experts_per_rank
        return range(start, start + self.experts_per_rank)

    def _check_even_split(self, ep_size_is: str, fix: str) -> None:
        """Every expert-parallel rank holds the same number of experts (``ep_size_is`` says where ep_size comes
        from)."""
        if self.num_experts % self.ep_size:
            raise LayoutError(f"num_experts ({self.num_experts}) must be divisible by {ep_size_is}; {fix}")


@dataclass(frozen=True)
class Layout(RankCounts, ExpertSlices):
    """A validated disaggregated layout.

    Args:
        attention_gpus: M, total attention ranks (p A-groups of M/p lanes each).
        ffn_gpus: N, total FFN ranks (p F-groups of N/p ranks each).
        depth: p, number of A-groups (= number of F-groups).
        num_layers: L, decoder layers of the model.
        num_experts: E, routed experts per MoE layer.
        expert_data_parallel: replicas of each expert shard inside an F-group.
        sequence_parallel: s, consecutive lanes of an A-group holding one micro-batch's sequence in slices (Ulysses).
        tensor_parallel: t, consecutive lanes of an A-group holding one micro-batch's sequence in slices and the
            attention heads in shards (Megatron-style tensor parallel with sequence parallel). With both, s x t
            consecutive lanes hold a micro-batch: s TP groups of t, the lanes of one TP rank across them an SP group.
        node_dedup: consecutive expert-parallel ranks (one node's) that share one message of a lane: a token
            bound for several of them crosses the network once, to one of them (the lane's gateway there), and fans
            out inside the node; 1: a message per expert-parallel rank. The node's ranks take the lanes in turns.
    """

    attention_gpus: int
    ffn_gpus: int
    num_layers: int
    num_experts: int
    depth: int = 1
    expert_data_parallel: int = 1
    sequence_parallel: int = 1
    tensor_parallel: int = 1
    node_dedup: int = 1

    def __post_init__(self) -> None:
        names = ("attention_gpus", "ffn_gpus", "num_layers", "num_experts", "depth", "expert_data_parallel")
        for name in (*names, "sequence_parallel", "tensor_parallel", "node_dedup"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise LayoutError(f"{name} must be a positive integer, got {value!r}")
        p = self.depth
        if self.attention_gpus % p:
            raise LayoutError(
                f"attention_gpus ({self.attention_gpus}) must be divisible by depth ({p}): every A-group needs the "
                f"same number of lanes; use attention_gpus = {p} * lanes"
            )
        if self.ffn_gpus % p:
            raise LayoutError(
                f"ffn_gpus ({self.ffn_gpus}) must be divisible by depth ({p}): every F-group needs the same number "
                f"of ranks; use ffn_gpus = {p} * ranks_per_group"
            )
        if self.num_layers % p:
            raise LayoutError(
                f"num_hidden_layers ({self.num_layers}) must be divisible by depth ({p}): group g owns layers "
                f"g, g+p, ...; pick a depth that divides {self.num_layers}"
            )
        if self.lanes % self.lane_slices:
            degrees = (("sequence_parallel", self.sequence_parallel), ("tensor_parallel", self.tensor_parallel))
            named = " x ".join(f"{name} ({degree})" for name, degree in degrees if degree > 1)
            raise LayoutError(
                f"lanes per A-group ({self.lanes}) must be divisible by {named}: that many lanes hold one micro-batch; "
                f"use attention_gpus = depth x a multiple of {self.lane_slices}"
            )
        if self.ffn_ranks_per_group % self.expert_data_parallel:
            raise LayoutError(
                f"FFN ranks per group ({self.ffn_ranks_per_group}) must be divisible by expert_data_parallel "
                f"({self.expert_data_parallel})"
            )
        self._check_even_split(
            f"the expert-parallel size ({self.ep_size} = ffn_gpus {self.ffn_gpus} / depth {p} / expert_data_parallel "
            f"{self.expert_data_parallel})",
            "choose ffn_gpus so that each F-group splits the experts evenly",
        )
        if self.ep_size % self.node_dedup:
            raise LayoutError(
                f"node_dedup ({self.node_dedup}) must divide the expert-parallel size ({self.ep_size}): every node "
                "of an expert-parallel group holds the same number of its ranks; use the GPUs per node that an "
                "expert-parallel group spans (or 1)"
            )

    # ----- sizes (world_size, lanes: RankCounts; experts_per_rank: ExpertSlices) -----
    @property
    def ffn_ranks_per_group(self) -> int:
        return self.ffn_gpus // self.depth

    @property
    def ep_size(self) -> int:
        """Expert-parallel ranks per F-group (each holds num_experts / ep_size experts)."""
        return self.ffn_ranks_per_group // self.expert_data_parallel

    @property
    def exchange_peers(self) -> int:
        """The messages a lane sends for one MoE layer: one per node of an expert-parallel group (``node_dedup``)."""
        return self.ep_size // self.node_dedup

    @property
    def experts_per_peer(self) -> int:
        """The experts one message serves: a node's."""
        return self.experts_per_rank * self.node_dedup

    @property
    def layers_per_group(self) -> int:
        """v: layers owned by each group."""
        return self.num_layers // self.depth

    @property
    def head_group(self) -> int:
        """A-group that runs the final norm, LM head and loss."""
        return self.num_layers % self.depth

    # ----- maps -----
    def group_of_layer(self, layer: int) -> int:
        return layer % self.depth

    def layers_of_group(self, group: int) -> tuple[int, ...]:
        return tuple(range(group, self.num_layers, self.depth))

    def attention_ranks(self, group: int) -> tuple[int, ...]:
        start = group * self.lanes
        return tuple(range(start, start + self.lanes))

    def ffn_ranks(self, group: int) -> tuple[int, ...]:
        start = self.attention_gpus + group * self.ffn_ranks_per_group
        return tuple(range(start, start + self.ffn_ranks_per_group))

    def ep_group_ranks(self, group: int, edp_rank: int) -> tuple[int, ...]:
        """The F-group ranks that together hold one full copy of the experts."""
        block = self.ffn_ranks(group)
        return block[edp_rank * self.ep_size : (edp_rank + 1) * self.ep_size]

    def edp_group_ranks(self, group: int, ep_rank: int) -> tuple[int, ...]:
        """The F-group ranks that hold the same expert shard (they average its gradients)."""
        return self.ffn_ranks(group)[ep_rank :: self.ep_size]

    def ffn_peer_of_lane(self, group: int, lane: int, peer: int) -> int:
        """The F rank that takes a lane's message ``peer`` (< ``exchange_peers``): in the lane's replica (lanes spread
        over the replicas), shard ``peer``'s rank, or with ``node_dedup`` the lane's gateway in node ``peer``
        (a node's ranks take the replica's lanes in turns)."""
        d, edp = self.node_dedup, self.expert_data_parallel
        return self.ep_group_ranks(group, lane % edp)[peer * d + (lane // edp) % d]

    def node_ranks(self, group: int, edp_rank: int, node: int) -> tuple[int, ...]:
        """The ranks of one node of an expert-parallel group (``node_dedup`` consecutive ep ranks)."""
        d = self.node_dedup
        return self.ep_group_ranks(group, edp_rank)[node * d : (node + 1) * d]

    def role_of(self, rank: int) -> RankRole:
        if not 0 <= rank < self.world_size:
            raise LayoutError(f"rank {rank} is outside the layout's world of {self.world_size} ranks")
        if rank < self.attention_gpus:
            return RankRole("attention", group=rank // self.lanes, index=rank % self.lanes)
        i = rank - self.attention_gpus
        index = i % self.ffn_ranks_per_group
        return RankRole(
            "ffn",
            group=i // self.ffn_ranks_per_group,
            index=index,
            ep_rank=index % self.ep_size,
            edp_rank=index // self.ep_size,
        )

    def group_ranks(self) -> GroupRanks:
        """Data parallel: the lanes of every A-group (with t > 1 the lanes of each TP rank: they hold the same shards),
        then the replicas of every expert shard (an FFN engine holds nothing but its shard, so its replicas are its
        data-parallel group); with s > 1 the SP groups, with t > 1 the TP groups (consecutive lanes); with
        ``node_dedup`` the nodes of every expert-parallel group. The exchanges' communicators are
        ``comm.exchange``'s."""
        lanes = [self.attention_ranks(g) for g in range(self.depth)]
        replicas = [self.edp_group_ranks(g, e) for g in range(self.depth) for e in range(self.ep_size)]
        s, t = self.sequence_parallel, self.tensor_parallel
        shards = [ranks[r::t] for ranks in lanes for r in range(t)]
        batch = consecutive_runs(lanes, s * t)  # the lanes of one micro-batch
        nodes = range(self.exchange_peers)
        replica_ids = range(self.expert_data_parallel)
        exchange_nodes = [self.node_ranks(g, r, n) for g in range(self.depth) for r in replica_ids for n in nodes]
        return GroupRanks(
            data_parallel=(*shards, *replicas),
            sequence_parallel=tuple(run[r::t] for run in batch for r in range(t)) if s > 1 else (),
            tensor_parallel=consecutive_runs(lanes, t),
            lane_slices=batch if s > 1 and t > 1 else (),
            exchange_nodes=tuple(exchange_nodes) if self.node_dedup > 1 else (),
        )

    def tp_rank_of(self, role: RankRole) -> int:
        """Which attention-head shard an attention rank holds (0 without tensor parallelism)."""
        return role.index % self.tensor_parallel

    # ----- what a checkpoint records (JobLayout) -----
    mode: ClassVar[str] = "disaggregated"
    relayout_hint: ClassVar[str] = "resume with the same layout (or convert it with `disagmoe-convert relayout`)"

    def manifest_layout(self) -> dict[str, int]:
        keys = ("attention_gpus", "ffn_gpus", "depth", "expert_data_parallel", "num_layers", "num_experts")
        tp = {"tensor_parallel": self.tensor_parallel} if self.tensor_parallel > 1 else {}  # shards' shapes differ
        return {**{key: getattr(self, key) for key in keys}, **tp}

    def checkpoint_dir(self, role: RankRole) -> str:
        """One directory per engine group: an A-group's lanes (of one TP rank), an F-group's replicas of one expert
        shard."""
        if not role.is_attention:
            return f"ffn_g{role.group}_ep{role.ep_rank}"
        return f"attention_g{role.group}" + (f"_tp{self.tp_rank_of(role)}" if self.tensor_parallel > 1 else "")

    def check_world_size(self, world_size: int) -> None:
        if world_size != self.world_size:
            raise LayoutError(
                f"world size {world_size} does not match the layout: attention_gpus {self.attention_gpus} + "
                f"ffn_gpus {self.ffn_gpus} = {self.world_size}; launch {self.world_size} ranks or change the layout"
            )

    def describe(self) -> str:
        return (
            f"M={self.attention_gpus} attention ranks ({self.depth} A-groups x {self.lanes} lanes"
            f"{f', SP {self.sequence_parallel}' if self.sequence_parallel > 1 else ''}"
            f"{f', TP {self.tensor_parallel}' if self.tensor_parallel > 1 else ''}), "
            f"N={self.ffn_gpus} FFN ranks ({self.depth} F-groups x EP {self.ep_size} x EDP "
            f"{self.expert_data_parallel}"
            f"{f', a message per node of {self.node_dedup}' if self.node_dedup > 1 else ''}), "
            f"{self.layers_per_group} layers per group, {self.experts_per_rank} experts per FFN rank"
        )


def consecutive_runs(lanes: list[tuple[int, ...]], size: int) -> tuple[tuple[int, ...], ...]:
    """Every group of lanes (an A-group's, a pipeline stage's) in runs of ``size`` consecutive ranks (none for size
    1)."""
    return tuple(ranks[i : i + size] for ranks in lanes for i in range(0, len(ranks), size)) if size > 1 else ()
