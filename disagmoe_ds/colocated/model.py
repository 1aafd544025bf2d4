"""What one co-located rank holds: the attention side of its stage's layers (every layer, with one pipeline stage)
and a slice of each of those layers' routed experts.

``ColocatedModel.forward`` runs one micro-batch of this rank exactly as ``models.split.SplitModel`` does in one
process (same attention parts, same dispatch plan, same expert shards, same combine, same aux loss), with the
expert shards spread over the ranks of the expert-parallel group and reached through a dispatcher. A pipeline
stage without the head returns its last layer's residual and the router sums so far for the next stage
(``colocated.handoff``); one after the first starts from the residual and sums the previous stage handed on.

On lanes that hold a micro-batch in slices (``lane``: Ulysses and/or TP with sequence parallelism, built by
``runtime.lanes``) a rank runs its slice: the context of its positions with the whole sequence's masks, each
layer's router statistics as its share (``SequenceParallel.share_of``: the lanes' counts, its own probabilities),
the head's loss as its share of the micro-batch's, all scaled by s x t (DeepSpeed averages over every lane, s x t of
which hold one micro-batch: ``models.sequence_parallel``); its own tokens go to the experts.

``ExpertStageMoE`` makes DeepSpeed treat the expert slice as MoE parameters: the engine sees a
``deepspeed.moe.layer.MoE`` instance (``has_moe_layers``), and every expert parameter carries ``allreduce=False``
and ``group_name``, so DeepSpeed reduces (and ZeRO partitions) them over the expert-data-parallel group and puts
them in their own optimizer parameter groups. Its state dict uses DeepSpeed's MoE naming (one entry per local
expert), so ``engine.save_checkpoint`` / ``load_checkpoint`` write and read one file per expert as for any
DeepSpeed MoE model.

Shape suffixes: B micro-batch size, S sequence, T = B*S tokens, H hidden, R rows received by the expert shard,
e local experts, L layers, E routed experts.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, cast

import torch
from deepspeed.moe.layer import MoE
from deepspeed.utils import groups as ds_groups
from torch import nn
from torch.utils.checkpoint import checkpoint

from disagmoe_ds.colocated.handoff import RouterSums, StageOutput
from disagmoe_ds.comm.dispatch import LocalDispatcher
from disagmoe_ds.comm.routing import count_ids
from disagmoe_ds.data.packing import labelled_tokens
from disagmoe_ds.errors import CheckpointError
from disagmoe_ds.fp8.frozen import held_weights
from disagmoe_ds.models.aux_loss import RouterStats, aux_loss_from_stats, balance_per_layer, router_stats
from disagmoe_ds.models.context import LayerContext
from disagmoe_ds.models.expert_shard import ExpertShard
from disagmoe_ds.models.graphs import StageGraphs, graph_stages, warm_up_positions
from disagmoe_ds.models.hyper_connections import add_routed
from disagmoe_ds.models.naming import attention_name_to_hf, expert_name_to_hf
from disagmoe_ds.models.parts import AttentionStage, ExpertStage
from disagmoe_ds.models.sequence_parallel import IGNORE_INDEX, SequenceParallel
from disagmoe_ds.runtime.step import summed_lm_loss

# DeepSpeed's MoE checkpointing finds expert ``i`` of a layer by this infix and renumbers it globally on save.
_DS_EXPERTS = "deepspeed_moe.experts.deepspeed_experts."
_DS_KEY = re.compile(re.escape(_DS_EXPERTS) + r"(?P<expert>\d+)\.layers\.(?P<layer>\d+)\.(?P<name>.+)$")


class ExpertStageMoE(MoE):
    """An ``ExpertStage`` dressed as DeepSpeed's ``MoE`` (``MoE.__init__`` is skipped: it builds a gate and experts
    of its own). The expert process groups must already be in DeepSpeed's registry (``register_with_deepspeed``).

    State dict: every expert parameter of the stage holds the e local experts stacked on dim 0
    (``stage.layers.<l>.experts.<name>``, e x ...); the state dict holds expert i's slice under DeepSpeed's name
    ``deepspeed_moe.experts.deepspeed_experts.<i>.layers.<l>.<name>``, which DeepSpeed's ``_save_moe_checkpoint``
    writes to one file per global expert and ``load_moe_state_dict`` reads back with local ids. Loading restacks.
    """

    def __init__(self, stage: ExpertStage, *, num_experts: int, ep_size: int, group_name: str):
        nn.Module.__init__(self)
        self.stage = stage
        self.num_experts = num_experts
        self.ep_size = ep_size
        self.num_local_experts = num_experts // ep_size
        self.expert_group_name = group_name
        self.use_residual = False
        self.enable_expert_tensor_parallelism = False
        # DeepSpeed-MoE's marks: reduced over the expert-data-parallel group; a frozen FP8 base's buffers carry them
        # too, for the LoRA factors beside them to copy (``models.adapters``)
        for param in [*stage.parameters(), *stage.buffers()]:
            param.allreduce = False  # type: ignore[attr-defined]
            param.group_name = group_name  # type: ignore[attr-defined]
        self.register_state_dict_post_hook(_split_experts)
        self.register_load_state_dict_pre_hook(_stack_experts)

    def set_deepspeed_parallelism(self, use_data_before_expert_parallel_: bool = False) -> None:
        """Called by the engine; the groups are registered already, so there is nothing to create."""
        assert self.expert_group_name in ds_groups._get_expert_parallel_group_dict(), "register_with_deepspeed first"

    def shard(self, layer: int) -> ExpertShard:
        return self.stage.shard(layer)

    def forward(self, *args, **kwargs):
        raise TypeError("ExpertStageMoE is a parameter holder; call shard(layer) for an MoE layer's experts")


def _split_experts(module: ExpertStageMoE, state_dict: dict, prefix: str, local_metadata) -> None:
    """``stage.layers.<l>.experts.<name>`` (e x ...) -> ``<_DS_EXPERTS><i>.layers.<l>.<name>`` for i < e."""
    del local_metadata
    stage_prefix = f"{prefix}stage.layers."
    for key in [k for k in state_dict if k.startswith(stage_prefix)]:
        layer, experts, name = key.removeprefix(stage_prefix).split(".", 2)
        stacked_e = state_dict.pop(key)
        if experts != "experts" or stacked_e.shape[0] != module.num_local_experts:
            raise CheckpointError(
                f"expert entry {key} of shape {tuple(stacked_e.shape)} does not hold this rank's "
                f"{module.num_local_experts} experts: the expert stage and its DeepSpeed-MoE wrapper disagree"
            )
        for i, value in enumerate(stacked_e.unbind(0)):
            state_dict[f"{prefix}{_DS_EXPERTS}{i}.layers.{layer}.{name}"] = value


def _stack_experts(module: ExpertStageMoE, state_dict: dict, prefix: str, *args) -> None:
    """The inverse of ``_split_experts``, before ``load_state_dict`` matches keys to parameters."""
    del args
    pieces: dict[str, dict[int, torch.Tensor]] = {}
    for key in [k for k in state_dict if k.startswith(prefix + _DS_EXPERTS)]:
        match = _DS_KEY.match(key.removeprefix(prefix))
        if match is None:
            raise CheckpointError(f"unexpected expert entry {key} in the checkpoint; was it written by this model?")
        stage_key = f"{prefix}stage.layers.{match['layer']}.experts.{match['name']}"
        pieces.setdefault(stage_key, {})[int(match["expert"])] = state_dict.pop(key)
    for key, by_expert in pieces.items():
        if sorted(by_expert) != list(range(module.num_local_experts)):
            continue  # load_state_dict reports the missing parameter (strict) by its own name
        state_dict[key] = torch.stack([by_expert[i] for i in range(module.num_local_experts)])


@dataclass
class ColocatedOutput:
    """One micro-batch's losses (``loss`` = LM loss + coef * aux loss, as HF computes it; on a slice, its share
    times s x t) and expert load."""

    loss: torch.Tensor
    lm_loss: torch.Tensor
    aux_loss: torch.Tensor | None
    # int64: this rank's tokens routed to each expert (top-k choices), 0 for dense layers; None from a module that
    # does not report its load (bench_e2e's DeepSpeed-MoE model)
    load_LE: torch.Tensor | None = None
    sums: RouterSums | None = None  # a pipeline's last stage: every MoE layer's router sums (for the aux gradients)
    # float64 [LM loss summed over this rank's labelled tokens, their count] (``step.summed_lm_loss``); None from a
    # module that does not report it (bench_e2e's): its labels give it
    token_sums: torch.Tensor | None = None

    def lm_token_sums(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """``token_sums``, or from ``batch``'s labels where the module gave none."""
        if self.token_sums is not None:
            return self.token_sums
        return summed_lm_loss(self.lm_loss, labelled_tokens(batch["labels"]))


