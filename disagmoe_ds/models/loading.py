"""Load a Hugging Face MoE model (weights or config only) through HF's normal loading path, with clear errors; or
build it on the meta device (``partial_load.place`` then allocates only the parts a rank cut from it)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING

import torch
from torch import nn

from disagmoe_ds.capabilities.uncut import check_uncut
from disagmoe_ds.errors import CheckpointError, ConfigError
from disagmoe_ds.jsonfile import read_json_object
from disagmoe_ds.models.families import (
    ALIASES,
    check_cut,
    expert_bias_of,
    family_of,
    is_moe_layer,
    token_table_of,
)

if TYPE_CHECKING:
    from transformers import PreTrainedModel

WEIGHT_FILES = (
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
)
_MODEL_DIR_FIX = "pass an HF model directory (one of hf_models/*, or one written by save_pretrained)"
_RESAVE_FIX = "write the model again with save_pretrained"


def load_config(path: str | Path):
    """The HF config of a model directory; rejects unsupported architectures (those known but not cut yet by the
    layer and the reason: ``uncut``), and configs the cut cannot hold (``families.check_cut``), before anything
    heavy happens.

    A vision-language config (Qwen3.5-MoE's ``qwen3_5_moe``, ``families.ALIASES``) gives its language model's
    config (``get_text_config()``), the one ``AutoModelForCausalLM`` builds its causal LM from.
    """
    from transformers import AutoConfig

    path = Path(path)
    config_file = path / "config.json"
    raw = read_json_object(config_file, what="model config", fix=_MODEL_DIR_FIX)
    check_uncut(raw)  # families known but not cut yet: the layer and the reason
    family_of(SimpleNamespace(model_type=raw.get("model_type")))  # reject unsupported families first
    try:
        config = AutoConfig.from_pretrained(path)
    except Exception as err:  # transformers raises several unrelated types for a bad config
        raise ConfigError(f"cannot read {config_file}: {str(err).splitlines()[0]}") from err
    config = config.get_text_config() if raw.get("model_type") in ALIASES else config
    check_cut(config)
    return config


def has_weights(path: str | Path) -> bool:
    return any((Path(path) / name).is_file() for name in WEIGHT_FILES)


def check_weights(path: str | Path) -> None:
    """A one-line error unless ``path`` holds weights and every weight file its index lists."""
    path = Path(path)
    if not has_weights(path):
        raise CheckpointError(
            f"no weight file in {path} (expected one of {', '.join(WEIGHT_FILES)}); "
            "point --model at a directory written by save_pretrained"
        )
    _check_shards(path)


def _check_shards(path: Path) -> None:
    for index_name in ("model.safetensors.index.json", "pytorch_model.bin.index.json"):
        index = path / index_name
        if index.is_file():
            index_map = read_json_object(index, what="weight index", fix=_RESAVE_FIX, error=CheckpointError)
            shards = set(index_map["weight_map"].values())
            missing = sorted(s for s in shards if not (path / s).is_file())
            if missing:
                raise CheckpointError(f"{index} lists weight files that are missing: {', '.join(missing)}")


def load_model(
    path: str | Path,
    *,
    dtype: torch.dtype = torch.float32,
    attn_implementation: str | None = None,
    require_weights: bool = False,
    seed: int = 0,
) -> PreTrainedModel:
    """An ``XForCausalLM`` from an HF directory.

    With weights in the directory they are loaded by ``from_pretrained``. A config-only directory (the tiny and
    real-size configs in ``hf_models/``) gives a model initialised by HF's ``_init_weights`` under ``seed``, unless
    ``require_weights`` asks for real weights.
    """
    from transformers import AutoModelForCausalLM

    path = Path(path)
    config = load_config(path)
    if not has_weights(path) and not require_weights:
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=attn_implementation)
        fill_token_tables(model.model.layers, model.config)
        return freeze_untrained(model)
    check_weights(path)
    try:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation=attn_implementation)
    except (OSError, RuntimeError, ValueError) as err:
        raise CheckpointError(f"cannot load weights from {path}: {str(err).splitlines()[0]}") from err
    return freeze_untrained(model)


def build_meta_model(path: str | Path, *, dtype: torch.dtype = torch.float32) -> PreTrainedModel:
    """The model's module tree on the meta device: no memory, no initialisation.

    A rank cuts the parts it owns from it and materialises only those (``partial_load.place``), so a job never holds
    the whole model in one process.
    """
    from transformers import AutoModelForCausalLM

    config = load_config(path)
    with torch.device("meta"):
        return freeze_untrained(AutoModelForCausalLM.from_config(config, dtype=dtype))


def freeze_untrained(model: PreTrainedModel) -> PreTrainedModel:
    """Parameters the language-model loss never trains stay out of the optimizer (an optimizer would still move
    them: weight decay on zero gradients):

    * a router correction bias that HF holds as a parameter (ERNIE-4.5's ``moe_statics``), as its module declares it
      (``requires_grad=False``; ``from_pretrained`` makes it trainable again): only the auxiliary-loss-free update
      moves it (``train.balance``), as it moves DeepSeek-V3's buffer;
    * DeepSeek-V3.2's lightning indexer, and DeepSeek-V4's (inside its compressed-sparse layers' compressor): its
      top-k choice is not differentiable, so no gradient reaches it in HF's forward either (DeepSeek trains it with
      a loss of its own, which transformers does not implement).
    """
    family = family_of(model.config)
    for layer in model.model.layers:
        if family.expert_bias_path is not None and is_moe_layer(layer):
            bias = expert_bias_of(family, layer.mlp)
            if isinstance(bias, nn.Parameter):
                bias.requires_grad_(False)
        attention = getattr(layer, "self_attn", None)
        for name, module in attention.named_modules() if attention is not None else ():
            if name.rpartition(".")[2] == "indexer":  # DeepSeek-V3.2's, or DeepSeek-V4's inside its compressor
                module.requires_grad_(False)
    return model


def token_table(config, layer: int) -> torch.Tensor:
    """Generated weights' token id -> experts table of a hash-routed layer ([V, K]: K distinct experts per token).

    HF initialises DeepSeek-V4's ``tid2eid`` to zeros (every token to expert 0 in every slot; its real values come
    from the checkpoint), which would route a generated model's hash layers to one expert. A frozen table, as a
    checkpoint's is: drawn from the layer index alone, so every rank and run that holds the layer has the same
    (the ranks initialise their parts from seeds of their own, and DeepSpeed broadcasts parameters, not buffers).
    """
    family = family_of(config)
    generator = torch.Generator().manual_seed(100_003 + layer)
    scores = torch.rand(config.vocab_size, getattr(config, family.num_experts_attr), generator=generator)
    return scores.argsort(dim=1)[:, : config.num_experts_per_tok]


def fill_token_tables(layers, config) -> None:
    """Fill the token tables (``Family.token_table``) of ``layers`` (decoder layers or attention parts, in order of
    their indices, or a {index: layer} mapping) with ``token_table``."""
    family = family_of(config)
    if family.token_table is None:
        return
    items = layers.items() if hasattr(layers, "items") else enumerate(layers)
    for index, layer in items:
        # Not ``is_moe_layer``: an attention part's MLP keeps the router but not the experts it tests for.
        table = token_table_of(family, layer.mlp)
        if table is not None:
            with torch.no_grad():
                table.copy_(token_table(config, int(index)))


def shared_parameters(module: nn.Module) -> list[list[str]]:
    """Names under which one parameter object appears more than once (tied embeddings), grouped."""
    names: dict[int, list[str]] = {}
    for name, param in module.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(name)
    return [group for group in names.values() if len(group) > 1]
