"""How payload bytes move: grouped point-to-point operations on a communicator, in posting order.

The exchange code speaks to a ``Transport`` only through ``new_comm`` (collective: every rank, same order) and
``start`` (one grouped operation: some sends and receives that run together). Two transports:

``TorchTransport``   torch.distributed: NCCL on GPUs, gloo on CPUs. One grouped operation is one
                     ``batch_isend_irecv`` (one ``ncclGroupStart/End``) on the communicator's stream.
``RendezvousTransport``  a CPU stand-in with the semantics of NCCL's network transport, for tests: each
                     communicator has one first-in first-out queue of grouped operations per rank; an operation
                     starts when the one before it on that rank has completed; a send completes only once its
                     receive has *started* on the peer (rendezvous). gloo, which buffers every send, cannot show
                     a deadlock; this transport does, as a timeout naming the blocked operation.

The contract the exchange code keeps (and the tests check under ``RendezvousTransport``): each communicator is
one-way (one kind of message, from one side to the other), both ends post its operations in the same order, a
receive is posted no later than the host's wait for it, and the host never blocks on a send.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Literal, Protocol

import torch
import torch.distributed as dist


class TransportError(RuntimeError):
    """A grouped operation did not complete in time (a deadlock under rendezvous), or was misused."""


@dataclass(frozen=True)
class Op:
    """One send or receive of a grouped operation; ``peer`` is a global rank."""

    kind: Literal["send", "recv"]
    tensor: torch.Tensor
    peer: int


@dataclass(eq=False)
class Comm:
    """A communicator over ``ranks`` (global ranks, increasing); ``name`` appears in errors."""

    name: str
    ranks: tuple[int, ...]
    group: dist.ProcessGroup | None  # None on ranks outside it
    pairs: tuple[tuple[int, int], ...] = ()  # the (src, dst) that ever send on it
    control: dist.ProcessGroup | None = None  # RendezvousTransport: ready tokens
    queue: queue.Queue[_Pending] | None = field(default=None, repr=False)  # RendezvousTransport: this rank's operations


class Work(Protocol):
    def wait(self) -> None: ...

    def is_completed(self) -> bool: ...


class Transport(Protocol):
    timeout: timedelta | None

    def new_comm(self, name: str, ranks: Sequence[int], pairs: Sequence[tuple[int, int]]) -> Comm: ...

    def warm_up(self, comms: Sequence[Comm], device: torch.device) -> None: ...

    def start(self, comm: Comm, ops: Sequence[Op]) -> Work: ...


def new_host_group(ranks: Sequence[int], timeout: timedelta | None = None) -> dist.ProcessGroup | None:
    """A gloo group over ``ranks`` (host-to-host messages); collective over the world like every ``new_group``.

    On a job whose default group has a bound device (DeepSpeed binds it on CUDA), torch makes each rank *outside*
    a new group join an NCCL ``ncclCommSplit`` of the world, whatever the new group's backend; the members of a gloo
    group never join it, so with any rank left out every rank hangs in ``new_group`` (pytorch/pytorch#145376; seen
    here with depth 2 on 4 GPUs). Creating the group with the device unbound keeps every rank off that path; NCCL
    groups are not affected (members and non-members both split).
    """
    default = dist.distributed_c10d._get_default_group()
    bound = default.bound_device_id
    default.bound_device_id = None
    try:
        group: dist.ProcessGroup | None = dist.new_group(list(ranks), timeout=timeout, backend="gloo")  # unannotated
        return group
    finally:
        default.bound_device_id = bound


@dataclass(eq=False)
class _Works:
    works: list[dist.Work]

    def wait(self) -> None:
        # NCCL: the current stream waits on the device, the host does not; gloo: the host waits.
        for work in self.works:
            work.wait()

    def is_completed(self) -> bool:
        return all(work.is_completed() for work in self.works)


class TorchTransport:
    """torch.distributed's own point-to-point, one ``batch_isend_irecv`` per grouped operation."""

    def __init__(self, timeout: timedelta | None = None) -> None:
        self.timeout = timeout

    def new_comm(self, name: str, ranks: Sequence[int], pairs: Sequence[tuple[int, int]] = ()) -> Comm:
        ranks = tuple(sorted(ranks))
        group = dist.new_group(list(ranks), timeout=self.timeout)
        return Comm(name, ranks, group if dist.get_rank() in ranks else None, tuple(pairs))

    def warm_up(self, comms: Sequence[Comm], device: torch.device) -> None:
        """Create the NCCL communicators and connect every pair that will talk, now, in one global order.

        NCCL creates a communicator lazily and collectively on its first use, and connects a point-to-point pair
        on the first operation between them; both block the host until the peers join. Inside the schedule,
        first uses that point at each other would hang. Walking the comms in one global order cannot deadlock:
        the lowest unfinished one always has all its members waiting on it.
        """
        rank = dist.get_rank()
        for comm in comms:
            if comm.group is None:
                continue
            dist.all_reduce(torch.zeros(1, device=device), group=comm.group)
            ops = [Op("send", torch.zeros(1, device=device), dst) for src, dst in comm.pairs if src == rank]
            ops += [Op("recv", torch.empty(1, device=device), src) for src, dst in comm.pairs if dst == rank]
            self.start(comm, ops).wait()
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    def start(self, comm: Comm, ops: Sequence[Op]) -> Work:
        p2p = [
            dist.P2POp(dist.isend if op.kind == "send" else dist.irecv, op.tensor, op.peer, group=comm.group)
            for op in ops
        ]
        return _Works(dist.batch_isend_irecv(p2p) if p2p else [])


