"""Expert load per layer, its imbalance, and DeepSeek-V3's auxiliary-loss-free balancing.

HF's Switch-style aux loss is part of the runtime already (``output_router_logits`` in the model config).
DeepSeek-V3 (arXiv 2412.19437, section 2.1.2) balances without a loss term: a bias b_e is added to each
expert's affinity for the top-k choice only, and after every step ``b_e += rate * sign(mean_load - load_e)``
(overloaded experts become less attractive, underloaded ones more). HF ships the bias
(``e_score_correction_bias``, a router buffer) but never updates it; this module does, on the attention ranks
that hold the routers, from the step's measured load of the whole batch (all lanes). Every lane of an A-group
applies the same update to its replica, so the replicas stay identical; the buffer is saved in checkpoints.

Shape suffixes: L layers, E routed experts.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from disagmoe_ds.capabilities.rules import Job, check
from disagmoe_ds.models.attention_part import AttentionPart
from disagmoe_ds.models.families import expert_bias_of, family_of
from disagmoe_ds.models.hf_model import model_config
from disagmoe_ds.models.model_facts import num_experts_of
from disagmoe_ds.runtime.rank import RankRuntime
from disagmoe_ds.runtime.step import StepResult

DEEPSEEK_V3_RATE = 1e-3  # gamma of DeepSeek-V3 for most of its training


def bias_update_rate(requested: float | None, config) -> float:
    """The rate to use: DeepSeek-V3's where the router has the bias and none was given, else the request."""
    bias_path = family_of(config).expert_bias_path
    if requested is None:
        return DEEPSEEK_V3_RATE if bias_path else 0.0
    check(Job.of(config.model_type, bias_update_rate=requested))  # a rate needs a router correction bias
    return requested


def expert_load(runtime: RankRuntime, result: StepResult) -> torch.Tensor:
    """[L, E] tokens routed to each expert in the step of ``result``, summed over every lane. Collective (all
    ranks)."""
    counts_LE = result.expert_counts_LE
    if counts_LE is None:  # the FFN side routes nothing (so does a module that reports no load); it adds zeros
        config = model_config(runtime.module)  # [L, E] of the model: a co-located layout has no L
        shape = (config.num_hidden_layers, num_experts_of(config))
        counts_LE = torch.zeros(shape, dtype=torch.int64, device=runtime.engine.device)
    dist.all_reduce(counts_LE)
    return counts_LE.cpu()  # host-device sync: the counts feed the bias update and the log


def imbalance(load_LE: torch.Tensor) -> list[float | None]:
    """Per layer, the busiest expert's load over the mean load (1.0 is perfect balance); None for dense layers."""
    out: list[float | None] = []
    for load_E in load_LE.double():
        mean = load_E.mean().item()
        out.append(load_E.max().item() / mean if mean > 0 else None)
    return out


def bias_step(load_E: torch.Tensor, rate: float) -> torch.Tensor:
    """DeepSeek-V3's update of one layer's bias: ``rate * sign(mean_load - load_e)``.

    >>> bias_step(torch.tensor([6, 2, 2, 2]), 0.5).tolist()
    [-0.5, 0.5, 0.5, 0.5]
    """
    load_E = load_E.double()
    return rate * torch.sign(load_E.mean() - load_E)


def update_expert_bias(runtime: RankRuntime, load_LE: torch.Tensor, rate: float) -> None:
    """Apply ``bias_step`` to the router bias of every MoE layer this attention rank holds (the attention parts
    anywhere in its module: an attention stage, or a co-located rank's whole model)."""
    if rate == 0 or not runtime.role.is_attention:
        return
    family = family_of(runtime.module.config)
    for part in runtime.module.modules():
        if isinstance(part, AttentionPart) and part.is_moe:
            bias_E = expert_bias_of(family, part.mlp)  # [E], or [1, E] (ERNIE)
            if bias_E is None:  # a hash-routed layer (DeepSeek-V4): its table chooses
                continue
            with torch.no_grad():
                bias_E.add_(bias_step(load_LE[part.layer_idx], rate).to(device=bias_E.device, dtype=bias_E.dtype))
