"""Where a stalled rank waits: every thread's Python stack on stderr when one piece of a step runs far too long.

A hung distributed job usually says nothing until the communication timeout ends it, and the error then names a
collective, not the line that waited. ``StallWatch`` keeps ``faulthandler``'s C-level timer (it fires even while
the main thread holds the GIL in a device sync) re-armed while a step makes progress; if no progress is reported
for ``seconds``, the rank prints its stacks once, before the timeout fires.

Re-arming costs about 30 us, so ``tick`` re-arms at most every quarter period: the dump comes between 3/4 and all
of ``seconds`` after the last progress.
"""

from __future__ import annotations

import faulthandler
import math
import sys
import time


class StallWatch:
    """``tick()`` at each unit of progress, ``stop()`` when the step is over; ``seconds`` None disables it."""

    def __init__(self, seconds: float | None) -> None:
        self._stream = sys.__stderr__  # the process's own stderr, not a test's capture; None in some embedded runs
        self.seconds = seconds if seconds and self._stream is not None else None
        self._armed_at = -math.inf

    @classmethod
    def before_timeout(cls, comm_timeout_s: float | None) -> StallWatch:
        """Fires at half the communication timeout: the stacks are out well before the timeout ends the job."""
        return cls(comm_timeout_s / 2 if comm_timeout_s else None)

    def tick(self) -> None:
        if self.seconds is None or self._stream is None:
            return
        now = time.monotonic()
        if now - self._armed_at >= self.seconds / 4:
            faulthandler.dump_traceback_later(self.seconds, file=self._stream)
            self._armed_at = now

    def stop(self) -> None:
        if self._armed_at > -math.inf:
            faulthandler.cancel_dump_traceback_later()
            self._armed_at = -math.inf
