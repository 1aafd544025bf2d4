"""The AF-Pipe schedule generator: list scheduling by discrete-event simulation (pure Python).

Each worker is one compute resource; each channel is one link whose transfers serialise in send order, while
different channels overlap each other and compute. An idle worker starts the ready task that comes first by:

1. backward before forward: a backward retires a micro-batch (activations, a slot under the cap) and feeds
   the workers upstream; 1F1B's memory rule.
2. most work still behind it: the lowest layer among forwards, the highest among backwards (critical-path
   list scheduling keeps the start of the ring fed); ~3% shorter steps than oldest-first over a shape grid.
3. the oldest micro-batch.

A worker admits micro-batches in increasing order and holds at most ``max_in_flight`` (admitted, not yet
finished there). The order this produces becomes each worker's instruction stream.

Split backward (the zero-bubble idea of Qi et al. 2023 on the A/F ring): where ``Costs`` gives a backward's
weight-gradient half a positive cost (``a_wgt``, ``f_wgt``, ``head_wgt``), the backward task B computes only the
input gradients its upstream peer waits for and a weight-gradient task W (``A_wgt``/``F_wgt``) follows it on the
same worker. A worker with no forward or B it may start runs its oldest pending W, so W fills what would be
bubbles. A micro-batch stays in flight on a worker until its W tasks there are done too (the wgrad GEMMs read its
activations), so the cap bounds memory as before. With every W cost zero nothing changes.
"""

from __future__ import annotations

import heapq
from collections import Counter, defaultdict, deque
from collections.abc import Mapping
from dataclasses import dataclass, field, fields

from disagmoe_ds.schedule.checker import render
from disagmoe_ds.schedule.instructions import Instruction
from disagmoe_ds.schedule.streams import build_streams
from disagmoe_ds.schedule.tasks import (
    Kind,
    PipeShape,
    ScheduleError,
    Task,
    TaskGraph,
    TaskKind,
    Transfer,
    Worker,
    build_graph,
)
from disagmoe_ds.schedule.trace import TimelineEvent

_KINDS = ("A_fwd", "A_bwd", "F_fwd", "F_bwd", "A_wgt", "F_wgt", *(kind.value for kind in Kind))
_WGRAD_OF: Mapping[TaskKind, TaskKind] = {"A_bwd": "A_wgt", "F_bwd": "F_wgt"}


