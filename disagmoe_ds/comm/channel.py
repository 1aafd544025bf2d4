"""One-way fan-out and fan-in of messages of varying size, first-in first-out, safe under rendezvous.

Legend (this file): a message is a tuple of tensors whose leading sizes are its ``sizes`` (e.g. R rows).

A ``FanOut`` sends one message to each of its peers per call, as one grouped operation of its transport on one
communicator; the matching ``FanIn`` receives one message from each of its peers per call, likewise. Per
communicator both ends post in the same order, so message k of every peer pair is matched by position, and a
send that waits for its receive (NCCL's network transport) holds back only later messages of the same kind.

Sizes: a receiver must know them before posting a receive. Where it cannot know them (M2N: how many tokens a lane
routed to this rank), the sender posts a **header** first: a few int64 on a gloo group, host to host, so it never
waits for the device and never queues behind a payload. Where the receiver knows the sizes itself (the reverse
paths), there is no header at all. Headers also carry a tag (schedule position) and the message spec's
fingerprint, so a schedule or spec mismatch fails with a clear error instead of corrupting data.

On CUDA the receives are allocated and posted on a side stream (``CommStream``): a receive posted ahead starts at
once instead of after the compute queued before it, and the compute stream waits for a payload on the device
(``hand_over``) only where it reads it.
"""

from __future__ import annotations

import contextlib
import hashlib
import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property

import torch
import torch.distributed as dist

from disagmoe_ds.comm.transport import Comm, Op, Transport, Work, started

HEADER_FIXED = 2  # tag, fingerprint; then the metas and the sizes
WIRE_ALIGN = 16  # bytes: each tensor of a coalesced message starts at a multiple, so the receiver can view it


class ChannelError(RuntimeError):
    """The two ends of a link disagree (spec, tag, sizes): a bug in the schedule or the exchange code."""


@dataclass(frozen=True)
class TensorSpec:
    """One tensor of a message: dtype, trailing shape and which of the message's sizes is its leading dim
    (``size`` None: a fixed-shape tensor)."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    size: int | None = 0

    def full_shape(self, sizes: Sequence[int]) -> tuple[int, ...]:
        return self.shape if self.size is None else (sizes[self.size], *self.shape)


@dataclass(frozen=True)
class MessageSpec:
    """What every message of a channel carries; both ends declare it and headers check that they agree."""

    tensors: tuple[TensorSpec, ...]
    name: str = "message"
    metas: int = 1  # ints of sender metadata in each header (M2N: routed pairs; resid: rows per ep rank)
    # One byte buffer per peer on the wire instead of one transfer per tensor (row tensors only): NCCL runs the
    # operations of a group one after another per peer, so a message's small tensors each add a transfer's latency.
    coalesced: bool = False

    def __post_init__(self) -> None:
        if self.coalesced and any(t.size is None for t in self.tensors):
            raise ChannelError(f"{self.name}: only messages of row tensors can be coalesced")

    @cached_property
    def num_sizes(self) -> int:
        return 1 + max((t.size for t in self.tensors if t.size is not None), default=-1)

    @cached_property
    def fingerprint(self) -> int:
        # hashlib, not hash(): Python's string hash is salted per process.
        digest = hashlib.blake2b(repr((self.tensors, self.metas, self.coalesced)).encode(), digest_size=8).digest()
        return int.from_bytes(digest, "little", signed=True)

    def to_wire(self, tensors: Sequence[torch.Tensor]) -> torch.Tensor:
        """The message as one byte buffer: each tensor's bytes, padded to ``WIRE_ALIGN``."""
        pieces = []
        for tensor in tensors:
            raw = tensor.reshape(-1).view(torch.uint8)
            pieces += [raw, raw.new_zeros(-raw.numel() % WIRE_ALIGN)]
        return torch.cat(pieces)

    def wire_bytes(self, sizes: Sequence[int]) -> int:
        return sum(_padded(_nbytes(spec, sizes)) for spec in self.tensors)

    def from_wire(self, wire: torch.Tensor, sizes: Sequence[int]) -> tuple[torch.Tensor, ...]:
        """Views of ``to_wire``'s buffer as the message's tensors (no copy)."""
        tensors, offset = [], 0
        for spec in self.tensors:
            nbytes = _nbytes(spec, sizes)
            tensors.append(wire[offset : offset + nbytes].view(spec.dtype).view(spec.full_shape(sizes)))
            offset += _padded(nbytes)
        return tuple(tensors)

    def sizes_of(self, tensors: Sequence[torch.Tensor]) -> tuple[int, ...]:
        """The message's sizes, read from the tensors' shapes (host metadata, no device read); checks the spec."""
        if len(tensors) != len(self.tensors):
            raise ChannelError(f"{self.name}: expected {len(self.tensors)} tensors, got {len(tensors)}")
        sizes = [-1] * self.num_sizes  # every size is some tensor's leading dim (``num_sizes``)
        for t, spec in zip(tensors, self.tensors, strict=True):
            if spec.size is not None:
                sizes[spec.size] = t.shape[0] if t.dim() else -1
        for i, (tensor, spec) in enumerate(zip(tensors, self.tensors, strict=True)):
            want = spec.full_shape(sizes)
            if tensor.dtype != spec.dtype or tuple(tensor.shape) != want:
                got = f"{tensor.dtype}{list(tensor.shape)}"
                raise ChannelError(f"{self.name}: tensor {i} is {got}, the spec wants {spec.dtype}{list(want)}")
        return tuple(sizes)


