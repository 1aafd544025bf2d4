"""What the compute instructions do on the attention side: chunk forward/backward with explicit gradient
hand-off.

Every chunk boundary is cut: a chunk's inputs become fresh leaves and its backward is one autograd pass from the
gradients received for its outputs (a pseudo-loss ``sum(out * grad)``, whose gradient is exactly ``grad``). So
chunks of one micro-batch can run on different ranks, and many micro-batches can be in flight.

Gradient scaling: the head backpropagates ``loss / n`` (n micro-batches); DeepSpeed averages attention
gradients over the lanes; expert gradients are rescaled in ``deepspeed_role``.

Router aux loss (HF's Switch-style ``load_balancing_loss_func`` over all MoE layers of a micro-batch): the
forward carries the running expert counts and probability sums to the head, which computes the value; its
gradient with respect to each layer's probability sums is the vector ``coef * E * counts / rows**2 / n``, which
travels back with the residual gradient and enters each MoE layer's backward. Per layer (``balance_per_layer``),
each MoE layer's own term needs nothing from other layers: it is computed and backpropagated where the layer runs,
and its value joins the step's loss sums there.

The head and the loss at layer L are ``head_lane``'s (a part of ``AttentionRunner``); what a chunk keeps from
its forward for its backward, and the residual message's per-token fields, ``attention_chunk``'s. The FFN
side's runner is ``afpipe.expert_runner``'s; what both take and give, ``afpipe.runner``'s. The residual goes to the
next layer's chunk as an ``Outbox.resid`` at every depth: a message to the next A-group, or at p = 1 a hand-off
to this rank's own next chunk, through the mailbox all the same.

Shape suffixes: B micro-batch size, S sequence, T = B*S, H hidden, K top-k, E experts, R/S rows.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from deepspeed import DeepSpeedEngine

from disagmoe_ds.afpipe.attention_chunk import AttentionChunk, PerToken
from disagmoe_ds.afpipe.chunk_io import checkpointed, grad_of_inputs, grad_or_zeros, leaf, run
from disagmoe_ds.afpipe.chunk_settings import ChunkSettings
from disagmoe_ds.afpipe.head_lane import AuxLoss, HeadLane
from disagmoe_ds.afpipe.head_stats import HeadStats
from disagmoe_ds.afpipe.later import Later
from disagmoe_ds.afpipe.runner import Batch, Inbox, Outbox
from disagmoe_ds.afpipe.split_backward import ChunkBackward
from disagmoe_ds.comm.messages import ExpertOutGrad, Residual, ResidualGrad, Tokens
from disagmoe_ds.comm.routing import CombinePlan, DispatchPlan, combine, count_ids, start_dispatch
from disagmoe_ds.layout import Layout
from disagmoe_ds.models.aux_loss import balance_per_layer, router_stats, switch_loss
from disagmoe_ds.models.context import LayerContext
from disagmoe_ds.models.graphs import StageGraphs, warm_up_positions
from disagmoe_ds.models.hyper_connections import add_routed
from disagmoe_ds.models.model_facts import residual_shape
from disagmoe_ds.models.moe_pattern import aux_layer_pattern
from disagmoe_ds.models.parts import AttentionStage
from disagmoe_ds.models.sequence_parallel import SequenceParallel, slice_batch
from disagmoe_ds.runtime.step import evaluating


class AttentionRunner:
    """Attention side of one rank: embedding (A-group 0), attention parts of its layers, head and loss."""

    def __init__(
        self,
        engine: DeepSpeedEngine,
        stage: AttentionStage,
        layout: Layout,
        settings: ChunkSettings,
        *,
        moe_layers: tuple[bool, ...],
        num_micro_batches: int,
        micro_batch_size: int,
        aux_coef: float | None,
        sp: SequenceParallel | None = None,
    ):
        self.engine, self.stage, self.layout, self.resend = engine, stage, layout, settings.resend
        self.sp = sp  # sequence parallelism: this lane holds a slice of every micro-batch (None: the whole)
        self.capacity = settings.capacity  # m2n messages padded to it (None: exact sizes, sent with headers)
        self.fp8 = settings.fp8  # the m2n rows travel in FP8
        self.need_2: torch.Tensor | None = None  # the most rows and pairs one m2n message wanted this step
        self.graphs = settings.graphs or StageGraphs()  # the parts replayed as CUDA graphs (none: as they are)
        self.weight_dtype = settings.weight_dtype  # the router weights' (resend at p > 1 sends them with the residual)
        self.backward_pass = ChunkBackward(
            engine, settings.split_layers
        )  # split backward: B here, W in ``weight_grad``
        self.recompute = checkpointed if settings.activation_checkpointing else run
        self.config = stage.config
        self.moe_layers = moe_layers
        self.num_layers = len(moe_layers)
        self.top_k = settings.top_k
        self.num_micro_batches = num_micro_batches
        self.B = micro_batch_size
        self.aux = AuxLoss(  # the aux term's coefficient (None: the family/config has none) and how it is split
            aux_coef,
            per_layer=balance_per_layer(stage.config),
            layers=sum(aux_layer_pattern(stage.config.to_dict())),  # MoE layers with a learned choice
            num_experts=layout.num_experts,
        )
        self.head = HeadLane(
            stage, self.graphs, sp, self.aux, num_micro_batches=num_micro_batches, micro_batch_size=micro_batch_size
        )
        self.routed_weights = residual_shape(stage.config)[1]  # per token: hc with hyper-connections, else 0
        self.num_experts = layout.num_experts
        self.chunks: dict[tuple[int, int], AttentionChunk] = {}
        self.stats = HeadStats()
        self.layer_counts: dict[int, torch.Tensor] = {}  # layer -> [E] (token, expert) pairs routed this step
        self.contexts: dict[int, LayerContext] = {}  # micro-batch -> its mask and rotary embeddings, this step

    def start_step(self, batches: Sequence[Batch] | None) -> Sequence[Batch] | None:
        """Forget the last step; this lane's micro-batches (with sequence parallelism: its slices of them)."""
        if batches is not None and self.sp is not None:  # the SP group's micro-batches: this lane's slices
            batches = [slice_batch(batch, self.sp) for batch in batches]
        self.stats, self.layer_counts, self.contexts = HeadStats(), {}, {}
        self.need_2 = None
        return batches

    def capacity_need(self) -> torch.Tensor:
        """int64 [2]: the most rows and routed pairs one of this step's m2n messages wanted (zeros: none sent)."""
        if self.need_2 is None:
            return torch.zeros(2, dtype=torch.int64, device=self.engine.device)
        return self.need_2

    def expert_counts(self) -> torch.Tensor:
        """[L, E] int64: tokens this lane routed to each expert in the step so far, per layer (top-k choices).

        Rows of layers this A-group does not own, and of dense layers, are zero; summing the result over all
        ranks (FFN ranks contribute zeros) gives the whole batch's load of every layer.
        """
        counts_LE = torch.zeros(self.num_layers, self.num_experts, dtype=torch.int64, device=self.engine.device)
        for layer, counts_E in self.layer_counts.items():
            counts_LE[layer] = counts_E
        return counts_LE

    def warm_up(self, seq_len: int, *, packed: bool = False, evaluates: bool = False) -> None:
        """Compile and load every compiled kernel of the attention parts and the head (forward and backward) now.

        Loading a kernel can synchronise the whole GPU; inside a step it would wait for receives posted ahead,
        whose senders may wait for this rank. So compiled jobs run this once, before any exchange. ``packed``: the
        batches carry position ids that may restart (packed documents), whose block mask is a graph of its own;
        ``evaluates``: the forwards of an evaluation (no autograd, eval mode) are graphs of their own too.
        """
        device, dtype = self.engine.device, next(self.stage.parameters()).dtype
        if self.graphs.attention:  # capturing runs (so compiles) every part and the head first
            self.graphs.capture_attention(
                self.stage, batch=self.B, seq_len=seq_len, positions=warm_up_positions(self.B, seq_len, packed, device)
            )
            return
        restarting = torch.arange(seq_len, device=device).remainder(max(seq_len // 2, 1)).expand(self.B, -1)
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            for positions_BS in (None, restarting) if packed else (None,):
                for layer in self.stage.layers:
                    h_BSH = torch.randn(self.B, seq_len, *self.stage.residual_dims, device=device, dtype=dtype)
                    if self.sp is not None:  # the lane's slice, its Ulysses all-to-alls with the others' warm-up
                        h_BSH = self.sp.slice_of(h_BSH)
                    h_BSH.requires_grad_()
                    ctx = self._warm_up_context(h_BSH, positions_BS)
                    part = self.stage.part(int(layer))
                    out = self.recompute(part, h_BSH, ctx, self.config)  # as the step runs
                    outputs = [out.residual_BSH, out.x_TH, out.topk_w_TK, out.router_logits_TE, out.routed_w_BSC]
                    grad_of_inputs(outputs, [h_BSH])
                    if evaluates:
                        with evaluating(self.stage):
                            self.recompute(part, h_BSH, ctx, self.config)
            self.head.warm_up(seq_len, device, dtype, evaluates=evaluates)

    def _warm_up_context(self, h_BSH: torch.Tensor, positions_BS: torch.Tensor | None) -> LayerContext:
        """A context as the step builds it (None: the default positions, no mask)."""
        if self.sp is None:
            ids_BS = torch.zeros(h_BSH.shape[:2], dtype=torch.long, device=h_BSH.device)  # for token-routed layers
            return self.stage.context(h_BSH, positions_BS, ids_BS)
        B, S_l, _ = h_BSH.shape
        whole_BS = (
            torch.arange(S_l * self.sp.size, device=h_BSH.device).expand(B, -1)
            if positions_BS is None
            else positions_BS
        )
        return self.sp.context(self.stage, h_BSH, self.sp.slice_of(whole_BS), positions_BS)

    # ----- forward -----
    def forward(self, layer: int, mb: int, inbox: Inbox) -> Outbox:
        """A_fwd(layer, mb): the embedding (layer 0: ``inbox.batch``) or the combine of ``inbox.resid`` and
        ``inbox.n2m``, then the layer's attention part (the m2n tokens and the residual for the next layer in the
        outbox) or, at layer L, the head and the loss."""
        chunk = AttentionChunk()
        if layer == 0:
            h_BSH, position_ids_BS, token_ids_BS, counts_E, probs_E = self._embed(_batch(inbox))
        else:
            h_BSH, position_ids_BS, token_ids_BS, counts_E, probs_E = self._combine(inbox, chunk)
        if layer == self.num_layers:
            self.head.loss(_batch(inbox), h_BSH, counts_E, probs_E, chunk, self.stats)
            self.chunks[(layer, mb)] = chunk
            return Outbox()
        part = self.graphs.part(self.stage, layer)
        ctx = self._context(mb, inbox.batch, h_BSH, position_ids_BS, token_ids_BS)
        out = self.recompute(part, h_BSH, ctx, self.config)
        chunk.residual_out, chunk.routed_w_out = out.residual_BSH, out.routed_w_BSC
        outbox = Outbox()
        T = h_BSH.shape[0] * h_BSH.shape[1]
        if out.x_TH is not None:
            topk_idx_TK = out.topk_idx_TK.long()
            load_E = count_ids(topk_idx_TK, self.num_experts)
            before = self.layer_counts.get(layer)
            self.layer_counts[layer] = load_E if before is None else before + load_E
            if self.aux.coef is not None and out.router_logits_TE is not None:  # a learned choice: an aux term
                stats = router_stats(out.router_logits_TE, self.top_k)
                if self.aux.per_layer:
                    share = switch_loss(stats if self.sp is None else self.sp.share_of(stats))
                    chunk.layer_aux = share * self.head.share_scale / self.aux.layers
                    self.stats.add_layer_aux(self.aux.coef, chunk.layer_aux)
                else:
                    chunk.prob_sum_E = stats.prob_sum_E
                    counts_E, probs_E = counts_E + stats.counts_E, probs_E + stats.prob_sum_E.detach()
            # No host sync: the sizes reach the host while it goes on, and the mailbox sends once they have.
            layout = self.layout
            chunk.dispatch = start_dispatch(
                out.x_TH, out.topk_w_TK, topk_idx_TK, layout.exchange_peers, layout.experts_per_peer, self.capacity
            )
            need_2 = chunk.dispatch.need_2
            if need_2 is not None:
                self.need_2 = need_2 if self.need_2 is None else torch.maximum(self.need_2, need_2)
            outbox.m2n = Later(chunk.dispatch, lambda: chunk.messages(fp8=self.fp8))
        # A_next combines from what combine needs of the plan (with p > 1 its rows per ep rank ride in the header).
        per_token = PerToken(
            out.residual_BSH.detach().reshape(T, -1),
            position_ids_BS.reshape(T),
            self._routed_w_TC(out.routed_w_BSC, T, out.residual_BSH),
            token_ids_BS.reshape(T, -1) if token_ids_BS is not None else position_ids_BS.new_empty(T, 0),
        )
        dispatch = chunk.dispatch
        outbox.resid = Later(
            dispatch,
            lambda: self._resid_message(
                per_token, dispatch.resolved[0] if dispatch else None, counts_E, probs_E, chunk
            ),
        )
        self.chunks[(layer, mb)] = chunk
        return outbox

    def _routed_w_TC(self, routed_w_BSC: torch.Tensor | None, T: int, like: torch.Tensor) -> torch.Tensor:
        """The routed sum's weights for the hand-off, [T, C]: [T, 0] without hyper-connections, zeros after a dense
        layer (nothing routed to weigh)."""
        if routed_w_BSC is not None:
            return routed_w_BSC.detach().reshape(T, -1)
        return like.new_zeros(T, self.routed_weights)

    def _context(
        self,
        mb: int,
        batch: Batch | None,
        h_BSH: torch.Tensor,
        position_ids_BS: torch.Tensor,
        token_ids_BS: torch.Tensor | None,
    ) -> LayerContext:
        """The micro-batch's mask and rotary embeddings, built once per rank and step: building them from given
        positions syncs the host with the device (HF looks for packed documents), so a lane given the ``batch``
        builds them from its own positions (None: the default ones, no sync) and every layer reuses them."""
        ctx = self.contexts.get(mb)
        if ctx is None and self.sp is not None:  # the masks are the whole sequence's: its positions, or the default
            whole = batch.get("full_position_ids") if batch is not None else self.sp.gather_sequence(position_ids_BS)
            ctx = self.contexts[mb] = self.sp.context(self.stage, h_BSH, position_ids_BS, whole)
        elif ctx is None:
            given = batch.get("position_ids") if batch is not None else position_ids_BS
            ctx = self.contexts[mb] = self.stage.context(h_BSH, given, token_ids_BS)
        return ctx

    def _resid_message(
        self,
        tokens: PerToken,
        plan: DispatchPlan | None,
        counts_E: torch.Tensor,
        probs_E: torch.Tensor,
        chunk: AttentionChunk,
    ) -> Residual:
        if plan is None:  # dense layer: nothing to combine (-1 tells A_next's mailbox no n2m follows)
            token_idx_S, rows_P = tokens.position_ids_T.new_empty(0), (-1,) * self.layout.exchange_peers
        else:
            token_idx_S, rows_P = plan.token_idx_S, plan.counts
        routed = None
        if self.resend and self.layout.depth > 1:  # A_next sends n2m_grad: it needs the tokens again
            routed = self._routed_rows(tokens.residual_TW, chunk.messages(fp8=self.fp8))
        return Residual(
            tokens.residual_TW,
            token_idx_S,
            tokens.position_ids_T,
            tokens.routed_w_TC,
            tokens.token_ids_TI,
            counts_E,
            probs_E,
            rows_P,
            routed,
        )

    def _routed_rows(self, residual_TW: torch.Tensor, messages: list[Tokens]) -> Tokens:
        """Every ep rank's m2n message in one (S rows), detached; empty for a dense layer."""
        if not messages:
            empty_K = residual_TW.new_empty(0, self.top_k)
            empty_H = residual_TW.new_empty(0, self.config.hidden_size)
            return Tokens.of(empty_H, empty_K.long(), empty_K.to(self.weight_dtype), 0, fp8=self.fp8)
        return Tokens.cat([m.detached() for m in messages])

    def _embed(self, batch: Batch) -> _ChunkInput:
        input_ids_BS = batch["input_ids"]
        h_BSH = self.stage.embed(input_ids_BS)
        position_ids_BS = batch.get("position_ids")
        if position_ids_BS is None:
            position_ids_BS = torch.arange(input_ids_BS.shape[1], device=h_BSH.device).expand_as(input_ids_BS)
        zeros_E = torch.zeros(self.num_experts, dtype=torch.float32, device=h_BSH.device)
        token_ids_BS = input_ids_BS if self.stage.token_routed else None
        return h_BSH, position_ids_BS, token_ids_BS, zeros_E, zeros_E

    def _combine(self, inbox: Inbox, chunk: AttentionChunk) -> _ChunkInput:
        resid = inbox.resid
        assert resid is not None, "every layer above the first receives the residual"
        rows_P = resid.rows_P if resid.is_moe else None  # None: a dense layer, no n2m follows
        if resid.routed is not None and rows_P is not None:  # resend, p > 1: kept for n2m_grad, as m2n messages were
            chunk.resent = resid.routed.split(rows_P)
        T = resid.residual_TH.shape[0]
        S = T // self.B
        chunk.resid_leaf = leaf(resid.residual_TH.view(self.B, S, *self.stage.residual_dims))
        h_BSH = chunk.resid_leaf
        if rows_P is not None:
            assert inbox.n2m is not None, "after a MoE layer its expert outputs come with the residual"
            chunk.y_leaves = [leaf(out.y_RH) for out in inbox.n2m]
            plan = CombinePlan(T, tuple(rows_P), resid.token_idx_S)
            if self.routed_weights:  # hyper-connections: the routed sum weighed per stream
                chunk.routed_w_leaf = leaf(resid.routed_w_TC.view(self.B, S, -1))
            h_BSH = add_routed(h_BSH, chunk.routed_w_leaf, combine(chunk.y_leaves, plan))
        token_ids_BS = resid.token_ids_TI.view(self.B, S) if self.stage.token_routed else None
        return h_BSH, resid.position_ids_T.view(self.B, S), token_ids_BS, resid.counts_E, resid.prob_sum_E

    # ----- backward -----
    def backward(self, layer: int, mb: int, inbox: Inbox) -> Outbox:
        """A_bwd(layer, mb): autograd through the chunk from the loss (layer L) or from ``inbox.resid_grad`` and
        ``inbox.m2n_grad``; the outbox holds the residual's gradient and the expert outputs' (``n2m_grad``)."""
        chunk = self.chunks.pop((layer, mb))
        inputs = [chunk.resid_leaf, *chunk.y_leaves, chunk.routed_w_leaf]
        if layer == self.num_layers:
            assert chunk.aux_grad_E is not None and chunk.scaled_loss is not None  # the head's forward set them
            aux_grad_E = chunk.aux_grad_E
            self.backward_pass.run((layer, mb), chunk.scaled_loss, inputs)
        else:
            grad = inbox.resid_grad
            assert grad is not None, "every layer below the head gets its residual's gradient"
            aux_grad_E = grad.aux_grad_E
            assert chunk.residual_out is not None  # every layer below the last hands a residual on
            terms = [(chunk.residual_out * grad.d_residual_TH.view_as(chunk.residual_out)).sum()]
            if chunk.routed_w_out is not None:
                terms.append((chunk.routed_w_out * grad.d_routed_w_TC.view_as(chunk.routed_w_out)).sum())
            for (x_RH, w_RK), token_grads in zip(chunk.pieces, inbox.m2n_grad or []):
                terms += [(x_RH * token_grads.dx_RH).sum(), (w_RK * token_grads.dw_RK).sum()]
            if chunk.prob_sum_E is not None:
                terms.append((chunk.prob_sum_E * aux_grad_E).sum())
            if chunk.layer_aux is not None and self.aux.coef is not None:  # the term exists only with a coefficient
                terms.append(self.aux.coef * chunk.layer_aux / self.num_micro_batches)
            self.backward_pass.run((layer, mb), torch.stack([t.float() for t in terms]).sum(), inputs)
        outbox = Outbox()
        if layer > 0:
            assert chunk.resid_leaf is not None  # every layer above the first received one
            T = chunk.resid_leaf.shape[0] * chunk.resid_leaf.shape[1]
            d_resid_TW = grad_or_zeros(chunk.resid_leaf).reshape(T, -1)
            if chunk.routed_w_leaf is not None:
                d_routed_w_TC = grad_or_zeros(chunk.routed_w_leaf).reshape(T, -1)
            else:  # no hyper-connections ([T, 0]), or a dense layer's (its weights weighed nothing)
                d_routed_w_TC = d_resid_TW.new_zeros(T, self.routed_weights)
            outbox.resid_grad = ResidualGrad(d_resid_TW, d_routed_w_TC, aux_grad_E)
            if chunk.y_leaves:
                resent: Sequence[Tokens | None] = [None] * len(chunk.y_leaves)
                if self.resend:  # the previous layer's tokens again (p = 1: its chunk is on this rank)
                    resent = chunk.resent or [m.detached() for m in self.chunks[(layer - 1, mb)].messages(fp8=self.fp8)]
                outbox.n2m_grad = [
                    ExpertOutGrad(grad_or_zeros(y), tokens) for y, tokens in zip(chunk.y_leaves, resent, strict=True)
                ]
        return outbox

    def weight_grad(self, layer: int, mb: int) -> None:
        """Split backward: the parameter gradients ``backward`` deferred for this chunk."""
        self.backward_pass.weight_grad((layer, mb))

    def drop_chunk(self, layer: int, mb: int) -> None:
        """Forget what ``forward`` kept for a backward (an evaluation runs none)."""
        del self.chunks[(layer, mb)]


_ChunkInput = tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor]
"""A chunk forward's input: h [B, S, H], positions [B, S], token ids [B, S] (None: no layer routes by them), and
the router statistics so far, counts and probability sums [E]."""


def _batch(inbox: Inbox) -> Batch:
    assert inbox.batch is not None, "the lanes that embed or end the model are given the micro-batches"
    return inbox.batch
