"""Which families DisagMoE-DS cuts and which of their decoder layers route to experts, from the model config alone
(pure Python: no torch, no transformers).

``MODEL_TYPES`` are the families of the one record of their facts (``capabilities.facts.FACTS``), which the
runtime's adapters (``families.FAMILIES``), the expert kernels (``grouped_experts.GATED_FUSED_FAMILIES``) and the
planner's field maps (``planner.hf_config``) read. ``moe_layer_pattern`` is the one rule for the runtime
(``models.model_facts.routing_facts``, the preflights of both modes) and the planner
(``planner.hf_config``); HF's built modules agree with it (``families.is_moe_layer``, tested
for every config in hf_models/). HF builds a layer's MLP as (hf-notes section 1; each family's
``FamilyFacts.moe_layers`` and ``first_dense``):

    deepseek_v2, deepseek_v3, glm4_moe, dots1  MoE from layer ``first_k_dense_replace`` on (HF's defaults: 0, 3,
                              1, 0)
    deepseek_v32              MoE where ``mlp_layer_types`` says "sparse" (HF fills it from
                              ``first_k_dense_replace``, default 3)
    ernie4_5_moe              MoE from ``moe_layer_start_index`` (default 1) to ``moe_layer_end_index`` (default
                              -1: the last layer), every ``moe_layer_interval``-th layer
    qwen2_moe, qwen3_moe, qwen3_next  MoE unless in ``mlp_only_layers``, and only every ``decoder_sparse_step``-th
                              layer
    mixtral, olmoe, gpt_oss, qwen3_5_moe(_text), hunyuan_v1_moe, minimax_m2, deepseek_v4  every layer MoE

DeepSeek-V4's MoE layers route by token id where ``mlp_layer_types`` says "hash_moe" (HF's default: the first
``num_hash_layers``, 3), by a learned router elsewhere (``token_routed_layers``); only the learned routers' logits
enter HF's aux loss (``aux_layer_pattern``).

A vision-language config.json (``qwen3_5_moe``) is read through its ``text_config`` (``language_model_config``).

>>> moe_layer_pattern({"model_type": "qwen2_moe", "num_hidden_layers": 4, "mlp_only_layers": [0]})
(False, True, True, True)
>>> moe_layer_pattern({"model_type": "deepseek_v3", "num_hidden_layers": 4})
(False, False, False, True)
>>> token_routed_layers({"model_type": "deepseek_v4", "num_hidden_layers": 4})
(True, True, True, False)
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from disagmoe_ds.capabilities.facts import FACTS, VISION_LANGUAGE

# The families DisagMoE-DS cuts, by their language model's model_type.
MODEL_TYPES = tuple(FACTS)


def _first_dense(config: Mapping[str, Any]) -> int:
    """DeepSeek-style dense first layers: ``first_k_dense_replace``, HF's family default where absent or null."""
    value = config.get("first_k_dense_replace")
    return FACTS[config["model_type"]].first_dense if value is None else int(value)


def language_model_config(config: Mapping[str, Any]) -> Mapping[str, Any]:
    """The language model's fields of a config.json dict: its ``text_config`` where the json is a vision-language
    model's (Qwen3.5-MoE's Hub config), else the dict itself."""
    model_type = config.get("model_type")
    if model_type not in VISION_LANGUAGE:
        return config
    return {"model_type": VISION_LANGUAGE[model_type], **config.get("text_config", {})}


def moe_layer_pattern(config: Mapping[str, Any]) -> tuple[bool, ...]:
    """One bool per layer, True where it has routed experts; ``config`` is a config.json dict (an HF config's
    ``to_dict()``)."""
    config = language_model_config(config)
    facts = FACTS.get(config["model_type"])
    num_layers, rule = config["num_hidden_layers"], "every" if facts is None else facts.moe_layers
    if rule == "mlp_layer_types" and config.get("mlp_layer_types"):
        return tuple(kind == "sparse" for kind in config["mlp_layer_types"])
    if rule in ("first_k_dense", "mlp_layer_types"):
        first_dense = _first_dense(config)
        return tuple(i >= first_dense for i in range(num_layers))
    if rule == "sparse_step":
        dense = set(config.get("mlp_only_layers") or ())
        step = config.get("decoder_sparse_step") or 1
        return tuple(i not in dense and (i + 1) % step == 0 for i in range(num_layers))
    if rule == "interval":
        start, end = config.get("moe_layer_start_index", 1), config.get("moe_layer_end_index", -1)
        end = num_layers - 1 if end == -1 else end
        interval = config.get("moe_layer_interval", 1)
        return tuple((i + 1) % interval == 0 and start <= i <= end for i in range(num_layers))
    return (True,) * num_layers


def token_routed_layers(config: Mapping[str, Any]) -> tuple[bool, ...]:
    """One bool per layer, True where the MoE layer chooses its experts by token id (DeepSeek-V4's "hash_moe":
    ``tid2eid[input_ids]``), so its attention part needs the micro-batch's token ids."""
    config = language_model_config(config)
    facts = FACTS.get(config["model_type"])
    num_layers, default = config["num_hidden_layers"], None if facts is None else facts.hash_layers
    if default is None:
        return (False,) * num_layers
    if config.get("mlp_layer_types"):
        return tuple(kind == "hash_moe" for kind in config["mlp_layer_types"])
    hashed = config.get("num_hash_layers", default)  # a legacy field HF still reads
    return tuple(i < hashed for i in range(num_layers))


def aux_layer_pattern(config: Mapping[str, Any]) -> tuple[bool, ...]:
    """One bool per layer, True where the router's logits enter the aux loss: the MoE layers whose choice is learned
    (HF records only its top-k routers' logits; a token-routed layer has no choice to balance)."""
    return tuple(m and not t for m, t in zip(moe_layer_pattern(config), token_routed_layers(config), strict=True))
