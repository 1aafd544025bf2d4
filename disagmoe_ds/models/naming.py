"""Map parameter names of ``AttentionStage`` / ``ExpertStage`` to the HF model's in-memory names.

Attention-side names are HF's minus the ``model.`` prefix, except the head; expert-side names point at a slice
``[first_expert, first_expert + num_local)`` of HF's fused expert tensors (dim 0 is the expert dim).
"""

from __future__ import annotations

# The head's modules: the final norm, the LM head and, with hyper-connections, DeepSeek-V4's stream collapse.
_HEAD = {"head.norm.": "model.norm.", "head.lm_head.": "lm_head.", "head.hc_head.": "model.hc_head."}


def attention_name_to_hf(name: str) -> str:
    for ours, theirs in _HEAD.items():
        if name.startswith(ours):
            return theirs + name[len(ours) :]
    return "model." + name


def expert_name_to_hf(name: str) -> str:
    """``layers.3.experts.gate_up_proj`` -> ``model.layers.3.mlp.experts.gate_up_proj``."""
    layer, rest = name.split(".experts.", 1)
    return f"model.{layer}.mlp.experts.{rest}"
