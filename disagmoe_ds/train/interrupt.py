"""Clean stops: Ctrl-C or SIGTERM ends the run after the current step, with a checkpoint, on every rank at once.

A signal only sets a flag (a handler may run in the middle of a collective). After each step the ranks agree
with one all-reduce whether any of them was asked to stop, so all of them leave the loop after the same step
and take the collective save together. A second Ctrl-C aborts at once.

Ctrl-C in a terminal reaches every process of the foreground group: the ranks, and the parent that started
them (``spawn_local``), which must then keep waiting instead of killing its ranks. Under the ``deepspeed``
launcher the launcher itself answers SIGINT with SIGTERM to the ranks and SIGKILL 30 s later, so SIGTERM is a
stop request too (also what Slurm sends before preemption); the step and the save must fit in that time.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import sys
from contextlib import contextmanager

import torch
import torch.distributed as dist


class StopRequest:
    """Set by SIGINT/SIGTERM in a rank; ``agreed()`` is True on every rank once any rank was asked to stop."""

    def __init__(self) -> None:
        self.requested = False

    def install(self) -> StopRequest:
        signal.signal(signal.SIGINT, self._handle)
        signal.signal(signal.SIGTERM, self._handle)
        return self

    def _handle(self, signum: int, frame: object) -> None:
        if self.requested and signum == signal.SIGINT:
            raise KeyboardInterrupt  # the second Ctrl-C: abort without saving
        self.requested = True

    def agreed(self, device: torch.device) -> bool:
        """Collective: whether any rank was asked to stop."""
        flag = torch.tensor([int(self.requested)], device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())  # host-device sync, once per step


@contextmanager
def parent_waits_for_ranks(message: str):
    """In the process that forked the ranks: keep waiting for them while they stop, and let them stop.

    Ctrl-C reaches the ranks from the terminal itself, so the parent only prints ``message`` and keeps waiting;
    a second Ctrl-C raises KeyboardInterrupt (``spawn_local`` then kills the ranks). SIGTERM (``kill``, a batch
    scheduler) reaches only this process, so it is passed on to the ranks, which stop after their step.
    """

    def on_interrupt(signum: int, frame: object) -> None:
        signal.signal(signal.SIGINT, signal.default_int_handler)
        print(message, file=sys.stderr, flush=True)

    def on_terminate(signum: int, frame: object) -> None:
        print(message, file=sys.stderr, flush=True)
        for rank in multiprocessing.active_children():
            os.kill(rank.pid, signal.SIGTERM)

    handlers = {signal.SIGINT: on_interrupt, signal.SIGTERM: on_terminate}
    previous = {signum: signal.signal(signum, handler) for signum, handler in handlers.items()}
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
