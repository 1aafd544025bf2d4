"""The Hugging Face causal LM the parts are cut from, typed as the ``PreTrainedModel`` it is.

The runtime passes it on as an ``nn.Module``, whose ``__getattr__`` types every attribute ``Tensor | Module``;
``causal_lm`` narrows it once where its HF attributes are read: ``config`` (a ``PretrainedConfig`` whose
family-specific fields are untyped), ``model.layers``, ``lm_head``, ``loss_function``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import nn

if TYPE_CHECKING:
    from transformers import PreTrainedModel


def causal_lm(model: nn.Module) -> PreTrainedModel:
    """``model``, which must be an HF ``XForCausalLM`` (``loading.load_model``'s)."""
    from transformers import PreTrainedModel  # loaded already where a model exists

    if not isinstance(model, PreTrainedModel):
        raise TypeError(f"expected a Hugging Face causal LM (transformers PreTrainedModel), got {type(model).__name__}")
    return model