def _nbytes(spec: TensorSpec, sizes: Sequence[int]) -> int:
    return math.prod(spec.full_shape(sizes)) * spec.dtype.itemsize


def _padded(nbytes: int) -> int:
    return nbytes + -nbytes % WIRE_ALIGN


class CommStream:
    """Where a rank's receives are allocated and posted: a side CUDA stream, or (CPU, or disabled) the current one.

    On the side stream a receive posted ahead starts at once; on the current stream NCCL would start it only after
    the compute queued before it. One ``CommStream`` serves all the receivers of a rank.
    """

    def __init__(self, device: torch.device, *, enabled: bool = True) -> None:
        self.stream = torch.cuda.Stream(device) if enabled and device.type == "cuda" else None

    def scope(self) -> contextlib.AbstractContextManager[object]:
        return torch.cuda.stream(self.stream) if self.stream is not None else contextlib.nullcontext()

    def hand_over(self, work: Work, tensors: Sequence[torch.Tensor]) -> None:
        """Make the current (compute) stream wait for ``work`` and mark ``tensors`` as used there.

        Under NCCL ``wait`` is a device-side wait of the current stream. ``record_stream`` keeps the caching
        allocator from handing the buffers' memory to the side stream again before the compute reading them is done.
        """
        work.wait()
        if self.stream is not None:
            current = torch.cuda.current_stream(self.stream.device)
            for tensor in tensors:
                tensor.record_stream(current)


@dataclass(frozen=True)
class Headers:
    """The gloo group that carries a channel's headers (host ints, sender to receiver)."""

    group: dist.ProcessGroup


@dataclass(eq=False)
class Sent:
    """A fan-out in flight; keeps its tensors alive until ``wait``."""

    work: Work
    tensors: tuple[torch.Tensor, ...]
    header_works: tuple[dist.Work, ...]

    def wait(self) -> None:
        self.work.wait()
        for work in self.header_works:
            work.wait()

    def is_completed(self) -> bool:
        # A gloo send dropped before it completes is abandoned: headers count too.
        return self.work.is_completed() and all(work.is_completed() for work in self.header_works)


