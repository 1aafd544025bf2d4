"""The real-size configs in ``hf_models/`` that were written by hand: the planner counts what HF builds from them."""

from __future__ import annotations

from pathlib import Path

import pytest

from disagmoe_ds.planner import load_model_spec

ROOT = Path(__file__).resolve().parent.parent


def test_deepseek_v4_flash_has_the_published_size() -> None:
    """284B parameters, 13B active: the planner's count equals that of HF's causal LM built on the meta device."""
    torch = pytest.importorskip("torch")
    from transformers import AutoModelForCausalLM

    from disagmoe_ds.models.loading import load_config

    path = ROOT / "hf_models" / "DeepSeek-V4-Flash"
    spec = load_model_spec(path)
    assert (spec.model_type, spec.num_layers, spec.num_moe_layers) == ("deepseek_v4", 43, 43)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(load_config(path))
    total = sum(p.numel() for p in model.parameters())
    assert spec.total_params() == total
    idle_experts = spec.num_moe_layers * (spec.num_experts - spec.top_k) * spec.expert_params()
    assert round(total / 1e9) == 284 and 13e9 < total - idle_experts < 14e9
