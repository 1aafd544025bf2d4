"""The schedule generator's list scheduler (``disagmoe_ds.schedule.generator._Simulation``) on integer indices, for
the planner's many simulations (pure Python).

The rules, the event order and the float arithmetic are the generator's, so every start and end is the same number
(``tests/test_planner_search_speed.py`` compares them on a grid of shapes, caps, costs and split backwards). What
differs is bookkeeping only, which made the generator's simulation the search's cost (issue 28's A-lanes multiply
the micro-batches): tasks are indices into arrays built once per (shape, micro-batches) (``RingGraph``), and a
worker's ready tasks sit in heaps by priority, split by admission (the generator scans the whole ready set, on
every start, for the admitted micro-batches' tasks). A worker's tasks have distinct priorities, so the heap's minimum
is the generator's ``min``. Timeline events are built only when asked for.
"""

from __future__ import annotations

import heapq
from collections import deque
from dataclasses import dataclass
from functools import lru_cache

from disagmoe_ds.schedule import Costs, PipeShape, Task, TimelineEvent, Worker, build_graph
from disagmoe_ds.schedule.generator import _Simulation
from disagmoe_ds.schedule.tasks import Transfer

_WGRAD_OF = {"A_bwd": "A_wgt", "F_bwd": "F_wgt"}