class FanOut:
    """The sending end: one message to each peer per ``send``, one grouped operation."""

    def __init__(
        self, transport: Transport, comm: Comm, peers: Sequence[int], spec: MessageSpec, headers: Headers | None
    ) -> None:
        self.transport, self.comm, self.peers, self.spec, self.headers = transport, comm, tuple(peers), spec, headers
        self._in_flight: deque[Sent] = deque()
        self.calls = 0  # communicator calls made (grouped payload operations and header sends)

    def send(
        self,
        messages: Sequence[Sequence[torch.Tensor]],
        *,
        tag: int = 0,
        metas: Sequence[Sequence[int]] | None = None,
    ) -> list[tuple[int, ...]]:
        """Send ``messages[i]`` to ``peers[i]`` without blocking the host; returns each message's sizes.

        Do not modify the tensors in place before ``wait_all``; the fan-out keeps them alive until then.
        ``metas[i]`` (``spec.metas`` ints) rides in peer i's header (M2N: the routed pairs, which size the expert
        side's buffers; resid: the combine plan's rows per ep rank).
        """
        if len(messages) != len(self.peers):
            raise ChannelError(f"{self.spec.name}: {len(messages)} messages for {len(self.peers)} peers")
        payloads = [tuple(t.detach().contiguous() for t in message) for message in messages]
        sizes = [self.spec.sizes_of(payload) for payload in payloads]
        header_works: list[dist.Work] = []
        if self.headers is not None:
            metas = metas or [(0,) * self.spec.metas] * len(self.peers)
            for peer, size, meta in zip(self.peers, sizes, metas, strict=True):
                if len(meta) != self.spec.metas:
                    raise ChannelError(f"{self.spec.name}: {len(meta)} header metas, the spec has {self.spec.metas}")
                header = torch.tensor([tag, self.spec.fingerprint, *meta, *size], dtype=torch.int64)
                header_works.append(started(dist.isend(header, peer, group=self.headers.group)))
        if self.spec.coalesced:
            payloads = [(self.spec.to_wire(payload),) for payload in payloads]
        ops = [Op("send", t, peer) for peer, payload in zip(self.peers, payloads) for t in payload if t.numel()]
        flat = tuple(t for payload in payloads for t in payload)
        self.calls += len(header_works) + bool(ops)
        self._in_flight.append(Sent(self.transport.start(self.comm, ops), flat, tuple(header_works)))
        self._reap()
        return sizes

    def wait_all(self) -> None:
        """Until every message sent so far has left (the end of a step)."""
        for sent in self._in_flight:
            sent.wait()
        self._in_flight.clear()

    def _reap(self) -> None:
        # Keep the list short on long steps: drop the leading fan-outs whose sends have completed.
        while self._in_flight and self._in_flight[0].is_completed():
            self._in_flight.popleft()


@dataclass(eq=False)
class Arrival:
    """One fan-in of a channel, from post to completion.

    ``sizes[i]`` is peer i's message sizes (from its header, or given by the receiver); ``buffers`` hold all the
    peers' messages concatenated along the leading dim, in peer order (one buffer per tensor of the spec).
    """

    tag: int
    sizes: list[tuple[int, ...]] | None = None
    metas: tuple[tuple[int, ...], ...] = ()
    header_buffers: tuple[torch.Tensor, ...] = ()
    header_works: tuple[dist.Work, ...] = ()
    buffers: tuple[torch.Tensor, ...] | None = None
    per_peer: list[tuple[torch.Tensor, ...]] | None = None  # views of ``buffers``: peer i's message
    work: Work | None = None


