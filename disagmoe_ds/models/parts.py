"""The two halves of every decoder layer, cut out of a Hugging Face MoE model with HF's own modules.

Attention side (``AttentionPart``): input norm, the layer's token mixer (self-attention, or Gated DeltaNet linear
attention in the linear layers of Qwen3-Next / Qwen3.5), residual, post-attention norm, then either the
dense MLP (dense layers) or the router and shared experts (MoE layers). Expert side (``ExpertShard``): a contiguous
slice of the routed experts held in HF's own experts module: gated families compute with grouped GEMMs
(``grouped_experts.py``, the same math), others (GPT-OSS) and the reference path call HF's module itself.

``AttentionStage`` / ``ExpertStage`` hold the parts one rank owns (any subset of layers, plus the embedding and
the head on the attention side). Their parameter names mirror HF's so checkpoints convert by a prefix map.

Shape suffixes: B batch, S sequence, T = B*S tokens, H hidden, E experts, K top-k, R rows received by an expert
shard, P (row, expert) pairs routed to local experts, V vocabulary.
"""

from __future__ import annotations

import copy
from collections import OrderedDict
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn

from disagmoe_ds.models import hyper_connections as hc
from disagmoe_ds.models.context import LayerContext, build_context
from disagmoe_ds.models.families import Family, family_of, is_moe_layer, mixer_attr, route
from disagmoe_ds.models.grouped_experts import EAGER, compiled_elementwise, grouped_gated_experts, supports_grouped
from disagmoe_ds.models.lora import expert_adapters, merged_expert_weights
from disagmoe_ds.models.moe_pattern import moe_layer_pattern, token_routed_layers

# ----------------------------------------------------------------------------------------------------------------
# Attention side
# ----------------------------------------------------------------------------------------------------------------


@dataclass
class AttentionOutput:
    """One attention part's results for one micro-batch.

    ``residual_BSH`` is everything of the layer's output except the routed experts' sum (for dense layers: the
    whole layer output; [B, S, hc, H] with hyper-connections). The rest is None on dense layers.
    ``router_logits_TE`` is None too where the layer routes by token id (no learned choice: no aux term, as HF
    records none); ``routed_w_BSC`` is the routed sum's weight per residual stream (hyper-connections), None where
    it is added as it is (``hyper_connections.add_routed``).
    """

    residual_BSH: torch.Tensor
    x_TH: torch.Tensor | None = None  # post-attention-norm tokens, sent to the experts
    topk_w_TK: torch.Tensor | None = None
    topk_idx_TK: torch.Tensor | None = None
    router_logits_TE: torch.Tensor | None = None
    routed_w_BSC: torch.Tensor | None = None


