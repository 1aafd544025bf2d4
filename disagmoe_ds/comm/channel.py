"""One-way point-to-point messages of varying row count between two ranks (FIFO per link).

Legend (this file): R rows of one message.

torch.distributed and NCCL point-to-point have no usable tags: messages on one (group, src, dst) match in
posting order. A message is therefore split in two streams on two process groups of the same pair:

    header  int64[4] = (rows, spec fingerprint, tag, meta) on ``Link.header_group``
    payload the message's tensors, in spec order, on ``Link.payload_group``

so a receiver can post header receives ahead of need (before it knows the size) without a posted receive
ever matching a payload. Tensors with zero elements are not sent (both sides skip them, knowing the rows).
Use one Sender and one Receiver per link: they are the only users of its two groups.

The code is device-agnostic: headers and received tensors live on the ``device`` given at construction
(the current CUDA device with NCCL, CPU with gloo). On CUDA, receives can run on a side stream (``CommStream``):
reading a header then waits for that header only, not for the compute queued before it.
"""

from __future__ import annotations

import contextlib
import hashlib
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property

import torch
import torch.distributed as dist

HEADER_LEN = 4  # rows, fingerprint, tag, meta


class ChannelError(RuntimeError):
    """The two ends of a link disagree (spec, tag, order): a bug in the schedule or the exchange code."""


@dataclass(frozen=True)
class TensorSpec:
    """One tensor of a message: dtype and shape; with ``per_row`` the shape excludes the leading row dim."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    per_row: bool = True

    def full_shape(self, rows: int) -> tuple[int, ...]:
        return (rows, *self.shape) if self.per_row else self.shape


@dataclass(frozen=True)
class MessageSpec:
    """What every message of a link carries; both ends declare it once and the header checks they agree."""

    tensors: tuple[TensorSpec, ...]
    name: str = "message"

    @cached_property
    def fingerprint(self) -> int:
        # hashlib, not hash(): Python's string hash is salted per process.
        digest = hashlib.blake2b(repr(self.tensors).encode(), digest_size=8).digest()
        return int.from_bytes(digest, "little", signed=True)

    def empty(self, rows: int, device: torch.device) -> tuple[torch.Tensor, ...]:
        return tuple(torch.empty(t.full_shape(rows), dtype=t.dtype, device=device) for t in self.tensors)

    def check(self, tensors: Sequence[torch.Tensor]) -> int:
        """Return the message's row count; raise ChannelError if ``tensors`` do not match the spec."""
        if len(tensors) != len(self.tensors):
            raise ChannelError(f"{self.name}: expected {len(self.tensors)} tensors, got {len(tensors)}")
        rows = next((t.shape[0] for t, s in zip(tensors, self.tensors, strict=True) if s.per_row), 0)
        for i, (tensor, spec) in enumerate(zip(tensors, self.tensors, strict=True)):
            want = spec.full_shape(rows)
            if tensor.dtype != spec.dtype or tuple(tensor.shape) != want:
                got = f"{tensor.dtype}{list(tensor.shape)}"
                raise ChannelError(f"{self.name}: tensor {i} is {got}, the spec wants {spec.dtype}{list(want)}")
        return rows


class CommStream:
    """Where a rank's receives run: a side CUDA stream, or (``stream`` None: CPU, or disabled) the current stream.

    On the current stream, NCCL starts a receive only after the compute queued before it, and reading a header
    (``tolist``) blocks the host until that compute is done: the GPU drains at every message, and no transfer
    overlaps compute. On the side stream a receive starts at once; the host waits for the header alone (copied
    into a reused pinned buffer), and the compute stream waits for a payload on the device (``hand_over``), not
    the host. One ``CommStream`` serves all the receivers of a rank.
    """

    def __init__(self, device: torch.device, *, enabled: bool = True) -> None:
        on_gpu = enabled and device.type == "cuda"
        self.stream = torch.cuda.Stream(device) if on_gpu else None
        self._pinned = torch.empty(HEADER_LEN, dtype=torch.int64, pin_memory=True) if on_gpu else None

    def scope(self) -> contextlib.AbstractContextManager:
        """Allocate and post receives inside this."""
        return torch.cuda.stream(self.stream) if self.stream is not None else contextlib.nullcontext()

    def header_values(self, work: dist.Work, header: torch.Tensor) -> list[int]:
        """Wait for a header's receive and read it on the host."""
        if self.stream is None:
            work.wait()
            return header.tolist()  # host sync of the current stream
        with self.scope():
            work.wait()  # the side stream waits for the transfer
            self._pinned.copy_(header, non_blocking=True)
        self.stream.synchronize()  # the host waits for this header only
        return self._pinned.tolist()

    def hand_over(self, works: Sequence[dist.Work], tensors: Sequence[torch.Tensor]) -> None:
        """Make the current (compute) stream wait for ``works`` and mark ``tensors`` as used there.

        Under NCCL ``wait`` is a device-side wait of the current stream. ``record_stream`` keeps the caching
        allocator from handing the buffers' memory to the side stream again before the compute reading them is done.
        """
        for work in works:
            work.wait()
        if self.stream is not None:
            current = torch.cuda.current_stream(self.stream.device)
            for tensor in tensors:
                tensor.record_stream(current)


@dataclass(frozen=True)
class Link:
    """The two process groups of one one-way (src -> dst) pair; both contain exactly src and dst."""

    src: int
    dst: int
    header_group: dist.ProcessGroup
    payload_group: dist.ProcessGroup


