"""The head lane: what the last A-group's lanes run at layer L, the head, HF's causal-LM loss and (pooled) the
router aux loss over every MoE layer of the micro-batch, added to the step's loss sums (``head_stats``).

The pooled aux loss's value comes from the expert counts and probability sums the forward carried to the head; its
gradient with respect to each layer's probability sums, ``coef * E * counts / rows**2 / n``, is what the chunk keeps
(``aux_grad_E``) to send back with the residual gradient. The head backpropagates ``loss / n`` (n micro-batches).
With sequence parallelism a lane computes its slice's share, counted s times (the aux gradient too).

Shape suffixes: B micro-batch size, S sequence, H hidden, E experts.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from disagmoe_ds.afpipe.attention_chunk import AttentionChunk
from disagmoe_ds.afpipe.chunk_io import grad_of_inputs
from disagmoe_ds.afpipe.head_stats import HeadStats
from disagmoe_ds.data.packing import IGNORE_INDEX, labelled_tokens
from disagmoe_ds.models.aux_loss import RouterStats, switch_loss
from disagmoe_ds.models.graphs import StageGraphs
from disagmoe_ds.models.parts import AttentionStage
from disagmoe_ds.models.sequence_parallel import SequenceParallel
from disagmoe_ds.runtime.step import evaluating, summed_lm_loss


@dataclass(frozen=True)
class AuxLoss:
    """The router aux loss of the attention side: its ``coef`` (None: the family or config has none), whether each
    MoE layer's term is its own (``per_layer``) or every layer's rows are pooled at the head, the MoE ``layers``
    with a learned choice (whose terms are averaged) and the routed experts."""

    coef: float | None
    per_layer: bool
    layers: int
    num_experts: int


class HeadLane:
    """The head and the loss at layer L of one attention lane (a part of ``AttentionRunner``).

    Args:
        stage: the lane's attention stage; its ``head`` where this lane ends the model.
        graphs: the parts replayed as CUDA graphs (the head's too).
        sp: the lanes sharing the micro-batch in slices (None: this lane holds it whole).
    """

    def __init__(
        self,
        stage: AttentionStage,
        graphs: StageGraphs,
        sp: SequenceParallel | None,
        aux: AuxLoss,
        *,
        num_micro_batches: int,
        micro_batch_size: int,
    ) -> None:
        self.stage, self.graphs, self.sp, self.aux = stage, graphs, sp, aux
        self.num_micro_batches, self.B = num_micro_batches, micro_batch_size

    @property
    def share_scale(self) -> float:
        """What this lane's share of a micro-batch's loss counts: s with sequence parallelism, whose s lanes share
        one micro-batch while DeepSpeed averages over every lane (``models.sequence_parallel``)."""
        return 1.0 if self.sp is None else float(self.sp.size)

    def loss(
        self,
        batch: dict[str, torch.Tensor],
        h_BSH: torch.Tensor,
        counts_E: torch.Tensor,
        probs_E: torch.Tensor,
        chunk: AttentionChunk,
        stats: HeadStats,
    ) -> None:
        """The micro-batch's loss from the last layer's output ``h_BSH``: added to ``stats``, kept in ``chunk`` (scaled
        for the backward, with the pooled aux term's gradient)."""
        scale = self.share_scale
        if self.sp is None:
            _, lm_loss = self.graphs.head_of(self.stage)(h_BSH, batch["labels"])
            token_sums = summed_lm_loss(lm_loss, labelled_tokens(batch["labels"]))
        else:  # this slice's share of the micro-batch's loss (no graphs with sequence parallelism)
            assert self.stage.head is not None
            _, lm_loss = self.stage.head(h_BSH, None, batch["shift_labels"], batch["num_items"])
            own = (batch["shift_labels"] != IGNORE_INDEX).sum()
            token_sums = summed_lm_loss(lm_loss, batch["num_items"], own)  # the slice's sum, its tokens
            lm_loss = lm_loss * scale
        loss, aux = lm_loss, torch.zeros_like(lm_loss)
        chunk.aux_grad_E = torch.zeros_like(counts_E)
        coef = self.aux.coef
        if coef is not None and not self.aux.per_layer:  # per layer: each layer's term is its own
            router = RouterStats(counts_E, probs_E, h_BSH.shape[0] * h_BSH.shape[1] * self.aux.layers)
            router = router if self.sp is None else self.sp.share_of(router)
            aux = switch_loss(router) * scale  # every MoE layer's rows pooled, as HF does
            n = self.num_micro_batches
            chunk.aux_grad_E = scale * coef * self.aux.num_experts * router.counts_E / router.rows**2 / n
            loss = loss + coef * aux
        stats.add(loss, lm_loss, aux, token_sums)
        chunk.scaled_loss = loss / self.num_micro_batches

    def warm_up(self, seq_len: int, device: torch.device, dtype: torch.dtype, *, evaluates: bool) -> None:
        """Where this lane holds the head: its forward and backward once, as the step calls it, and with
        ``evaluates`` its forward as an evaluation does (``AttentionRunner.warm_up``)."""
        if self.stage.head is not None:
            S = seq_len // (1 if self.sp is None else self.sp.size)
            h_BSH = torch.randn(self.B, S, *self.stage.residual_dims, device=device, dtype=dtype)
            h_BSH.requires_grad_()
            labels_BS = torch.randint(0, self.stage.config.vocab_size, (self.B, S), device=device)
            grad_of_inputs([self._head_loss(h_BSH, labels_BS)], [h_BSH])
            if evaluates:
                with evaluating(self.stage):
                    self._head_loss(h_BSH, labels_BS)

    def _head_loss(self, h_BSH: torch.Tensor, labels_BS: torch.Tensor) -> torch.Tensor:
        """The head's loss as the step calls it (with slices: a slice's share)."""
        assert self.stage.head is not None
        loss: torch.Tensor  # (a module's call is untyped in torch)
        if self.sp is None:
            _, loss = self.stage.head(h_BSH, labels_BS)
        else:
            _, loss = self.stage.head(h_BSH, None, labels_BS, labels_BS.new_tensor(labels_BS.numel()))
        return loss
