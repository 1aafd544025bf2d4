"""Families known but not cut yet (Gemma 4's text MoE; ``capabilities.uncut``): HF builds and trains their tiny configs,
every layer type included, and DisagMoE-DS refuses them before launch in one line naming the layers and the
reasons, alike in the runtime's preflight, the planner, the benches' one-layer models and the CLIs. DeepSeek-V4 is
cut (hyper-connection streams, hash routing by token id); what its cut cannot run with yet (sequence parallelism,
CUDA graphs) is refused before launch in one line naming the reason (``capabilities.facts``, its ``not_with``)."""

from __future__ import annotations

import json

import pytest
import torch

from disagmoe_ds.afpipe import verify
from disagmoe_ds.afpipe.build import build_rank
from disagmoe_ds.colocated import ColocatedConfig
from disagmoe_ds.colocated.build import build_colocated_rank
from disagmoe_ds.config import DisagMoEConfig
from disagmoe_ds.errors import ConfigError, LayoutError, UnsupportedModelError
from disagmoe_ds.models.families import family_of
from disagmoe_ds.models.loading import load_model
from disagmoe_ds.models.sequence_parallel import check_sequence_parallel
from disagmoe_ds.planner.attention_lanes import lane_refusal
from disagmoe_ds.planner.hf_config import model_fields
from disagmoe_ds.planner.model import ModelSpec, load_model_spec
from tests.conftest import ROOT

BESIDE = r"layers 0-3 run their experts beside a dense MLP and normalise the experts' sum"
CASES = {
    "gemma4": rf"^the gemma4_text config cannot be cut by DisagMoE-DS: {BESIDE}.*; not supported yet \(the README",
}
V4 = ROOT / "hf_models" / "tiny-deepseek-v4"


def tiny_config(tiny: str) -> dict:
    return json.loads((ROOT / "hf_models" / f"tiny-{tiny}" / "config.json").read_text())