@dataclass(frozen=True, kw_only=True)
class Costs:
    """Predicted seconds per task and per transfer, from the roofline model or a profile.

    ``overrides`` maps (kind, layer) to seconds; kind is a task or message kind, layer that of the task or of
    the sending task. A dense layer 0 that costs more on A: ``{("A_fwd", 0): 3.0, ("A_bwd", 0): 6.0}``.
    ``a_wgt``, ``f_wgt``, ``head_wgt``: a split backward's deferred weight-gradient tasks (0: not split); the
    ``*_bwd`` costs are then the input-gradient half only.
    """

    a_fwd: float = 1.0
    a_bwd: float = 2.0  # backward is about twice the forward's FLOPs
    f_fwd: float = 1.0
    f_bwd: float = 2.0
    head_fwd: float = 1.0
    head_bwd: float = 2.0
    m2n: float = 0.5
    n2m: float = 0.5
    resid: float = 0.5
    m2n_grad: float = 0.5
    n2m_grad: float = 0.5
    resid_grad: float = 0.5
    a_wgt: float = 0.0
    f_wgt: float = 0.0
    head_wgt: float = 0.0
    overrides: Mapping[tuple[str, int], float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        values = [(f.name, getattr(self, f.name)) for f in fields(self) if f.name != "overrides"]
        for key, value in [*values, *self.overrides.items()]:
            if not value >= 0:
                raise ScheduleError(f"Costs {key} must be a non-negative number of seconds, got {value!r}")
        unknown = {kind for kind, _ in self.overrides} - set(_KINDS)
        if unknown:
            raise ScheduleError(f"Costs.overrides has unknown kinds {sorted(unknown)}; use one of {_KINDS}")

    def compute_s(self, task: Task, num_layers: int) -> float:
        if (task.kind, task.layer) in self.overrides:
            return self.overrides[task.kind, task.layer]
        if task.layer == num_layers:
            return self.head_fwd if task.is_forward else self.head_wgt if task.is_weight_grad else self.head_bwd
        per_kind: dict[TaskKind, float] = {
            "A_fwd": self.a_fwd,
            "A_bwd": self.a_bwd,
            "F_fwd": self.f_fwd,
            "F_bwd": self.f_bwd,
            "A_wgt": self.a_wgt,
            "F_wgt": self.f_wgt,
        }
        return per_kind[task.kind]

    def weight_grad_of(self, task: Task, num_layers: int) -> Task | None:
        """The W task a backward ``task`` defers (split backward), None where its W costs nothing."""
        kind = _WGRAD_OF.get(task.kind)
        if kind is None:
            return None
        wgrad = Task(kind, task.layer, task.micro_batch)
        return wgrad if self.compute_s(wgrad, num_layers) > 0 else None

    def transfer_s(self, message: Transfer) -> float:
        per_kind = {
            Kind.M2N: self.m2n,
            Kind.N2M: self.n2m,
            Kind.RESID: self.resid,
            Kind.M2N_GRAD: self.m2n_grad,
            Kind.N2M_GRAD: self.n2m_grad,
            Kind.RESID_GRAD: self.resid_grad,
        }
        return self.overrides.get((message.kind, message.src.layer), per_kind[message.kind])


def unit_costs(*, split_backward: bool = False, compiled: bool = False, ffn_zero3: bool = False) -> Costs:
    """``Costs()`` (forward 1, backward 2, transfers 0.5) for a job whose task costs are not known; with a split
    backward, half of each backward is its W task (all of it stays in B on a compiled attention side, and on an
    expert side at ZeRO-3)."""
    if not split_backward:
        return Costs()
    a_bwd, a_wgt = (2.0, 0.0) if compiled else (1.0, 1.0)
    f_bwd, f_wgt = (2.0, 0.0) if ffn_zero3 else (1.0, 1.0)
    return Costs(a_bwd=a_bwd, head_bwd=a_bwd, f_bwd=f_bwd, a_wgt=a_wgt, head_wgt=a_wgt, f_wgt=f_wgt)


@dataclass(frozen=True, eq=False)
class Schedule:
    """The instruction ``streams`` the engine runs, and the predicted (start, end) seconds they came from."""

    graph: TaskGraph
    max_in_flight: int
    compute: dict[Task, tuple[float, float]]
    transfers: dict[Transfer, tuple[float, float]]
    streams: dict[Worker, tuple[Instruction, ...]]

    @property
    def step_time_s(self) -> float:
        """End of the last compute; gradient reduction and the optimizer step are not modelled."""
        return max(end for _, end in self.compute.values())

    @property
    def busy_fraction(self) -> dict[Worker, float]:
        """Share of the step each worker spends computing."""
        busy: dict[Worker, float] = dict.fromkeys(self.graph.tasks, 0.0)
        for task, (start, end) in self.compute.items():
            busy[self.graph.shape.worker_of(task)] += end - start
        return {w: b / self.step_time_s for w, b in busy.items()}

    @property
    def bubble_fraction(self) -> dict[Worker, float]:
        return {w: 1.0 - busy for w, busy in self.busy_fraction.items()}

    def render(self) -> str:
        return render(self.streams)

    def timeline_events(self) -> list[TimelineEvent]:
        """Compute on its worker; each transfer twice, as a send on its sender and a recv on its receiver."""
        events = []
        for task, (start, end) in self.compute.items():
            worker = str(self.graph.shape.worker_of(task))
            events.append(TimelineEvent(worker, task.label, "compute", start, end, {"task": str(task)}))
        for msg, (start, end) in self.transfers.items():
            args = {"channel": str(msg.channel), "src": str(msg.src), "dst": str(msg.dst)}
            events.append(TimelineEvent(str(msg.src_worker), str(msg), "send", start, end, args))
            events.append(TimelineEvent(str(msg.dst_worker), str(msg), "recv", start, end, args))
        return events


def default_max_in_flight(shape: PipeShape, num_micro_batches: int) -> int:
    """2p + 1, at most the number of micro-batches.

    A micro-batch returns to a worker after one trip round the 2p-stage ring A_0 F_0 ... A_p-1 F_p-1, so 2p in
    flight keep every stage busy when compute dominates (1F1B's argument); one more covers the transfers. Each
    one costs a micro-batch of activations per worker.
    """
    return min(num_micro_batches, 2 * shape.depth + 1)


def generate(
    shape: PipeShape,
    num_micro_batches: int,
    *,
    costs: Costs | None = None,
    max_in_flight: int | None = None,
    lookahead: int = 2,
) -> Schedule:
    """Schedule one training step.

    Args:
        costs: seconds per task and transfer; ``None`` means ``Costs()``.
        max_in_flight: micro-batches a worker may hold at once; ``None`` means ``default_max_in_flight``.
        lookahead: post each receive this many compute tasks before the one that waits on it.
    """
    graph = build_graph(shape, num_micro_batches)
    cap = default_max_in_flight(shape, num_micro_batches) if max_in_flight is None else max_in_flight
    if not isinstance(cap, int) or cap < 1:
        raise ScheduleError(f"max_in_flight must be a positive integer, got {max_in_flight!r}")
    if not isinstance(lookahead, int) or lookahead < 0:
        raise ScheduleError(f"lookahead must be a non-negative integer, got {lookahead!r}")
    order, compute, transfers = _Simulation(graph, costs or Costs(), cap).run()
    return Schedule(graph, cap, compute, transfers, build_streams(graph, order, lookahead=lookahead))


def _priority(task: Task) -> tuple[bool, int, int]:
    """Smaller first: the three rules of the module docstring, in order."""
    return (task.is_forward, task.layer if task.is_forward else -task.layer, task.micro_batch)


class _Simulation:
    """Event-driven list scheduler; ``run`` returns each worker's order and the predicted intervals."""

    def __init__(self, graph: TaskGraph, costs: Costs, cap: int) -> None:
        self.graph, self.costs, self.cap, self.worker_of = graph, costs, cap, graph.shape.worker_of
        self.missing = {task: len(deps) for task, deps in graph.deps.items()}
        self.successors: dict[Task, list[Task]] = defaultdict(list)
        for task, deps in graph.deps.items():
            for dep in deps:
                self.successors[dep].append(task)
        self.transfer_of = {(msg.src, msg.dst): msg for msg in graph.remote_transfers}
        self.ready = {w: {t for t in tasks if not self.missing[t]} for w, tasks in graph.tasks.items()}
        self.left = Counter((self.worker_of(t), t.micro_batch) for t in graph.deps)  # unfinished, per worker
        self.admitted = dict.fromkeys(graph.tasks, 0)  # micro-batches 0 .. admitted-1 have started there
        self.in_flight = dict.fromkeys(graph.tasks, 0)  # of those, the ones not finished there
        self.pending: dict[Worker, deque[Task]] = {w: deque() for w in graph.tasks}  # W tasks, in release order
        self.wgrad = {t: w for t in graph.deps if (w := costs.weight_grad_of(t, graph.shape.num_layers)) is not None}
        self.left.update((self.worker_of(w), w.micro_batch) for w in self.wgrad.values())  # in flight until W too
        self.order: dict[Worker, list[Task]] = {w: [] for w in graph.tasks}
        self.compute: dict[Task, tuple[float, float]] = {}
        self.transfers: dict[Transfer, tuple[float, float]] = {}
        self.link_free: dict[object, float] = defaultdict(float)
        self.events: list[tuple[float, int, Task | Transfer]] = []

    def run(
        self,
    ) -> tuple[dict[Worker, tuple[Task, ...]], dict[Task, tuple[float, float]], dict[Transfer, tuple[float, float]]]:
        now, idle = 0.0, set(self.graph.tasks)
        while True:
            for worker in sorted(idle):
                if self._start(worker, now):
                    idle.remove(worker)
            if not self.events:
                break
            now = self.events[0][0]
            while self.events and self.events[0][0] == now:
                item = heapq.heappop(self.events)[2]
                if isinstance(item, Task):
                    idle.add(self.worker_of(item))
                    self._finish(item, now)
                else:
                    self._release(item.dst)
        if any(task not in self.compute for task in self.missing):
            raise ScheduleError(self._stall_report(now))
        return {w: tuple(ts) for w, ts in self.order.items()}, self.compute, self.transfers

    def _start(self, worker: Worker, now: float) -> bool:
        admit = self.admitted[worker] if self.in_flight[worker] < self.cap else -1  # the one it may admit
        candidates = [t for t in self.ready[worker] if t.micro_batch < self.admitted[worker] or t.micro_batch == admit]
        if candidates:
            task = min(candidates, key=_priority)
            if task.micro_batch == admit:
                self.admitted[worker] += 1
                self.in_flight[worker] += 1
            self.ready[worker].remove(task)
        elif self.pending[worker]:  # nothing else may start: the oldest deferred weight gradients fill the gap
            task = self.pending[worker].popleft()
        else:
            return False
        self.order[worker].append(task)
        self.compute[task] = (now, now + self.costs.compute_s(task, self.graph.shape.num_layers))
        self._push(self.compute[task][1], task)
        return True

    def _finish(self, task: Task, now: float) -> None:
        worker = self.worker_of(task)
        self.left[worker, task.micro_batch] -= 1
        if not self.left[worker, task.micro_batch]:
            self.in_flight[worker] -= 1
        if task in self.wgrad:
            self.pending[worker].append(self.wgrad[task])
        for succ in self.successors[task]:
            msg = self.transfer_of.get((task, succ))
            if msg is None:
                self._release(succ)
                continue
            # Sends reach a channel in time order here, so serving them first come first served keeps send order.
            start = max(now, self.link_free[msg.channel])
            self.link_free[msg.channel] = start + self.costs.transfer_s(msg)
            self.transfers[msg] = (start, self.link_free[msg.channel])
            self._push(self.link_free[msg.channel], msg)

    def _release(self, task: Task) -> None:
        self.missing[task] -= 1
        if not self.missing[task]:
            self.ready[self.worker_of(task)].add(task)

    def _push(self, time: float, item: Task | Transfer) -> None:
        heapq.heappush(self.events, (time, len(self.compute) + len(self.transfers), item))

    def _stall_report(self, now: float) -> str:
        stuck = [f"{w} ready {sorted(map(str, ts))}" for w, ts in sorted(self.ready.items()) if ts]
        return (
            f"schedule simulation stalled at t={now:g}s with {len(self.missing) - len(self.compute)} tasks never "
            f"started (max_in_flight={self.cap}); {'; '.join(stuck) or 'no task is ready: the graph has a cycle'}"
        )