@dataclass(eq=False)
class SendHandle:
    """Works of one sent message; holds the tensors so their memory lives until the send completes."""

    works: list[dist.Work]
    tensors: tuple[torch.Tensor, ...]

    def is_completed(self) -> bool:
        return all(work.is_completed() for work in self.works)

    def wait(self) -> None:
        for work in self.works:
            work.wait()


class Sender:
    """The src end of a link: non-blocking sends, in order."""

    def __init__(self, link: Link, spec: MessageSpec, device: torch.device) -> None:
        self.link = link
        self.spec = spec
        self.device = device
        self._in_flight: deque[SendHandle] = deque()

    def send(self, tensors: Sequence[torch.Tensor], *, tag: int = 0, meta: int = 0) -> SendHandle:
        """Post header and payload sends; returns at once. Do not modify the tensors in place until the send
        completes (``SendHandle.wait`` or ``wait_all``); the Sender keeps them alive until then.

        Args:
            tensors: the message, matching the spec (same row count for every per-row tensor).
            tag: an integer the receiver may check (e.g. the micro-batch id), to catch schedule mismatches.
            meta: an integer the receiver reads with the header, on the host, before the payload arrives (M2N:
                the routed (row, expert) pairs, which size the expert side's buffers without a device read).
        """
        rows = self.spec.check(tensors)
        # isend needs contiguous memory; detach because communication is outside autograd.
        payload = tuple(t.detach().contiguous() for t in tensors)
        header = torch.tensor([rows, self.spec.fingerprint, tag, meta], dtype=torch.int64, device=self.device)
        works = [dist.isend(header, self.link.dst, group=self.link.header_group)]
        works += [dist.isend(t, self.link.dst, group=self.link.payload_group) for t in payload if t.numel()]
        handle = SendHandle(works=works, tensors=(header, *payload))
        self._reap()
        self._in_flight.append(handle)
        return handle

    def wait_all(self) -> None:
        """Block until every message sent so far has left (before reusing or freeing its buffers)."""
        while self._in_flight:
            self._in_flight.popleft().wait()

    def _reap(self) -> None:
        while self._in_flight and self._in_flight[0].is_completed():
            self._in_flight.popleft()


@dataclass(eq=False)
class _PostedHeader:
    header: torch.Tensor
    work: dist.Work


class Receiver:
    """The dst end of a link: headers posted ahead, messages completed oldest first."""

    def __init__(self, link: Link, spec: MessageSpec, device: torch.device, comm: CommStream | None = None) -> None:
        self.link = link
        self.spec = spec
        self.device = device
        self.comm = comm or CommStream(device, enabled=False)
        self._posted: deque[_PostedHeader] = deque()
        self._payload_rows: int | None = None  # rows of the message whose header was read, payload not yet

    def post(self) -> None:
        """Post the receive of one more header (no size needed); call ahead of need to overlap."""
        with self.comm.scope():
            header = torch.empty(HEADER_LEN, dtype=torch.int64, device=self.device)
            work = dist.irecv(header, self.link.src, group=self.link.header_group)
        self._posted.append(_PostedHeader(header, work))

    def wait(self, *, tag: int | None = None) -> tuple[torch.Tensor, ...]:
        """Complete the oldest message (posting its header now if none is posted) and return its tensors."""
        rows, _ = self.wait_header(tag=tag)
        with self.comm.scope():
            tensors = self.spec.empty(rows, self.device)
        self.comm.hand_over(self.irecv_payload(tensors), tensors)
        return tensors

    def wait_header(self, *, tag: int | None = None) -> tuple[int, int]:
        """Wait for the oldest posted header and return the message's rows and meta (a host sync on devices).

        Must be followed by ``irecv_payload`` before the next header: payloads match in order. With a side
        stream the host waits for the header only, not for the compute queued before it.
        """
        if self._payload_rows is not None:
            raise ChannelError(f"{self._where()}: wait_header called twice without irecv_payload in between")
        if not self._posted:
            self.post()
        posted = self._posted.popleft()
        rows, fingerprint, sent_tag, meta = self.comm.header_values(posted.work, posted.header)  # sizes the payload
        if fingerprint != self.spec.fingerprint:
            raise ChannelError(
                f"{self._where()}: the sender's message spec differs from this receiver's {self.spec.tensors} "
                f"(fingerprint {fingerprint} != {self.spec.fingerprint}); both ends must declare the same spec"
            )
        if tag is not None and sent_tag != tag:
            raise ChannelError(f"{self._where()}: expected tag {tag}, the oldest message has tag {sent_tag}")
        self._payload_rows = rows
        return rows, meta

    def irecv_payload(self, tensors: Sequence[torch.Tensor]) -> list[dist.Work]:
        """Post the payload receives of the message whose header was just read, into ``tensors``.

        ``tensors`` may be views of a larger buffer (e.g. one slice per lane) as long as each is contiguous;
        allocate them in ``comm.scope()`` and pass them with the works to ``comm.hand_over`` before using them.
        """
        rows = self._payload_rows
        if rows is None:
            raise ChannelError(f"{self._where()}: irecv_payload called before wait_header")
        buffer_rows = self.spec.check(tensors)
        if buffer_rows != rows:
            raise ChannelError(f"{self._where()}: buffers for {buffer_rows} rows, the message has {rows}")
        self._payload_rows = None
        with self.comm.scope():
            return [dist.irecv(t, self.link.src, group=self.link.payload_group) for t in tensors if t.numel()]

    def _where(self) -> str:
        return f"{self.spec.name} {self.link.src}->{self.link.dst}"