class AttentionPart(nn.Module):
    """Attention side of one decoder layer. Keeps HF's attribute names (``self_attn`` or ``linear_attn``,
    ``mlp.gate``, ``mlp.shared_expert``, DeepSeek-V4's ``attn_hc`` / ``ffn_hc``...).

    ``token_routed``: the layer chooses its experts by token id (``moe_pattern.token_routed_layers``); its router
    then reads ``LayerContext.token_ids``.
    """

    def __init__(self, layer: nn.Module, family: Family, layer_idx: int, *, token_routed: bool = False):
        super().__init__()
        self.layer_idx = layer_idx
        self.family = family
        self.is_moe = is_moe_layer(layer)
        self.token_routed = token_routed
        self.mixer_attr = mixer_attr(layer)
        self.input_layernorm = layer.input_layernorm
        setattr(self, self.mixer_attr, getattr(layer, self.mixer_attr))
        self.post_attention_layernorm = layer.post_attention_layernorm
        self.mlp = _without_experts(layer.mlp) if self.is_moe else layer.mlp
        self.hyper = family.hyper
        if self.hyper is not None:  # the two HyperConnection modules, under HF's names
            for attr in (self.hyper.around_mixer, self.hyper.around_mlp):
                setattr(self, attr, getattr(layer, attr))

    @property
    def router(self) -> nn.Module:
        return getattr(self.mlp, self.family.router_attr)

    @property
    def mixer(self) -> nn.Module:
        """The token mixer: HF's attention module, or its Gated DeltaNet."""
        return getattr(self, self.mixer_attr)

    def _around(self, which: str) -> nn.Module | None:
        """The hyper-connection around the mixer or the MLP (None: a plain residual)."""
        return None if self.hyper is None else getattr(self, getattr(self.hyper, which))

    def _mix(self, x_BSH: torch.Tensor, ctx: LayerContext, config) -> torch.Tensor:
        """The token mixer called as HF's decoder layer calls it (no cache: training)."""
        mask = ctx.mask_for(config, self.layer_idx)
        if self.mixer_attr == "linear_attn":
            return self.linear_attn(hidden_states=x_BSH, attention_mask=mask)
        attn_BSH, _ = self.self_attn(
            hidden_states=x_BSH,
            attention_mask=mask,
            position_embeddings=ctx.position_embeddings,
            position_ids=ctx.position_ids,
        )
        return attn_BSH

    def forward(self, h_BSH: torch.Tensor, ctx: LayerContext, config) -> AttentionOutput:
        x_BSH, around = hc.enter(self._around("around_mixer"), h_BSH)
        a_BSH = hc.leave(around, h_BSH, self._mix(self.input_layernorm(x_BSH), ctx, config))
        x_BSH, around = hc.enter(self._around("around_mlp"), a_BSH)
        x_BSH = self.post_attention_layernorm(x_BSH)
        if not self.is_moe:
            return AttentionOutput(residual_BSH=hc.leave(around, a_BSH, self.mlp(x_BSH)))
        x_TH = x_BSH.reshape(-1, x_BSH.shape[-1])
        jitter = getattr(self.mlp, "jitter_noise", 0.0)
        if self.training and jitter > 0:  # Mixtral's router jitter, as HF applies it (in place, before routing)
            x_TH = x_TH * torch.empty_like(x_TH).uniform_(1.0 - jitter, 1.0 + jitter)
        token_ids_T = ctx.token_ids.reshape(-1) if self.token_routed and ctx.token_ids is not None else None
        logits_TE, w_TK, idx_TK = route(self.family, self.mlp, x_TH, token_ids_T)
        shared_TH = None if self.family.shared is None else self.family.shared(self.mlp, x_TH)
        residual_BSH = hc.leave(around, a_BSH, None if shared_TH is None else shared_TH.view_as(x_BSH))
        logits_TE = None if self.token_routed else logits_TE
        return AttentionOutput(residual_BSH, x_TH, w_TK, idx_TK, logits_TE, hc.routed_weight(around, a_BSH.dtype))


def _without_experts(block: nn.Module) -> nn.Module:
    """A shallow copy of an MoE block that keeps its router and shared experts but not the routed experts.

    The routed experts live on the FFN side. The HF model itself is left intact, so the FFN side can still be cut
    from it.
    """
    pruned = copy.copy(block)
    pruned._modules = OrderedDict((name, m) for name, m in block._modules.items() if name != "experts")
    return pruned


