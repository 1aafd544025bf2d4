"""HF's router aux loss, decomposed so that layers on different ranks can contribute: each MoE layer's counts and
probability sums (``RouterStats``), pooled or per layer (``balance_per_layer``).

Shape suffixes: T tokens, E experts, K top-k.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from disagmoe_ds.comm.routing import count_ids


@dataclass
class RouterStats:
    """One MoE layer's share of HF's Switch-style ``load_balancing_loss_func``.

    HF computes, over the router logits of all MoE layers concatenated (R rows in total):
    ``aux = E * sum_e (counts_e / R) * (probs_e / R)`` where counts are top-k assignments of the re-computed
    softmax (no gradient) and probs the summed softmax probabilities. Both sums split over layers, so each
    layer contributes its own ``counts_E`` and ``prob_sum_E`` and the head combines them.
    """

    counts_E: torch.Tensor
    prob_sum_E: torch.Tensor  # differentiable
    rows: int


def router_stats(logits_TE: torch.Tensor, top_k: int) -> RouterStats:
    probs_TE = torch.softmax(logits_TE, dim=-1)
    _, selected_TK = torch.topk(probs_TE, top_k, dim=-1)
    counts_E = count_ids(selected_TK, logits_TE.shape[-1]).float()
    return RouterStats(counts_E, probs_TE.float().sum(dim=0), logits_TE.shape[0])


def aux_loss_from_stats(stats: list[RouterStats], *, per_layer: bool = False) -> torch.Tensor:
    """HF's loss over the layers' rows pooled; ``per_layer``: the mean of each layer's own (``balance_per_layer``)."""
    if per_layer:
        return torch.stack([switch_loss(s) for s in stats]).mean()
    counts_E = torch.stack([s.counts_E for s in stats]).sum(0)
    prob_sum_E = torch.stack([s.prob_sum_E for s in stats]).sum(0)
    return switch_loss(RouterStats(counts_E, prob_sum_E, sum(s.rows for s in stats)))


def switch_loss(stats: RouterStats) -> torch.Tensor:
    """The Switch loss of ``stats``' rows, ``E * sum_e (counts_e / R) * (probs_e / R)``: HF's
    ``load_balancing_loss_func`` given those rows alone (one layer's, or several layers' pooled)."""
    return (stats.counts_E / stats.rows * stats.prob_sum_E / stats.rows).sum() * stats.counts_E.numel()


def balance_per_layer(config) -> bool:
    """Whether the router aux loss is the mean of every MoE layer's own Switch loss (``router_aux_loss_per_layer``
    in the model's config.json, as Megatron-Core computes it) instead of HF's one loss over all layers' rows pooled.
    Pooled, layers whose loads are skewed in different directions cancel out: each can collapse onto a few experts
    while the pooled loss reads perfectly balanced."""
    return bool(getattr(config, "router_aux_loss_per_layer", False))
