"""One rank's ends of the AF-Pipe exchanges, addressed by the schedule's transfers.

Every message kind a rank sends leaves through one ``FanOut`` and every kind it receives arrives through one
``FanIn`` (one communicator each, see ``comm.exchange``); a hand-off (p = 1: the residual and its gradient, both
ends on A0) is sent and received through the mailbox as well, without a wire. The schedule posts and waits each
channel in the sender's order; the mailbox adds what makes that safe and fast under rendezvous:

- **sizes before receives.** A payload receive is posted as soon as its sizes are known: from a header (m2n, resid),
  from a fixed capacity (m2n and resid with one ep rank or a ``capacity_factor``: ``exchange.static_sizes``), or,
  for every other kind, from the transfer the schedule names as its size source (``schedule.size_sources``), which
  this rank sent or received before: ``_SIZES_FROM`` says which of that transfer's counts to take. ``pump`` posts
  every receive that has become postable, oldest first per channel, without blocking; a wait blocks only for a
  header that is not in yet.
- **no host sync per send.** Sizes come from tensor shapes and host ints, headers go host to host. Where the sizes
  come from the device (m2n and resid with several ep ranks: rows per ep rank), the runner hands over a ``Later``
  and the sizes land in host memory while the host goes on; the mailbox sends it once they have (``pump``), keeps
  every later send behind it (the schedule's order of sends), and sends them all, waiting for their sizes,
  before anything that may block the host. Sent late, a message leaves from a side stream after the compute that
  made it, not after the compute queued since.

Payloads at the runner boundary are the typed messages of ``comm.messages``: a runner sends one per peer (a
list; one message for the residual kinds, which have one peer) and gets one per peer on the A side (per ep rank;
the residual kinds' one message), or, on the F side, every lane's message gathered with the ``LaneRows`` that
split its answer (``afpipe.runner.Received``).
"""

from __future__ import annotations

import contextlib
from collections import defaultdict, deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, fields

import torch

from disagmoe_ds.afpipe.later import Later
from disagmoe_ds.afpipe.runner import Received, Sendable
from disagmoe_ds.comm.channel import Arrival, ChannelError, CommStream, FanIn
from disagmoe_ds.comm.exchange import MESSAGE_TYPES, ExchangeComms, LaneRows, exchange_specs, static_sizes
from disagmoe_ds.comm.messages import Dims, Message, Tokens
from disagmoe_ds.comm.routing import Capacity, pads
from disagmoe_ds.schedule import SELF_SIZED, Kind, Transfer, Worker

Sizes = list[tuple[int, ...]]  # per peer, the sizes of its message (rows, ...)
Metas = Sequence[tuple[int, ...]]  # per peer, the host ints of its message (its header's)


def _rows(sizes: Sizes, metas: Metas) -> Sizes:
    """A gradient's rows per peer: those of the forward message it answers."""
    return list(sizes)


def _tokens(sizes: Sizes, metas: Metas) -> Sizes:
    """The residual gradient's tokens: the residual's (its first size; the second is the combine plan's)."""
    return [sizes[0][:1]]


def _plan_rows(sizes: Sizes, metas: Metas) -> Sizes:
    """The expert outputs' rows per ep rank: the combine plan's, which the residual carries as host ints."""
    return [(rows,) for rows in metas[0]]


# (receive kind, the kind of its size source) -> its sizes from the source's; the pairs are the schedule's convention
_SIZES_FROM: Mapping[tuple[Kind, Kind], Callable[[Sizes, Metas], Sizes]] = {
    (Kind.M2N_GRAD, Kind.M2N): _rows,
    (Kind.N2M_GRAD, Kind.N2M): _rows,
    (Kind.RESID_GRAD, Kind.RESID): _tokens,
    (Kind.N2M, Kind.RESID): _plan_rows,
}


def _made(payload: Later[Sendable] | Sendable) -> Sendable:
    """The payload itself: ``make()`` of a ``Later``, anything else as it is."""
    return payload.make() if isinstance(payload, Later) else payload


def _tag(transfer: Transfer) -> int:
    # Checked by the receiver against the next message on the channel: catches any schedule mismatch.
    return transfer.src.layer * (1 << 20) + transfer.src.micro_batch


@dataclass
class ExchangeStats:
    """What one rank's exchanges cost its host so far: messages, communicator calls, and waits for sizes.

    ``size_waits`` counts the times the host had to stop inside a step for a message's sizes: a header not in yet
    when its payload was waited for, or sizes made on the device not yet on the host when a send had to go.
    """

    sends: int = 0
    receives: int = 0
    send_calls: int = 0
    receive_calls: int = 0
    size_waits: int = 0

    def since(self, before: ExchangeStats) -> ExchangeStats:
        """The costs between ``before`` and these (of one step, say)."""
        return ExchangeStats(*(getattr(self, f.name) - getattr(before, f.name) for f in fields(self)))

    @property
    def calls_per_send(self) -> float:
        return self.send_calls / max(self.sends, 1)

    @property
    def calls_per_receive(self) -> float:
        return self.receive_calls / max(self.receives, 1)


