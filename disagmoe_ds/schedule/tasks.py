"""The AF-Pipe task graph: what each worker computes per micro-batch and what it sends to whom (pure Python).

Per micro-batch m, with L layers, depth p and g(l) = l % p:

    A_fwd(l, m)  on A_g(l)   l < L: combine layer l-1's output, attention (+ router, shared or dense MLP) of l
                             l = L: combine the last layer's output, final norm, LM head, loss
    F_fwd(l, m)  on F_g(l)   routed experts of MoE layer l
    A_bwd, F_bwd             the mirror images, on the same workers
    A_wgt, F_wgt             split backward only: a backward's deferred weight gradients, on its worker; not in
                             the graph (nothing depends on them), the generator adds them (``generator``)

A dependency between two different workers is a message on the channel (kind, src worker, dst worker):

    resid  A_fwd(l-1) -> A_fwd(l)      m2n  A_fwd(l) -> F_fwd(l)    n2m  F_fwd(l-1) -> A_fwd(l)
    resid_grad  A_bwd(l+1) -> A_bwd(l)     m2n_grad  F_bwd(l) -> A_bwd(l)     n2m_grad  A_bwd(l+1) -> F_bwd(l)

With p = 1, resid and resid_grad stay on A0: they are hand-offs (``TaskGraph.hand_offs``), transfers whose two
ends are one worker, which cost no link time; so a micro-batch sends 4 messages per MoE layer over the network, plus
2 * L when p > 1, and hands 2 * L on locally when p = 1. Both kinds are ``Transfer``s, sent and received alike.

>>> graph = build_graph(PipeShape(depth=2, num_layers=2, moe_layers=(True, True)), num_micro_batches=1)
>>> [str(w) for w in graph.tasks], len(graph.remote_transfers)
(['A0', 'A1', 'F0', 'F1'], 12)
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import Literal, TypeVar

from disagmoe_ds.errors import DisagMoEError

TaskKind = Literal["A_fwd", "F_fwd", "A_bwd", "F_bwd", "A_wgt", "F_wgt"]


class Kind(StrEnum):
    """The kind of a transfer, from the schedule to the wire: one channel and one communicator per kind and pair of
    workers (``comm.exchange``), one message type per kind (``comm.exchange.MESSAGE_TYPES``)."""

    M2N = "m2n"
    N2M = "n2m"
    RESID = "resid"
    M2N_GRAD = "m2n_grad"
    N2M_GRAD = "n2m_grad"
    RESID_GRAD = "resid_grad"

    @property
    def is_grad(self) -> bool:
        """A backward transfer (an evaluation, forwards alone, has none)."""
        return self.value.endswith("_grad")


class ScheduleError(DisagMoEError):
    """A schedule input is invalid, or instruction streams break the send/receive contract."""


@dataclass(frozen=True, order=True)
class Worker:
    """One A-group or F-group: all its lanes (or ranks) run the same instruction stream."""

    side: Literal["A", "F"]
    group: int

    def __str__(self) -> str:
        return f"{self.side}{self.group}"


@dataclass(frozen=True, order=True)
class Task:
    """One chunk of compute; on the A side ``layer == num_layers`` is the head chunk (norm, LM head, loss)."""

    kind: TaskKind
    layer: int
    micro_batch: int

    @property
    def is_forward(self) -> bool:
        return self.kind.endswith("fwd")

    @property
    def is_weight_grad(self) -> bool:
        """A deferred weight-gradient task (split backward): never in the graph, nothing waits for it."""
        return self.kind.endswith("wgt")

    @property
    def label(self) -> str:
        """``F<layer>.<micro_batch>`` for a forward, ``B...`` for a backward, ``W...`` for a weight-gradient task."""
        letter = "F" if self.is_forward else "W" if self.is_weight_grad else "B"
        return f"{letter}{self.layer}.{self.micro_batch}"

    def __str__(self) -> str:
        return f"{self.kind}({self.layer}.{self.micro_batch})"


@dataclass(frozen=True, order=True)
class Channel:
    """A one-way link: the messages of one kind from one worker to another, received in their send order. At run
    time each is a communicator of its own (``comm.exchange``), so no kind queues behind another."""

    kind: Kind
    src: Worker
    dst: Worker

    def __str__(self) -> str:
        return f"{self.kind}:{self.src}->{self.dst}"


@dataclass(frozen=True, order=True)
class Transfer:
    """``src`` produces a tensor that ``dst`` consumes: a scheduled transfer (its wire form is a
    ``comm.messages.Message``).

    ``src_worker`` runs ``src`` and ``dst_worker`` runs ``dst``; the transfer travels on their ``channel`` (one per
    kind and worker pair), where receives match sends in the sender's order. A hand-off (both ends one worker) moves
    through the same instructions and the same mailbox, without a wire.
    """

    kind: Kind
    src: Task
    dst: Task
    src_worker: Worker
    dst_worker: Worker

    @property
    def channel(self) -> Channel:
        return Channel(self.kind, self.src_worker, self.dst_worker)

    @property
    def is_hand_off(self) -> bool:
        """Both ends on one worker (p = 1: the residual and its gradient)."""
        return self.src_worker == self.dst_worker

    def __str__(self) -> str:
        return f"{self.kind} {self.src.layer}.{self.src.micro_batch} {self.src_worker}->{self.dst_worker}"


@dataclass(frozen=True)
class PipeShape:
    """All the schedule needs to know of the model and layout.

    Args:
        depth: p, number of A-groups (= F-groups); group g owns layers g, g+p, ...
        num_layers: L, decoder layers.
        moe_layers: one bool per layer, True where it has routed experts (False: dense MLP, on the A side).
    """

    depth: int
    num_layers: int
    moe_layers: tuple[bool, ...]

    def __post_init__(self) -> None:
        for name in ("depth", "num_layers"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ScheduleError(f"{name} must be a positive integer, got {getattr(self, name)!r}")
        if self.num_layers % self.depth:
            raise ScheduleError(
                f"num_layers ({self.num_layers}) must be divisible by depth ({self.depth}): group g owns layers "
                f"g, g+p, ...; pick a depth that divides {self.num_layers}"
            )
        if len(self.moe_layers) != self.num_layers:
            raise ScheduleError(
                f"moe_layers has {len(self.moe_layers)} entries, need one per layer ({self.num_layers})"
            )
        if not any(self.moe_layers):
            raise ScheduleError("moe_layers marks no MoE layer, so the F-groups would idle; use the co-located mode")
        idle = [g for g in range(self.depth) if not any(self.moe_layers[g :: self.depth])]
        if idle:
            warnings.warn(
                f"F-groups {idle} own no MoE layer (depth {self.depth}, moe_layers {self.moe_layers}): their GPUs "
                "idle the whole step; pick a depth that gives every group a MoE layer",
                stacklevel=3,
            )

    def worker_of(self, task: Task) -> Worker:
        return Worker("A" if task.kind.startswith("A") else "F", task.layer % self.depth)

    @property
    def workers(self) -> tuple[Worker, ...]:
        return tuple(Worker(side, g) for side in ("A", "F") for g in range(self.depth))


@dataclass(frozen=True, eq=False)
class TaskGraph:
    """Every task of a step: ``tasks`` per worker (canonical order, not execution order), ``deps`` (every
    predecessor, local or remote), ``remote_transfers`` (the transfers between two workers, which take link time),
    ``hand_offs`` (those within one worker, which take none), and ``inputs``/``outputs`` (a task's transfers of
    both sorts, in a fixed order)."""

    shape: PipeShape
    num_micro_batches: int
    tasks: dict[Worker, tuple[Task, ...]]
    deps: dict[Task, tuple[Task, ...]]
    remote_transfers: tuple[Transfer, ...]
    hand_offs: tuple[Transfer, ...]
    inputs: dict[Task, tuple[Transfer, ...]]
    outputs: dict[Task, tuple[Transfer, ...]]


def _edges(shape: PipeShape, m: int) -> Iterator[tuple[Kind | None, Task, Task]]:
    """(transfer kind, producer, consumer) for every dependency of micro-batch ``m`` (None: the chunk's own state,
    from its forward to its backward)."""
    for layer in range(shape.num_layers + 1):
        a_fwd, a_bwd = Task("A_fwd", layer, m), Task("A_bwd", layer, m)
        yield None, a_fwd, a_bwd
        if layer >= 1:
            yield Kind.RESID, Task("A_fwd", layer - 1, m), a_fwd
        if layer < shape.num_layers:
            yield Kind.RESID_GRAD, Task("A_bwd", layer + 1, m), a_bwd
        if layer < shape.num_layers and shape.moe_layers[layer]:
            f_fwd, f_bwd = Task("F_fwd", layer, m), Task("F_bwd", layer, m)
            yield Kind.M2N, a_fwd, f_fwd
            yield Kind.N2M, f_fwd, Task("A_fwd", layer + 1, m)
            yield None, f_fwd, f_bwd
            yield Kind.N2M_GRAD, Task("A_bwd", layer + 1, m), f_bwd
            yield Kind.M2N_GRAD, f_bwd, a_bwd


def build_graph(shape: PipeShape, num_micro_batches: int) -> TaskGraph:
    """The dependency graph of one training step over ``num_micro_batches`` micro-batches."""
    if not isinstance(num_micro_batches, int) or num_micro_batches < 1:
        raise ScheduleError(f"num_micro_batches must be a positive integer, got {num_micro_batches!r}")
    deps: dict[Task, list[Task]] = {}
    transfers: list[Transfer] = []
    for m in range(num_micro_batches):
        for kind, src, dst in _edges(shape, m):
            deps.setdefault(src, [])
            deps.setdefault(dst, []).append(src)
            if kind is not None:
                transfers.append(Transfer(kind, src, dst, shape.worker_of(src), shape.worker_of(dst)))
    tasks: dict[Worker, list[Task]] = {w: [] for w in shape.workers}
    inputs: dict[Task, list[Transfer]] = {t: [] for t in deps}
    outputs: dict[Task, list[Transfer]] = {t: [] for t in deps}
    for task in sorted(deps):
        tasks[shape.worker_of(task)].append(task)
    for transfer in transfers:
        inputs[transfer.dst].append(transfer)
        outputs[transfer.src].append(transfer)
    remote_transfers = tuple(t for t in transfers if not t.is_hand_off)
    hand_offs = tuple(t for t in transfers if t.is_hand_off)
    return TaskGraph(
        shape,
        num_micro_batches,
        _tuples(tasks),
        _tuples(deps),
        remote_transfers,
        hand_offs,
        _tuples(inputs),
        _tuples(outputs),
    )


K = TypeVar("K")
V = TypeVar("V")


def _tuples(lists: Mapping[K, list[V]]) -> dict[K, tuple[V, ...]]:
    return {key: tuple(value) for key, value in lists.items()}
