"""The co-located pipeline's schedule: each stage's order of micro-batch forwards and backwards (1F1B, and
Megatron-Core's interleaved 1F1B over virtual stages), and a check that the stages' orders neither deadlock nor
mismatch their messages (pure Python).

A pass is (kind, chunk, micro-batch): stage s's chunk k is virtual stage ``k * P + s`` of the P x v virtual stages
the layers are split into, so a micro-batch's forward visits stage 0 .. P - 1 for chunk 0, then comes back to
stage 0 for chunk 1, and so on; its backward runs the other way.

1F1B (v = 1) is DeepSpeed's ``TrainSchedule`` and Megatron-Core's non-interleaved schedule: stage s runs P - s - 1
forwards ahead (warm-up), then alternates one forward and one backward, then drains the backwards, so at most
P - s micro-batches keep activations on it. Interleaved (v > 1) is Megatron-Core's
``forward_backward_pipelining_with_interleaving``: micro-batches go in groups of P, each group through every chunk
in turn, with ``2 (P - s - 1) + (v - 1) P`` forwards ahead; the bubble shrinks v-fold, for P x v hand-offs.

>>> one_f_one_b(stage=0, stages=3, micro_batches=4)
[('F', 0, 0), ('F', 0, 1), ('F', 0, 2), ('B', 0, 0), ('F', 0, 3), ('B', 0, 1), ('B', 0, 2), ('B', 0, 3)]
>>> [p[:2] for p in interleaved(stage=1, stages=2, chunks=2, micro_batches=2)]
[('F', 0), ('F', 0), ('F', 1), ('B', 1), ('F', 1), ('B', 1), ('B', 0), ('B', 0)]
>>> check_pipeline([interleaved(s, 2, 2, 4) for s in range(2)], chunks=2)
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

Pass = tuple[Literal["F", "B"], int, int]  # a forward or backward of one chunk for one micro-batch


class PipelineScheduleError(RuntimeError):
    """The stages' orders would deadlock, mismatch their messages, or lose a micro-batch."""


def schedule(stage: int, stages: int, chunks: int, micro_batches: int) -> list[Pass]:
    """Stage ``stage``'s passes for one step: 1F1B, or interleaved 1F1B over ``chunks`` virtual stages."""
    if chunks == 1:
        return one_f_one_b(stage, stages, micro_batches)
    return interleaved(stage, stages, chunks, micro_batches)


def one_f_one_b(stage: int, stages: int, micro_batches: int) -> list[Pass]:
    """Stage ``stage``'s passes, in order, for one step of ``micro_batches`` (one chunk)."""
    warm_up = min(stages - stage - 1, micro_batches)
    order: list[Pass] = [("F", 0, mb) for mb in range(warm_up)]
    for mb in range(warm_up, micro_batches):
        order += [("F", 0, mb), ("B", 0, mb - warm_up)]
    return order + [("B", 0, mb) for mb in range(micro_batches - warm_up, micro_batches)]


def interleaved(stage: int, stages: int, chunks: int, micro_batches: int) -> list[Pass]:
    """Megatron-Core's interleaved order for stage ``stage`` (``micro_batches`` a multiple of ``stages``)."""
    if micro_batches % stages:
        raise PipelineScheduleError(
            f"interleaved stages run the micro-batches in groups of the {stages} stages: {micro_batches} "
            f"micro-batches are not a multiple of {stages}"
        )
    total = micro_batches * chunks
    warm_up = min(2 * (stages - stage - 1) + (chunks - 1) * stages, total)
    order: list[Pass] = [_virtual("F", i, stages, chunks) for i in range(warm_up)]
    for i in range(total - warm_up):
        order += [_virtual("F", warm_up + i, stages, chunks), _virtual("B", i, stages, chunks)]
    return order + [_virtual("B", i, stages, chunks) for i in range(total - warm_up, total)]


def _virtual(kind: Literal["F", "B"], i: int, stages: int, chunks: int) -> Pass:
    """The ``i``-th forward (backward) of a stage: micro-batches in groups of ``stages``, each group through the
    chunks in turn (backwards from the last chunk)."""
    chunk = i % (stages * chunks) // stages
    mb = i // (stages * chunks) * stages + i % stages
    return kind, chunk if kind == "F" else chunks - 1 - chunk, mb


