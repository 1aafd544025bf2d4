"""The AF-Pipe streams in DeepSpeed's schedule vocabulary (``PipeSchedule`` / ``PipeInstruction``).

The schedule package stays free of torch and deepspeed; this module lowers one worker's stream to
DeepSpeed ``PipeInstruction`` subclasses, one instruction per step. A send never blocks the host (its bytes may
wait on the device for their receive), and a rank's host only ever waits for messages its peers send earlier in
their own streams (the schedule checker proves it, under rendezvous; see ``comm.transport``).
"""

from __future__ import annotations

from collections.abc import Iterator

from deepspeed.runtime.pipe import schedule as ds_schedule

from disagmoe_ds import schedule as af


class PostRecv(ds_schedule.PipeInstruction):
    """Post the receive of ``message`` (headers first). Pairs with ``SendMessage(message)`` on the sender."""


class WaitRecv(ds_schedule.PipeInstruction):
    """Wait until ``message`` has arrived. Pairs with ``SendMessage(message)`` on the sender."""


class SendMessage(ds_schedule.PipeInstruction):
    """Start the non-blocking send of ``message``. Pairs with ``PostRecv`` and ``WaitRecv`` on the receiver."""


class ForwardAttn(ds_schedule.PipeInstruction):
    """Forward of an attention chunk (``layer == num_layers``: final norm, head and loss)."""


class BackwardAttn(ds_schedule.PipeInstruction):
    """Backward of an attention chunk from the gradients received for its outputs."""


class ForwardExperts(ds_schedule.PipeInstruction):
    """Forward of this rank's expert shard of one MoE layer on the tokens received by M2N."""


class BackwardExperts(ds_schedule.PipeInstruction):
    """Backward of this rank's expert shard of one MoE layer."""


class WeightGradAttn(ds_schedule.PipeInstruction):
    """Split backward: the parameter gradients a ``BackwardAttn`` deferred; no message in or out."""


class WeightGradExperts(ds_schedule.PipeInstruction):
    """Split backward: the expert weight gradients a ``BackwardExperts`` deferred; no message in or out."""


_LOWER = {
    af.PostRecv: PostRecv,
    af.WaitRecv: WaitRecv,
    af.Send: SendMessage,
    af.ForwardAttn: ForwardAttn,
    af.BackwardAttn: BackwardAttn,
    af.ForwardExperts: ForwardExperts,
    af.BackwardExperts: BackwardExperts,
    af.WeightGradAttn: WeightGradAttn,
    af.WeightGradExperts: WeightGradExperts,
    af.ReduceGrads: ds_schedule.ReduceGrads,
    af.OptimizerStep: ds_schedule.OptimizerStep,
}


def lower(instruction: af.Instruction) -> ds_schedule.PipeInstruction:
    """The DeepSpeed instruction for one schedule instruction (its fields become keyword arguments)."""
    kwargs = {name: getattr(instruction, name) for name in instruction.__dataclass_fields__}
    return _LOWER[type(instruction)](**kwargs)


class AFPipeSchedule(ds_schedule.PipeSchedule):
    """One worker's AF-Pipe stream as a DeepSpeed ``PipeSchedule``.

    Args:
        schedule: the generated schedule of the whole step.
        worker: the A- or F-group this rank belongs to (all its ranks run the same stream).
    """

    def __init__(self, schedule: af.Schedule, worker: af.Worker):
        workers = sorted(schedule.streams)
        super().__init__(schedule.graph.num_micro_batches, len(workers), workers.index(worker))
        self._stream = schedule.streams[worker]
        self._forwards = af.forward_stream(self._stream)
        self._max_in_flight = schedule.max_in_flight

    def steps(self) -> Iterator[list[ds_schedule.PipeInstruction]]:
        for instruction in self._stream:
            yield [lower(instruction)]

    def forward_steps(self) -> Iterator[list[ds_schedule.PipeInstruction]]:
        """The step's forwards alone, an evaluation's (``schedule.forward_stream``)."""
        for instruction in self._forwards:
            yield [lower(instruction)]

    def num_pipe_buffers(self) -> int:
        return self._max_in_flight
