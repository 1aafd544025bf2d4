"""Where each receive's sizes come from: for every transfer whose receiver cannot read its sizes off the wire, the
transfer whose counts give them (pure Python).

A receiver posts a payload receive once it knows the payload's sizes (rows per peer). Two kinds carry their own, in
a header or from a fixed capacity (``SELF_SIZED``): m2n (how many tokens a lane routed to each ep rank) and resid
(the residual's tokens and the combine plan's rows). Every other kind is sized by a transfer its receiver has seen
by the time it waits (``tests/test_schedule.py`` checks it on every stream):

    m2n_grad, n2m_grad, resid_grad   the forward transfer the gradient answers, which the receiver sent
    n2m into A_fwd(l + 1)            the resid into the same task: its combine plan's rows per ep rank (at p = 1 a
                                     hand-off, at p > 1 a message whose header the receiver reads)

Hand-offs need no sizes (no wire). The mailbox (``afpipe.mailbox``) reads this table and learns a receive's sizes
when its source passes through it, sent or received.

>>> from disagmoe_ds.schedule.tasks import PipeShape, build_graph
>>> table = size_sources(build_graph(PipeShape(depth=2, num_layers=2, moe_layers=(True, True)), 1))
>>> sorted({(str(receive.kind), str(source.kind)) for receive, source in table.items()})
[('m2n_grad', 'm2n'), ('n2m', 'resid'), ('n2m_grad', 'n2m'), ('resid_grad', 'resid')]
"""

from __future__ import annotations

from disagmoe_ds.schedule.tasks import Kind, Task, TaskGraph, Transfer

SELF_SIZED = frozenset({Kind.M2N, Kind.RESID})  # sized by their own header, or by a fixed capacity


def size_sources(graph: TaskGraph) -> dict[Transfer, Transfer]:
    """For every message (not hand-off) whose kind is not ``SELF_SIZED``, the transfer whose counts size it."""
    forwards = {(t.src, t.dst): t for t in (*graph.remote_transfers, *graph.hand_offs) if not t.kind.is_grad}
    sources: dict[Transfer, Transfer] = {}
    for transfer in graph.remote_transfers:
        if transfer.kind in SELF_SIZED:
            continue
        if transfer.kind.is_grad:  # the forward transfer it answers: from its receiver's forward to its sender's
            sources[transfer] = forwards[_forward(transfer.dst), _forward(transfer.src)]
        else:  # n2m: the combine plan rides in the residual that the same task combines
            sources[transfer] = next(t for t in graph.inputs[transfer.dst] if t.kind == Kind.RESID)
    return sources


def _forward(task: Task) -> Task:
    """The forward whose chunk a backward task runs through."""
    return Task("A_fwd" if task.kind == "A_bwd" else "F_fwd", task.layer, task.micro_batch)
