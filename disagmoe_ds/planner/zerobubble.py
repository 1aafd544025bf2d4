"""Split backward on the A/F ring (the zero-bubble idea of Qi et al. 2023, applied to AF-Pipe; pure Python).

Each backward task becomes an input-gradient task B (what the upstream worker waits for: dgrad GEMMs, the
attention core's backward and any recompute) and a weight-gradient task W (the wgrad GEMMs; nothing waits
for it but the optimizer step). The scheduling rule is the schedule generator's own
(``disagmoe_ds.schedule.generator``: W tasks exist where ``Costs`` gives them a positive cost, an idle worker
runs its oldest pending W, a micro-batch stays in flight until its W there is done), so the order simulated here
is the one the runtime runs with ``"disagmoe": {"split_backward": true}``. This module only reads the timeline.

With every W cost zero this reduces to ``generate`` exactly (tested).
"""

from __future__ import annotations

from disagmoe_ds.schedule import Costs, PipeShape, TimelineEvent, Worker, build_graph
from disagmoe_ds.schedule.generator import _Simulation


def simulate_split_backward(
    shape: PipeShape, micro_batches: int, costs: Costs, *, cap: int
) -> tuple[float, dict[Worker, float], tuple[TimelineEvent, ...]]:
    """(step seconds, busy share per worker, timeline) of one step; ``costs``' ``*_wgt`` costs are the W tasks."""
    _, compute, transfers = _Simulation(build_graph(shape, micro_batches), costs, cap).run()
    step = max(end for _, end in compute.values())
    busy: dict[Worker, float] = dict.fromkeys(shape.workers, 0.0)
    events = []
    for task, (start, end) in compute.items():
        busy[shape.worker_of(task)] += end - start
        events.append(TimelineEvent(str(shape.worker_of(task)), task.label, "compute", start, end, {"task": str(task)}))
    for msg, (start, end) in transfers.items():
        args = {"channel": str(msg.channel)}
        events.append(TimelineEvent(str(msg.src_worker), str(msg), "send", start, end, args))
        events.append(TimelineEvent(str(msg.dst_worker), str(msg), "recv", start, end, args))
    return step, {w: b / step for w, b in busy.items()}, tuple(events)
