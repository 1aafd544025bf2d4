"""The runtime of one rank: DeepSpeed engines over its part of the model, and what runs a training step.

rank          build one rank of either mode, in a fixed order (model, layout, groups, module, engine, executor)
build         the disaggregated mode's steps of that build (``build_rank``, ``preflight``), the schedule's costs
deepspeed_role  one DeepSpeed engine per rank over its role's module, and the global gradient norm it clips with
instructions  the AF-Pipe streams as DeepSpeed ``PipeSchedule`` / ``PipeInstruction``\\s
executor      runs a rank's instruction stream: compute, exchanges, gradient reduction, optimizer step
runners       what a compute instruction does on the attention side and on the expert side
mailbox       the rank's ends of the exchanges, addressed by the schedule's messages; receives posted ahead
timeline      every rank's events of a step, written by rank 0 as one Chrome/Perfetto trace
checkpoint    DeepSpeed checkpoints of a job (one directory per engine group) tied together by a manifest
ds_state      the only code that reads or writes DeepSpeed's optimizer internals (re-layout, HF export)
"""
