"""The lanes that hold one micro-batch in slices, as either mode builds them: an attention stage cut for tensor
parallelism and wrapped for Ulysses (``split_attention``), a rank's place in its lanes (``lane_of``), and the TP
group's sum of the replicated gradients (``tensor_parallel_grads``).

The groups are ``groups.ProcessGroups``' ``sequence_parallel``, ``tensor_parallel`` and ``lane_slices``; the
slicing itself, the loss shares and the shards are ``models.sequence_parallel``'s and ``models.tensor_parallel``'s.
An AF-Pipe attention rank and a co-located rank (its attention side) are built the same way.
"""

from __future__ import annotations

from collections.abc import Callable

import torch.distributed as dist
from deepspeed import DeepSpeedEngine
from torch import nn

from disagmoe_ds.groups import ProcessGroups
from disagmoe_ds.models.parts import AttentionStage
from disagmoe_ds.models.sequence_parallel import SequenceParallel, install_ulysses
from disagmoe_ds.models.tensor_parallel import (
    TensorParallel,
    TensorParallelGrads,
    broadcast_from_first,
    glu_blocks,
    shard_attention,
    shard_mlp,
)


def lane_of(groups: ProcessGroups) -> SequenceParallel | None:
    """This rank's place in the lanes that hold its micro-batch in slices: its SP group, or its TP group
    (``TensorParallel``, over all s x t lanes of the micro-batch with Ulysses too); None when it holds the whole."""
    if groups.tensor_parallel is not None:
        shards = _place(groups.tensor_parallel, groups.tensor_parallel_ranks)
        lane = shards if groups.lane_slices is None else _place(groups.lane_slices, groups.lane_slices_ranks)
        return TensorParallel(lane.group, lane.size, lane.rank, shards)
    if groups.sequence_parallel is None:
        return None
    return _place(groups.sequence_parallel, groups.sequence_parallel_ranks)


def _place(group: dist.ProcessGroup, ranks: tuple[int, ...]) -> SequenceParallel:
    """This rank's place in ``group`` (its global ``ranks``, increasing)."""
    return SequenceParallel(group, len(ranks), ranks.index(dist.get_rank()))


def split_attention(stage: AttentionStage, groups: ProcessGroups) -> None:
    """An attention stage on lanes that share micro-batches: its attention modules and gated MLPs cut to the rank's
    part from one full copy (TP), Ulysses around its attention cores (SP), or both; nothing on a whole lane."""
    lane = lane_of(groups)
    parts = [stage.part(int(layer)) for layer in stage.layers]
    if isinstance(lane, TensorParallel):
        broadcast_from_first(stage, lane, groups.tensor_parallel_ranks[0])
        for part in parts:
            shard_attention(part.mixer, lane)
            for mlp in glu_blocks(part.mlp):
                shard_mlp(mlp, lane)
    if groups.sequence_parallel is not None:  # Ulysses around the cores (of the TP rank's heads, with TP)
        install_ulysses(
            [part.mixer for part in parts], _place(groups.sequence_parallel, groups.sequence_parallel_ranks)
        )


def tensor_parallel_grads(
    engine: DeepSpeedEngine, attention: nn.Module, groups: ProcessGroups
) -> Callable[[], None] | None:
    """With TP: the sum over the TP group of ``attention``'s replicated gradients, once per step (the returned call,
    before ``step()``); ZeRO-2 reduces and frees the gradients inside each backward, so there the sum runs in each
    backward (hooks) and nothing is returned. None without TP."""
    lane = lane_of(groups)
    if not isinstance(lane, TensorParallel):
        return None
    per_backward = engine.zero_optimization_stage() == 2
    grads = TensorParallelGrads(attention, lane, per_backward=per_backward)
    return None if per_backward else grads.reduce
