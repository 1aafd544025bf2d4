"""One table of the families and one rule for which layers route, read alike by the runtime and the planner.

For every config in hf_models/ the runtime cuts (tiny and real-size), three views of which layers route agree: the
rule read from config.json (``models.moe_pattern.moe_layer_pattern``), what HF builds (``families.is_moe_layer`` on
the meta model, which allocates nothing) and the planner's ``ModelSpec.moe_layers``.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from disagmoe_ds.capabilities.uncut import refusal
from disagmoe_ds.models.families import ALIASES, FAMILIES, is_moe_layer
from disagmoe_ds.models.grouped_experts import GATED_FUSED_FAMILIES
from disagmoe_ds.models.loading import build_meta_model
from disagmoe_ds.models.moe_pattern import MODEL_TYPES, VISION_LANGUAGE, moe_layer_pattern
from disagmoe_ds.planner.hf_config import SUPPORTED_TYPES
from disagmoe_ds.planner.model import load_model_spec

ROOT = Path(__file__).resolve().parent.parent
CUT_MODELS = [
    p.parent for p in sorted((ROOT / "hf_models").glob("*/config.json")) if refusal(json.loads(p.read_text())) is None
]


def test_one_family_table():
    assert sorted(FAMILIES) == sorted(MODEL_TYPES)
    assert ALIASES == VISION_LANGUAGE
    assert SUPPORTED_TYPES == (*MODEL_TYPES, *VISION_LANGUAGE)
    assert set(MODEL_TYPES) - set(GATED_FUSED_FAMILIES) == {"gpt_oss"}


def test_every_family_has_a_config_in_hf_models():
    types = {json.loads((d / "config.json").read_text())["model_type"] for d in CUT_MODELS}
    assert {VISION_LANGUAGE.get(t, t) for t in types} == set(MODEL_TYPES)


@pytest.mark.parametrize("model", CUT_MODELS, ids=lambda p: p.name)
def test_runtime_hf_and_planner_agree_on_which_layers_route(model: Path):
    rule = moe_layer_pattern(json.loads((model / "config.json").read_text()))
    built = tuple(is_moe_layer(layer) for layer in build_meta_model(model).model.layers)
    assert built == rule
    assert load_model_spec(model).moe_layers == rule
    assert any(rule)