@dataclass(frozen=True, eq=False)
class RingGraph:
    """One micro-batch of ``build_graph``'s graph as arrays; every micro-batch repeats it (task j of micro-batch m is
    index m T + j, its messages m K + k), because no dependency crosses micro-batches. The local order is the
    graph's: tasks as ``graph.deps`` meets them, successors in dependency order (it orders a channel's sends)."""

    shape: PipeShape
    micro_batches: int
    workers: tuple[Worker, ...]  # sorted: the generator visits idle workers in this order
    kinds: tuple[tuple[str, int], ...]  # (kind, layer) per local task
    worker: tuple[int, ...]
    priority: tuple[tuple[bool, int], ...]  # the generator's ``_priority`` without the micro-batch
    missing: tuple[int, ...]  # dependencies per task
    successors: tuple[tuple[tuple[int, int], ...], ...]  # (successor, message or -1: same worker)
    messages: tuple[tuple[str, int, int, int], ...]  # (kind, src task, dst task, channel) per local message
    channels: int

    @property
    def size(self) -> int:
        """T: tasks per micro-batch."""
        return len(self.kinds)

    def task(self, i: int) -> Task:
        kind, layer = self.kinds[i % self.size]
        return Task(kind, layer, i // self.size)  # type: ignore[arg-type]

    def message(self, i: int) -> Transfer:
        kind, src, dst, _ = self.messages[i % len(self.messages)]
        offset = i // len(self.messages) * self.size
        a, b = self.task(offset + src), self.task(offset + dst)
        w = self.shape.worker_of
        return Transfer(kind, a, b, w(a), w(b))  # type: ignore[arg-type]


@lru_cache(maxsize=64)
def ring_graph(shape: PipeShape, micro_batches: int) -> RingGraph:
    """The arrays of one step's graph (cached: a candidate's caps and backward forms share them)."""
    one = build_graph(shape, 1)
    tasks = tuple(one.deps)
    index = {t: j for j, t in enumerate(tasks)}
    workers = tuple(sorted(one.tasks))
    wid = {w: j for j, w in enumerate(workers)}
    message = {(m.src, m.dst): k for k, m in enumerate(one.remote_transfers)}
    channels: dict[object, int] = {}
    successors: list[list[tuple[int, int]]] = [[] for _ in tasks]
    for task, deps in one.deps.items():
        for dep in deps:
            successors[index[dep]].append((index[task], message.get((dep, task), -1)))
    return RingGraph(
        shape=shape,
        micro_batches=micro_batches,
        workers=workers,
        kinds=tuple((t.kind, t.layer) for t in tasks),
        worker=tuple(wid[shape.worker_of(t)] for t in tasks),
        priority=tuple((t.is_forward, t.layer if t.is_forward else -t.layer) for t in tasks),
        missing=tuple(len(one.deps[t]) for t in tasks),
        successors=tuple(tuple(s) for s in successors),
        messages=tuple(
            (m.kind, index[m.src], index[m.dst], channels.setdefault(m.channel, len(channels)))
            for m in one.remote_transfers
        ),
        channels=len(channels),
    )


@dataclass(frozen=True)
class RingRun:
    """One simulated step: its end, each worker's busy seconds (in ``shape.workers`` order) and, when asked for,
    the intervals in the generator's order (compute in start order, transfers in send order)."""

    step_s: float
    busy_s: dict[Worker, float]
    compute: tuple[tuple[Task, float, float], ...] = ()
    transfers: tuple[tuple[Transfer, float, float], ...] = ()

    def events(self, shape: PipeShape) -> tuple[TimelineEvent, ...]:
        """``zerobubble``'s timeline: compute on its worker, each transfer as a send and a recv."""
        out = [
            TimelineEvent(str(shape.worker_of(t)), t.label, "compute", start, end, {"task": str(t)})
            for t, start, end in self.compute
        ]
        for msg, start, end in self.transfers:
            args = {"channel": str(msg.channel)}
            out.append(TimelineEvent(str(msg.src_worker), str(msg), "send", start, end, args))
            out.append(TimelineEvent(str(msg.dst_worker), str(msg), "recv", start, end, args))
        return tuple(out)


def run_ring(shape: PipeShape, micro_batches: int, costs: Costs, *, cap: int, intervals: bool = False) -> RingRun:
    """Simulate one step as ``_Simulation(build_graph(shape, micro_batches), costs, cap).run()`` does."""
    g = ring_graph(shape, micro_batches)
    sim = _Run(g, costs, cap, record=intervals)
    sim.run()
    if sim.started < sim.n:  # a stall: the generator raises, in its words
        _Simulation(build_graph(shape, micro_batches), costs, cap).run()
        raise AssertionError("the schedule generator did not stall where its replica did")
    busy = {w: sim.busy[i] for i, w in enumerate(g.workers)}
    if not intervals:
        return RingRun(sim.step, {w: busy[w] for w in shape.workers})
    compute = tuple((sim.task(i), sim.start_of[i], sim.end_of[i]) for i in sim.order)
    transfers = tuple((g.message(m), start, end) for m, start, end in sim.sent)
    return RingRun(sim.step, {w: busy[w] for w in shape.workers}, compute, transfers)


def _local_costs(g: RingGraph, costs: Costs) -> tuple[list[float], list[float], list[float]]:
    """Per local task its ``compute_s`` and its deferred W task's (0: none), per local message its ``transfer_s``:
    none depends on the micro-batch."""
    layers = g.shape.num_layers
    compute, wgrad = [], []
    for kind, layer in g.kinds:
        compute.append(costs.compute_s(Task(kind, layer, 0), layers))  # type: ignore[arg-type]
        w_kind = _WGRAD_OF.get(kind)
        wgrad.append(costs.compute_s(Task(w_kind, layer, 0), layers) if w_kind else 0.0)  # type: ignore[arg-type]
    transfer = [costs.overrides.get((kind, g.kinds[src][1]), getattr(costs, kind)) for kind, src, _, _ in g.messages]
    return compute, wgrad, transfer


class _Run:
    """The event loop of ``_Simulation.run`` over ``RingGraph`` indices. Task i's deferred W task is n + i.

    A ready task waits in its worker's heap as one int, priority x 2n + i: the generator's ``_priority`` order
    (backward first, then the layer, then the micro-batch) packed in ``_packed_priority``, i to recover the task.
    An idle worker is asked to start again only once something it could start changed (a task of its became ready,
    or it finished one: a W task pending, a slot freed); the generator asks every idle worker every time, and one
    whose state did not change starts nothing, so the starts are the same."""

    def __init__(self, g: RingGraph, costs: Costs, cap: int, *, record: bool = True) -> None:
        self.g, self.cap, self.record = g, cap, record
        mbs, size, workers = g.micro_batches, g.size, len(g.workers)
        self.n = n = size * mbs
        self.size, self.mbs, self.local = size, mbs, len(g.messages)
        compute, wgrad, self.transfer = _local_costs(g, costs)
        self.cost = compute * mbs + wgrad * mbs
        self.worker = list(g.worker) * (2 * mbs)  # of task i and of its W task n + i
        self.micro_batch = [m for m in range(mbs) for _ in range(size)] * 2
        self.has_wgrad = [c > 0 for c in wgrad]
        per_worker = [0] * workers  # tasks (W tasks too) a micro-batch has on each worker
        for j, w in enumerate(g.worker):
            per_worker[w] += 1 + self.has_wgrad[j]
        self.left = [per_worker[w] for w in range(workers) for _ in range(mbs)]  # unfinished, per (worker, m)
        self.key = [p * 2 * n + i for i, p in enumerate(_packed_priority(g))]
        self.missing = list(g.missing) * mbs
        self.admitted, self.in_flight = [0] * workers, [0] * workers
        self.eligible: list[list[int]] = [[] for _ in range(workers)]  # ready, of admitted micro-batches
        self.waiting: list[dict[int, list[int]]] = [{} for _ in range(workers)]  # ready, not yet admitted
        self.pending: list[deque[int]] = [deque() for _ in range(workers)]  # W tasks, in release order
        self.link_free = [0.0] * g.channels
        self.events: list[tuple[float, int, int]] = []  # (time, sequence, task i or message ~k)
        self.seq = self.started = 0
        self.step = 0.0
        self.busy = [0.0] * workers
        self.start_of, self.end_of = [0.0] * len(self.cost), [0.0] * len(self.cost)
        self.order: list[int] = []
        self.sent: list[tuple[int, float, float]] = []
        self.wake = set(range(workers))
        for i in range(n):
            if not self.missing[i]:
                self._ready(i)

    def task(self, i: int) -> Task:
        if i < self.n:
            return self.g.task(i)
        b = self.g.task(i - self.n)
        return Task(_WGRAD_OF[b.kind], b.layer, b.micro_batch)  # type: ignore[arg-type]

    def run(self) -> None:
        now, idle, events, wake, worker = 0.0, set(self.wake), self.events, self.wake, self.worker
        local, size, dst = self.local, self.size, [m[2] for m in self.g.messages]
        while True:
            for w in sorted(wake & idle):
                if self._start(w, now):
                    idle.remove(w)
            wake.clear()
            if not events:
                break
            now = events[0][0]
            while events and events[0][0] == now:
                item = heapq.heappop(events)[2]
                if item >= 0:
                    idle.add(worker[item])
                    wake.add(worker[item])
                    self._finish(item, now)
                else:
                    k = ~item
                    self._release(k // local * size + dst[k % local])

    def _start(self, w: int, now: float) -> bool:
        eligible, admit = self.eligible[w], self.admitted[w]
        fresh = self.waiting[w].get(admit) if self.in_flight[w] < self.cap else None
        if fresh and (not eligible or fresh[0] < eligible[0]):
            i = heapq.heappop(fresh) % (2 * self.n)
            del self.waiting[w][admit]
            for key in fresh:  # the admitted micro-batch's other ready tasks
                heapq.heappush(eligible, key)
            self.admitted[w] += 1
            self.in_flight[w] += 1
        elif eligible:
            i = heapq.heappop(eligible) % (2 * self.n)
        elif self.pending[w]:  # nothing else may start: the oldest deferred weight gradients fill the gap
            i = self.pending[w].popleft()
        else:
            return False
        end = now + self.cost[i]
        self.busy[w] += end - now
        if end > self.step:
            self.step = end
        if self.record:
            self.start_of[i], self.end_of[i] = now, end
            self.order.append(i)
        self.started += i < self.n
        self.seq += 1
        heapq.heappush(self.events, (end, self.seq, i))
        return True

    def _finish(self, i: int, now: float) -> None:
        w, m, left = self.worker[i], self.micro_batch[i], self.left
        key = w * self.mbs + m
        left[key] -= 1
        if not left[key]:
            self.in_flight[w] -= 1
        if i >= self.n:
            return
        offset = m * self.size
        j = i - offset
        if self.has_wgrad[j]:
            self.pending[w].append(self.n + i)
        link_free, messages = self.link_free, self.g.messages
        for succ, k in self.g.successors[j]:
            if k < 0:
                self._release(offset + succ)
                continue
            channel, sent = messages[k][3], m * self.local + k
            start = max(now, link_free[channel])
            end = link_free[channel] = start + self.transfer[k]
            if self.record:
                self.sent.append((sent, start, end))
            self.seq += 1
            heapq.heappush(self.events, (end, self.seq, ~sent))

    def _release(self, i: int) -> None:
        missing = self.missing
        missing[i] -= 1
        if not missing[i]:
            self._ready(i)

    def _ready(self, i: int) -> None:
        w, m = self.worker[i], self.micro_batch[i]
        self.wake.add(w)
        if m < self.admitted[w]:
            heapq.heappush(self.eligible[w], self.key[i])
        else:
            heapq.heappush(self.waiting[w].setdefault(m, []), self.key[i])


def _packed_priority(g: RingGraph) -> list[int]:
    """The generator's ``_priority`` (is_forward, layer or -layer, micro-batch) of every task as one int, in the same
    order: the fields packed with room for each range (the layer key lies in [-L, L])."""
    mbs, span = g.micro_batches, 2 * g.shape.num_layers + 1
    local = [(int(fwd) * span + layer + g.shape.num_layers) * mbs for fwd, layer in g.priority]
    return [p + m for m in range(mbs) for p in local]


# ----- an exact lower bound on the step, for the search's pruning -----
BOUND_SLACK = 1e-6  # relative: covers the simulation's float rounding (far below 1e-9 for 1e5 additions)


def round_trip_s(shape: PipeShape, costs: Costs) -> float:
    """The shortest time one micro-batch is in flight on A_0: its longest dependency path from A_fwd(0), its first
    task there, to the end of A_bwd(0) (and its W task, under a split backward), the last; transfers take at least
    their cost. Every micro-batch's tasks are costed alike, so this holds for each."""
    g = ring_graph(shape, 1)
    compute, wgrad, transfer = _local_costs(g, costs)
    ready = [0.0] * g.size  # longest path to each task's start
    order, missing = [j for j in range(g.size) if not g.missing[j]], list(g.missing)
    for j in order:  # Kahn's order: every task after its dependencies
        end = ready[j] + compute[j]
        for succ, k in g.successors[j]:
            ready[succ] = max(ready[succ], end + (transfer[k] if k >= 0 else 0.0))
            missing[succ] -= 1
            if not missing[succ]:
                order.append(succ)
    last = g.kinds.index(("A_bwd", 0))
    return ready[last] + compute[last] + wgrad[last]


def cap_bound_s(shape: PipeShape, micro_batches: int, costs: Costs, *, cap: int) -> float:
    """A lower bound on ``run_ring``'s step: A_0 holds at most ``cap`` micro-batches at a time, each for at least a
    round trip, so some run of ceil(m / cap) of them is in flight one after another (the in-flight intervals, at most
    ``cap`` overlapping, split into ``cap`` chains of disjoint ones). Shaved by ``BOUND_SLACK``."""
    return -(-micro_batches // min(cap, micro_batches)) * round_trip_s(shape, costs) * (1 - BOUND_SLACK)
