"""A rank's parts replayed as CUDA graphs: its attention parts, its head and its expert shards, each a
``graphed_part.GraphedPart`` called as the part is, captured before the first step.

Why: at the micro-batch sizes AF-Pipe runs (1 x 4,096 tokens), a compiled attention part takes its host longer to
launch than its GPU takes to run it (on an H200, 2.06 ms of host time for 0.81 ms of GPU time in the forward), so
the GPU waits for the host. A replayed graph launches the same kernels with one call. How, and what a pipeline needs
on top (slots, variants, copies out): ``graphed_part``.

Shape suffixes: B micro-batch size, S sequence, T = B*S tokens, H hidden, K top-k, E experts, R rows.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from disagmoe_ds.models.attention_part import AttentionOutput, AttentionPart, Head
from disagmoe_ds.models.context import LayerContext
from disagmoe_ds.models.expert_shard import ExpertShard
from disagmoe_ds.models.graphed_part import GraphedPart
from disagmoe_ds.models.parts import AttentionStage, ExpertStage


class GraphedAttention:
    """An ``AttentionPart`` called as the part is (``(h_BSH, ctx, config)``), as graphs: the context's position
    ids, rotary embeddings and masks are inputs."""

    def __init__(self, part: AttentionPart, config, *, slots: int) -> None:
        self.part, self.config = part, config
        self.graphs = GraphedPart(part, self._run, slots=slots, name=f"attention part of layer {part.layer_idx}")

    def _run(self, h_BSH, position_ids, position_embeddings, masks) -> tuple:
        out = self.part(h_BSH, LayerContext(position_ids, position_embeddings, masks), self.config)
        return out.residual_BSH, out.x_TH, out.topk_w_TK, out.topk_idx_TK, out.router_logits_TE

    @staticmethod
    def _args(h_BSH: torch.Tensor, ctx: LayerContext) -> tuple:
        return h_BSH, ctx.position_ids, ctx.position_embeddings, ctx.masks

    def capture(self, h_BSH: torch.Tensor, ctx: LayerContext) -> None:
        self.graphs.capture(*self._args(h_BSH, ctx))

    def __call__(self, h_BSH: torch.Tensor, ctx: LayerContext, config=None) -> AttentionOutput:
        del config  # the part's own, captured
        return AttentionOutput(*self.graphs(*self._args(h_BSH, ctx)))


class GraphedHead:
    """The ``Head`` as graphs: ``(h_BSH, labels_BS) -> (None, loss)`` (the logits stay inside the graph)."""

    def __init__(self, head: Head, *, slots: int) -> None:
        self.head = head
        self.graphs = GraphedPart(head, lambda h_BSH, labels_BS: head(h_BSH, labels_BS)[1], slots=slots, name="head")

    def capture(self, h_BSH: torch.Tensor, labels_BS: torch.Tensor) -> None:
        self.graphs.capture(h_BSH, labels_BS)

    def __call__(self, h_BSH: torch.Tensor, labels_BS: torch.Tensor) -> tuple[None, torch.Tensor]:
        return None, self.graphs(h_BSH, labels_BS)


class GraphedShard:
    """An ``ExpertShard`` as graphs, one capture per (rows, pairs, bounded): called as the shard is. Bounded (a
    capacity's messages, padded to fixed rows with a bound on the pairs) runs on the device only, so it captures."""

    def __init__(self, shard: ExpertShard, *, slots: int, name: str) -> None:
        self.shard, self.num_local = shard, shard.num_local
        self.graphs = GraphedPart(shard, shard, slots=slots, name=name)

    def capture(self, x_RH, local_idx_RK, w_RK, num_pairs: int, bounded: bool = False) -> None:
        self.graphs.capture(x_RH, local_idx_RK, w_RK, num_pairs, bounded)

    def __call__(
        self,
        x_RH: torch.Tensor,
        local_idx_RK: torch.Tensor,
        w_RK: torch.Tensor,
        num_pairs: int | None = None,
        bounded: bool = False,
    ) -> torch.Tensor:
        return self.graphs(x_RH, local_idx_RK, w_RK, num_pairs, bounded)


@dataclass
class StageGraphs:
    """The graphed parts of one rank, by layer; a part that is not here runs as it is (``part`` / ``shard``)."""

    attention: dict[int, GraphedAttention] = field(default_factory=dict)
    shards: dict[int, GraphedShard] = field(default_factory=dict)
    head: GraphedHead | None = None

    def part(self, stage: AttentionStage, layer: int):
        return self.attention.get(layer) or stage.part(layer)

    def shard(self, stage: ExpertStage, layer: int) -> ExpertShard | GraphedShard:
        return self.shards.get(layer) or stage.shard(layer)

    def head_of(self, stage: AttentionStage) -> Head | GraphedHead:
        head = self.head or stage.head
        assert head is not None, "only the last A-group's lanes, which hold the head, ask for it"
        return head

    @property
    def misses(self) -> int:
        """Calls so far that ran ungraphed: an input structure no capture has (expert rows that vary, say)."""
        graphed: list[GraphedAttention | GraphedShard | GraphedHead] = [*self.attention.values(), *self.shards.values()]
        graphed += [self.head] if self.head else []
        return sum(g.graphs.misses for g in graphed)

    def capture_attention(
        self, stage: AttentionStage, *, batch: int, seq_len: int, positions: Sequence[torch.Tensor | None]
    ) -> None:
        """Capture every attention part for each context ``positions`` give (None: the default positions, no
        mask), and the head; on synthetic inputs, which only give the shapes."""
        device, dtype = _where(stage)
        h_BSH = torch.randn(batch, seq_len, stage.config.hidden_size, device=device, dtype=dtype, requires_grad=True)
        for position_ids in positions:
            ctx = stage.context(h_BSH, position_ids)
            for graphed in self.attention.values():
                graphed.capture(h_BSH, ctx)
        if self.head is not None:
            labels_BS = torch.randint(0, stage.config.vocab_size, (batch, seq_len), device=device)
            self.head.capture(h_BSH, labels_BS)

    def capture_shards(
        self, stage: ExpertStage, *, rows: int, top_k: int, weight_dtype: torch.dtype, pair_bound: int | None = None
    ) -> None:
        """Capture every expert shard at ``rows`` rows, in place of what it held: with ``pair_bound``, for messages
        padded to a capacity (at most that many pairs); without, for rows whose K ids are all local (one ep rank,
        no capacity factor: every message)."""
        device, dtype = _where(stage)
        x_RH = torch.randn(rows, stage.config.hidden_size, device=device, dtype=dtype, requires_grad=True)
        w_RK = torch.rand(rows, top_k, device=device, dtype=weight_dtype, requires_grad=True)
        idx_RK = torch.randint(0, stage.num_local, (rows, top_k), device=device)
        pairs, bounded = (rows * top_k, False) if pair_bound is None else (pair_bound, True)
        for graphed in self.shards.values():
            graphed.graphs.forget()
            graphed.capture(x_RH, idx_RK, w_RK, pairs, bounded)


def warm_up_positions(batch: int, seq_len: int, packed: bool, device: torch.device) -> list[torch.Tensor | None]:
    """The position ids whose contexts a rank's steps can see: the default (None: no mask), and with packed data
    (position ids in the batch) positions that never restart (no mask either, other shapes) and that restart (a
    block-diagonal mask)."""
    if not packed:
        return [None]
    counting = torch.arange(seq_len, device=device).expand(batch, -1)
    return [None, counting, counting.remainder(max(seq_len // 2, 1))]


def _where(stage: nn.Module) -> tuple[torch.device, torch.dtype]:
    param = next(stage.parameters())
    return param.device, param.dtype


def graph_stages(
    slots: Callable[[int], int], *, attention: AttentionStage | None = None, experts: ExpertStage | None = None
) -> StageGraphs:
    """Graphs of every attention part and the head (layer ``num_hidden_layers``) of ``attention``, and of every
    expert shard of ``experts`` that runs on the device alone (``ExpertShard.capturable``); ``slots(layer)``: how
    many copies each keeps."""
    graphs = StageGraphs()
    if attention is not None:
        graphs.attention = {
            int(i): GraphedAttention(attention.part(int(i)), attention.config, slots=slots(int(i)))
            for i in attention.layers
        }
        if attention.head is not None:
            graphs.head = GraphedHead(attention.head, slots=slots(attention.config.num_hidden_layers))
    if experts is not None and len(experts.layers):
        device, dtype = _where(experts)
        shards = {int(i): experts.shard(int(i)) for i in experts.layers}
        graphs.shards = {
            i: GraphedShard(shard, slots=slots(i), name=f"expert shard of layer {i}")
            for i, shard in shards.items()
            if shard.capturable(dtype, device)  # the others run as they are
        }
    return graphs
