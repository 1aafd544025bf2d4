"""One rank's ends of the AF-Pipe exchanges, addressed by schedule messages.

Every message kind a rank sends leaves through one ``FanOut`` and every kind it receives arrives through one
``FanIn`` (one communicator each, see ``comm.exchange``). The schedule posts and waits each channel in the sender's
order; the mailbox adds what makes that safe and fast under rendezvous:

- **sizes before receives.** A payload receive is posted as soon as its sizes are known: from a header (m2n, resid),
  from a fixed capacity (m2n and resid with one ep rank or a ``capacity_factor``: ``exchange.static_sizes``), or
  from what this rank itself sent earlier (the reverse paths). ``pump`` posts every receive that has become
  postable, oldest first per channel, without blocking; a wait blocks only for a header that is not in yet.
- **no host sync per send.** Sizes come from tensor shapes and host ints, headers go host to host. Where the sizes
  come from the device (m2n and resid with several ep ranks: rows per ep rank), the runner hands over a ``Later``
  and the sizes land in host memory while the host goes on; the mailbox sends it once they have (``pump``), keeps
  every later send behind it (the schedule's order of sends), and sends them all, waiting for their sizes,
  before anything that may block the host. Sent late, a message leaves from a side stream after the compute that
  made it, not after the compute queued since.

Payloads at the runner boundary are the typed messages of ``comm.messages``: a runner sends one per peer (a
list; one message for the residual kinds, which have one peer) and gets one per peer on the A side (per ep rank;
the residual kinds' one message), or, on the F side, every lane's message gathered with the ``LaneRows`` that
split its answer.
"""

from __future__ import annotations

import contextlib
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field, fields
from typing import Any

import torch

from disagmoe_ds.afpipe.later import Later, made
from disagmoe_ds.comm.channel import Arrival, ChannelError, CommStream, FanIn, FanOut
from disagmoe_ds.comm.exchange import A_TO_A, MESSAGE_TYPES, ExchangeComms, Kind, LaneRows, exchange_specs, static_sizes
from disagmoe_ds.comm.messages import Dims, Message, Tokens
from disagmoe_ds.comm.routing import Capacity, pads
from disagmoe_ds.schedule import Message as Scheduled

Key = tuple[str, int, int]  # ``Scheduled.key``: (kind, layer of the sending task, micro-batch)
_HEADED = ("m2n", "resid")  # the kinds whose sizes need a header, except at a fixed capacity (``static_sizes``)


def _tag(key: Key) -> int:
    # Checked by the receiver against the next message on the channel: catches any schedule mismatch.
    return key[1] * (1 << 20) + key[2]


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
    pending: deque[tuple[Key, Arrival]] = field(default_factory=deque)  # expected, oldest first


