"""Per-family facts as data: where HF keeps the router, the shared experts and the expert count.

Qwen2-MoE, Qwen3-MoE, Mixtral, OLMoE, GPT-OSS, DeepSeek-V2, DeepSeek-V3, GLM-4.5-style MoE (``glm4_moe``),
Qwen3-Next and Qwen3.5-MoE (its text model, ``qwen3_5_moe_text``), ERNIE-4.5-MoE, Hunyuan-MoE (v1), dots.llm1,
MiniMax-M2 and DeepSeek-V4.

Every supported family builds its decoder layer from the same template (a token mixer, ``mlp``, two norms), and
its MoE block holds a router module that returns ``(router_logits, top_k_weights, top_k_index)`` plus a fused
``experts`` module. What differs is captured here, so that splitting a layer never branches on class names.

The token mixer is ``self_attn`` (softmax attention), or, in the hybrid Qwen3-Next / Qwen3.5 layers whose
``config.layer_types[i]`` is ``"linear_attention"``, ``linear_attn`` (Gated DeltaNet); ``mixer_attr`` says which.

DeepSeek-V4 adds four facts: a residual of several streams (``hyper``: hyper-connections,
``models.hyper_connections``), rotary tables by name instead of one (``rotary_tables``), layer types that share
another type's mask (``mask_types``), and a token id -> experts table for the first layers, which choose their
experts by token id (``token_table``; ``moe_pattern.token_routed_layers``: the router takes the token ids, ``route``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from disagmoe_ds.errors import UnsupportedModelError
from disagmoe_ds.models.hyper_connections import HyperConnections
from disagmoe_ds.models.moe_pattern import VISION_LANGUAGE
from disagmoe_ds.models.uncut import check_uncut

SharedFn = Callable[[nn.Module, torch.Tensor], torch.Tensor | None]
# (block, x_TH, token_ids_T or None) -> (router_logits, top_k_weights, top_k_index)
RouteFn = Callable[[nn.Module, torch.Tensor, torch.Tensor | None], tuple[torch.Tensor, torch.Tensor, torch.Tensor]]


def _qwen2_shared(block: nn.Module, x_TH: torch.Tensor) -> torch.Tensor:
    # Qwen2-MoE gates its shared expert per token with a sigmoid.
    return F.sigmoid(block.shared_expert_gate(x_TH)) * block.shared_expert(x_TH)


def _deepseek_shared(block: nn.Module, x_TH: torch.Tensor) -> torch.Tensor | None:
    # ERNIE-4.5 builds none when moe_num_shared_experts is 0.
    return None if block.shared_experts is None else block.shared_experts(x_TH)


def _hunyuan_shared(block: nn.Module, x_TH: torch.Tensor) -> torch.Tensor:
    return block.shared_mlp(x_TH)


def _minimax_route(
    block: nn.Module, x_TH: torch.Tensor, token_ids_T: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    # MiniMax-M2 keeps its correction bias on the MoE block and hands it to the router.
    return block.gate(x_TH, block.e_score_correction_bias)


def _deepseek_v4_route(
    block: nn.Module, x_TH: torch.Tensor, token_ids_T: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    # DeepSeek-V4's hash-routed blocks (``is_hash``) take the token ids: their experts are ``tid2eid[input_ids]``.
    if block.is_hash:
        if token_ids_T is None:
            raise RuntimeError("a hash-routed DeepSeek-V4 layer needs the token ids (LayerContext.token_ids)")
        return block.gate(x_TH, token_ids_T)
    return block.gate(x_TH)


@dataclass(frozen=True)
class Family:
    """How one HF MoE family lays out its MoE block.

    Attributes:
        model_type: ``config.model_type``.
        router_attr: attribute of the MoE block holding the router (``gate``, or ``router`` for GPT-OSS).
        router_weight: the router's [E, H] weight, as a dotted path from the router (``wg.weight`` for Hunyuan).
        num_experts_attr: config attribute that sets the experts module's expert count.
        shared: computes the shared-expert contribution on the attention side (None where a layer has none),
            or None.
        has_aux_loss: HF adds ``router_aux_loss_coef * load_balancing_loss`` when ``output_router_logits``.
        expert_bias_path: the correction bias of DeepSeek-V3 style auxiliary-loss-free balancing, as a dotted path
            from the MoE block (a buffer, or ERNIE's frozen parameter), or None.
        route: how the MoE block calls its router, where it is not ``router(x_TH)`` (MiniMax-M2), or None.
        mrope: the rotary embedding takes M-RoPE's (3, B, S) position ids (temporal, height, width), which for text
            are the token positions three times, as HF's model passes them (Qwen3.5; transformers 5.17 needs them).
        hyper: the residual has several streams (hyper-connections, ``models.hyper_connections``), or None.
        rotary_tables: the rotary embedding's tables, each called with ``layer_type=name`` and handed to the attention
            as a dict by name (DeepSeek-V4: ``main`` for sliding layers, ``compress`` for compressed ones); () for one.
        mask_types: (layer type, the layer type whose mask it takes) pairs, for layer types that build no mask of
            their own (DeepSeek-V4's compressed layers take the sliding-window mask, as its model does).
        token_table: a hash router's token id -> experts table, as a dotted path from the MoE block (DeepSeek-V4's
            ``gate.tid2eid``), or None. Generated weights fill it (``loading``), the skew sets it (``skew``).
    """

    model_type: str
    router_attr: str = "gate"
    router_weight: str = "weight"
    num_experts_attr: str = "num_experts"
    shared: SharedFn | None = None
    has_aux_loss: bool = True
    expert_bias_path: str | None = None
    route: RouteFn | None = None
    mrope: bool = False
    hyper: HyperConnections | None = None
    rotary_tables: tuple[str, ...] = ()
    mask_types: tuple[tuple[str, str], ...] = ()
    token_table: str | None = None

    def mask_type(self, layer_type: str) -> str:
        """The layer type whose mask a layer of ``layer_type`` takes (itself, unless ``mask_types`` says another)."""
        return dict(self.mask_types).get(layer_type, layer_type)


FAMILIES: dict[str, Family] = {
    f.model_type: f
    for f in (
        Family("qwen2_moe", shared=_qwen2_shared),
        Family("qwen3_moe", num_experts_attr="num_local_experts"),
        Family("mixtral", num_experts_attr="num_local_experts"),
        Family("olmoe"),
        Family("gpt_oss", router_attr="router", num_experts_attr="num_local_experts"),
        Family("deepseek_v2", num_experts_attr="n_routed_experts", shared=_deepseek_shared, has_aux_loss=False),
        Family(
            "deepseek_v3",
            num_experts_attr="n_routed_experts",
            shared=_deepseek_shared,
            has_aux_loss=False,
            expert_bias_path="gate.e_score_correction_bias",
        ),
        # DeepSeek-V3.2: DeepSeek-V3's MoE; its MLA attention adds a lightning indexer (DeepSeek Sparse Attention),
        # all inside ``self_attn``; layers are "indexed_attention", MoE where ``mlp_layer_types`` says "sparse".
        Family(
            "deepseek_v32",
            num_experts_attr="n_routed_experts",
            shared=_deepseek_shared,
            has_aux_loss=False,
            expert_bias_path="gate.e_score_correction_bias",
        ),
        # GLM-4.5 / 4.6 / 4.7 (Air too): DeepSeek-V3's router (sigmoid, grouped top-k, a correction bias) and shared
        # experts, dense first layers, GQA attention with partial rotary embeddings.
        Family(
            "glm4_moe",
            num_experts_attr="n_routed_experts",
            shared=_deepseek_shared,
            has_aux_loss=False,
            expert_bias_path="gate.e_score_correction_bias",
        ),
        # Qwen3-Next and Qwen3.5-MoE: Qwen2-MoE's softmax router and sigmoid-gated shared expert; layers alternate
        # Gated DeltaNet linear attention (``linear_attn``) and gated softmax attention (``self_attn``).
        Family("qwen3_next", shared=_qwen2_shared),
        Family("qwen3_5_moe_text", shared=_qwen2_shared, mrope=True),
        # ERNIE-4.5-MoE: softmax router whose top-k choice adds a correction bias (``gate.moe_statics``), ungated
        # shared experts, MoE layers from moe_layer_start_index to moe_layer_end_index every moe_layer_interval.
        Family("ernie4_5_moe", shared=_deepseek_shared, expert_bias_path="gate.moe_statics.e_score_correction_bias"),
        # Hunyuan-MoE v1 (Hunyuan-A13B): fp32 softmax router (``gate.wg``), one ungated shared MLP, every layer MoE.
        Family(
            "hunyuan_v1_moe",
            router_weight="wg.weight",
            num_experts_attr="num_local_experts",
            shared=_hunyuan_shared,
            has_aux_loss=False,
        ),
        # dots.llm1: DeepSeek-V3's router and shared experts with Qwen3's attention, dense first layers.
        Family(
            "dots1",
            num_experts_attr="n_routed_experts",
            shared=_deepseek_shared,
            has_aux_loss=False,
            expert_bias_path="gate.e_score_correction_bias",
        ),
        # MiniMax-M2: sigmoid router with a correction bias kept on the MoE block, no shared expert, every layer MoE.
        Family(
            "minimax_m2",
            num_experts_attr="num_local_experts",
            expert_bias_path="e_score_correction_bias",
            route=_minimax_route,
        ),
        # DeepSeek-V4: hyper-connections (hc_mult residual streams), one shared KV head over a sliding window plus
        # compressed keys (a compressor, and on compressed-sparse layers a frozen lightning indexer, inside
        # ``self_attn``), hash-routed first layers (``mlp_layer_types`` "hash_moe"), then a sqrt-softplus router
        # with a correction bias; one ungated shared expert; experts with a clamped SwiGLU (``swiglu_limit``).
        Family(
            "deepseek_v4",
            num_experts_attr="n_routed_experts",
            shared=_deepseek_shared,
            expert_bias_path="gate.e_score_correction_bias",
            route=_deepseek_v4_route,
            hyper=HyperConnections(),
            rotary_tables=("main", "compress"),
            mask_types=(
                ("compressed_sparse_attention", "sliding_attention"),
                ("heavily_compressed_attention", "sliding_attention"),
            ),
            token_table="gate.tid2eid",
        ),
    )
}
# config.json model_types that name a family by another model_type: Qwen3.5-MoE's Hub config is its vision-language
# model, whose ``text_config`` (``qwen3_5_moe_text``) is the language model ``AutoModelForCausalLM`` builds.
ALIASES = VISION_LANGUAGE


def family_of(config) -> Family:
    """The family adapter for an HF config, or a one-line error: the layer and the reason for a family known but
    not cut yet (``uncut``), else what is supported."""
    model_type = getattr(config, "model_type", None)
    model_type = ALIASES.get(model_type, model_type)
    if model_type not in FAMILIES:
        if hasattr(config, "to_dict"):  # an HF config (the benches build one-layer models from one)
            check_uncut(config.to_dict())
        raise UnsupportedModelError(
            f"model_type {model_type!r} is not supported by DisagMoE-DS; supported: "
            f"{', '.join(sorted([*FAMILIES, *ALIASES]))}"
        )
    return FAMILIES[model_type]


def is_moe_layer(layer: nn.Module) -> bool:
    """A built decoder layer is MoE iff its ``mlp`` holds routed experts: what HF built, where
    ``moe_pattern.moe_layer_pattern`` is the rule read from the config (a test holds the two equal for every config in
    hf_models/)."""
    return hasattr(layer.mlp, "experts")


def router_of(family: Family, layer: nn.Module) -> nn.Module:
    return getattr(layer.mlp, family.router_attr)


def route(
    family: Family, block: nn.Module, x_TH: torch.Tensor, token_ids_T: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(router_logits, top_k_weights, top_k_index)`` of the MoE block ``block`` for tokens ``x_TH`` (their ids
    ``token_ids_T`` where the layer routes by token id), its router called as the block calls it."""
    if family.route is not None:
        return family.route(block, x_TH, token_ids_T)
    return getattr(block, family.router_attr)(x_TH)


def expert_bias_of(family: Family, block: nn.Module) -> torch.Tensor | None:
    """The correction bias of an MoE block whose family has one (``expert_bias_path``); None for a block of it that
    has none (DeepSeek-V4's hash-routed blocks: a token's table chooses, nothing to balance)."""
    if family.expert_bias_path is None:
        raise UnsupportedModelError(f"model_type {family.model_type!r} has no router correction bias")
    owner_path, _, name = family.expert_bias_path.rpartition(".")
    return getattr(block.get_submodule(owner_path), name, None)


def token_table_of(family: Family, block: nn.Module) -> torch.Tensor | None:
    """The token id -> experts table ([V, K] int64) of a hash-routed MoE block (``Family.token_table``), else None."""
    if family.token_table is None:
        return None
    owner_path, _, name = family.token_table.rpartition(".")
    try:
        owner = block.get_submodule(owner_path)
    except AttributeError:  # a dense layer's MLP
        return None
    return getattr(owner, name, None)


def mixer_attr(layer: nn.Module) -> str:
    """The decoder layer's token mixer: ``linear_attn`` (Gated DeltaNet layers of Qwen3-Next / Qwen3.5) or
    ``self_attn``."""
    return "linear_attn" if hasattr(layer, "linear_attn") else "self_attn"


# Layer types the attention parts build a mask for (``context.build_context``).
LAYER_TYPES = ("full_attention", "sliding_attention", "linear_attention", "indexed_attention")


def check_cut(config) -> None:
    """Refuse, in one line naming the layer and the reason, a config the cut cannot hold (before any rank starts).

    * a layer type the attention parts have no mask for (``LAYER_TYPES``);
    * a per-layer expert count or top-k (Hunyuan's ``num_experts`` / ``moe_topk`` may be lists): every MoE
      layer's experts are sharded alike and every exchange carries one K.
    """
    family = family_of(config)
    for i, kind in enumerate(getattr(config, "layer_types", None) or ()):
        if family.mask_type(kind) not in LAYER_TYPES:
            raise UnsupportedModelError(
                f"layer {i} of the {config.model_type} config is a {kind!r} layer, which DisagMoE-DS cannot cut "
                f"(its attention parts handle {', '.join(LAYER_TYPES)})"
            )
    for attr in ("num_experts", "moe_topk"):
        value = getattr(config, attr, None)
        if isinstance(value, list | tuple):
            other = next((i for i, v in enumerate(value) if v != value[0]), 0)
            raise UnsupportedModelError(
                f"layer {other} of the {config.model_type} config has its own {attr} ({value[other]}; layer 0: "
                f"{value[0]}): DisagMoE-DS needs one {attr} for every MoE layer; write it as one number"
            )
