"""Co-located EP+DP mode: every rank holds the whole attention side and a slice of every MoE layer's experts.

The classic baseline (dispatch and combine all-to-all on the critical path, 1F1B with pipeline depth 1) and the
path for one-GPU runs, over the same model parts as the disaggregated runtime. ``build_colocated_rank`` returns a
runtime whose ``executor.train_batch(batches)`` gives the same ``StepResult`` as the AF-Pipe executor.
"""

from disagmoe_ds.colocated.build import build_colocated_rank, preflight_colocated
from disagmoe_ds.colocated.layout import ColocatedConfig, ColocatedLayout
from disagmoe_ds.comm.dispatch import AllToAllDispatcher, DispatchMetadata, LocalDispatcher

__all__ = [
    "AllToAllDispatcher",
    "ColocatedConfig",
    "ColocatedLayout",
    "DispatchMetadata",
    "LocalDispatcher",
    "build_colocated_rank",
    "preflight_colocated",
]