class Mailbox:
    """Fan-outs and fan-ins of one rank, built once per run; ``post``/``wait``/``send`` by schedule message."""

    def __init__(
        self,
        comms: ExchangeComms,
        *,
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
    ):
        """``moe_layers``: which layers route (one bool per layer); ``capacity``: the fixed sizes of m2n messages
        when ``comms`` has no headers. Header-less resid messages take their sizes from both. ``residual``: the
        residual's streams, routed-sum weights and token-id columns per token (``comm.messages.Dims``)."""
        layout, rank = comms.layout, comms.rank
        if comms.headerless and capacity is None:
            raise ValueError("header-less exchanges need the capacity that sizes their messages")
        dims = Dims(hidden, top_k, layout.num_experts, layout.ep_size, dtype, weight_dtype, *residual)
        specs = exchange_specs(dims, resend=resend)
        stream = CommStream(device, enabled=comm_stream)
        self.depth = layout.depth
        self._attention = layout.role_of(rank).is_attention
        if self._attention:
            sends, receives = [Kind.M2N, Kind.N2M_GRAD], [Kind.N2M, Kind.M2N_GRAD]
            if layout.depth > 1:  # resid first: ``pump`` learns n2m's sizes from its headers
                sends, receives = [*sends, Kind.RESID, Kind.RESID_GRAD], [Kind.RESID, Kind.RESID_GRAD, *receives]
        else:
            sends, receives = [Kind.N2M, Kind.M2N_GRAD], [Kind.M2N, Kind.N2M_GRAD]
        self._out: dict[str, FanOut] = {k.value: comms.fan_out(k, specs[k]) for k in sends}
        self._in = {k.value: _Inbox(comms.fan_in(k, specs[k], device, stream)) for k in receives}
        self._known: dict[Key, list[tuple[int, ...]]] = {}  # sizes of receives this rank can predict
        self.capacity = capacity  # grown between steps by the executor when a step outgrew it
        self._ep_size, self._moe_layers = layout.ep_size, tuple(moe_layers)
        # Sends not made yet, in schedule order, each with the point of the compute stream that produced it.
        self._queued: deque[tuple[Scheduled, Any, torch.cuda.Event | None]] = deque()
        cuda = device.type == "cuda"
        self._send_stream = torch.cuda.Stream(device) if cuda else None
        self._waits_block_host = not cuda  # NCCL waits are the compute stream's; gloo's block the host
        self._sends = self._receives = self._size_waits = 0

    # ----- the schedule's verbs -----
    def post(self, message: Scheduled) -> None:
        """Expect ``message`` (its header receives go out now); its payload receive is posted once sizes are known."""
        key = message.key
        inbox = self._in[message.kind]
        inbox.pending.append((key, inbox.fan_in.expect(_tag(key))))
        self.pump()

    def wait(self, message: Scheduled) -> Any:
        """The payload of ``message``; posts it (and the older messages of its channel) first if not yet posted."""
        key = message.key
        inbox = self._in[message.kind]
        keys = [k for k, _ in inbox.pending]
        if key not in keys:
            raise ChannelError(f"{message}: waited for without a PostRecv before")
        index = keys.index(key)
        if self._waits_block_host:
            self._drain(block=True)
        for k, arrival in list(inbox.pending)[: index + 1]:
            if arrival.work is None:
                if not self._resolve(message.kind, k, arrival, block=False):
                    self._size_waits += 1
                    self._drain(block=True)  # this rank's queued sends may be what the sender waits for
                    self._resolve(message.kind, k, arrival, block=True)
                inbox.fan_in.post(arrival)
        arrival = inbox.pending[index][1]
        del inbox.pending[index]
        self._receives += 1
        whole, per_peer = inbox.fan_in.complete(arrival)
        return self._unpack(message.kind, arrival, whole, per_peer)

    def send(self, message: Scheduled, payload: Any) -> None:
        """Send ``payload`` now, or queue it (a ``Later`` whose sizes are not on the host yet, or anything behind
        one): ``pump`` sends the queue in order as it becomes ready."""
        if self._queued or (isinstance(payload, Later) and not payload.ready()):
            self._queued.append((message, payload, self._produced()))
        else:
            self._send_now(message, made(payload))
        self.pump()

    def _send_now(self, message: Scheduled, payload: Any) -> None:
        self._sends += 1
        key = message.key
        kind, layer, mb = key
        messages: Sequence[Message] = [payload] if isinstance(payload, Message) else payload
        if kind in _HEADED:
            self._check_static(key, messages)
        tensors, host_ints = [m.tensors() for m in messages], [m.host_ints() for m in messages]
        sizes = self._out[kind].send(tensors, tag=_tag(key), metas=host_ints)
        if kind == "m2n":  # the sizes of what comes back
            self._known[("m2n_grad", layer, mb)] = sizes
            if self.depth == 1:  # A_next is this rank
                self._known[("n2m", layer, mb)] = sizes
        elif kind == "resid":
            self._known[("resid_grad", layer + 1, mb)] = [sizes[0][:1]]

    def pump(self) -> None:
        """Send what has become sendable, then post every payload receive whose sizes are known by now, oldest first
        per channel; never blocks."""
        self._drain(block=False)
        for kind, inbox in self._in.items():
            for key, arrival in inbox.pending:
                if arrival.work is not None:
                    continue
                if not self._resolve(kind, key, arrival, block=False):
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
            self._known = {key: sizes for key, sizes in self._known.items() if not key[0].endswith("_grad")}
        stale = [key for inbox in self._in.values() for key, _ in inbox.pending]
        if stale or self._known:
            raise ChannelError(f"end of step with messages expected but never waited: {stale or list(self._known)}")

    # ----- queued sends -----
    def _drain(self, *, block: bool, step_end: bool = False) -> None:
        """Send the queue in order: up to the first ``Later`` not ready (``block``: waiting for each; a wait counts
        as a size wait unless it is the ``step_end``'s, where the host waits for the device anyway)."""
        while self._queued:
            message, payload, produced = self._queued[0]
            if isinstance(payload, Later) and not payload.ready():
                if not block:
                    return
                self._size_waits += not step_end  # the host waits for sizes made on the device
            self._queued.popleft()
            with self._after(produced):
                self._send_now(message, made(payload))

    def _produced(self) -> torch.cuda.Event | None:
        """The point of the compute stream after which a payload queued now is complete (None on CPUs)."""
        if self._send_stream is None:
            return None
        event = torch.cuda.Event()
        event.record()
        return event

    def _after(self, produced: torch.cuda.Event | None) -> contextlib.AbstractContextManager:
        # On the compute stream NCCL would start the send only after all compute queued since.
        if produced is None or self._send_stream is None:  # no event without a send stream (``_produced``)
            return contextlib.nullcontext()
        self._send_stream.wait_event(produced)
        return torch.cuda.stream(self._send_stream)

    # ----- sizes -----
    def _resolve(self, kind: str, key: Key, arrival: Arrival, *, block: bool) -> bool:
        """Fill ``arrival.sizes``; False if they are not known yet and ``block`` is off."""
        if arrival.sizes is not None:
            return True
        fan_in = self._in[kind].fan_in
        if kind in _HEADED and fan_in.headers is None:  # one ep rank: no header, the sizes are the micro-batch's
            arrival.sizes, arrival.metas = self._static_sizes(kind, key, len(fan_in.peers))
            self._learn_from_header(kind, key, arrival)
            return True
        if fan_in.headers is not None:
            if not (block or fan_in.header_arrived(arrival)):
                return False
            fan_in.read_headers(arrival)
            self._learn_from_header(kind, key, arrival)
            return True
        if key not in self._known and block and kind == "n2m":  # p > 1: the sizes ride in resid's header
            self._read_resid_headers_until(key)
        if key not in self._known:
            if block:
                raise ChannelError(f"{key}: receive sizes unknown (nothing this rank sent or received implies them)")
            return False
        arrival.sizes = self._known.pop(key)
        return True

    @property
    def _fixed(self) -> Capacity:
        """The capacity of header-less exchanges (the constructor refuses those without one)."""
        assert self.capacity is not None
        return self.capacity

    def _static_sizes(self, kind: str, key: Key, peers: int):
        moe_layer = self._moe_layers[key[1]] if kind == "resid" else True
        return static_sizes(Kind(kind), self._fixed, peers=peers, ep_size=self._ep_size, moe_layer=moe_layer)

    def _check_static(self, key: Key, messages: Sequence[Message]) -> None:
        """A header-less message must have the sizes its receiver assumes (else it would wait for bytes never sent)."""
        fan_out = self._out[key[0]]
        if fan_out.headers is not None:
            return
        want, _ = self._static_sizes(key[0], key, len(messages))
        got = [fan_out.spec.sizes_of(message.tensors()) for message in messages]
        if got != want:
            side = "the FFN side expects" if key[0] == "m2n" else "the next A-group expects"
            raise ChannelError(
                f"{key}: {key[0]} rows {[g[0] for g in got]}, but {side} {[w[0] for w in want]}, the fixed sizes of "
                f"the micro-batch's {self._fixed.tokens} tokens (no header): every micro-batch must have the "
                "micro_batch_size x seq_len the ranks were built with"
            )

    def _learn_from_header(self, kind: str, key: Key, arrival: Arrival) -> None:
        _, layer, mb = key
        assert arrival.sizes is not None  # read from the header just now
        if kind == "m2n":  # the gradients of these rows come back on n2m_grad from A_next's chunk layer + 1
            self._known[("n2m_grad", layer + 1, mb)] = list(arrival.sizes)
        elif kind == "resid" and arrival.metas[0][0] >= 0:  # layer was MoE (-1: dense): its n2m rows per ep rank
            self._known[("n2m", layer, mb)] = [(rows,) for rows in arrival.metas[0]]

    def _read_resid_headers_until(self, key: Key) -> None:
        for resid_key, arrival in self._in["resid"].pending:
            if key in self._known:
                return
            self._resolve("resid", resid_key, arrival, block=True)

    # ----- payloads for the runner -----
    def _unpack(self, kind: str, arrival: Arrival, whole: Sequence[torch.Tensor], per_peer: list) -> Any:
        fan_in, message = self._in[kind].fan_in, MESSAGE_TYPES[Kind(kind)]
        assert arrival.sizes is not None  # payloads are unpacked once their sizes are known
        if not self._attention:  # every lane's message in one, in lane order (host ints summed: all lanes' pairs)
            host_ints = [sum(ints) for ints in zip(*arrival.metas, strict=True)] or [0] * fan_in.spec.metas
            local = {"bounded": pads(self.capacity)} if message is Tokens else {}
            lane_rows = LaneRows(fan_in.peers, tuple(size[0] for size in arrival.sizes))
            return message.from_wire(whole, host_ints, **local), lane_rows
        metas = arrival.metas or [()] * len(per_peer)
        messages = [message.from_wire(tensors, ints) for tensors, ints in zip(per_peer, metas, strict=True)]
        return messages[0] if Kind(kind) in A_TO_A else messages