@dataclass
class _Inbox:
    fan_in: FanIn
    pending: deque[tuple[Transfer, Arrival]] = field(default_factory=deque)  # expected, oldest first


class Mailbox:
    """Fan-outs and fan-ins of one rank, built once per run; ``post``/``wait``/``send`` by scheduled transfer."""

    def __init__(
        self,
        comms: ExchangeComms,
        *,
        worker: Worker,
        size_sources: Mapping[Transfer, Transfer],
        hidden: int,
        top_k: int,
        dtype: torch.dtype,
        weight_dtype: torch.dtype,
        device: torch.device,
        comm_stream: bool = True,
        resend: bool = False,
        moe_layers: Sequence[bool] = (),
        capacity: Capacity | None = None,
        residual: tuple[int, int, int] = (1, 0, 0),
        fp8: bool = False,
    ):
        """``worker``: the A- or F-group of this rank; ``size_sources``: the schedule's table of which transfer sizes
        each receive (``schedule.size_sources``); ``moe_layers``: which layers route (one bool per layer);
        ``capacity``: the fixed sizes of m2n messages when ``comms`` has no headers. Header-less resid messages take
        their sizes from both. ``residual``: the residual's streams, routed-sum weights and token-id columns per
        token (``comm.messages.Dims``); ``fp8``: the routed tokens travel in FP8."""
        layout, rank = comms.layout, comms.rank
        if comms.headerless and capacity is None:
            raise ValueError("header-less exchanges need the capacity that sizes their messages")
        dims = Dims(hidden, top_k, layout.num_experts, layout.exchange_peers, dtype, weight_dtype, *residual, fp8=fp8)
        specs = exchange_specs(dims, resend=resend)
        stream = CommStream(device, enabled=comm_stream)
        self._attention = layout.role_of(rank).is_attention
        if self._attention:
            sends, receives = [Kind.M2N, Kind.N2M_GRAD], [Kind.N2M, Kind.M2N_GRAD]
            if layout.depth > 1:  # resid first: ``pump`` learns n2m's sizes from its headers
                sends, receives = [*sends, Kind.RESID, Kind.RESID_GRAD], [Kind.RESID, Kind.RESID_GRAD, *receives]
        else:
            sends, receives = [Kind.N2M, Kind.M2N_GRAD], [Kind.M2N, Kind.N2M_GRAD]
        self._out = {kind: comms.fan_out(kind, specs[kind]) for kind in sends}
        self._in = {kind: _Inbox(comms.fan_in(kind, specs[kind], device, stream)) for kind in receives}
        self._sources = {r: s for r, s in size_sources.items() if r.dst_worker == worker}  # this rank's receives'
        self._sized_by: dict[Transfer, list[Transfer]] = defaultdict(list)  # source -> the receives it sizes
        for receive, source in self._sources.items():
            if (receive.kind, source.kind) not in _SIZES_FROM:
                raise ValueError(f"{receive}: no rule reads its sizes from a {source.kind} transfer ({source})")
            self._sized_by[source].append(receive)
        self._known: dict[Transfer, Sizes] = {}  # sizes of receives learnt from their sources, not posted yet
        self._handed: dict[Transfer, Sendable] = {}  # hand-offs sent, not received yet
        self.capacity = capacity  # grown between steps by the executor when a step outgrew it
        self._exchange_peers, self._moe_layers = layout.exchange_peers, tuple(moe_layers)
        # Sends not made yet, in schedule order, each with the point of the compute stream that produced it.
        self._queued: deque[tuple[Transfer, Later[Sendable] | Sendable, torch.cuda.Event | None]] = deque()
        cuda = device.type == "cuda"
        self._send_stream = torch.cuda.Stream(device) if cuda else None
        self._waits_block_host = not cuda  # NCCL waits are the compute stream's; gloo's block the host
        self._sends = self._receives = self._size_waits = 0

    # ----- the schedule's verbs -----
    def post(self, transfer: Transfer) -> None:
        """Expect ``transfer`` (its header receives go out now); its payload receive is posted once sizes are known.
        A hand-off has nothing to post."""
        if transfer.is_hand_off:
            return
        inbox = self._in[transfer.kind]
        inbox.pending.append((transfer, inbox.fan_in.expect(_tag(transfer))))
        self.pump()

    def wait(self, transfer: Transfer) -> Received:
        """The payload of ``transfer``; posts it (and the older messages of its channel) first if not yet posted."""
        if transfer.is_hand_off:
            return self._hand_over(transfer)
        inbox = self._in[transfer.kind]
        expected = [t for t, _ in inbox.pending]
        if transfer not in expected:
            raise ChannelError(f"{transfer}: waited for without a PostRecv before")
        index = expected.index(transfer)
        if self._waits_block_host:
            self._drain(block=True)
        for older, arrival in list(inbox.pending)[: index + 1]:
            if arrival.work is None:
                if not self._resolve(older, arrival, block=False):
                    self._size_waits += 1
                    self._drain(block=True)  # this rank's queued sends may be what the sender waits for
                    self._resolve(older, arrival, block=True)
                inbox.fan_in.post(arrival)
        arrival = inbox.pending[index][1]
        del inbox.pending[index]
        self._receives += 1
        whole, per_peer = inbox.fan_in.complete(arrival)
        return self._unpack(transfer.kind, arrival, whole, per_peer)

    def send(self, transfer: Transfer, payload: Later[Sendable] | Sendable) -> None:
        """Send ``payload`` now, or queue it (a ``Later`` whose sizes are not on the host yet, or anything behind
        one): ``pump`` sends the queue in order as it becomes ready."""
        if self._queued or (isinstance(payload, Later) and not payload.ready()):
            self._queued.append((transfer, payload, self._produced()))
        else:
            self._send_now(transfer, _made(payload))
        self.pump()

    def _send_now(self, transfer: Transfer, payload: Sendable) -> None:
        messages: Sequence[Message] = [payload] if isinstance(payload, Message) else payload
        if transfer.is_hand_off:  # no wire: the payload itself, and the host ints its header would carry
            self._handed[transfer] = payload
            self._learn(transfer, [], [m.host_ints() for m in messages])
            return
        self._sends += 1
        if transfer.kind in SELF_SIZED:
            self._check_static(transfer, messages)
        tensors, host_ints = [m.tensors() for m in messages], [m.host_ints() for m in messages]
        sizes = self._out[transfer.kind].send(tensors, tag=_tag(transfer), metas=host_ints)
        self._learn(transfer, sizes, host_ints)

    def _hand_over(self, transfer: Transfer) -> Received:
        if transfer not in self._handed:
            self._drain(block=True)  # still queued behind a ``Later``
        payload = self._handed.pop(transfer, None)
        if payload is None:
            raise ChannelError(f"{transfer}: a hand-off waited for before it was sent")
        return Received([payload] if isinstance(payload, Message) else payload)

    def pump(self) -> None:
        """Send what has become sendable, then post every payload receive whose sizes are known by now, oldest first
        per channel; never blocks."""
        self._drain(block=False)
        for inbox in self._in.values():
            for transfer, arrival in inbox.pending:
                if arrival.work is not None:
                    continue
                if not self._resolve(transfer, arrival, block=False):
                    break
                inbox.fan_in.post(arrival)

    def stats(self) -> ExchangeStats:
        """The rank's exchange costs since the mailbox was built."""
        return ExchangeStats(
            sends=self._sends,
            receives=self._receives,
            send_calls=sum(fan_out.calls for fan_out in self._out.values()),
            receive_calls=sum(inbox.fan_in.calls for inbox in self._in.values()),
            size_waits=self._size_waits,
        )

    def flush(self, *, backward: bool = True) -> None:
        """Wait until every send has left (end of step: buffers may be freed). ``backward=False``: the step ran its
        forwards alone (an evaluation), so the gradients' sizes its sends and headers told are never wanted."""
        self._drain(block=True, step_end=True)
        for fan_out in self._out.values():
            fan_out.wait_all()
        if not backward:
            self._known = {t: sizes for t, sizes in self._known.items() if not t.kind.is_grad}
        stale = [t for inbox in self._in.values() for t, _ in inbox.pending] + list(self._handed)
        if stale or self._known:
            raise ChannelError(f"end of step with messages expected but never waited: {stale or list(self._known)}")

    # ----- queued sends -----
    def _drain(self, *, block: bool, step_end: bool = False) -> None:
        """Send the queue in order: up to the first ``Later`` not ready (``block``: waiting for each; a wait counts
        as a size wait unless it is the ``step_end``'s, where the host waits for the device anyway)."""
        while self._queued:
            transfer, payload, produced = self._queued[0]
            if isinstance(payload, Later) and not payload.ready():
                if not block:
                    return
                self._size_waits += not step_end  # the host waits for sizes made on the device
            self._queued.popleft()
            with self._after(produced):
                self._send_now(transfer, _made(payload))

    def _produced(self) -> torch.cuda.Event | None:
        """The point of the compute stream after which a payload queued now is complete (None on CPUs)."""
        if self._send_stream is None:
            return None
        event = torch.cuda.Event()
        event.record()
        return event

    def _after(self, produced: torch.cuda.Event | None) -> contextlib.AbstractContextManager[object]:
        # On the compute stream NCCL would start the send only after all compute queued since.
        if produced is None or self._send_stream is None:  # no event without a send stream (``_produced``)
            return contextlib.nullcontext()
        self._send_stream.wait_event(produced)
        return torch.cuda.stream(self._send_stream)

    # ----- sizes -----
    def _resolve(self, transfer: Transfer, arrival: Arrival, *, block: bool) -> bool:
        """Fill ``arrival.sizes``; False if they are not known yet and ``block`` is off."""
        if arrival.sizes is not None:
            return True
        fan_in = self._in[transfer.kind].fan_in
        if transfer.kind in SELF_SIZED and fan_in.headers is None:  # a fixed capacity: no header
            arrival.sizes, arrival.metas = self._static_sizes(transfer, len(fan_in.peers))
            self._learn(transfer, arrival.sizes, arrival.metas)
            return True
        if fan_in.headers is not None:
            if not (block or fan_in.header_arrived(arrival)):
                return False
            fan_in.read_headers(arrival)
            assert arrival.sizes is not None  # read from the header just now
            self._learn(transfer, arrival.sizes, arrival.metas)
            return True
        if transfer not in self._known and block:
            self._resolve_source(transfer)
        if transfer not in self._known:
            if block:
                raise ChannelError(f"{transfer}: receive sizes unknown (its size source never passed this rank)")
            return False
        arrival.sizes = self._known.pop(transfer)
        return True

    def _learn(self, source: Transfer, sizes: Sizes, metas: Metas) -> None:
        """The sizes of the receives ``source`` sizes (``schedule.size_sources``), now that it passed this rank."""
        for receive in self._sized_by.get(source, ()):
            self._known[receive] = _SIZES_FROM[receive.kind, source.kind](sizes, metas)

    def _resolve_source(self, transfer: Transfer) -> None:
        """Read the headers of ``transfer``'s size source, a receive of this rank (and those before it on its
        channel, which arrive first); a source this rank sends was sent by the ``_drain`` before."""
        source = self._sources.get(transfer)
        if source is None or source.kind not in self._in or source.is_hand_off:
            return
        for pending, arrival in self._in[source.kind].pending:
            self._resolve(pending, arrival, block=True)
            if pending == source:
                return

    @property
    def _fixed(self) -> Capacity:
        """The capacity of header-less exchanges (the constructor refuses those without one)."""
        assert self.capacity is not None
        return self.capacity

    def _static_sizes(self, transfer: Transfer, peers: int) -> tuple[Sizes, tuple[tuple[int, ...], ...]]:
        moe_layer = self._moe_layers[transfer.src.layer] if transfer.kind == Kind.RESID else True
        return static_sizes(transfer.kind, self._fixed, peers=peers, ep_size=self._exchange_peers, moe_layer=moe_layer)

    def _check_static(self, transfer: Transfer, messages: Sequence[Message]) -> None:
        """A header-less message must have the sizes its receiver assumes (else it would wait for bytes never sent)."""
        fan_out = self._out[transfer.kind]
        if fan_out.headers is not None:
            return
        want, _ = self._static_sizes(transfer, len(messages))
        got = [fan_out.spec.sizes_of(message.tensors()) for message in messages]
        if got != want:
            side = "the FFN side expects" if transfer.kind == Kind.M2N else "the next A-group expects"
            raise ChannelError(
                f"{transfer}: {transfer.kind} rows {[g[0] for g in got]}, but {side} {[w[0] for w in want]}, the fixed "
                f"sizes of the micro-batch's {self._fixed.tokens} tokens (no header): every micro-batch must have the "
                "micro_batch_size x seq_len the ranks were built with"
            )

    # ----- payloads for the runner -----
    def _unpack(
        self,
        kind: Kind,
        arrival: Arrival,
        whole: Sequence[torch.Tensor],
        per_peer: Sequence[Sequence[torch.Tensor]],
    ) -> Received:
        fan_in, message = self._in[kind].fan_in, MESSAGE_TYPES[kind]
        assert arrival.sizes is not None  # payloads are unpacked once their sizes are known
        if not self._attention:  # every lane's message in one, in lane order (host ints summed: all lanes' pairs)
            host_ints = [sum(ints) for ints in zip(*arrival.metas, strict=True)] or [0] * fan_in.spec.metas
            bounded = pads(self.capacity)
            gathered = (
                message.from_wire(whole, host_ints, bounded=bounded)
                if message is Tokens
                else message.from_wire(whole, host_ints)
            )
            return Received([gathered], LaneRows(fan_in.peers, tuple(size[0] for size in arrival.sizes)))
        metas = arrival.metas or [()] * len(per_peer)
        return Received([message.from_wire(tensors, ints) for tensors, ints in zip(per_peer, metas, strict=True)])