@pytest.mark.parametrize("tiny", [*CASES, "deepseek-v4"])
def test_hf_trains_the_tiny_config_with_every_layer_type(tiny):
    """HF's own model of the tiny config runs forward and backward, with every layer type of the real model."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(ROOT / "hf_models" / f"tiny-{tiny}")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    input_ids = torch.randint(3, config.vocab_size, (2, 12))
    out = model(input_ids=input_ids, labels=input_ids)
    out.loss.backward()
    assert torch.isfinite(out.loss)
    if tiny == "deepseek-v4":
        attention = {"sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"}
        assert set(config.layer_types) == attention and set(config.mlp_layer_types) == {"hash_moe", "moe"}
    else:
        assert set(config.layer_types) == {"sliding_attention", "full_attention"}
        assert all(hasattr(layer, "experts") and hasattr(layer, "mlp") for layer in model.model.layers)


@pytest.mark.parametrize("tiny", CASES)
def test_refused_in_one_line_by_runtime_planner_and_benches(tiny):
    with pytest.raises(UnsupportedModelError, match=CASES[tiny]) as err:
        load_model(ROOT / "hf_models" / f"tiny-{tiny}")
    line = str(err.value)
    assert "\n" not in line
    with pytest.raises(UnsupportedModelError) as planner:
        model_fields(tiny_config(tiny))
    from transformers import AutoConfig

    with pytest.raises(UnsupportedModelError) as bench:  # bench_layer builds its one-layer model from AutoConfig
        family_of(AutoConfig.from_pretrained(ROOT / "hf_models" / f"tiny-{tiny}"))
    assert str(planner.value) == str(bench.value) == line


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({}, r"^the gemma4 config's text model \(gemma4_text\) cannot be cut by DisagMoE-DS: layers 0-3 run"),
        ({"num_kv_shared_layers": 2}, r"; layers 2-3 reuse earlier layers' keys and values \(num_kv_shared_layers\)"),
        ({"hidden_size_per_layer_input": 16}, r"; every layer adds a per-layer embedding of the token ids"),
        ({"enable_moe_block": False}, r"cannot be cut by DisagMoE-DS: it has no MoE layer \(enable_moe_block is"),
    ],
    ids=["hub-config", "shared-kv", "per-layer-embeddings", "dense"],
)
def test_gemma4_hub_config_is_refused_through_its_text_config(tmp_path, fields, message):
    """The Hub's Gemma 4 config is the vision-language model's (model_type gemma4); its text_config is refused, with
    each structure it has."""
    text = {k: v for k, v in tiny_config("gemma4").items() if k != "model_type"}
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gemma4", "text_config": {**text, **fields}}))
    with pytest.raises(UnsupportedModelError, match=message) as err:
        load_model(tmp_path)
    assert "\n" not in str(err.value)


def test_disagmoe_verify_refuses_before_any_rank_starts(capfd):
    argv = ["--model", str(ROOT / "hf_models" / "tiny-gemma4"), "--attention-gpus", "2", "--ffn-gpus", "2"]
    assert verify.main(argv) == 2
    out, err = capfd.readouterr()
    assert err.splitlines() == [f"disagmoe-verify: error: {_line('gemma4')}"], err
    assert out == ""


def _line(tiny: str) -> str:
    with pytest.raises(UnsupportedModelError) as err:
        load_model(ROOT / "hf_models" / f"tiny-{tiny}")
    return str(err.value)


# ----- DeepSeek-V4: cut, and refused only with what its cut cannot run with yet -----
def test_deepseek_v4_is_cut_by_runtime_planner_and_benches():
    from transformers import AutoConfig

    load_model(V4)
    assert family_of(AutoConfig.from_pretrained(V4)).hyper is not None
    spec = load_model_spec(V4)
    assert spec.hc_streams == 4 and spec.token_routed and spec.compressed.kinds == ("sliding", "csa", "hca", "csa")
    plain = {**tiny_config("deepseek-v4"), "mlp_layer_types": ["moe"] * 4}
    hc, h, k = 4, 2 * 64, 2  # streams, bf16 hidden bytes, top-k
    assert spec.wire_bytes_per_token(1).resid == hc * h + 2 * hc + 8 + 4 * k  # streams, weights, token id, ids
    H = 64  # two hyper-connections per layer: projections of the flattened streams to (2 + hc) hc weights, the mixes
    assert spec.hyper_flops() == 2 * (2 * hc * H * (2 + hc) * hc + 2 * hc * hc * H)
    assert spec.layer_input_bytes() == hc * h and spec.wire_bytes_per_token(1).resid_grad == hc * h + 2 * hc
    assert not ModelSpec.from_config(plain).token_routed  # no hash-routed layer: no token ids in the hand-off


def test_deepseek_v4_refuses_sequence_parallelism_in_one_line():
    from transformers import AutoConfig

    with pytest.raises(LayoutError, match=r"^sequence_parallel 2: deepseek_v4 is not supported: its compressors") as e:
        check_sequence_parallel(AutoConfig.from_pretrained(V4), 2)
    assert "\n" not in str(e.value)
    spec = load_model_spec(V4)  # the planner's A-lanes too
    assert "compressors" in lane_refusal(spec, 2, 1, tokens=4096, gpus_per_node=8)
    assert lane_refusal(spec, 1, 1, tokens=4096, gpus_per_node=8) is None


@pytest.mark.parametrize("mode", ["disaggregated", "colocated"])
def test_deepseek_v4_refuses_cuda_graphs_before_any_rank_starts(mode):
    if mode == "disaggregated":
        cfg, preflight, world = DisagMoEConfig(attention_gpus=1, ffn_gpus=1, cuda_graphs=True), build_rank, 2
    else:
        cfg, preflight, world = ColocatedConfig(world_size=1, ep_size=1, cuda_graphs=True), build_colocated_rank, 1
    refusal = r'^"cuda_graphs" does not work with the deepseek_v4 model yet: its parts take the micro-batch.s token ids'
    with pytest.raises(ConfigError, match=refusal) as e:
        preflight.preflight(V4, cfg, {"zero_optimization": {"stage": 0}}, world)
    assert "\n" not in str(e.value)
