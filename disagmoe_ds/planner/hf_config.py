"""A Hugging Face MoE config.json read into the planner's vocabulary (pure Python; transformers is not imported).

Supported ``model_type``s: the runtime's families (``models.moe_pattern.MODEL_TYPES``: qwen2_moe, qwen3_moe,
mixtral, olmoe, deepseek_v2/v3/v32/v4, glm4_moe, gpt_oss, qwen3_next, qwen3_5_moe_text, ernie4_5_moe,
hunyuan_v1_moe, dots1, minimax_m2), and qwen3_5_moe, read through its ``text_config``. Which layers route is the
runtime's rule (``moe_pattern.moe_layer_pattern``). Field names differ per family; the maps below resolve them, by
the family's facts (``capabilities.facts.FACTS``, the record the runtime reads too), into ``model_fields``, the
keyword arguments of ``model.ModelSpec``, into an ``AttentionSpec`` and, for the hybrid Qwen3-Next / Qwen3.5 layers,
a ``LinearAttentionSpec``; DeepSeek-V4's attention and hyper-connection streams are ``compressed_attention``'s.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from disagmoe_ds.capabilities.facts import FACTS, FamilyFacts
from disagmoe_ds.capabilities.uncut import check_uncut
from disagmoe_ds.errors import ConfigError, UnsupportedModelError
from disagmoe_ds.models.moe_pattern import (
    MODEL_TYPES,
    VISION_LANGUAGE,
    language_model_config,
    moe_layer_pattern,
    token_routed_layers,
)
from disagmoe_ds.planner.compressed_attention import compressed_attention
from disagmoe_ds.planner.inputs import read_json

SUPPORTED_TYPES = (*MODEL_TYPES, *VISION_LANGUAGE)  # the runtime's families, one record (capabilities.facts)


@dataclass(frozen=True)
class AttentionSpec:
    """Self-attention shape. ``kind`` is "gqa" (MHA/GQA/MQA) or "mla" (DeepSeek multi-head latent attention)."""

    kind: Literal["gqa", "mla"]
    num_heads: int
    num_kv_heads: int
    head_dim: int  # GQA head size; for MLA the query/key head size qk_nope + qk_rope
    v_head_dim: int
    q_lora_rank: int = 0  # MLA only; 0 means a direct q_proj
    kv_lora_rank: int = 0  # MLA only
    qk_rope_head_dim: int = 0  # MLA only
    qkv_bias: bool = False
    o_bias: bool = False
    qk_norm: Literal["", "head", "full"] = ""  # Qwen3: per-head RMSNorm; OLMoE: over the whole projection
    sinks: bool = False  # GPT-OSS learned attention sinks, one per head
    output_gate: bool = False  # Qwen3-Next / Qwen3.5: q_proj also gives a sigmoid gate on the attention output
    # DeepSeek-V3.2's lightning indexer (DeepSeek Sparse Attention): heads of this size scoring keys from the query
    # latent; its parameters are counted, its FLOPs and the sparse core are costed as dense MLA (not yet specific)
    indexer_heads: int = 0
    indexer_head_dim: int = 0


@dataclass(frozen=True)
class LinearAttentionSpec:
    """Gated DeltaNet (Qwen3-Next / Qwen3.5 linear-attention layers): projections to q, k (``num_k_heads`` x
    ``head_k_dim``), v and the output gate z (``num_v_heads`` x ``head_v_dim``) and to the per-head beta and decay,
    a depthwise causal conv of ``conv_kernel`` over q, k, v, the chunked delta rule, a gated norm, out_proj."""

    num_k_heads: int
    num_v_heads: int
    head_k_dim: int
    head_v_dim: int
    conv_kernel: int
    split_in_proj: bool = False  # Qwen3.5: in_proj_qkv, in_proj_z, in_proj_b, in_proj_a (Qwen3-Next: qkvz, ba)

    @property
    def key_dim(self) -> int:
        return self.num_k_heads * self.head_k_dim

    @property
    def value_dim(self) -> int:
        return self.num_v_heads * self.head_v_dim


def read_model_config(path: str | Path) -> tuple[dict[str, Any], str]:
    """(config dict, model name) of ``path``: a model directory holding config.json, or the json file itself."""
    path = Path(path)
    file = path / "config.json" if path.is_dir() else path
    if not file.is_file():
        raise ConfigError(f"--model {path}: no config.json there; pass a Hugging Face model directory or its config")
    cfg = read_json(file, "--model")
    return cfg, file.parent.name if file.name == "config.json" else file.stem


def model_fields(cfg: dict[str, Any]) -> dict[str, Any]:
    """``ModelSpec``'s fields but its name, from a config.json dict; ``UnsupportedModelError`` / ``ConfigError``
    name the field at fault."""
    check_uncut(cfg)  # known families the runtime cannot cut yet, refused as the runtime refuses them
    cfg = dict(language_model_config(cfg))
    model_type = cfg.get("model_type")
    if model_type not in SUPPORTED_TYPES:
        raise UnsupportedModelError(
            f"model_type {model_type!r} is not supported by the planner; supported: {', '.join(SUPPORTED_TYPES)}"
        )
    num_layers, facts = _int(cfg, "num_hidden_layers"), FACTS[model_type]
    experts = _experts(cfg, facts)
    return {
        "model_type": model_type,
        "hidden_size": _int(cfg, "hidden_size"),
        "num_layers": num_layers,
        "vocab_size": _int(cfg, "vocab_size"),
        "tie_word_embeddings": bool(cfg.get("tie_word_embeddings", False)),
        "attention": _attention(cfg, facts),
        "moe_layers": _moe_layers(cfg),
        "windows": _windows(cfg, facts, num_layers),
        **experts,
        **_linear_attention(cfg, facts, num_layers),
        **_hyper(cfg, facts, num_layers),
    }


# ----- family field maps -----
def _int(cfg: dict[str, Any], *names: str, default: int | None = None) -> int:
    """First present, non-null field of ``names`` as an int; ConfigError naming the field if none is."""
    for name in names:
        value = cfg.get(name)
        if value is not None:
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ConfigError(f"config field {name} must be a non-negative integer, got {value!r}")
            return value
    if default is None:
        raise ConfigError(f"config.json lacks {' / '.join(names)} (model_type {cfg.get('model_type')!r})")
    return default


def _experts(cfg: dict[str, Any], facts: FamilyFacts) -> dict[str, Any]:
    """Routed/shared/dense MLP sizes: num_experts | num_local_experts | n_routed_experts, etc."""
    # ERNIE-4.5: moe_num_experts, moe_k; Hunyuan: moe_topk (a per-layer list is refused here, by _int)
    num_experts = _int(cfg, "num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")
    top_k = _int(cfg, "num_experts_per_tok", "experts_per_token", "moe_k", "moe_topk")
    if not 1 <= top_k <= num_experts:
        raise ConfigError(f"num_experts_per_tok ({top_k}) must be between 1 and the expert count ({num_experts})")
    expert_i = _int(cfg, facts.expert_width_field)
    shared = 0
    if facts.shared_experts == "gated":  # one sigmoid-gated shared expert of its own size
        shared = _int(cfg, "shared_expert_intermediate_size", default=0)
    elif facts.shared_experts == "experts":  # a count of shared experts of the routed ones' size
        field, default = facts.shared_count
        shared = _int(cfg, field, default=default) * expert_i
    elif facts.shared_experts == "mlp":  # one shared MLP of the experts' size
        shared = expert_i
    return {
        "num_experts": num_experts,
        "top_k": top_k,
        "expert_intermediate": expert_i,
        "dense_intermediate": _int(cfg, "intermediate_size", default=0) if facts.moe_intermediate else 0,
        "shared_intermediate": shared,
        "shared_gate": facts.shared_experts == "gated" and shared > 0,
        "expert_bias": facts.experts == "gpt_oss",
        # GPT-OSS's router bias; ERNIE's correction bias is a (frozen) parameter of the same size
        "router_bias": facts.router_bias,
    }


def _attention(cfg: dict[str, Any], facts: FamilyFacts) -> AttentionSpec:
    heads = _int(cfg, "num_attention_heads")
    hidden = _int(cfg, "hidden_size")
    if facts.attention == "compressed":  # one K=V head; its own terms are compressed_attention's
        head_dim = _int(cfg, "head_dim", default=512)
        return AttentionSpec(kind="gqa", num_heads=heads, num_kv_heads=1, head_dim=head_dim, v_head_dim=head_dim)
    if facts.attention == "mla":
        rope, nope = _int(cfg, "qk_rope_head_dim"), _int(cfg, "qk_nope_head_dim")
        return AttentionSpec(
            kind="mla",
            num_heads=heads,
            num_kv_heads=heads,
            head_dim=rope + nope,
            v_head_dim=_int(cfg, "v_head_dim"),
            q_lora_rank=_int(cfg, "q_lora_rank", default=0),
            kv_lora_rank=_int(cfg, "kv_lora_rank"),
            qk_rope_head_dim=rope,
            qkv_bias=bool(cfg.get("attention_bias", False)),
            o_bias=bool(cfg.get("attention_bias", False)),
            indexer_heads=_int(cfg, "index_n_heads", default=0) if facts.indexer else 0,
            indexer_head_dim=_int(cfg, "index_head_dim", default=0) if facts.indexer else 0,
        )
    head_dim = _int(cfg, "head_dim", default=hidden // heads)
    bias_field, bias_default = facts.bias
    bias = bool(cfg.get(bias_field, bias_default))
    return AttentionSpec(
        kind="gqa",
        num_heads=heads,
        num_kv_heads=_int(cfg, "num_key_value_heads", default=heads),
        head_dim=head_dim,
        v_head_dim=head_dim,
        qkv_bias=bias,
        o_bias=bias and facts.o_bias,
        qk_norm="head" if cfg.get("use_qk_norm") else facts.qk_norm,
        sinks=facts.sinks,
        output_gate=bool(facts.linear_attention),
    )


def _linear_attention(cfg: dict[str, Any], facts: FamilyFacts, num_layers: int) -> dict[str, Any]:
    """``linear_layers`` (True where ``layer_types`` says "linear_attention") and their ``LinearAttentionSpec``."""
    if not facts.linear_attention:
        return {"linear_attention": None, "linear_layers": (False,) * num_layers}
    types = cfg.get("layer_types")
    if types is None:  # HF's default: every full_attention_interval-th layer full, the others linear
        interval = _int(cfg, "full_attention_interval", default=4) or 4
        types = ["linear_attention" if (i + 1) % interval else "full_attention" for i in range(num_layers)]
    if len(types) != num_layers:
        raise ConfigError(f"layer_types has {len(types)} entries but num_hidden_layers is {num_layers}")
    spec = LinearAttentionSpec(
        num_k_heads=_int(cfg, "linear_num_key_heads", default=16),
        num_v_heads=_int(cfg, "linear_num_value_heads", default=32),
        head_k_dim=_int(cfg, "linear_key_head_dim", default=128),
        head_v_dim=_int(cfg, "linear_value_head_dim", default=128),
        conv_kernel=_int(cfg, "linear_conv_kernel_dim", default=4),
        split_in_proj=facts.linear_attention == "split",
    )
    return {"linear_attention": spec, "linear_layers": tuple(t == "linear_attention" for t in types)}


def _hyper(cfg: dict[str, Any], facts: FamilyFacts, num_layers: int) -> dict[str, Any]:
    """DeepSeek-V4: its attention (``compressed_attention``), its residual streams (``hc_mult``, HF's default 4) and
    whether a layer routes by token id (the residual hand-off then carries the ids)."""
    if not facts.hyper_connections:
        return {}
    return {
        "compressed": compressed_attention(cfg, num_layers),
        "hc_streams": _int(cfg, "hc_mult", default=4),
        "token_routed": any(token_routed_layers(cfg)),
    }


def _moe_layers(cfg: dict[str, Any]) -> tuple[bool, ...]:
    """Which layers route: the runtime's rule (``models.moe_pattern``), the integer fields it reads checked first so
    that a bad one is a ``ConfigError`` naming it."""
    for name in ("first_k_dense_replace", "decoder_sparse_step"):
        _int(cfg, name, default=0)
    return moe_layer_pattern(cfg)


def _windows(cfg: dict[str, Any], facts: FamilyFacts, num_layers: int) -> tuple[int, ...]:
    """Per-layer sliding window (0 = full causal), from layer_types or the family's default rule (``windows``)."""
    window = cfg.get("sliding_window") or 0
    types = cfg.get("layer_types")
    if types is not None:
        if len(types) != num_layers:
            raise ConfigError(f"layer_types has {len(types)} entries but num_hidden_layers is {num_layers}")
        return tuple(window if t == "sliding_attention" else 0 for t in types)
    if facts.window_switch and not cfg.get("use_sliding_window", False):
        return (0,) * num_layers
    if facts.windows == "even":
        return tuple(window if i % 2 == 0 else 0 for i in range(num_layers))
    if facts.windows == "even_below_max":
        last = _int(cfg, "max_window_layers", default=num_layers)
        return tuple(window if i % 2 == 0 and i < last else 0 for i in range(num_layers))
    if facts.windows == "every":
        return (window,) * num_layers
    return (0,) * num_layers
