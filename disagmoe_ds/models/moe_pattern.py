"""Which families DisagMoE-DS cuts and which of their decoder layers route to experts, from the model config alone
(pure Python: no torch, no transformers).

``MODEL_TYPES`` is the one table of the families: the runtime's adapters (``families.FAMILIES``), the expert
kernels (``grouped_experts.GATED_FUSED_FAMILIES``) and the planner's field maps (``planner.hf_config``) are held to
it. ``moe_layer_pattern`` is the one rule for the runtime (``models.model_facts.routing_facts``, the preflights of both
modes) and the planner (``planner.hf_config``); HF's built modules agree with it (``families.is_moe_layer``, tested
for every config in hf_models/). HF builds a layer's MLP as (hf-notes section 1):

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

# The families DisagMoE-DS cuts, by their language model's model_type.
MODEL_TYPES = (
    "qwen2_moe",
    "qwen3_moe",
    "mixtral",
    "olmoe",
    "deepseek_v2",
    "deepseek_v3",
    "deepseek_v32",
    "glm4_moe",
    "gpt_oss",
    "qwen3_next",
    "qwen3_5_moe_text",
    "ernie4_5_moe",
    "hunyuan_v1_moe",
    "dots1",
    "minimax_m2",
    "deepseek_v4",
)
# config.json model_type -> its text_config's: Qwen3.5-MoE's Hub config is its vision-language model's.
VISION_LANGUAGE = {"qwen3_5_moe": "qwen3_5_moe_text"}

_FIRST_DENSE_DEFAULT = {"deepseek_v2": 0, "deepseek_v3": 3, "deepseek_v32": 3, "glm4_moe": 1, "dots1": 0}
_QWEN_SPARSE_STEP = ("qwen2_moe", "qwen3_moe", "qwen3_next")
_HASH_LAYERS_DEFAULT = {"deepseek_v4": 3}  # HF's default_num_hash_layers


def _first_dense(config: Mapping[str, Any]) -> int:
    """DeepSeek-style dense first layers: ``first_k_dense_replace``, HF's family default where absent or null."""
    value = config.get("first_k_dense_replace")
    return _FIRST_DENSE_DEFAULT[config["model_type"]] if value is None else value


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
    model_type, num_layers = config["model_type"], config["num_hidden_layers"]
    if model_type == "deepseek_v32" and config.get("mlp_layer_types"):
        return tuple(kind == "sparse" for kind in config["mlp_layer_types"])
    if model_type in _FIRST_DENSE_DEFAULT:
        first_dense = _first_dense(config)
        return tuple(i >= first_dense for i in range(num_layers))
    if model_type in _QWEN_SPARSE_STEP:
        dense = set(config.get("mlp_only_layers") or ())
        step = config.get("decoder_sparse_step") or 1
        return tuple(i not in dense and (i + 1) % step == 0 for i in range(num_layers))
    if model_type == "ernie4_5_moe":
        start, end = config.get("moe_layer_start_index", 1), config.get("moe_layer_end_index", -1)
        end = num_layers - 1 if end == -1 else end
        interval = config.get("moe_layer_interval", 1)
        return tuple((i + 1) % interval == 0 and start <= i <= end for i in range(num_layers))
    return (True,) * num_layers


def token_routed_layers(config: Mapping[str, Any]) -> tuple[bool, ...]:
    """One bool per layer, True where the MoE layer chooses its experts by token id (DeepSeek-V4's "hash_moe":
    ``tid2eid[input_ids]``), so its attention part needs the micro-batch's token ids."""
    config = language_model_config(config)
    model_type, num_layers = config["model_type"], config["num_hidden_layers"]
    if model_type not in _HASH_LAYERS_DEFAULT:
        return (False,) * num_layers
    if config.get("mlp_layer_types"):
        return tuple(kind == "hash_moe" for kind in config["mlp_layer_types"])
    hashed = config.get("num_hash_layers", _HASH_LAYERS_DEFAULT[model_type])  # a legacy field HF still reads
    return tuple(i < hashed for i in range(num_layers))


def aux_layer_pattern(config: Mapping[str, Any]) -> tuple[bool, ...]:
    """One bool per layer, True where the router's logits enter the aux loss: the MoE layers whose choice is learned
    (HF records only its top-k routers' logits; a token-routed layer has no choice to balance)."""
    return tuple(m and not t for m, t in zip(moe_layer_pattern(config), token_routed_layers(config), strict=True))
