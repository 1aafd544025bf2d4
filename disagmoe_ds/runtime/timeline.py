"""A whole job's timeline: every rank records what it ran when, rank 0 writes one Chrome/Perfetto trace.

Times are ``time.perf_counter`` seconds relative to a start taken right after a barrier, so ranks line up to
within the barrier's skew. On GPU the events are host-side: they show when work was issued and how long the host
waited, which is where bubbles and communication waits appear.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch.distributed as dist

from disagmoe_ds.schedule import TimelineEvent, write_chrome_trace


def start_clock() -> float:
    dist.barrier()
    return time.perf_counter()


def gather_timeline(events: list[TimelineEvent], t0: float) -> list[TimelineEvent] | None:
    """All ranks' events shifted to the common start; the list on rank 0, None elsewhere (collective)."""
    shifted = [TimelineEvent(e.worker, e.name, e.category, e.start_s - t0, e.end_s - t0, dict(e.args)) for e in events]
    # Rank 0's slots, one per rank, each filled with that rank's events.
    gathered: list[list[TimelineEvent] | None] | None = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(shifted, gathered, dst=0)
    if gathered is None:
        return None
    return [event for rank_events in gathered for event in rank_events or ()]


def write_job_timeline(events: list[TimelineEvent], t0: float, path: str | Path) -> None:
    """Collective: gather every rank's events and write ``path`` (Chrome trace JSON) on rank 0."""
    merged = gather_timeline(events, t0)
    if merged is not None:
        write_chrome_trace(merged, path)
