"""The seam between the executor and a rank's compute: the ``Runner`` protocol both sides' runners implement, and
the typed ``Inbox`` and ``Outbox`` of one compute instruction.

The executor walks the worker's stream: ``WaitRecv`` puts a received message into the inbox of the task that reads
it, a compute instruction calls ``Runner.forward`` or ``Runner.backward`` with that inbox and keeps the outbox it
returns, and each ``Send`` takes its message out of that outbox for the mailbox. One field per transfer kind, typed
by its message (``comm.messages``), so a micro-batch can be followed from argument to argument: an A-side forward
reads ``resid`` and ``n2m`` and writes ``m2n`` and ``resid``; an F-side forward reads ``m2n`` and writes ``n2m``;
the backwards mirror them. The A side gets one message per ep rank (a list) or per lane (resid kinds); the F side
gets every lane's message gathered in one, with the ``LaneRows`` that split its answer.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import Protocol, TypeVar

import torch

from disagmoe_ds.afpipe.head_stats import HeadStats
from disagmoe_ds.afpipe.later import Later
from disagmoe_ds.comm.exchange import LaneRows
from disagmoe_ds.comm.messages import ExpertOut, ExpertOutGrad, Message, Residual, ResidualGrad, TokenGrads, Tokens
from disagmoe_ds.comm.routing import Capacity
from disagmoe_ds.schedule import Kind

Batch = dict[str, torch.Tensor]  # one micro-batch: input_ids, labels[, position_ids, ...]
M = TypeVar("M", bound=Message)


@dataclass(frozen=True)
class Received:
    """What the mailbox hands over for one receive: one message per peer (A side), or every lane's message gathered
    in one and the rows each lane sent (F side)."""

    messages: Sequence[Message]
    lanes: LaneRows | None = None


@dataclass
class Inbox:
    """What one compute instruction reads: the micro-batch's data where this rank reads it, and each transfer kind
    that its task receives (None: it receives none of that kind)."""

    batch: Batch | None = None  # A side, lanes given data (A-group 0, the head's): the micro-batch
    resid: Residual | None = None  # A_fwd(l): from A_fwd(l - 1)
    n2m: list[ExpertOut] | None = None  # A_fwd(l): layer l - 1's expert outputs, one per ep rank
    resid_grad: ResidualGrad | None = None  # A_bwd(l): from A_bwd(l + 1)
    m2n_grad: list[TokenGrads] | None = None  # A_bwd(l): the gradients of the tokens it sent, one per ep rank
    m2n: tuple[Tokens, LaneRows] | None = None  # F_fwd(l): every lane's tokens
    n2m_grad: tuple[ExpertOutGrad, LaneRows] | None = None  # F_bwd(l): every lane's output gradients

    def put(self, kind: Kind, received: Received) -> None:
        """File ``received`` under ``kind``, checking that it holds that kind's message type."""
        if kind == Kind.RESID:
            self.resid = _only(received, Residual)
        elif kind == Kind.RESID_GRAD:
            self.resid_grad = _only(received, ResidualGrad)
        elif kind == Kind.N2M:
            self.n2m = _each(received, ExpertOut)
        elif kind == Kind.M2N_GRAD:
            self.m2n_grad = _each(received, TokenGrads)
        elif kind == Kind.M2N:
            self.m2n = _gathered(received, Tokens)
        else:
            self.n2m_grad = _gathered(received, ExpertOutGrad)


def _each(received: Received, cls: type[M]) -> list[M]:
    out = [m for m in received.messages if isinstance(m, cls)]
    if len(out) != len(received.messages):
        raise TypeError(f"expected {cls.__name__} messages, got {[type(m).__name__ for m in received.messages]}")
    return out


def _only(received: Received, cls: type[M]) -> M:
    (message,) = _each(received, cls)
    return message


def _gathered(received: Received, cls: type[M]) -> tuple[M, LaneRows]:
    assert received.lanes is not None, "the F side receives every lane's message gathered"
    return _only(received, cls), received.lanes


Sendable = Message | Sequence[Message]  # one message (resid kinds: one peer), or one per peer


@dataclass
class Outbox:
    """What one compute instruction made for its ``Send``s, by transfer kind (None: nothing of that kind). A
    ``Later`` is made by the mailbox once the sizes it waits for reach the host."""

    m2n: Later[list[Tokens]] | None = None  # A_fwd(l), MoE layer: one message per ep rank
    resid: Later[Residual] | None = None  # A_fwd(l), l < L: to A_fwd(l + 1)
    resid_grad: ResidualGrad | None = None  # A_bwd(l), l > 0: to A_bwd(l - 1)
    n2m_grad: list[ExpertOutGrad] | None = None  # A_bwd(l), after a MoE layer: one per ep rank
    n2m: list[ExpertOut] | None = None  # F_fwd(l): one per lane
    m2n_grad: list[TokenGrads] | None = None  # F_bwd(l): one per lane

    def take(self, kind: Kind) -> Later[Sendable] | Sendable:
        """The payload of ``kind``, which the compute must have made; it leaves the outbox."""
        payload: Later[Sendable] | Sendable | None = getattr(self, kind.value)
        if payload is None:
            raise RuntimeError(f"the schedule sends {kind} but the compute before it made none")
        setattr(self, kind.value, None)
        return payload

    @property
    def empty(self) -> bool:
        return all(getattr(self, f.name) is None for f in fields(self))


class Runner(Protocol):
    """One rank's compute, as the executor calls it (``AttentionRunner``, ``ExpertRunner``)."""

    @property
    def capacity(self) -> Capacity | None:
        """The size m2n messages are padded to (None: exact sizes, with headers)."""
        ...

    @capacity.setter
    def capacity(self, capacity: Capacity) -> None: ...

    @property
    def stats(self) -> HeadStats:
        """The step's loss sums so far (empty where this rank runs no head and no aux term)."""
        ...

    def start_step(self, batches: Sequence[Batch] | None) -> Sequence[Batch] | None:
        """Forget the last step; this lane's part of the step's micro-batches (None where it reads none)."""
        ...

    def forward(self, layer: int, mb: int, inbox: Inbox) -> Outbox: ...

    def backward(self, layer: int, mb: int, inbox: Inbox) -> Outbox: ...

    def weight_grad(self, layer: int, mb: int) -> None:
        """Split backward: the parameter gradients ``backward`` deferred for this chunk."""
        ...

    def drop_chunk(self, layer: int, mb: int) -> None:
        """Forget what ``forward`` kept for a backward (an evaluation runs none)."""
        ...

    def warm_up(self, seq_len: int, *, packed: bool = False, evaluates: bool = False) -> None: ...

    def capacity_need(self) -> torch.Tensor:
        """int64 [2]: the most rows and routed pairs one of this step's m2n messages wanted (zeros: none sent)."""
        ...

    def expert_counts(self) -> torch.Tensor | None:
        """[L, E] int64: tokens this rank routed to each expert in the step, per layer (None: it routes none)."""
        ...
