"""A job whose ranks failed: one line on the terminal naming the root cause, every traceback in a log file.

A failing rank usually takes its peers down with it (their next collective fails with "Connection closed by
peer"), so the full report holds several tracebacks of which only the first failing rank's matters.
``spawn_local`` orders the failed ranks root cause first; the line names that rank's exception and where the rest
went.
"""

from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path

from disagmoe_ds.launch import RankFailedError


def failure_log_path() -> Path:
    """In the system's temporary directory ($TMPDIR), not among the checkpoints (whose directory lists are exact)."""
    name = f"run_pretrain-failure-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}.log"
    return Path(tempfile.gettempdir()) / name


def report_rank_failure(err: RankFailedError) -> str:
    """Write every failed rank's traceback to a log file; return the one line to print."""
    path = failure_log_path()
    try:
        path.write_text(f"{err}\n")
    except OSError as write_err:  # the report must not hide the failure: fall back to printing it whole
        return f"rank {err.rank} failed: {err.cause} (could not write the log {path}: {write_err}); all ranks:\n{err}"
    return f"rank {err.rank} failed: {err.cause} (tracebacks of every failed rank: {path})"
