"""How a rank's runner runs its chunks: the settings both sides' runners take from the build."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from disagmoe_ds.comm.routing import Capacity
from disagmoe_ds.models.graphs import StageGraphs


@dataclass(frozen=True)
class ChunkSettings:
    """How a rank's runner runs every chunk, on either side.

    Attributes:
        top_k: experts per token.
        weight_dtype: the router weights' dtype (they travel with the routed tokens).
        activation_checkpointing: keep only each chunk's inputs and recompute the rest in its backward.
        resend: the expert side keeps nothing between a micro-batch's forward and backward (it gets the tokens again).
        split_layers: the layers whose backward is split into input gradients now and weight gradients later.
        graphs: the parts replayed as CUDA graphs (None: every part as it is).
        capacity: m2n messages padded to it (None: exact sizes, sent with headers).
        fp8: the routed tokens travel in FP8 (the lever; ``comm.messages.Tokens.of``).
    """

    top_k: int
    weight_dtype: torch.dtype = torch.float32
    activation_checkpointing: bool = False
    resend: bool = False
    split_layers: frozenset[int] = frozenset()
    graphs: StageGraphs | None = None
    capacity: Capacity | None = None
    fp8: bool = False
