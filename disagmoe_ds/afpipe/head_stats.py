"""The head lanes' loss sums of a step (``afpipe.attention_runner``)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class HeadStats:
    """Per-step loss sums on the head lanes, kept on the device: reading a loss per micro-batch would block the
    host until that micro-batch's head forward is done."""

    sums: torch.Tensor | None = None  # float64 [loss, lm_loss, aux_loss]
    micro_batches: int = 0
    token_sums: torch.Tensor | None = None  # float64 [LM loss summed over labelled tokens, their count] (evaluation)

    def add(self, loss: torch.Tensor, lm_loss: torch.Tensor, aux_loss: torch.Tensor, token_sums: torch.Tensor) -> None:
        self._add(torch.stack([loss.detach(), lm_loss.detach(), aux_loss.detach()]))
        self.micro_batches += 1
        self.token_sums = token_sums if self.token_sums is None else self.token_sums + token_sums

    def add_layer_aux(self, coef: float, aux_loss: torch.Tensor) -> None:
        """One MoE layer's own aux loss of one micro-batch (per-layer balancing), on the rank that runs the layer."""
        aux = aux_loss.detach()
        self._add(torch.stack([coef * aux, torch.zeros_like(aux), aux]))

    def _add(self, terms: torch.Tensor) -> None:
        terms = terms.double()
        self.sums = terms if self.sums is None else self.sums + terms
