"""Families DisagMoE-DS knows and cannot cut yet, refused before launch in one line naming the layer and the reason.

The cut hands every layer's attention part a residual (one stream, or DeepSeek-V4's hyper-connection streams with the
routed sum's weight per stream, ``models.hyper_connections``), adds the routed experts' sum to it as it arrives
(``attention_part.AttentionOutput``; the next A-group does the add, ``afpipe.attention_runner``), and gives the
attention parts hidden states and, where a layer routes by token id (DeepSeek-V4's hash-routed layers), the token ids.
How DeepSeek-V4's layers are cut: the attention part holds ``attn_hc``, the input norm, ``self_attn`` (sliding window,
compressor and frozen indexer), ``ffn_hc``, the post-attention norm, the router (hash or learned) and the shared expert,
and hands on ``comb^T @ streams + post * shared`` with ``post``; A_next adds ``post * routed``. One issue-29 family
needs more (HF 5.24's modules):

    gemma4_text   (and the Hub's ``gemma4``, through its ``text_config``) the experts sit beside a dense MLP and their
                  sum is normalised (``post_feedforward_layernorm_2``), added to the MLP's, normalised again
                  (``post_feedforward_layernorm``) and scaled (``layer_scalar``) around the residual add; optional
                  per-layer token embeddings (``hidden_size_per_layer_input``) and keys and values shared across layers
                  (``num_kv_shared_layers``).

Read from the config.json dict alone (no torch), so the runtime's preflight (``models.loading.load_config``) and the
planner (``planner.hf_config``) refuse alike. What a family that is cut cannot run with yet is in its facts
(``capabilities.facts.FamilyFacts.not_with``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from disagmoe_ds.errors import UnsupportedModelError

# One reason per structure the cut cannot hold, each naming its layers.
ReasonsFn = Callable[[Mapping[str, Any]], list[str]]
_NOT_YET = "not supported yet (the README's Model families table lists what is)"


def _layers(indices: list[int]) -> str:
    """``layer 3``, ``layers 0-2`` (contiguous), ``layers 1, 4``; ``every layer`` if the count is unknown."""
    if not indices:
        return "every layer"
    if len(indices) == 1:
        return f"layer {indices[0]}"
    if indices == list(range(indices[0], indices[-1] + 1)):
        return f"layers {indices[0]}-{indices[-1]}"
    return f"layers {', '.join(map(str, indices))}"


def _gemma4_text(cfg: Mapping[str, Any]) -> list[str]:
    num_layers = cfg.get("num_hidden_layers", 0)
    if not cfg.get("enable_moe_block", False):
        return ["it has no MoE layer (enable_moe_block is false): nothing to put on the expert side"]
    reasons = [
        f"{_layers(list(range(num_layers)))} run their experts beside a dense MLP and normalise the experts' sum "
        "(post_feedforward_layernorm_2, then post_feedforward_layernorm with the MLP's) and scale the layer's output "
        "(layer_scalar), while the cut adds the experts' sum to the residual as it arrives"
    ]
    shared = cfg.get("num_kv_shared_layers", 0)
    if shared:
        reasons.append(
            f"{_layers(list(range(num_layers - shared, num_layers)))} reuse earlier layers' keys and values "
            "(num_kv_shared_layers), which one A-group does not hand to the next"
        )
    per_layer = cfg.get("hidden_size_per_layer_input", 256)  # HF's default
    if per_layer:
        reasons.append(
            f"every layer adds a per-layer embedding of the token ids (hidden_size_per_layer_input {per_layer}), "
            "while the attention parts get hidden states only"
        )
    return reasons


UNCUT: dict[str, ReasonsFn] = {"gemma4_text": _gemma4_text}
# config.json model_types whose language model is the ``text_config`` of a vision-language config.
_TEXT_OF = {"gemma4": "gemma4_text"}


def check_uncut(cfg: Mapping[str, Any]) -> None:
    """Refuse a config.json dict of a family in ``UNCUT`` (``refusal``); other configs pass."""
    line = refusal(cfg)
    if line is not None:
        raise UnsupportedModelError(line)


def refusal(cfg: Mapping[str, Any]) -> str | None:
    """The one line refusing a config.json dict of a family in ``UNCUT``: its model type, every reason with its
    layers, and that it is not supported yet; None for other configs."""
    model_type = cfg.get("model_type")
    what = f"the {model_type} config"
    if model_type in _TEXT_OF:
        cfg = {**cfg.get("text_config", {}), "model_type": _TEXT_OF[model_type]}
        what = f"the {model_type} config's text model ({cfg['model_type']})"
        model_type = cfg["model_type"]
    if model_type not in UNCUT:
        return None
    return f"{what} cannot be cut by DisagMoE-DS: {'; '.join(UNCUT[model_type](cfg))}; {_NOT_YET}"
