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

from disagmoe_ds.planner.ring_sim import run_ring
from disagmoe_ds.schedule import Costs, PipeShape, TimelineEvent, Worker


def simulate_split_backward(
    shape: PipeShape, micro_batches: int, costs: Costs, *, cap: int, events: bool = True
) -> tuple[float, dict[Worker, float], tuple[TimelineEvent, ...]]:
    """(step seconds, busy share per worker, timeline) of one step; ``costs``' ``*_wgt`` costs are the W tasks. The
    generator's simulation, run by its index-based replica (``ring_sim.py``); ``events=False`` skips the timeline."""
    run = run_ring(shape, micro_batches, costs, cap=cap, intervals=events)
    step = run.step_s
    return step, {w: b / step for w, b in run.busy_s.items()}, run.events(shape) if events else ()
