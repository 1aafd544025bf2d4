"""Check the send/receive contract of AF-Pipe instruction streams, and draw streams as text (pure Python).

The contract: each message is sent once by its source worker, posted once and waited once by its destination
worker; post before wait, wait before the compute that reads it, send after the compute that makes it; per
channel the receiver posts and waits in the sender's send order; and running the streams, where ``Send``
never blocks and ``WaitRecv(x)`` blocks until ``x`` is sent, finishes (no deadlock).

That run is the rendezvous model (NCCL's network transport: a send completes only once its receive has started)
for the runtime's exchange: each channel has its own one-way communicator, so a transfer waits only for the
transfers before it on the same channel, which the receiver waited for earlier; a receive is posted no later than
its ``WaitRecv``; and the host never blocks on a send.

``render`` shows compute only, one line per worker: ``F<layer>.<micro_batch>`` is a forward and
``B<layer>.<micro_batch>`` a backward (with a split backward: its input gradients), ``W<layer>.<micro_batch>`` a
deferred weight-gradient task; on the A side ``layer == L`` is the head chunk (norm, LM head, loss).

>>> from disagmoe_ds.schedule.instructions import BackwardAttn, ForwardAttn
>>> print(render({Worker("A", 0): [ForwardAttn(0, 0), BackwardAttn(0, 0)]}))
A0: F0.0 B0.0
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping, Sequence

from disagmoe_ds.schedule.instructions import (
    CommInstruction,
    ComputeInstruction,
    Instruction,
    PostRecv,
    Send,
    WaitRecv,
)
from disagmoe_ds.schedule.tasks import Channel, ScheduleError, Task, Transfer, Worker

Streams = Mapping[Worker, Sequence[Instruction]]
Places = Mapping[str, list[tuple[Worker, int]]]


def check_streams(streams: Streams) -> None:
    """Raise ``ScheduleError`` naming the worker, instruction and mismatch or wait cycle, if any."""
    for message, places in _places(streams).items():
        _check_message(message, places)
    _check_channel_order(streams)
    _check_no_deadlock(streams)


def render(streams: Streams) -> str:
    """Compute order per worker, e.g. ``A0: F0.0 F0.1 B2.1`` (notation in the module docstring)."""
    lines = []
    for worker in sorted(streams):
        labels = [ins.task.label for ins in streams[worker] if isinstance(ins, ComputeInstruction)]
        lines.append(" ".join([f"{worker}:", *labels]))
    return "\n".join(lines)


def _places(streams: Streams) -> dict[Transfer, Places]:
    """Per message, where (worker, index) it is sent, posted, waited, produced and consumed."""
    computes: dict[Task, tuple[Worker, int]] = {}
    places: dict[Transfer, Places] = defaultdict(lambda: defaultdict(list))
    for worker, stream in streams.items():
        for i, ins in enumerate(stream):
            if isinstance(ins, CommInstruction):
                places[ins.transfer][type(ins).__name__].append((worker, i))
            elif isinstance(ins, ComputeInstruction):
                computes[ins.task] = (worker, i)
    for message, where in places.items():
        where["producer"] += [computes[message.src]] if message.src in computes else []
        where["consumer"] += [computes[message.dst]] if message.dst in computes else []
    return places


def _check_message(message: Transfer, where: Places) -> None:
    expected = {"Send": message.src_worker, "PostRecv": message.dst_worker, "WaitRecv": message.dst_worker}
    for name, worker in expected.items():
        if [w for w, _ in where[name]] != [worker]:
            found = ", ".join(f"{w}[{i}]" for w, i in where[name]) or "nowhere"
            raise ScheduleError(f"{message}: {name} must appear once, in {worker}'s stream; found at {found}")
    send, post, wait = (where[name][0][1] for name in ("Send", "PostRecv", "WaitRecv"))
    if post > wait:
        raise ScheduleError(f"{message.dst_worker}: WaitRecv({message}) at [{wait}] precedes its PostRecv [{post}]")
    if where["producer"] and where["producer"][0][1] > send:
        raise ScheduleError(f"{message.src_worker}: Send({message}) at [{send}] precedes the compute making it")
    if where["consumer"] and where["consumer"][0][1] < wait:
        raise ScheduleError(f"{message.dst_worker}: the compute reading {message} precedes its WaitRecv [{wait}]")


def _check_channel_order(streams: Streams) -> None:
    order: dict[type, dict[Channel, list[Transfer]]] = {cls: defaultdict(list) for cls in (Send, PostRecv, WaitRecv)}
    for stream in streams.values():
        for ins in stream:
            if isinstance(ins, CommInstruction):
                order[type(ins)][ins.transfer.channel].append(ins.transfer)
    for channel, sent in order[Send].items():
        for verb, cls in (("posted", PostRecv), ("waited", WaitRecv)):
            for k, (send, recv) in enumerate(zip(sent, order[cls][channel], strict=True)):
                if send != recv:
                    raise ScheduleError(
                        f"{channel.dst}: receive #{k} on channel {channel} is {verb} for {recv} but {channel.src} "
                        f"sends {send} as #{k}; receive in the sender's send order (p2p matches FIFO per channel)"
                    )


def _check_no_deadlock(streams: Streams) -> None:
    """Run the streams with non-blocking sends and blocking waits; if they stop, name the wait cycle."""
    pc = dict.fromkeys(streams, 0)
    sent: set[Transfer] = set()
    blocked: dict[Worker, WaitRecv] = {}
    progress = True
    while progress:
        progress, blocked = False, {}
        for worker, stream in streams.items():
            while pc[worker] < len(stream):
                ins = stream[pc[worker]]
                if isinstance(ins, WaitRecv) and ins.transfer not in sent:
                    blocked[worker] = ins
                    break
                if isinstance(ins, Send):
                    sent.add(ins.transfer)
                pc[worker], progress = pc[worker] + 1, True
    if blocked:
        raise ScheduleError("deadlock: " + _cycle(blocked, pc))


def _cycle(blocked: Mapping[Worker, WaitRecv], pc: Mapping[Worker, int]) -> str:
    """Follow "waits for" edges; every sender is blocked too (it sends every message once), so a worker repeats."""
    chain = [min(blocked)]
    while (sender := blocked[chain[-1]].transfer.src_worker) not in chain:
        chain.append(sender)
    return "; ".join(f"{w} waits at [{pc[w]}] {blocked[w]!r}" for w in chain[chain.index(sender) :])
