"""The Hugging Face causal LM the parts are cut from, typed as the ``PreTrainedModel`` it is.

The runtime passes it on as an ``nn.Module``, whose ``__getattr__`` types every attribute ``Tensor | Module``;
``causal_lm`` narrows it once where its HF attributes are read: ``config`` (a ``PretrainedConfig`` whose
family-specific fields are untyped), ``model.layers``, ``lm_head``, ``loss_function``. ``model_config`` narrows the
``config`` that a model, a stage cut from it or a rank's module keeps.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import nn

if TYPE_CHECKING:
    from transformers import PretrainedConfig, PreTrainedModel


def causal_lm(model: nn.Module) -> PreTrainedModel:
    """``model``, which must be an HF ``XForCausalLM`` (``loading.load_model``'s)."""
    from transformers import PreTrainedModel  # loaded already where a model exists

    if not isinstance(model, PreTrainedModel):
        raise TypeError(f"expected a Hugging Face causal LM (transformers PreTrainedModel), got {type(model).__name__}")
    return model


def model_config(module: nn.Module) -> PretrainedConfig:
    """The HF config ``module`` keeps as ``config`` (an HF model, an attention or expert stage, a rank's module)."""
    from transformers import PretrainedConfig

    config = getattr(module, "config", None)
    if not isinstance(config, PretrainedConfig):
        raise TypeError(f"{type(module).__name__} keeps no Hugging Face config (got {type(config).__name__})")
    return config