class FanIn:
    """The receiving end: one message from each peer per arrival, in posting order.

    ``expect`` registers the next arrival (and posts its header receives, if the channel has headers);
    ``read_headers`` takes its sizes from them (blocking the host until they are in); ``post`` posts the payload
    receives once the sizes are known (the caller posts arrivals in order); ``complete`` hands the buffers over.
    """

    def __init__(
        self,
        transport: Transport,
        comm: Comm,
        peers: Sequence[int],
        spec: MessageSpec,
        headers: Headers | None,
        device: torch.device,
        comm_stream: CommStream,
    ) -> None:
        self.transport, self.comm, self.peers, self.spec, self.headers = transport, comm, tuple(peers), spec, headers
        self.device, self.comm_stream = device, comm_stream
        self._header_len = HEADER_FIXED + spec.metas + spec.num_sizes
        self.calls = 0  # communicator calls made (header receives and grouped payload operations)

    def expect(self, tag: int) -> Arrival:
        arrival = Arrival(tag)
        if self.headers is not None:
            buffers = tuple(torch.empty(self._header_len, dtype=torch.int64) for _ in self.peers)
            works = [started(dist.irecv(b, peer, group=self.headers.group)) for b, peer in zip(buffers, self.peers)]
            arrival.header_buffers, arrival.header_works = buffers, tuple(works)
            self.calls += len(works)
        return arrival

    def header_arrived(self, arrival: Arrival) -> bool:
        return all(work.is_completed() for work in arrival.header_works)

    def read_headers(self, arrival: Arrival) -> None:
        """Wait for the arrival's headers (host to host) and take its sizes from them."""
        for work in arrival.header_works:
            work.wait()
        sizes, metas = [], []
        for peer, header in zip(self.peers, arrival.header_buffers):
            tag, fingerprint, *rest = header.tolist()
            if fingerprint != self.spec.fingerprint:
                raise ChannelError(
                    f"{self._where(peer)}: the sender's spec differs from this receiver's {self.spec.tensors}"
                )
            if tag != arrival.tag:
                raise ChannelError(f"{self._where(peer)}: expected tag {arrival.tag}, the next message has {tag}")
            metas.append(tuple(rest[: self.spec.metas]))
            sizes.append(tuple(rest[self.spec.metas :]))
        arrival.sizes, arrival.metas, arrival.header_works = sizes, tuple(metas), ()

    def post(self, arrival: Arrival) -> None:
        """Post the payload receives (sizes known) as one grouped operation on the side stream."""
        if arrival.sizes is None:
            raise ChannelError(f"{self.spec.name}: payload posted before its sizes are known")
        if len(arrival.sizes) != len(self.peers):
            raise ChannelError(
                f"{self.spec.name}: sizes for {len(arrival.sizes)} peers, the channel has {len(self.peers)}"
            )
        with self.comm_stream.scope():
            if self.spec.coalesced:  # one byte buffer per peer; the tensors are views of it
                wires = tuple(self._empty_bytes(self.spec.wire_bytes(size)) for size in arrival.sizes)
                per_peer = [self.spec.from_wire(wire, size) for wire, size in zip(wires, arrival.sizes)]
                receives: list[tuple[torch.Tensor, ...]] = [(wire,) for wire in wires]
                arrival.buffers = wires
            else:
                buffers = self._concat_buffers(arrival.sizes)
                parts = [self._split(b, spec, arrival.sizes) for b, spec in zip(buffers, self.spec.tensors)]
                per_peer = [tuple(part[i] for part in parts) for i in range(len(self.peers))]
                receives, arrival.buffers = per_peer, buffers
            arrival.per_peer = per_peer
            ops = [Op("recv", t, peer) for peer, message in zip(self.peers, receives) for t in message if t.numel()]
            arrival.work = self.transport.start(self.comm, ops)
            self.calls += bool(ops)

    def complete(self, arrival: Arrival) -> tuple[tuple[torch.Tensor, ...], list[tuple[torch.Tensor, ...]]]:
        """Hand the arrival's buffers to the compute stream; returns them whole and split per peer."""
        work, buffers, per_peer = arrival.work, arrival.buffers, arrival.per_peer
        if work is None or buffers is None or per_peer is None:
            raise ChannelError(f"{self.spec.name}: an arrival completed before its payload was posted")
        self.comm_stream.hand_over(work, buffers)
        if not self.spec.coalesced:
            return buffers, per_peer
        if len(self.peers) == 1:
            return per_peer[0], per_peer
        if not self.peers:  # a replica no lane sends to (fewer lanes than replicas): an empty message
            return self.spec.from_wire(self._empty_bytes(0), (0,) * self.spec.num_sizes), per_peer
        # Several peers' messages sit in separate wire buffers: joining them is a copy, on the compute stream.
        return tuple(torch.cat(parts) for parts in zip(*per_peer, strict=True)), per_peer

    def _empty_bytes(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, device=self.device)

    def _concat_buffers(self, sizes: Sequence[tuple[int, ...]]) -> tuple[torch.Tensor, ...]:
        out = []
        for spec in self.spec.tensors:
            if spec.size is None:  # fixed shape: one per peer, stacked
                out.append(torch.empty((len(self.peers), *spec.shape), dtype=spec.dtype, device=self.device))
            else:
                rows = sum(size[spec.size] for size in sizes)
                out.append(torch.empty((rows, *spec.shape), dtype=spec.dtype, device=self.device))
        return tuple(out)

    @staticmethod
    def _split(buffer: torch.Tensor, spec: TensorSpec, sizes: Sequence[tuple[int, ...]]) -> tuple[torch.Tensor, ...]:
        if spec.size is None:
            return tuple(buffer.unbind(0))
        return torch.split(buffer, [size[spec.size] for size in sizes])

    def _where(self, peer: int) -> str:
        return f"{self.spec.name} {peer}->{dist.get_rank()}"
