"""The co-located pipeline's schedule: each stage's order of micro-batch forwards and backwards (1F1B), and a check
that the stages' orders cannot deadlock (pure Python).

1F1B is DeepSpeed's ``TrainSchedule`` and Megatron-Core's non-interleaved schedule: stage s of P runs P - s - 1
forwards ahead (warm-up), then alternates one forward and one backward, then drains the backwards, so at most
P - s micro-batches keep activations on it.

>>> one_f_one_b(stage=0, stages=3, micro_batches=4)
[('F', 0), ('F', 1), ('F', 2), ('B', 0), ('F', 3), ('B', 1), ('B', 2), ('B', 3)]
>>> check_pipeline([one_f_one_b(s, 3, 4) for s in range(3)])
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

Pass = tuple[Literal["F", "B"], int]  # a forward or backward of one micro-batch


class PipelineScheduleError(RuntimeError):
    """The stages' orders would deadlock or lose a micro-batch."""


def one_f_one_b(stage: int, stages: int, micro_batches: int) -> list[Pass]:
    """Stage ``stage``'s passes, in order, for one step of ``micro_batches``."""
    warm_up = min(stages - stage - 1, micro_batches)
    order: list[Pass] = [("F", mb) for mb in range(warm_up)]
    for mb in range(warm_up, micro_batches):
        order += [("F", mb), ("B", mb - warm_up)]
    return order + [("B", mb) for mb in range(micro_batches - warm_up, micro_batches)]


def check_pipeline(orders: Sequence[Sequence[Pass]]) -> None:
    """Run the stages' orders as the executor does, a host blocking only where it waits for a message: a forward
    for the previous stage's forward of its micro-batch, a backward for the next stage's backward of it (sends never
    block, each receive is posted before its wait). Raises if some stage waits forever or a micro-batch's passes
    are missing, repeated, or out of order."""
    stages = len(orders)
    for stage, order in enumerate(orders):
        forwards = [mb for kind, mb in order if kind == "F"]
        backwards = [mb for kind, mb in order if kind == "B"]
        if forwards != sorted(set(forwards)) or sorted(backwards) != forwards or backwards != sorted(backwards):
            raise PipelineScheduleError(f"stage {stage}: every micro-batch once forward then backward, in order")
        if any(order.index(("B", mb)) < order.index(("F", mb)) for mb in forwards):
            raise PipelineScheduleError(f"stage {stage} runs a backward before its forward")
    done: set[tuple[int, Pass]] = set()
    position = [0] * stages
    while any(position[s] < len(orders[s]) for s in range(stages)):
        moved = False
        for stage in range(stages):
            while position[stage] < len(orders[stage]):
                kind, mb = orders[stage][position[stage]]
                needs = (stage - 1, ("F", mb)) if kind == "F" else (stage + 1, ("B", mb))
                if 0 <= needs[0] < stages and needs not in done:
                    break
                done.add((stage, (kind, mb)))
                position[stage] += 1
                moved = True
        if not moved:
            waiting = {s: orders[s][position[s]] for s in range(stages) if position[s] < len(orders[s])}
            raise PipelineScheduleError(f"the stages deadlock, each waiting at its next pass: {waiting}")