class ColocatedModel(nn.Module):
    """The module of one co-located rank's DeepSpeed engine.

    Args:
        attention: every layer's attention part, the embedding and the head.
        experts: this rank's expert slice of every MoE layer (None: a pipeline stage of dense layers alone).
        dispatcher: routes tokens to the expert-parallel ranks and back (not a module: it holds no parameters).
        aux_coef: router aux-loss coefficient, or None when the family/config has no aux loss.
        num_experts: E, the routed experts of an MoE layer.
        chunks: the layers of each of the stage's chunks (virtual stages), in order; None: one chunk of them all.
        full_recompute: the sides (``attention``, ``ffn``) whose parts keep only their inputs for the backward,
            which runs their forward again (non-reentrant checkpoints around each attention part and expert shard
            call; the dispatch and combine between them keep theirs, so no all-to-all runs twice).
        lane: the lanes that hold this rank's micro-batches in slices (None: it holds them whole).
    """

    def __init__(
        self,
        attention: AttentionStage,
        experts: ExpertStageMoE | None,
        dispatcher: LocalDispatcher,
        aux_coef: float | None,
        *,
        num_experts: int,
        chunks: tuple[tuple[int, ...], ...] | None = None,
        full_recompute: frozenset[str] = frozenset(),
        lane: SequenceParallel | None = None,
    ):
        super().__init__()
        self.lane = lane
        self.attention = attention
        self.experts = experts
        self.num_experts = num_experts
        self.dispatcher = dispatcher
        self.aux_coef = aux_coef
        self.config = attention.config
        self.chunks = chunks or (tuple(sorted(int(layer) for layer in attention.layers)),)
        self.full_recompute = full_recompute
        self.graphs = StageGraphs()  # the parts replayed as CUDA graphs (``capture_graphs``); none: as they are

    def capture_graphs(self, *, batch: int, seq_len: int, top_k: int, weight_dtype: torch.dtype, packed: bool) -> None:
        """Replay every attention part, the head and, when this rank holds every expert (its rows are then the
        micro-batch's tokens), every expert shard as CUDA graphs from now on; one slot each (a micro-batch's
        backward runs before the next one's forward)."""
        experts = self.experts.stage if self.experts is not None and self.experts.ep_size == 1 else None
        graphs = graph_stages(lambda layer: 1, attention=self.attention, experts=experts)
        device = next(self.parameters()).device
        graphs.capture_attention(
            self.attention, batch=batch, seq_len=seq_len, positions=warm_up_positions(batch, seq_len, packed, device)
        )
        if experts is not None:
            graphs.capture_shards(experts, rows=batch * seq_len, top_k=top_k, weight_dtype=weight_dtype)
        self.graphs = graphs

    @property
    def share_scale(self) -> float:
        """What this rank's share of a micro-batch's loss counts: s x t on a slice (1 holding it whole)."""
        return 1.0 if self.lane is None else float(self.lane.size)

    def forward(
        self,
        input_ids: torch.Tensor,
        labels: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        inbound: tuple[torch.Tensor, RouterSums] | None = None,
        chunk: int = 0,
        *,
        shift_labels: torch.Tensor | None = None,
        num_items: torch.Tensor | None = None,
        full_position_ids: torch.Tensor | None = None,
    ) -> ColocatedOutput | StageOutput:
        """One micro-batch through the layers of this rank's ``chunk``; ``inbound``: the residual and router sums the
        previous (virtual) pipeline stage handed on (None: this stage embeds the tokens). The last chunk of the
        stage that holds the head ends in the loss. On a slice the batch is ``sequence_parallel.slice_batch``'s
        (``shift_labels``, ``num_items``, ``full_position_ids``) in place of ``labels``."""
        h_BSH = self.attention.embed(input_ids) if inbound is None else inbound[0]
        ctx = self._context(h_BSH, input_ids, position_ids, full_position_ids)
        stats: list[RouterStats] = []
        num_layers, num_experts = self.config.num_hidden_layers, self.num_experts
        load_LE = torch.zeros(num_layers, num_experts, dtype=torch.int64, device=h_BSH.device)
        for layer in self.chunks[chunk]:
            part = self.attention.part(layer)
            out = self._run("attention", self.graphs.part(self.attention, layer), h_BSH, ctx, self.config)
            if out.x_TH is None:  # dense layer
                h_BSH = out.residual_BSH
                continue
            load_LE[layer] = count_ids(out.topk_idx_TK, num_experts)
            if out.router_logits_TE is not None:  # a learned choice (not a token-routed layer)
                layer_stats = router_stats(out.router_logits_TE, cast(int, part.router.top_k))
                stats.append(layer_stats if self.lane is None else self.lane.share_of(layer_stats))
            routed, meta = self.dispatcher.dispatch(out.x_TH, out.topk_w_TK, out.topk_idx_TK)
            assert self.experts is not None, "a stage with an MoE layer holds its experts"
            shard = self.graphs.shard(self.experts.stage, layer)
            y_RH = self._run("ffn", shard, *routed.shard_args(out.x_TH.dtype))
            h_BSH = add_routed(out.residual_BSH, out.routed_w_BSC, self.dispatcher.combine(y_RH, meta))
        if self.attention.head is None or chunk < len(self.chunks) - 1:
            before = RouterSums.zeros(num_experts, h_BSH.device) if inbound is None else inbound[1]
            return StageOutput(h_BSH, before.plus(stats), load_LE)
        lm_loss, token_sums = self._lm_loss(h_BSH, labels, shift_labels, num_items)
        if self.aux_coef is None:
            return ColocatedOutput(lm_loss, lm_loss, None, load_LE, token_sums=token_sums)
        per_layer = balance_per_layer(self.config)
        sums = None if inbound is None else inbound[1].plus(stats)
        aux = aux_loss_from_stats(stats, per_layer=per_layer) if sums is None else sums.aux_loss(per_layer=per_layer)
        aux = aux * self.share_scale
        return ColocatedOutput(lm_loss + self.aux_coef * aux, lm_loss, aux, load_LE, sums, token_sums)

    def _context(
        self,
        h_BSH: torch.Tensor,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor | None,
        full_position_ids: torch.Tensor | None,
    ) -> LayerContext:
        """The attention context: HF's of the micro-batch, or on a slice the rotary embeddings of its positions with
        the whole sequence's masks (``full_position_ids``: its positions, None: the default ones)."""
        if self.lane is None:
            return self.attention.context(h_BSH, position_ids, input_ids)
        assert position_ids is not None, "a slice's batch carries its positions (sequence_parallel.slice_batch)"
        ctx = self.lane.context(self.attention, h_BSH, position_ids, full_position_ids)
        return replace(ctx, token_ids=input_ids) if self.attention.token_routed else ctx

    def _lm_loss(
        self,
        h_BSH: torch.Tensor,
        labels: torch.Tensor | None,
        shift_labels: torch.Tensor | None,
        num_items: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """HF's LM loss of the micro-batch (on a slice: its share, scaled by s x t) and this rank's token sums."""
        if self.lane is None:
            assert labels is not None
            _, lm_loss = self.graphs.head_of(self.attention)(h_BSH, labels)
            return lm_loss, summed_lm_loss(lm_loss, labelled_tokens(labels))
        assert self.attention.head is not None and shift_labels is not None and num_items is not None
        _, lm_loss = self.attention.head(h_BSH, None, shift_labels, num_items)
        token_sums = summed_lm_loss(lm_loss, num_items, (shift_labels != IGNORE_INDEX).sum())
        return lm_loss * self.share_scale, token_sums

    def _run(self, side: str, part: Callable[..., Any], *args: Any) -> Any:
        """``part(*args)``, checkpointed where ``side`` recomputes in full."""
        if side in self.full_recompute and torch.is_grad_enabled():
            return checkpoint(part, *args, use_reentrant=False)
        return part(*args)

    def hf_names(self) -> dict[str, tuple[str, int]]:
        """Parameter name (or a frozen FP8 base's, ``fp8.frozen``) -> (HF name, first expert of the slice; 0 for
        attention-side parameters)."""
        names = {}
        for name in [*(n for n, _ in self.named_parameters()), *held_weights(self)]:
            if name.startswith("attention."):
                names[name] = (attention_name_to_hf(name.removeprefix("attention.")), 0)
            else:
                assert self.experts is not None  # the name is an expert parameter's
                stage_name = name.removeprefix("experts.stage.")
                names[name] = (expert_name_to_hf(stage_name), self.experts.stage.first_expert)
        return names
