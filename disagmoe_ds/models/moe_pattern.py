"""Which decoder layers route to experts, from the model config alone (pure Python: no torch, no transformers).

The one rule for the runtime (``models.parts.routing_facts``, the preflights of both modes) and, being pure, for
the planner. HF builds a layer's MLP as (hf-notes section 1):

    deepseek_v2, deepseek_v3, glm4_moe  MoE from layer ``first_k_dense_replace`` on (HF's defaults: 0, 3, 1)
    qwen2_moe, qwen3_moe      MoE unless in ``mlp_only_layers``, and only every ``decoder_sparse_step``-th layer
    mixtral, olmoe, gpt_oss   every layer MoE

>>> moe_layer_pattern({"model_type": "qwen2_moe", "num_hidden_layers": 4, "mlp_only_layers": [0]})
(False, True, True, True)
>>> moe_layer_pattern({"model_type": "deepseek_v3", "num_hidden_layers": 4})
(False, False, False, True)
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

_FIRST_DENSE_DEFAULT = {"deepseek_v2": 0, "deepseek_v3": 3, "glm4_moe": 1}


def moe_layer_pattern(config: Mapping[str, Any]) -> tuple[bool, ...]:
    """One bool per layer, True where it has routed experts; ``config`` is a config.json dict (an HF config's
    ``to_dict()``)."""
    model_type, num_layers = config["model_type"], config["num_hidden_layers"]
    if model_type in _FIRST_DENSE_DEFAULT:
        first_dense = config.get("first_k_dense_replace", _FIRST_DENSE_DEFAULT[model_type])
        return tuple(i >= first_dense for i in range(num_layers))
    if model_type in ("qwen2_moe", "qwen3_moe"):
        dense = set(config.get("mlp_only_layers") or ())
        step = config.get("decoder_sparse_step", 1) or 1
        return tuple(i not in dense and (i + 1) % step == 0 for i in range(num_layers))
    return (True,) * num_layers
