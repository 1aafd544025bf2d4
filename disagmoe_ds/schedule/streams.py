"""Lower each worker's task order to an instruction stream that keeps every channel first-in first-out.

NCCL and torch.distributed match point-to-point messages in posting order per (src, dst, group), with no
tags, and our receivers complete a channel's messages oldest first. So on every channel the receiver posts
and waits in exactly the sender's send order. When a task needs a message that was sent after others on the
same channel, it first waits for those too: they were sent earlier, so this never blocks longer, and their
tensors are held until their own task runs. Each receive is posted ``lookahead`` compute tasks before its wait.
A hand-off (both ends on one worker) is sent, posted and waited in the same way, so it takes the same path.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping

from disagmoe_ds.schedule import instructions as ins
from disagmoe_ds.schedule.tasks import Channel, Task, TaskGraph, Transfer, Worker


def build_streams(
    graph: TaskGraph, order: Mapping[Worker, tuple[Task, ...]], *, lookahead: int
) -> dict[Worker, tuple[ins.Instruction, ...]]:
    """One instruction stream per worker that runs the worker's tasks in ``order`` (execution order)."""
    sent: dict[Channel, list[Transfer]] = defaultdict(list)  # every channel's messages in send order
    for tasks in order.values():
        for task in tasks:
            for message in graph.outputs.get(task, ()):  # a weight-gradient task is not in the graph: none
                sent[message.channel].append(message)
    return {w: _stream(graph, order[w], sent, lookahead) for w in sorted(order)}


def _wait_slots(
    graph: TaskGraph, tasks: tuple[Task, ...], sent: Mapping[Channel, list[Transfer]]
) -> list[list[Transfer]]:
    """For each compute task, the messages waited just before it: its inputs and any sent ahead of them."""
    rank = {message: k for queue in sent.values() for k, message in enumerate(queue)}
    num_waited: dict[Channel, int] = defaultdict(int)
    slots: list[list[Transfer]] = [[] for _ in tasks]
    for slot, task in zip(slots, tasks):
        for message in graph.inputs.get(task, ()):
            channel = message.channel
            while num_waited[channel] <= rank[message]:
                slot.append(sent[channel][num_waited[channel]])
                num_waited[channel] += 1
    return slots


def _stream(
    graph: TaskGraph, tasks: tuple[Task, ...], sent: Mapping[Channel, list[Transfer]], lookahead: int
) -> tuple[ins.Instruction, ...]:
    waits = _wait_slots(graph, tasks, sent)
    posts: list[list[Transfer]] = [[] for _ in tasks]
    for i, messages in enumerate(waits):
        posts[max(0, i - lookahead)] += messages  # waits keep send order per channel, so posts do too
    stream: list[ins.Instruction] = []
    for task, post, wait in zip(tasks, posts, waits):
        stream += [ins.PostRecv(message) for message in post]
        stream += [ins.WaitRecv(message) for message in wait]
        stream.append(ins.compute_of(task))
        stream += [ins.Send(message) for message in graph.outputs.get(task, ())]
    return (*stream, ins.ReduceGrads(), ins.OptimizerStep())


def forward_stream(stream: tuple[ins.Instruction, ...]) -> tuple[ins.Instruction, ...]:
    """``stream`` with its forwards alone (an evaluation): the forward computes and their messages, in the same order.

    Every worker drops the backward messages at both ends and keeps its own order, so what the full streams ran
    before an instruction is still before it, less what was dropped: the forward streams of deadlock-free streams
    are deadlock-free (``check_streams`` accepts them; tests check it over layouts).
    """
    return tuple(
        instruction
        for instruction in stream
        if isinstance(instruction, ins.ForwardAttn | ins.ForwardExperts)
        or (isinstance(instruction, ins.CommInstruction) and not instruction.transfer.kind.is_grad)
    )


def layer_in_flight(stream: tuple[ins.Instruction, ...]) -> dict[int, int]:
    """The most micro-batches of each chunk layer in ``stream`` whose forward has run and backward has not, at once:
    how many copies of the layer's activations the worker holds at its peak (``models.graphs`` slots).

    >>> layer_in_flight((ins.ForwardAttn(0, 0), ins.ForwardAttn(0, 1), ins.BackwardAttn(0, 0), ins.BackwardAttn(0, 1)))
    {0: 2}
    """
    live: dict[int, int] = defaultdict(int)
    most: dict[int, int] = defaultdict(int)
    for instruction in stream:
        if isinstance(instruction, ins.ForwardAttn | ins.ForwardExperts):
            live[instruction.layer] += 1
            most[instruction.layer] = max(most[instruction.layer], live[instruction.layer])
        elif isinstance(instruction, ins.BackwardAttn | ins.BackwardExperts):
            live[instruction.layer] -= 1
    return dict(most)
