"""Selective recompute of a role stage: the planner's "selective" policy as the runtime runs it.

What each side drops after a chunk's forward and rebuilds in its backward:

* attention side: every token mixer (Q/K/V, for MLA the latents and up-projected heads, the attention output
  and its log-sum-exp; a Gated DeltaNet block whole) and every shared or dense SwiGLU (gate, up and activation
  outputs). Each is checkpointed as a module with torch's non-reentrant checkpoint, keeping only its input, so its
  backward re-runs the whole module's forward: the output projection and the down GEMM too (``planner.recompute``,
  ``whole_blocks``);
* expert side: the routed experts' gate/up outputs and activation (3 x I per routed pair); the backward re-runs
  the gate/up GEMM and the activation, not the down GEMM (``grouped_experts._RecomputedMiddle``). Families whose
  experts keep HF's module (GPT-OSS; fp32 on CUDA) keep everything.

The router, norms and residual adds keep their tensors: they are small and the dispatch needs the router's output.
"""

from __future__ import annotations

import functools

from torch import nn
from torch.utils.checkpoint import checkpoint

from disagmoe_ds.models.expert_shard import ExpertShard
from disagmoe_ds.models.parts import AttentionStage


def _checkpoint_module(module: nn.Module) -> None:
    """Make ``module`` keep only its inputs for the backward, which re-runs its forward."""
    module.forward = functools.partial(checkpoint, module.forward, use_reentrant=False)


def _swiglus(mlp: nn.Module) -> list[nn.Module]:
    """The gated MLPs an attention part runs: the dense MLP itself, or an MoE block's shared expert(s)."""
    if hasattr(mlp, "gate_proj") and hasattr(mlp, "down_proj"):
        return [mlp]
    return [m for m in mlp.children() if hasattr(m, "gate_proj") and hasattr(m, "down_proj")]


def apply_selective_recompute(stage: nn.Module) -> None:
    """Switch selective recompute on for every part of an ``AttentionStage`` or shard of an ``ExpertStage``."""
    if isinstance(stage, AttentionStage):
        for layer in stage.layers:
            part = stage.part(int(layer))
            for module in (part.mixer, *_swiglus(part.mlp)):
                _checkpoint_module(module)
        return
    for shard in stage.modules():
        if isinstance(shard, ExpertShard):
            shard.recompute = True