@dataclass(eq=False)
class _Pending:
    comm: Comm
    ops: tuple[Op, ...]
    done: threading.Event = field(default_factory=threading.Event)
    error: BaseException | None = None
    timeout_s: float = 300.0

    def wait(self) -> None:
        if not self.done.wait(self.timeout_s):
            raise TransportError(
                f"rendezvous transport: an operation on {self.comm.name} ({_describe(self.ops)}) did not complete "
                f"within {self.timeout_s:g} s: its peers never posted the matching operations (a deadlock)"
            )
        if self.error is not None:
            raise TransportError(f"rendezvous transport: {self.comm.name} failed: {self.error}") from self.error

    def is_completed(self) -> bool:
        return self.done.is_set()


class RendezvousTransport:
    """CPU stand-in for NCCL's network transport (see the module docstring); gloo underneath, one thread per comm.

    An operation at the head of a rank's queue first tells every peer it receives from that it is ready (a token
    on the comm's control group), then, for each send, waits for the receiver's token before sending. So a send
    completes only after its receive started, and everything queued behind a blocked operation waits with it.
    """

    def __init__(self, timeout: timedelta | None = None) -> None:
        self.timeout = timeout
        self.timeout_s = timeout.total_seconds() if timeout else 300.0

    def new_comm(self, name: str, ranks: Sequence[int], pairs: Sequence[tuple[int, int]] = ()) -> Comm:
        ranks = tuple(sorted(ranks))
        data, control = new_host_group(ranks, self.timeout), new_host_group(ranks, self.timeout)
        if dist.get_rank() not in ranks:
            return Comm(name, ranks, None)
        operations: queue.Queue[_Pending] = queue.Queue()
        comm = Comm(name, ranks, data, tuple(pairs), control, operations)
        threading.Thread(target=self._serve, args=(comm, operations), name=f"rendezvous {name}", daemon=True).start()
        return comm

    def warm_up(self, comms: Sequence[Comm], device: torch.device) -> None:
        del comms, device  # gloo groups connect at creation

    def start(self, comm: Comm, ops: Sequence[Op]) -> Work:
        if comm.queue is None:
            raise TransportError(f"rank {dist.get_rank()} is not a member of {comm.name}")
        pending = _Pending(comm, tuple(ops), timeout_s=self.timeout_s)
        comm.queue.put(pending)
        return pending

    @staticmethod
    def _serve(comm: Comm, operations: queue.Queue[_Pending]) -> None:
        while True:
            pending: _Pending = operations.get()
            try:
                _run(comm, pending.ops)
            except BaseException as err:  # reported to the waiter; the thread keeps serving
                pending.error = err
            pending.done.set()


def _run(comm: Comm, ops: tuple[Op, ...]) -> None:
    token = torch.zeros(1, dtype=torch.int64)
    recvs = [op for op in ops if op.kind == "recv"]
    sends = [op for op in ops if op.kind == "send"]
    works = [started(dist.isend(token, op.peer, group=comm.control)) for op in recvs]  # "my receive has started"
    for op in sends:
        started(dist.irecv(torch.empty_like(token), op.peer, group=comm.control)).wait()  # its receive has started
        works.append(started(dist.isend(op.tensor, op.peer, group=comm.group)))
    works += [started(dist.irecv(op.tensor, op.peer, group=comm.group)) for op in recvs]
    for work in works:
        work.wait()


def started(work: dist.Work | None) -> dist.Work:
    """A point-to-point operation torch started (it returns None only to a rank outside the group)."""
    if work is None:
        raise TransportError(f"rank {dist.get_rank()} sent or received on a group it is not in")
    return work


def _describe(ops: Sequence[Op]) -> str:
    return ", ".join(f"{op.kind} {'to' if op.kind == 'send' else 'from'} rank {op.peer}" for op in ops) or "no op"


TRANSPORTS: dict[str, type[TorchTransport] | type[RendezvousTransport]] = {
    "auto": TorchTransport,
    "rendezvous": RendezvousTransport,
}


def make_transport(name: str, timeout: timedelta | None = None) -> Transport:
    """``auto``: torch.distributed's backend (NCCL on GPUs, gloo on CPUs); ``rendezvous``: the CPU test stand-in."""
    return TRANSPORTS[name](timeout)
