"""Clean stops: Ctrl-C or SIGTERM ends the run after the current step, with a checkpoint, on every rank at once.

A signal only sets a flag (a handler may run in the middle of a collective). After each step the ranks agree
with one all-reduce whether any of them was asked to stop, so all of them leave the loop after the same step
and take the collective save together. A second SIGINT to a rank aborts it at once; SIGTERM never does.

Who gets the signal depends on the launcher, and every path ends in the same stop:

- no launcher (``spawn_local``): Ctrl-C in a terminal reaches the ranks and the parent; ``kill -INT``/``kill -TERM``
  of the parent's PID reaches the parent alone. The parent forwards a SIGTERM to its ranks either way and keeps
  waiting; a second SIGINT to the parent aborts (``spawn_local`` kills the ranks).
- ``deepspeed``: its per-node launcher answers SIGINT/SIGTERM with SIGTERM to the ranks and SIGKILL 30 s later
  (the step and the save must fit in that time). SIGINT to the ``deepspeed`` command alone kills that command but
  leaves the per-node launcher and the ranks running; the ranks see their launcher orphaned (``LauncherWatch``)
  and stop as if asked.
- ``torchrun``: it forwards the signal it got to the ranks (each in its own session) and kills them 30 s later.
- Slurm sends SIGTERM before preemption.

A run stopped on request saves, then exits with ``STOPPED_EXIT`` (130, "interrupted"); the launchers' own exit
codes after a signal are non-zero too (deepspeed 1, torchrun a SignalException), so a stopped run never looks
finished to a script.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import sys
from contextlib import contextmanager

import psutil
import torch
import torch.distributed as dist

from disagmoe_ds.launch import detect_launcher

STOPPED_EXIT = 130  # 128 + SIGINT: what a shell reports for an interrupted command


class LauncherWatch:
    """Whether the process that started this rank died (``kill -9`` of it leaves the rank orphaned, re-parented).

    Under ``deepspeed`` the rank's parent is DeepSpeed's per-node launcher (``deepspeed.launcher.launch``), which
    outlives a killed ``deepspeed`` command (or pdsh's remote shell): the watch is on the launcher's parent. Under
    any other start (this script's forked ranks, torchrun, mpirun) it is on the rank's own parent. A re-parented
    process's parent PID changes: one read per step, no PID-reuse race, no zombie confusion.
    """

    def __init__(self, launcher: str | None) -> None:
        self._read = (lambda: _parent_of(os.getppid())) if launcher == "deepspeed" else os.getppid
        self._expected = self._read()

    def gone(self) -> bool:
        return self._read() != self._expected


def _parent_of(pid: int) -> int | None:
    try:
        return psutil.Process(pid).ppid()
    except psutil.Error:
        return None


class StopRequest:
    """Set by SIGINT/SIGTERM in a rank; ``agreed()`` is True on every rank once any rank was asked to stop."""

    def __init__(self) -> None:
        self.requested = False
        self._interrupts = 0
        self._launcher = LauncherWatch(detect_launcher())

    def install(self) -> StopRequest:
        signal.signal(signal.SIGINT, self._handle)
        signal.signal(signal.SIGTERM, self._handle)
        return self

    def _handle(self, signum: int, frame: object) -> None:
        if signum == signal.SIGINT:
            self._interrupts += 1
            if self._interrupts > 1:
                raise KeyboardInterrupt  # the second Ctrl-C: abort without saving
        self.requested = True

    def agreed(self, device: torch.device) -> bool:
        """Collective: whether any rank was asked to stop (or lost the launcher that started it)."""
        self.requested = self.requested or self._launcher.gone()
        flag = torch.tensor([int(self.requested)], device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())  # host-device sync, once per step


@contextmanager
def parent_waits_for_ranks(message: str):
    """In the process that forked the ranks: pass a stop request on to them and keep waiting while they stop.

    The first SIGINT or SIGTERM prints ``message`` and sends SIGTERM to every rank (a Ctrl-C in a terminal also
    reached them directly; SIGTERM on top of it never aborts a rank), then the parent keeps waiting for the save.
    A second SIGINT raises KeyboardInterrupt (``spawn_local`` then kills the ranks).
    """
    stopping = False

    def on_signal(signum: int, frame: object) -> None:
        nonlocal stopping
        if signum == signal.SIGINT:
            signal.signal(signal.SIGINT, signal.default_int_handler)
        if stopping:
            return
        stopping = True
        print(message, file=sys.stderr, flush=True)
        for rank in multiprocessing.active_children():
            if rank.pid is None:  # active children are started; pid is None only before start()
                continue
            try:
                os.kill(rank.pid, signal.SIGTERM)
            except ProcessLookupError:  # exited since active_children() looked
                pass

    previous = {signum: signal.signal(signum, on_signal) for signum in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
