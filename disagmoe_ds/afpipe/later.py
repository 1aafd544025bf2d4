"""A message payload that can be made only once sizes computed on the device have reached the host."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

T = TypeVar("T", covariant=True)


class Landing(Protocol):
    """Device results on their way to host memory (``comm.routing.PendingDispatch``)."""

    def ready(self) -> bool: ...


@dataclass(frozen=True, eq=False)
class Later(Generic[T]):
    """``make()`` gives the payload; it may wait for ``source`` (None: nothing to wait for). The mailbox sends a
    ``Later`` once ``ready``, so the host never stops queueing work to wait for a message's sizes."""

    source: Landing | None
    make: Callable[[], T]

    def ready(self) -> bool:
        return self.source is None or self.source.ready()
