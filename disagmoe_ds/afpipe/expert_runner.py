"""The FFN side's runner: the expert shard of every MoE layer an F-group owns, chunk forward and backward (see
``afpipe.attention_runner`` for the chunk protocol both sides follow).

Shape suffixes: R/S rows, H hidden, K top-k.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass

import torch
from deepspeed import DeepSpeedEngine

from disagmoe_ds.afpipe.chunk_io import checkpointed, grad_of_inputs, grad_or_zeros, leaf, run
from disagmoe_ds.afpipe.chunk_settings import ChunkSettings
from disagmoe_ds.afpipe.head_stats import HeadStats
from disagmoe_ds.afpipe.node_fanout import NodeFanOut, ShardCall
from disagmoe_ds.afpipe.runner import Batch, Inbox, Outbox
from disagmoe_ds.afpipe.split_backward import ChunkBackward, retained_graph_compiles
from disagmoe_ds.comm.exchange import LaneRows
from disagmoe_ds.comm.messages import ExpertOut, ExpertOutGrad, TokenGrads, Tokens
from disagmoe_ds.comm.routing import Capacity, pads
from disagmoe_ds.models.expert_shard import ExpertShard
from disagmoe_ds.models.graphs import GraphedShard, StageGraphs
from disagmoe_ds.models.parts import ExpertStage
from disagmoe_ds.runtime.step import evaluating


def warm_up_cases(seq_len: int) -> list[tuple[int, str]]:
    """(rows, id pattern): several row and pair counts, 1 row, 1 pair, with and without sentinel ids."""
    sizes = (seq_len, seq_len // 2 + 1, seq_len // 3 + 2)
    return [(r, p) for p in ("all", "some") for r in (*sizes, 1)] + [(1, "one"), (2, "one"), (0, "all")]


def warm_up_ids(rows: int, top_k: int, num_local: int, pattern: str, device: torch.device) -> torch.Tensor:
    """Local expert ids: all local (``all``), the last slot held elsewhere (``some``), or one pair in all (``one``)."""
    idx_RK = torch.randint(0, num_local, (rows, top_k), device=device)
    if pattern == "some" and top_k > 1:
        idx_RK[:, -1] = num_local
    elif pattern == "one":
        idx_RK.fill_(num_local)
        idx_RK[0, 0] = 0
    return idx_RK


@dataclass
class _ExpertChunk:
    x_SH: torch.Tensor | None  # None between forward and backward with resend
    w_SK: torch.Tensor | None
    y_SH: torch.Tensor | None
    rows: LaneRows
    pairs: int | None  # the routed pairs, where the host knows them
    bounded: bool  # pairs is a capacity's bound


class ExpertRunner:
    """FFN side of one rank: its expert shard of every MoE layer its F-group owns."""

    def __init__(
        self,
        engine: DeepSpeedEngine,
        stage: ExpertStage,
        settings: ChunkSettings,
        *,
        lanes: int = 1,
        fanout: NodeFanOut | None = None,
    ):
        """``settings.capacity``, ``lanes``: the fixed size of each of the ``lanes`` messages a step's micro-batch
        brings (None: sizes vary); the graphed shards and the warm-up run at their sum. ``fanout``: the messages
        are a node's (``Layout.node_dedup``), and the shard computes the rows the node's all-to-all brings it."""
        self.engine, self.stage, self.top_k, self.weight_dtype = engine, stage, settings.top_k, settings.weight_dtype
        self.fanout = fanout
        self.graphs = settings.graphs or StageGraphs()  # the shards replayed as CUDA graphs (at the capacity's rows)
        self._capacity, self.lanes = settings.capacity, lanes
        self.resend = settings.resend
        split_layers = settings.split_layers
        self.backward_pass = ChunkBackward(engine, split_layers)  # split backward: B here, W in ``weight_grad``
        # B keeps the graph through the compiled elementwise middle (the grouped GEMMs, eager, are what W runs).
        self.compiling: Callable[[], AbstractContextManager[object]] = (
            retained_graph_compiles if split_layers else nullcontext
        )
        self.recompute = checkpointed if settings.activation_checkpointing else run
        self.chunks: dict[tuple[int, int], _ExpertChunk] = {}
        self.stats = HeadStats()  # no head and no aux term here: the step's sums stay empty

    def start_step(self, batches: Sequence[Batch] | None) -> None:
        """The FFN side reads no data."""
        del batches

    def capacity_need(self) -> torch.Tensor:
        """The FFN side sends no m2n message: zeros (the executor's all-reduce takes every rank's)."""
        return torch.zeros(2, dtype=torch.int64, device=self.engine.device)

    def expert_counts(self) -> None:
        """The FFN side routes nothing."""
        return None

    @property
    def capacity(self) -> Capacity | None:
        return self._capacity

    @capacity.setter
    def capacity(self, capacity: Capacity) -> None:
        """A grown capacity (a step outgrew the old one): the graphed shards are captured again at its size."""
        grown, self._capacity = capacity != self._capacity, capacity
        if grown and self.graphs.shards:
            self._capture_shards()

    def warm_up(self, seq_len: int, *, packed: bool = False, evaluates: bool = False) -> None:
        with self.compiling():
            self._warm_up(seq_len, packed=packed, evaluates=evaluates)
        if self.graphs.shards:
            self._capture_shards()

    def _capture_shards(self) -> None:
        assert self.capacity is not None, "graphed shards run at a capacity (afpipe.build graphs them only then)"
        rows, bound = self.capacity.rows * self.lanes, self.capacity.pairs * self.lanes
        self.graphs.capture_shards(
            self.stage, rows=rows, top_k=self.top_k, weight_dtype=self.weight_dtype,
            pair_bound=bound if pads(self.capacity) else None,
        )  # fmt: skip

    def _warm_up(self, seq_len: int, *, packed: bool = False, evaluates: bool = False) -> None:
        """Compile and load every compiled kernel of the expert shards now (see ``AttentionRunner.warm_up``).

        Row and pair counts change every micro-batch: after two sizes the compiled graphs are dynamic in them, but a
        count of 1 gets graphs of its own, and so do messages whose ids all live here (no sentinel, as with one ep
        rank): ``_warm_up_cases`` covers each combination. Without autograd (resend, ``evaluates``) the forward's
        graphs are others.
        """
        del packed  # the experts see rows, not documents
        device, dtype, hidden = self.engine.device, self.dtype, self.stage.config.hidden_size
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            for layer in self.stage.layers:
                shard = self.stage.shard(int(layer))
                for rows, pattern, bound in self._warm_up_cases(seq_len):
                    x_RH = torch.randn(rows, hidden, device=device, dtype=dtype, requires_grad=True)
                    idx_RK = warm_up_ids(rows, self.top_k, shard.num_local, pattern, device)
                    w_RK = torch.rand(rows, self.top_k, device=device, dtype=self.weight_dtype, requires_grad=True)
                    pairs = bound or int((idx_RK < shard.num_local).sum())
                    if self.resend:  # its forward runs without autograd: graphs of their own
                        with torch.no_grad():
                            shard(x_RH, idx_RK, w_RK, pairs, bool(bound))
                    if evaluates:  # an evaluation's forward: without autograd, in eval mode
                        with evaluating(shard):
                            shard(x_RH, idx_RK, w_RK, pairs, bool(bound))
                    grad_of_inputs([self.recompute(shard, x_RH, idx_RK, w_RK, pairs, bool(bound))], [x_RH, w_RK])

    def _warm_up_cases(self, seq_len: int) -> list[tuple[int, str, int | None]]:
        """(rows, id pattern, pair bound): messages of varying size, or, at a capacity that pads them, the one size
        they all have, with and without sentinel ids."""
        if not pads(self.capacity):
            return [(rows, pattern, None) for rows, pattern in warm_up_cases(seq_len)]
        rows, pairs = self.capacity.rows * self.lanes, self.capacity.pairs * self.lanes
        return [(rows, pattern, pairs) for pattern in ("some", "one")]

    @functools.cached_property
    def dtype(self) -> torch.dtype:
        """The activations' (m2n rows may travel in FP8): the shard's parameters'."""
        return next(self.stage.parameters()).dtype

    def forward(self, layer: int, mb: int, inbox: Inbox) -> Outbox:
        """F_fwd(layer, mb): the shard's experts on every lane's tokens (``inbox.m2n``); the outbox holds each lane's
        rows of the output (``n2m``)."""
        assert inbox.m2n is not None, "an expert forward receives its lanes' tokens"
        with self.compiling():
            return Outbox(n2m=self._forward(layer, mb, *inbox.m2n))

    def _forward(self, layer: int, mb: int, tokens: Tokens, rows: LaneRows) -> list[ExpertOut]:
        pairs, bounded = tokens.pairs, tokens.bounded
        if self.resend:  # keep nothing: the backward gets the tokens again and recomputes
            with torch.no_grad():
                y_SH = self._experts(layer, *tokens.shard_args(self.dtype), recompute=False)
            self.chunks[(layer, mb)] = _ExpertChunk(None, None, None, rows, pairs, bounded)
            return ExpertOut(y_SH).split(rows.counts)
        x_SH, w_SK = leaf(tokens.rows(self.dtype)), leaf(tokens.w_RK)
        y_SH = self._experts(layer, x_SH, tokens.local_idx_RK, w_SK, pairs, bounded)
        self.chunks[(layer, mb)] = _ExpertChunk(x_SH, w_SK, y_SH, rows, pairs, bounded)
        return ExpertOut(y_SH).split(rows.counts)

    def backward(self, layer: int, mb: int, inbox: Inbox) -> Outbox:
        """F_bwd(layer, mb): autograd through the chunk from every lane's output gradients (``inbox.n2m_grad``); the
        outbox holds each lane's token gradients (``m2n_grad``)."""
        assert inbox.n2m_grad is not None, "an expert backward receives its lanes' output gradients"
        with self.compiling():
            return Outbox(m2n_grad=self._backward(layer, mb, inbox.n2m_grad[0]))

    def _shard(self, layer: int) -> ExpertShard | GraphedShard:
        return self.graphs.shard(self.stage, layer)

    def _experts(
        self,
        layer: int,
        x_SH: torch.Tensor,
        idx_SK: torch.Tensor,
        w_SK: torch.Tensor,
        pairs: int | None,
        bounded: bool,
        *,
        recompute: bool = True,
    ) -> torch.Tensor:
        """The layer's shard on the received rows (through the node's fan-out with ``node_dedup``), checkpointed
        with activation checkpointing unless ``recompute`` is off (the caller recomputes: resend)."""
        call: ShardCall = functools.partial(self.recompute if recompute else run, self._shard(layer))
        if self.fanout is None:
            return call(x_SH, idx_SK, w_SK, pairs, bounded)
        return self.fanout(call, x_SH, idx_SK, w_SK)

    def weight_grad(self, layer: int, mb: int) -> None:
        """Split backward: the expert weight gradients ``backward`` deferred for this chunk."""
        self.backward_pass.weight_grad((layer, mb))

    def drop_chunk(self, layer: int, mb: int) -> None:
        """Forget what ``forward`` kept for a backward (an evaluation runs none)."""
        del self.chunks[(layer, mb)]

    def _backward(self, layer: int, mb: int, grad: ExpertOutGrad) -> list[TokenGrads]:
        chunk = self.chunks.pop((layer, mb))
        x_SH, w_SK, y_SH = chunk.x_SH, chunk.w_SK, chunk.y_SH
        if grad.resent is not None:  # resend: recompute the forward from the tokens sent again
            x_SH, w_SK = leaf(grad.resent.rows(self.dtype)), leaf(grad.resent.w_RK)
            y_SH = self._experts(
                layer, x_SH, grad.resent.local_idx_RK, w_SK, chunk.pairs, chunk.bounded, recompute=False
            )
        assert x_SH is not None and w_SK is not None and y_SH is not None, "kept by the forward, or resent"
        if y_SH.requires_grad:
            self.backward_pass.run((layer, mb), (y_SH * grad.dy_RH).float().sum(), [x_SH, w_SK])
        token_grads = TokenGrads(grad_or_zeros(x_SH), grad_or_zeros(w_SK))
        return token_grads.split(chunk.rows.counts)
