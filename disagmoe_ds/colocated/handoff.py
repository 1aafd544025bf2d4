"""What one pipeline stage hands the next for a micro-batch, and what comes back: the typed messages of the
co-located pipeline (``colocated.pipeline``).

Forward, stage s to s + 1: the residual after stage s's last layer and the router statistics of every MoE layer so
far (``RouterSums``), which the head needs for HF's aux loss over all layers' rows pooled. Backward, s + 1 to s: the
residual's gradient and the aux loss's gradients with respect to those sums (``AuxGrads``): a stage's own layers'
probability sums and per-layer terms reach the loss only through the sums, so ``coef * E * counts / rows**2 / n``
(pooled) and ``coef / layers / n`` (per-layer balancing) are all a stage needs to backpropagate its share, as the
AF-Pipe head lane does for its attention groups (``afpipe.head_lane``).

Both messages have fixed shapes, known to the receiver from its own micro-batch: no headers.

Shape suffixes: B micro-batch size, S sequence, H hidden, E routed experts.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from disagmoe_ds.models.aux_loss import RouterStats, switch_loss


@dataclass(frozen=True)
class RouterSums:
    """The router statistics of the MoE layers up to a stage, summed over them (one micro-batch).

    Attributes:
        counts_E: top-k choices per expert (no gradient).
        probs_E: router probabilities per expert; differentiable in the stage that added its layers' to them.
        layer_losses: per-layer balancing: the sum of each layer's own Switch loss (differentiable likewise).
        rows: tokens times the layers counted.
        layers: the MoE layers with a learned choice counted.
    """

    counts_E: torch.Tensor
    probs_E: torch.Tensor
    layer_losses: torch.Tensor
    rows: int
    layers: int

    @classmethod
    def zeros(cls, num_experts: int, device: torch.device) -> RouterSums:
        zeros_E = torch.zeros(num_experts, dtype=torch.float32, device=device)
        return cls(zeros_E, zeros_E, zeros_E.new_zeros(()), 0, 0)

    def plus(self, stats: list[RouterStats]) -> RouterSums:
        """These sums with ``stats`` (a stage's own layers') added."""
        if not stats:
            return self
        return RouterSums(
            self.counts_E + torch.stack([s.counts_E for s in stats]).sum(0),
            self.probs_E + torch.stack([s.prob_sum_E for s in stats]).sum(0),
            self.layer_losses + torch.stack([switch_loss(s) for s in stats]).sum(),
            self.rows + sum(s.rows for s in stats),
            self.layers + len(stats),
        )

    def aux_loss(self, *, per_layer: bool) -> torch.Tensor:
        """HF's aux loss of every layer counted (``models.aux_loss.aux_loss_from_stats`` of them all)."""
        if per_layer:
            return self.layer_losses / self.layers
        return switch_loss(RouterStats(self.counts_E, self.probs_E, self.rows))

    def grads(self, coef: float, *, per_layer: bool, micro_batches: int) -> AuxGrads:
        """The gradients of ``coef * aux_loss / micro_batches`` with respect to ``probs_E`` and ``layer_losses``."""
        E = self.counts_E.numel()
        if per_layer:
            return AuxGrads(torch.zeros_like(self.counts_E), coef / self.layers / micro_batches)
        return AuxGrads(coef * E * self.counts_E / self.rows**2 / micro_batches, 0.0)

    def to_wire(self) -> torch.Tensor:
        """float32 [2E + 1]: counts, probabilities, the per-layer sum (rows and layers the receiver knows)."""
        return torch.cat([self.counts_E, self.probs_E.detach(), self.layer_losses.detach().reshape(1)])

    @classmethod
    def from_wire(cls, wire: torch.Tensor, *, tokens: int, layers: int) -> RouterSums:
        """The sums of ``layers`` MoE layers of a micro-batch of ``tokens`` tokens, from ``to_wire``'s tensor."""
        E = (wire.numel() - 1) // 2
        return cls(wire[:E], wire[E : 2 * E], wire[2 * E], tokens * layers, layers)


@dataclass(frozen=True)
class AuxGrads:
    """d loss / d ``RouterSums.probs_E`` and d loss / d ``RouterSums.layer_losses`` (the micro-batch's share)."""

    probs_E: torch.Tensor
    layer_losses: float

    def surrogate(self, sums: RouterSums) -> torch.Tensor:
        """A scalar whose gradient is the aux loss's through ``sums`` (their differentiable parts)."""
        return (sums.probs_E * self.probs_E).sum() + sums.layer_losses.float() * self.layer_losses

    def to_wire(self) -> torch.Tensor:
        """float32 [E + 1]."""
        return torch.cat([self.probs_E, self.probs_E.new_tensor([self.layer_losses])])

    @classmethod
    def from_wire(cls, wire: torch.Tensor) -> AuxGrads:
        return cls(wire[:-1], float(wire[-1]))


@dataclass(frozen=True)
class StageOutput:
    """A stage's forward of one micro-batch below the head: its last layer's residual and the router sums so far."""

    h_BSH: torch.Tensor
    sums: RouterSums
    load_LE: torch.Tensor
