"""Timelines as Chrome trace JSON (loads in Perfetto and chrome://tracing); shared by planner and runtime.

The planner writes predicted timelines and the runtime measured ones with the same ``TimelineEvent``.
Each worker is one process; each category gets its own threads, and overlapping events of one category
(transfers on different channels) are spread over numbered threads, since a trace thread cannot overlap.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

Category = Literal["compute", "wait", "send", "recv", "optimizer"]
_CATEGORIES: tuple[Category, ...] = ("compute", "optimizer", "wait", "send", "recv")
_TIDS_PER_CATEGORY = 1000


@dataclass(frozen=True)
class TimelineEvent:
    """One interval on one worker; ``args`` is free-form detail shown in the trace viewer."""

    worker: str
    name: str
    category: Category
    start_s: float
    end_s: float
    args: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.category not in _CATEGORIES:
            raise ValueError(f"category {self.category!r} of {self.name!r} must be one of {_CATEGORIES}")
        if self.end_s < self.start_s:
            raise ValueError(f"event {self.name!r} on {self.worker} ends ({self.end_s}) before it starts")


def to_chrome_trace(events: Iterable[TimelineEvent]) -> dict[str, Any]:
    """Chrome trace event format: one ``X`` event per interval, microsecond timestamps, named processes."""
    events = sorted(events, key=lambda e: (e.worker, e.start_s, e.end_s))
    pids = {w: pid for pid, w in enumerate(sorted({e.worker for e in events}))}
    meta = [_meta("process_name", pid, 0, w) for w, pid in pids.items()]
    track_ends: dict[tuple[str, str], list[float]] = {}
    out = []
    for e in events:
        ends = track_ends.setdefault((e.worker, e.category), [])
        k = next((k for k, end in enumerate(ends) if end <= e.start_s), len(ends))
        if k == len(ends):
            ends.append(e.end_s)
            name = e.category if k == 0 else f"{e.category} {k}"
            meta.append(_meta("thread_name", pids[e.worker], _tid(e.category, k), name))
        ends[k] = e.end_s
        out.append(
            {
                "ph": "X",
                "name": e.name,
                "cat": e.category,
                "pid": pids[e.worker],
                "tid": _tid(e.category, k),
                "ts": e.start_s * 1e6,
                "dur": (e.end_s - e.start_s) * 1e6,
                "args": dict(e.args),
            }
        )
    return {"traceEvents": meta + out, "displayTimeUnit": "ms"}


def write_chrome_trace(events: Iterable[TimelineEvent], path: str | Path) -> None:
    Path(path).write_text(json.dumps(to_chrome_trace(events)), encoding="utf-8")


def _tid(category: Category, k: int) -> int:
    return _CATEGORIES.index(category) * _TIDS_PER_CATEGORY + k


def _meta(kind: str, pid: int, tid: int, name: str) -> dict[str, Any]:
    return {"ph": "M", "name": kind, "pid": pid, "tid": tid, "args": {"name": name}}
