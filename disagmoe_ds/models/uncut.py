"""Families DisagMoE-DS knows and cannot cut yet, refused before launch in one line naming the layer and the reason.

The cut hands every layer's attention part one residual stream and adds the routed experts' sum to it as it
arrives (``parts.AttentionOutput``; the next A-group does the add, ``engine.runners``), and it gives the attention
parts hidden states only (the token ids stay with the embedding, on the first A-group). Two issue-29 families need
more (HF 5.24's modules):

    deepseek_v4   hyper-connections (``DeepseekV4HyperConnection``): ``hc_mult`` residual streams per token; a layer's
                  output is ``post * (experts + shared) + comb^T @ streams``, the experts' sum weighed per token and
                  stream. Hash-routed layers (``mlp_layer_types`` "hash_moe") choose experts by ``tid2eid[input_ids]``.
    gemma4_text   (and the Hub's ``gemma4``, through its ``text_config``) the experts sit beside a dense MLP and their
                  sum is normalised (``post_feedforward_layernorm_2``), added to the MLP's, normalised again
                  (``post_feedforward_layernorm``) and scaled (``layer_scalar``) around the residual add; optional
                  per-layer token embeddings (``hidden_size_per_layer_input``) and keys and values shared across layers
                  (``num_kv_shared_layers``).

Read from the config.json dict alone (no torch), so the runtime's preflight (``loading.load_config``) and the
planner (``planner.hf_config``) refuse alike.
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


def _deepseek_v4(cfg: Mapping[str, Any]) -> list[str]:
    num_layers = cfg.get("num_hidden_layers", 0)
    hc = cfg.get("hc_mult", 4)  # HF's default; V4 always builds its hyper-connections
    reasons = [
        f"{_layers(list(range(num_layers)))} carry {hc} residual streams (hyper-connections, hc_mult) and weigh the "
        "experts' sum per token and stream (ffn_hc), while the cut hands one residual stream on and adds the "
        "experts' sum to it"
    ]
    mlp_types = cfg.get("mlp_layer_types")
    if not mlp_types:  # HF's default: the first num_hash_layers (3) hash-routed
        hashed = min(num_layers, cfg.get("num_hash_layers", 3))
        mlp_types = ["hash_moe"] * hashed + ["moe"] * (num_layers - hashed)
    hashed = [i for i, kind in enumerate(mlp_types) if kind == "hash_moe"]
    if hashed:
        reasons.append(
            f"{_layers(hashed)} route by token id (hash_moe: tid2eid[input_ids]), while the attention parts get "
            "hidden states only (the token ids stay with the embedding)"
        )
    return reasons


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


UNCUT: dict[str, ReasonsFn] = {"deepseek_v4": _deepseek_v4, "gemma4_text": _gemma4_text}
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
