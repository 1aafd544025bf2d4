"""A job whose ranks failed: one line on the terminal naming the root cause, every traceback in a log file.

A failing rank usually takes its peers down with it (their next collective fails with "Connection closed by
peer"), so the full report holds several tracebacks of which only the first failing rank's matters.
``spawn_local`` orders the failed ranks root cause first; the line names that rank's exception and where the rest
went. Under a launcher (torchrun, deepspeed) every rank reports for itself: each writes its own traceback, and only
the first to fail prints the line (the launcher's own messages follow it).
"""

from __future__ import annotations

import os
import tempfile
import time
import traceback
from pathlib import Path

import psutil
import torch.distributed as dist

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


def job_key() -> str:
    """One name for this launched job on every rank (rank 0's start time, broadcast): the failure files' prefix."""
    key = [time.strftime("%Y%m%d-%H%M%S") + f"-{os.getpid()}"]
    dist.broadcast_object_list(key, src=0)
    return key[0]


def report_launched_failure(key: str, rank: int, err: BaseException) -> str | None:
    """Under a launcher, a failing rank writes its traceback to ``run_pretrain-failure-KEY-rankR.log``; the first
    rank of the job to fail (first to create the ``.first`` marker in the same temporary directory, one per node)
    returns the one line to print, the others None: their failures are usually the first one's consequence.

    A rank that lost a peer is a consequence, not a cause: it waits a moment (so that a peer with an error of its
    own claims the line) and then names the peers of this node that ended without one (a signal, the kernel's
    out-of-memory killer), which no Python handler sees."""
    folder = Path(tempfile.gettempdir())
    log = folder / f"run_pretrain-failure-{key}-rank{rank}.log"
    log.write_text("".join(traceback.format_exception(err)))
    cause = f"{type(err).__name__}: {err}".splitlines()[0]
    lost_peer = any(text in cause for text in _PEER_LOST)
    if lost_peer:
        time.sleep(PEER_GRACE_S)
    try:
        os.close(os.open(folder / f"run_pretrain-failure-{key}.first", os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return None
    where = f"tracebacks: {folder}/run_pretrain-failure-{key}-rank*.log"
    if not lost_peer:
        return f"rank {rank} failed: {cause} ({where})"
    reported = {int(path.stem.rpartition("-rank")[2]) for path in folder.glob(f"run_pretrain-failure-{key}-rank*.log")}
    dead = [r for r in gone_local_ranks() if r not in reported]  # those that failed in Python wrote a log
    who = f"rank {', '.join(map(str, dead))}" if dead else "a rank on another node (its launcher's log names it)"
    return (
        f"{who} ended without a Python error (killed by a signal, or by the out-of-memory killer: see dmesg), and "
        f"rank {rank} then lost its connection: {cause} ({where})"
    )


# What a collective raises when the rank at the other end is gone (gloo, NCCL's socket transport).
_PEER_LOST = ("Connection reset by peer", "Connection closed by peer", "Broken pipe", "Connection refused")
PEER_GRACE_S = 2.0


def gone_local_ranks() -> list[int]:
    """Global ranks of this node's launcher whose processes are gone: the local ranks (``LOCAL_SIZE``, or
    torchrun's ``LOCAL_WORLD_SIZE``) that no live sibling of this rank holds."""
    local_size = int(os.environ.get("LOCAL_SIZE") or os.environ.get("LOCAL_WORLD_SIZE") or 0)
    first = int(os.environ.get("RANK", 0)) - int(os.environ.get("LOCAL_RANK", 0))
    alive = set()
    for sibling in psutil.Process(os.getppid()).children():
        try:
            if sibling.status() != psutil.STATUS_ZOMBIE and "LOCAL_RANK" in (env := sibling.environ()):
                alive.add(int(env["LOCAL_RANK"]))
        except psutil.Error:  # ended while we looked
            continue
    return [first + local for local in range(local_size) if local not in alive]
