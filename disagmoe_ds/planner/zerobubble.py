"""Split backward on the A/F ring (the zero-bubble idea of Qi et al. 2023, applied to AF-Pipe; pure Python).

Each backward task becomes an input-gradient task B (what the upstream worker waits for: dgrad GEMMs, the
attention core's backward and any recompute) and a weight-gradient task W (the wgrad GEMMs; nothing waits
for it but the optimizer step). The simulation is the schedule generator's own list scheduler
(``disagmoe_ds.schedule.generator``) with one rule added: a worker with no forward or B task it may start
runs its oldest pending W instead, so W fills what would be bubbles. A micro-batch stays in flight on a
worker until its W tasks there are done too, because the wgrad GEMMs read the layer inputs and output
gradients that make up its activations; the in-flight cap therefore bounds the memory as before.

With every W cost zero this reduces to ``generate`` exactly (tested).
"""

from __future__ import annotations

from collections import deque

from disagmoe_ds.schedule import Costs, PipeShape, Task, TimelineEvent, Worker, build_graph
from disagmoe_ds.schedule.generator import _Simulation

_WGRAD_KIND = {"A_bwd": "A_wgt", "F_bwd": "F_wgt"}


class SplitBackwardSimulation(_Simulation):
    """``_Simulation`` whose backward tasks release a deferred weight-gradient task on their worker."""

    def __init__(self, shape: PipeShape, micro_batches: int, costs: Costs, cap: int, wgrad: dict) -> None:
        super().__init__(build_graph(shape, micro_batches), costs, cap)
        self.wgrad_s = wgrad  # (kind "A_wgt"/"F_wgt", layer) -> seconds
        self.pending: dict[Worker, deque[Task]] = {w: deque() for w in self.graph.tasks}
        for task in self.graph.deps:
            if self._wgrad_of(task) is not None:
                self.left[self.worker_of(task), task.micro_batch] += 1  # its W must finish there too

    def _wgrad_of(self, task: Task) -> Task | None:
        kind = _WGRAD_KIND.get(task.kind)
        if kind is None or not self.wgrad_s.get((kind, task.layer), 0.0) > 0:
            return None
        return Task(kind, task.layer, task.micro_batch)  # type: ignore[arg-type]

    def _start(self, worker: Worker, now: float) -> bool:
        if super()._start(worker, now):
            return True
        if not self.pending[worker]:
            return False
        task = self.pending[worker].popleft()
        self.compute[task] = (now, now + self.wgrad_s[task.kind, task.layer])
        self._push(self.compute[task][1], task)
        return True

    def _finish(self, task: Task, now: float) -> None:
        super()._finish(task, now)
        wgrad = self._wgrad_of(task)
        if wgrad is not None:
            self.pending[self.worker_of(task)].append(wgrad)


def simulate_split_backward(
    shape: PipeShape, micro_batches: int, costs: Costs, *, cap: int, wgrad: dict
) -> tuple[float, dict[Worker, float], tuple[TimelineEvent, ...]]:
    """(step seconds, busy share per worker, timeline) of one step with deferred weight-gradient tasks."""
    sim = SplitBackwardSimulation(shape, micro_batches, costs, cap, wgrad)
    _, compute, transfers = sim.run()
    step = max(end for _, end in compute.values())
    busy: dict[Worker, float] = dict.fromkeys(shape.workers, 0.0)
    events = []
    for task, (start, end) in compute.items():
        busy[shape.worker_of(task)] += end - start
        label = f"W{task.layer}.{task.micro_batch}" if task.kind.endswith("wgt") else task.label
        events.append(TimelineEvent(str(shape.worker_of(task)), label, "compute", start, end, {"task": str(task)}))
    for msg, (start, end) in transfers.items():
        args = {"channel": str(msg.channel)}
        events.append(TimelineEvent(str(msg.src_worker), str(msg), "send", start, end, args))
        events.append(TimelineEvent(str(msg.dst_worker), str(msg), "recv", start, end, args))
    return step, {w: b / step for w, b in busy.items()}, tuple(events)
