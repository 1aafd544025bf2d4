"""Which of HF's attention functions the attention parts run (``"disagmoe.attention"``).

``"auto"`` keeps HF's own choice (SDPA where the modeling file has it, else eager), except where HF falls back to
eager for want of an SDPA path and flex_attention serves on the device: GPT-OSS's sink attention on CUDA. Eager
writes and reads every layer's H x S x S scores in fp32; flex_attention folds the sinks in from its log-sum-exp
(``bench/check_sink_attention.py`` on an H100: the same loss and gradients within 3e-6 in fp32, the attention part
8.7x faster at 4K tokens). A named implementation is HF's as ``attn_implementation`` names it.

>>> from transformers import AutoConfig
>>> gpt_oss = AutoConfig.from_pretrained("hf_models/tiny-gpt-oss")
>>> attention_for(gpt_oss, "auto", "cuda"), attention_for(gpt_oss, "auto", "cpu")
('flex_attention', 'eager')
>>> print(attention_refusal(gpt_oss, "sdpa", "cuda"))
"disagmoe.attention": sdpa is not one HF's gpt_oss runs (it runs eager, flex_attention): pick one or "auto"
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from disagmoe_ds.errors import ConfigError

if TYPE_CHECKING:  # reading a config imports this module's names, and no torch
    import torch
    from transformers import PretrainedConfig

ATTENTION_KERNELS = ("auto", "eager", "sdpa", "flex_attention")


def attention_for(config: PretrainedConfig, choice: str, device_type: str) -> str:
    """The implementation the parts of ``config``'s model run on ``device_type`` for ``choice``: "auto" keeps the
    config's (HF's default where it has none yet) but for the eager fallback flex_attention replaces on CUDA."""
    if choice != "auto":
        return choice
    supports = _supported(config)
    if device_type == "cuda" and "sdpa" not in supports and "flex_attention" in supports:
        return "flex_attention"
    return config._attn_implementation or ("sdpa" if "sdpa" in supports else "eager")


def attention_refusal(config: PretrainedConfig, choice: str, device_type: str | None = None) -> str | None:
    """Why ``choice`` (one of ``ATTENTION_KERNELS``) cannot run ``config``'s model on ``device_type`` (None: not
    known yet), or None."""
    supports = _supported(config)
    key = '"disagmoe.attention"'
    if choice != "auto" and choice not in supports:
        runs = ", ".join(supports)
        return f'{key}: {choice} is not one HF\'s {config.model_type} runs (it runs {runs}): pick one or "auto"'
    if choice == "flex_attention" and device_type == "cpu":
        import torch

        return f'{key}: flex_attention has no backward on CPU in torch {torch.__version__}: use "auto" on CPU ranks'
    return None


def use_attention(model: Any, choice: str, device: torch.device) -> None:
    """Set the implementation of ``model`` (an HF ``XForCausalLM``, or a meta one before its parts are cut: they share
    its config) for ``choice`` on ``device``; refused in one line (``attention_refusal``)."""
    problem = attention_refusal(model.config, choice, device.type)
    if problem is not None:
        raise ConfigError(problem)
    wanted = attention_for(model.config, choice, device.type)
    if wanted != model.config._attn_implementation:
        model.set_attn_implementation(wanted)


def _supported(config: PretrainedConfig) -> list[str]:
    """The implementations HF's causal-LM class of ``config`` declares, eager first."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    cls: Any = MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]
    flags = {"sdpa": cls._supports_sdpa, "flex_attention": cls._supports_flex_attn}
    return ["eager", *(name for name, supported in flags.items() if supported)]