class Head(nn.Module):
    """Final norm + LM head + HF's causal-LM loss; with hyper-connections, the streams collapsed first (HF's hyper
    head, under its name)."""

    def __init__(self, model: nn.Module):
        super().__init__()
        hyper = family_of(model.config).hyper
        self.hyper_head = None if hyper is None else hyper.head
        if self.hyper_head is not None:
            setattr(self, self.hyper_head, getattr(model.model, self.hyper_head))
        self.norm = model.model.norm
        self.lm_head = model.lm_head
        self._loss_function = model.loss_function
        self.vocab_size = model.config.vocab_size

    def forward(
        self,
        h_BSH: torch.Tensor,
        labels_BS: torch.Tensor | None,
        shift_labels_BS: torch.Tensor | None = None,
        num_items: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``shift_labels_BS`` (labels already shifted) and ``num_items`` (what the sum is divided by): one slice's
        share of a micro-batch's loss (``models.sequence_parallel``)."""
        if self.hyper_head is not None:
            h_BSH = getattr(self, self.hyper_head)(h_BSH)
        logits_BSV = self.lm_head(self.norm(h_BSH))
        if labels_BS is None and shift_labels_BS is None:
            return logits_BSV, None
        loss = self._loss_function(
            logits_BSV, labels_BS, self.vocab_size, num_items_in_batch=num_items, shift_labels=shift_labels_BS
        )
        return logits_BSV, loss


# ----------------------------------------------------------------------------------------------------------------
# Expert side
# ----------------------------------------------------------------------------------------------------------------


class ExpertShard(nn.Module):
    """Routed experts ``[first_expert, first_expert + num_local)`` of one layer, stored in HF's experts module.

    ``forward`` takes the R tokens this shard received, their local expert ids (``num_local`` is the sentinel for
    experts held elsewhere) and routing weights, and returns each token's weighted sum over its local experts:
    with grouped GEMMs where the family and dtype allow, else (and in ``forward_hf``) through HF's module. Only
    real (row, expert) pairs are computed, so no work is spent on sentinels and HF versions that do not know the
    sentinel work too. ``elementwise``: the grouped path's elementwise functions (``compile_stage`` fuses them);
    ``recompute``: the grouped path keeps only its permuted inputs for the backward (``models.recompute``).
    """

    def __init__(self, experts: nn.Module, first_expert: int, num_local: int, family: str):
        super().__init__()
        self.experts = experts
        self.first_expert = first_expert
        self.num_local = num_local
        self.family = family
        self.elementwise = EAGER
        self.recompute = False

    def forward(
        self,
        x_RH: torch.Tensor,
        local_idx_RK: torch.Tensor,
        w_RK: torch.Tensor,
        num_pairs: int | None = None,
        bounded: bool = False,
    ) -> torch.Tensor:
        """``num_pairs``: the non-sentinel ids in ``local_idx_RK`` when the host knows it (saves a host sync);
        ``bounded``: at most that many (messages at a fixed capacity, ``routing.Capacity``).

        With no pair here the result still reaches every parameter (``_untouched``; the bounded grouped GEMMs
        always do), so a backward always gives the whole shard a gradient, in the same order, however the tokens
        were routed.
        """
        grouped = supports_grouped(self.family, self.experts, x_RH)
        if bounded and grouped:
            return self._pairs(x_RH, local_idx_RK, w_RK, num_pairs, bounded=True)
        if num_pairs is None or bounded:
            num_pairs = int((local_idx_RK < self.num_local).sum())  # host sync
        if num_pairs == 0:
            return x_RH * 0 + self._untouched(x_RH, local_idx_RK, w_RK)
        return self._pairs(x_RH, local_idx_RK, w_RK, num_pairs)

    def _pairs(self, x_RH: torch.Tensor, local_idx_RK: torch.Tensor, w_RK: torch.Tensor, num_pairs: int, bounded=False):
        if supports_grouped(self.family, self.experts, x_RH):
            e = self.experts
            return grouped_gated_experts(
                x_RH,
                local_idx_RK,
                w_RK,
                e.gate_up_proj,
                e.down_proj,
                e.act_fn,
                num_pairs,
                self.elementwise,
                self.recompute,
                bounded,
                expert_adapters(e),
                getattr(e, "limit", None),  # the SwiGLU's clamp where HF's experts have one (DeepSeek-V4)
            )
        return self.forward_hf(x_RH, local_idx_RK, w_RK)

    def _untouched(self, x_RH: torch.Tensor, local_idx_RK: torch.Tensor, w_RK: torch.Tensor) -> torch.Tensor:
        """An exact zero [1, H] that depends on every parameter as a routed pair does: one zero row to local expert
        0 with weight 0, through the same path (the warm-up's one-pair case, so no new compiled graph).

        Why: ZeRO-2 reduces gradients during each backward, bucket by bucket in the order they are produced, so the
        replicas of a shard must produce the same parameters' gradients in the same order in every backward, also
        the replica no token reached (its gradients are then exactly zero: every term carries the weight 0). The
        zero row is made from ``x_RH`` so that it lies on the input path: a split backward's W then reaches every
        parameter here as it does on a busy replica (``afpipe.split_backward``).
        """
        top_k = local_idx_RK.shape[1]
        idx_1K = local_idx_RK.new_full((1, top_k), self.num_local)
        idx_1K[0, 0] = 0
        zero_1H = x_RH.sum(0, keepdim=True) * 0
        return self._pairs(zero_1H, idx_1K, w_RK.new_zeros(1, top_k), 1)

    def forward_hf(self, x_RH: torch.Tensor, local_idx_RK: torch.Tensor, w_RK: torch.Tensor) -> torch.Tensor:
        """Through HF's own experts module (its configured implementation): the reference path. With LoRA adapters
        (``models.lora``) it runs on the merged weights, as PEFT's ``target_parameters`` does."""
        rows_P, slots_P = (local_idx_RK < self.num_local).nonzero(as_tuple=True)
        args = (
            x_RH.index_select(0, rows_P),
            local_idx_RK[rows_P, slots_P].unsqueeze(1),
            w_RK[rows_P, slots_P].unsqueeze(1),
        )
        if expert_adapters(self.experts) is None:
            out_PH = self.experts(*args)
        else:
            out_PH = torch.func.functional_call(self.experts, merged_expert_weights(self.experts), args)
        return torch.zeros_like(x_RH).index_add(0, rows_P, out_PH.to(x_RH.dtype))


def slice_experts(experts: nn.Module, config, family: Family, start: int, stop: int) -> nn.Module:
    """A new HF experts module of the same class holding experts ``[start, stop)`` (copied, not views)."""
    local_config = copy.deepcopy(config)
    setattr(local_config, family.num_experts_attr, stop - start)
    with torch.device("meta"):
        shard = type(experts)(local_config)
    for name, param in experts.named_parameters(recurse=False):
        setattr(shard, name, nn.Parameter(param.detach()[start:stop].clone(), requires_grad=param.requires_grad))
    return shard


# ----------------------------------------------------------------------------------------------------------------
# What one rank holds
# ----------------------------------------------------------------------------------------------------------------


class AttentionStage(nn.Module):
    """The attention parts of the layers one A-group owns, plus embedding (A-group 0) and head (A-group L % p).

    ``residual_dims``: a token's residual, (H,), or (hc, H) with hyper-connections; ``token_routed``: some layer of
    the model routes by token id, so contexts carry the token ids and the residual hand-off too.
    """

    config: Any  # the model's HF config (family-specific fields)
    head: Head | None

    def __init__(self, model: nn.Module, layers: tuple[int, ...], *, with_embedding: bool, with_head: bool):
        super().__init__()
        self.config = model.config
        self.family = family_of(model.config)
        self.embed_tokens = model.model.embed_tokens if with_embedding else None
        self.rotary_emb = model.model.rotary_emb
        hf_layers = model.model.layers
        by_token = token_routed_layers(model.config.to_dict())
        self.token_routed = any(by_token)
        self.layers = nn.ModuleDict(
            {str(i): AttentionPart(hf_layers[i], self.family, i, token_routed=by_token[i]) for i in layers}
        )
        self.head = Head(model) if with_head else None
        self.streams = None if self.family.hyper is None else self.family.hyper.streams(model.config)
        hidden = model.config.hidden_size
        self.residual_dims = (hidden,) if self.streams is None else (self.streams, hidden)
        self._default_contexts: dict[tuple, LayerContext] = {}

    def embed(self, input_ids_BS: torch.Tensor) -> torch.Tensor:
        """The first layer's residual: the token embeddings (in every stream, with hyper-connections)."""
        return hc.expand(self.embed_tokens(input_ids_BS), self.streams)

    def context(
        self, h_BSH: torch.Tensor, position_ids: torch.Tensor | None, token_ids: torch.Tensor | None = None
    ) -> LayerContext:
        """The micro-batch's context; with the default positions (None), one per shape, built once: its tensors
        are then the same every call, which a graphed part need not copy in, and no step rebuilds them. The token
        ids ([B, S]) join it where some layer routes by them."""
        if position_ids is not None or torch.is_inference_mode_enabled():
            ctx = build_context(self.config, self.rotary_emb, h_BSH, position_ids)
        else:
            key = (h_BSH.shape[:2], h_BSH.dtype, h_BSH.device, self.config._attn_implementation)
            if key not in self._default_contexts:
                with torch.no_grad():
                    self._default_contexts[key] = build_context(self.config, self.rotary_emb, h_BSH, None)
            ctx = self._default_contexts[key]
        return replace(ctx, token_ids=token_ids) if self.token_routed else ctx

    def part(self, layer: int) -> AttentionPart:
        return self.layers[str(layer)]


class ExpertStage(nn.Module):
    """The expert shards ``[start, stop)`` of the MoE layers one F-group owns."""

    config: Any  # the model's HF config

    def __init__(self, model: nn.Module, layers: tuple[int, ...], start: int, stop: int):
        super().__init__()
        self.config = model.config
        family = family_of(model.config)
        hf_layers = model.model.layers
        self.first_expert, self.num_local = start, stop - start
        self.layers = nn.ModuleDict(
            {
                str(i): ExpertShard(
                    slice_experts(hf_layers[i].mlp.experts, model.config, family, start, stop),
                    start,
                    stop - start,
                    family.model_type,
                )
                for i in layers
                if is_moe_layer(hf_layers[i])
            }
        )

    def shard(self, layer: int) -> ExpertShard:
        return self.layers[str(layer)]


def compile_stage(module: nn.Module) -> None:
    """``torch.compile`` the parts of ``module`` in place (parameter names unchanged): every attention part, the
    head (norm, LM head and loss: compiled, the loss reads the bf16 logits once instead of writing and reading an
    fp32 copy of them, 2.5 GB per 4,096 tokens at a 152K vocabulary), and the elementwise middle of every expert
    shard (``grouped_experts.compiled_elementwise``)."""
    for sub in module.modules():
        if isinstance(sub, AttentionPart | Head):
            sub.compile()
        elif isinstance(sub, ExpertShard):
            sub.elementwise = compiled_elementwise()


# ----------------------------------------------------------------------------------------------------------------
# Facts of the whole model, from its config (the preflight knows no more) or, for the router's output, its modules
# ----------------------------------------------------------------------------------------------------------------


def num_experts_of(config) -> int:
    """E, the routed experts of every MoE layer, from the HF config."""
    return getattr(config, family_of(config).num_experts_attr)


def residual_shape(config) -> tuple[int, int, int]:
    """A token's residual in the hand-off (``comm.messages.Dims``): its streams, the routed sum's weights (one per
    stream with hyper-connections, else none) and its token-id columns (one where some layer routes by token id)."""
    hyper = family_of(config).hyper
    streams = 1 if hyper is None else hyper.streams(config)
    return streams, 0 if hyper is None else streams, int(any(token_routed_layers(config.to_dict())))


def num_routed_experts(model: nn.Module) -> int:
    """E of ``model`` (its config's ``num_experts_of``)."""
    return num_experts_of(model.config)


@dataclass(frozen=True)
class RoutingFacts:
    """What a rank's runners need to know of the whole model's routing once its own parts are cut.

    Attributes:
        moe_layers: one bool per layer, True where it routes (``moe_pattern.moe_layer_pattern`` of the config).
        top_k: K, experts chosen per token.
        weight_dtype: dtype of the routing weights (fp32 for Mixtral/DeepSeek even in bf16 models).
    """

    moe_layers: tuple[bool, ...]
    top_k: int
    weight_dtype: torch.dtype


def routing_facts(model: nn.Module) -> RoutingFacts:
    """The ``RoutingFacts`` of ``model`` (on the meta device too): its first router runs once on a zero token."""
    moe = moe_layer_pattern(model.config.to_dict())
    family = family_of(model.config)
    block = model.model.layers[moe.index(True)].mlp
    router = getattr(block, family.router_attr)
    param = next(model.parameters())
    with torch.no_grad():
        x_1H = torch.zeros(1, model.config.hidden_size, dtype=param.dtype, device=param.device)
        token_1 = torch.zeros(1, dtype=torch.long, device=param.device)  # for a router that reads token ids
        _, weights, _ = route(family, block, x_1H, token_1)
    return RoutingFacts(moe, router.top_k, weights.dtype)
