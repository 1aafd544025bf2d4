"""AF-Pipe schedule: task graph, generator, instruction streams, contract checker, traces (pure Python, no torch).

>>> schedule = generate(PipeShape(depth=1, num_layers=1, moe_layers=(True,)), num_micro_batches=1)
>>> check_streams(schedule.streams)
>>> print(schedule.render())
A0: F0.0 F1.0 B1.0 B0.0
F0: F0.0 B0.0
"""

from disagmoe_ds.schedule.checker import check_streams, render
from disagmoe_ds.schedule.generator import Costs, Schedule, default_max_in_flight, generate, unit_costs
from disagmoe_ds.schedule.instructions import (
    BackwardAttn,
    BackwardExperts,
    CommInstruction,
    ComputeInstruction,
    ForwardAttn,
    ForwardExperts,
    Instruction,
    OptimizerStep,
    PostRecv,
    ReduceGrads,
    Send,
    WaitRecv,
    WeightGradAttn,
    WeightGradExperts,
)
from disagmoe_ds.schedule.sizes import SELF_SIZED, size_sources
from disagmoe_ds.schedule.streams import build_streams, forward_stream, layer_in_flight
from disagmoe_ds.schedule.tasks import (
    Channel,
    Kind,
    PipeShape,
    ScheduleError,
    Task,
    TaskGraph,
    TaskKind,
    Transfer,
    Worker,
    build_graph,
)
from disagmoe_ds.schedule.trace import TimelineEvent, to_chrome_trace, write_chrome_trace

__all__ = [
    "BackwardAttn",
    "BackwardExperts",
    "Channel",
    "CommInstruction",
    "ComputeInstruction",
    "Costs",
    "ForwardAttn",
    "ForwardExperts",
    "Instruction",
    "Kind",
    "OptimizerStep",
    "PipeShape",
    "PostRecv",
    "ReduceGrads",
    "SELF_SIZED",
    "Schedule",
    "ScheduleError",
    "Send",
    "Task",
    "TaskGraph",
    "TaskKind",
    "TimelineEvent",
    "Transfer",
    "WaitRecv",
    "WeightGradAttn",
    "WeightGradExperts",
    "Worker",
    "build_graph",
    "build_streams",
    "check_streams",
    "default_max_in_flight",
    "forward_stream",
    "generate",
    "layer_in_flight",
    "render",
    "size_sources",
    "to_chrome_trace",
    "unit_costs",
    "write_chrome_trace",
]