def source(stages: int, chunks: int, stage: int, pass_: Pass) -> tuple[int, Pass] | None:
    """The pass of another stage whose message ``pass_`` of ``stage`` waits for (None: it waits for none)."""
    kind, chunk, mb = pass_
    if kind == "F":
        if stage > 0:
            return stage - 1, ("F", chunk, mb)
        return (stages - 1, ("F", chunk - 1, mb)) if chunk > 0 else None
    if stage < stages - 1:
        return stage + 1, ("B", chunk, mb)
    return (0, ("B", chunk + 1, mb)) if chunk < chunks - 1 else None


def check_pipeline(orders: Sequence[Sequence[Pass]], *, chunks: int = 1) -> None:
    """Run the stages' orders as the executor does, a host blocking only where it waits for a message (sends never
    block; each link's next receive is posted as soon as the previous is taken). Raises if some stage waits
    forever, if a link's receiver takes its messages in another order than its sender sends them (one message
    would be read as another), or if a micro-batch's passes are missing, repeated, or out of order."""
    stages = len(orders)
    for stage, order in enumerate(orders):
        forwards = sorted(p[1:] for p in order if p[0] == "F")
        backwards = sorted(p[1:] for p in order if p[0] == "B")
        micro_batches = {mb for _, mb in forwards}
        if len(set(forwards)) != len(forwards) or forwards != backwards or len(micro_batches) * chunks != len(forwards):
            raise PipelineScheduleError(f"stage {stage}: every micro-batch once forward then backward in every chunk")
        if any(order.index(("B", c, mb)) < order.index(("F", c, mb)) for c, mb in forwards):
            raise PipelineScheduleError(f"stage {stage} runs a backward before its forward")
    _check_links(orders, chunks)
    done: set[tuple[int, Pass]] = set()
    position = [0] * stages
    while any(position[s] < len(orders[s]) for s in range(stages)):
        moved = False
        for stage in range(stages):
            while position[stage] < len(orders[stage]):
                needs = source(stages, chunks, stage, orders[stage][position[stage]])
                if needs is not None and needs not in done:
                    break
                done.add((stage, orders[stage][position[stage]]))
                position[stage] += 1
                moved = True
        if not moved:
            waiting = {s: orders[s][position[s]] for s in range(stages) if position[s] < len(orders[s])}
            raise PipelineScheduleError(f"the stages deadlock, each waiting at its next pass: {waiting}")


def _check_links(orders: Sequence[Sequence[Pass]], chunks: int) -> None:
    """Every link's messages are taken in the order they are sent (its FIFO matches them by position)."""
    stages = len(orders)
    sent: dict[tuple[int, int, str], list[tuple[int, Pass]]] = {}
    taken: dict[tuple[int, int, str], list[tuple[int, Pass]]] = {}
    for stage, order in enumerate(orders):
        for pass_ in order:
            dst = destination(stages, chunks, stage, pass_)
            if dst is not None:
                sent.setdefault((stage, dst[0], pass_[0]), []).append((stage, pass_))
            src = source(stages, chunks, stage, pass_)
            if src is not None:
                taken.setdefault((src[0], stage, pass_[0]), []).append(src)
    for (sender, receiver, kind), messages in taken.items():
        if sent.get((sender, receiver, kind)) != messages:
            raise PipelineScheduleError(
                f"stage {receiver} takes the {kind} messages of stage {sender} in another order than they are sent"
            )


def destination(stages: int, chunks: int, stage: int, pass_: Pass) -> tuple[int, Pass] | None:
    """The pass of another stage that waits for ``pass_``'s message (None: it sends none); ``source``'s inverse."""
    kind, chunk, mb = pass_
    if kind == "F":
        if stage < stages - 1:
            return stage + 1, ("F", chunk, mb)
        return (0, ("F", chunk + 1, mb)) if chunk < chunks - 1 else None
    if stage > 0:
        return stage - 1, ("B", chunk, mb)
    return (stages - 1, ("B", chunk - 1, mb)) if chunk > 0 else None
