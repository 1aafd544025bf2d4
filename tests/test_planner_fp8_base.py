"""The planner prices LoRA over a base shipped in FP8 blocks (``--fp8-base``, issue 42): the frozen weight matrices
at ``FP8_BASE_BYTES`` a parameter on every rank (held whole: ZeRO-3 does not shard them), everything else as before."""

from __future__ import annotations

import json

import pytest

from disagmoe_ds.errors import ConfigError
from disagmoe_ds.layout import Layout
from disagmoe_ds.planner.cli import main
from disagmoe_ds.planner.lora import LoRA, a_side_split, expert_split, ships_fp8_blocks
from disagmoe_ds.planner.model import load_model_spec
from disagmoe_ds.planner.rank_state import rank_state_bytes
from disagmoe_ds.planner.training_state import FP8_BASE_BYTES, Precision
from tests.conftest import ROOT

DSV3 = ROOT / "hf_models" / "DeepSeek-V3"
FP8_BLOCKS = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128], "activation_scheme": "dynamic"}


def test_the_weight_matrices_are_the_fp8_share_of_the_frozen_base() -> None:
    spec = load_model_spec(DSV3)
    lora, fp8 = LoRA(16), LoRA(16, fp8_base=True)
    h, i = spec.hidden_size, spec.expert_intermediate
    assert expert_split(spec, fp8).fp8 == h * 2 * i + i * h and expert_split(spec, lora).fp8 == 0
    assert expert_split(spec, fp8).frozen == expert_split(spec, lora).frozen  # the same parameters, held otherwise
    a = a_side_split(spec, 3, fp8)  # the first MoE layer: attention, shared experts, router
    assert 0 < a.fp8 < a.frozen == spec.a_side_params(3)  # norms and the router stay high precision
    with pytest.raises(ConfigError, match="an FP8 base needs a LoRA rank"):
        LoRA(0, fp8_base=True)


@pytest.mark.parametrize(("zero_stage", "dp"), [(1, 4), (3, 4)])
def test_an_fp8_base_costs_its_bytes_on_every_rank(zero_stage: int, dp: int) -> None:
    spec, bf16 = load_model_spec(DSV3), Precision.named("bf16")
    plain, fp8 = expert_split(spec, LoRA(16)), expert_split(spec, LoRA(16, fp8_base=True))
    trained = plain.trained * bf16.per_param(zero_stage=zero_stage, dp=dp)
    frozen_share = 1 / dp if zero_stage == 3 else 1
    assert bf16.state_bytes(plain, zero_stage=zero_stage, dp=dp) == pytest.approx(
        plain.frozen * 2 * frozen_share + trained
    )
    assert bf16.state_bytes(fp8, zero_stage=zero_stage, dp=dp) == pytest.approx(
        (fp8.frozen - fp8.fp8) * 2 * frozen_share + fp8.fp8 * FP8_BASE_BYTES + trained
    )


def test_a_config_shipped_in_fp8_blocks_implies_the_fp8_base() -> None:
    config = json.loads((DSV3 / "config.json").read_text())
    assert not ships_fp8_blocks(config) and ships_fp8_blocks({**config, "quantization_config": FP8_BLOCKS})
    layout = Layout(attention_gpus=8, ffn_gpus=8, num_layers=config["num_hidden_layers"], num_experts=256)
    kwargs = {"precision": "bf16", "zero_stage_a": 1, "zero_stage_f": 1, "lora_rank": 16}
    plain = rank_state_bytes(config, layout, **kwargs)
    fp8 = rank_state_bytes({**config, "quantization_config": FP8_BLOCKS}, layout, **kwargs)
    assert fp8["ffn"] < 0.55 * plain["ffn"] and fp8["attention"] < plain["attention"]


def test_lora_on_deepseek_v3_over_its_fp8_base_fits_where_a_bf16_base_does_not(capsys) -> None:
    """16 H200s: the bf16 base leaves AF-Pipe 4 attention GPUs and one NIC (network-bound); the FP8 base frees the
    expert side's memory for an even split."""
    argv = ["--model", str(DSV3), "--seq-len", "4096", "--cluster", "h200", "--nodes", "2", "--lora-rank", "16"]
    plans = {}
    for name, flags in (("bf16", []), ("fp8", ["--fp8-base"])):
        assert main([*argv, *flags, "--json"]) == 0
        plans[name] = json.loads(capsys.readouterr().out)
    assert plans["fp8"]["tokens_per_s"] > 5 * plans["bf16"]["tokens_per_s"]
    assert plans["fp8"]["attention_gpus"] > plans["bf16"]["attention_gpus"]
    assert main([*argv[:-2], "--fp8-base"]) == 2  # without --lora-rank
    assert "--fp8-base needs --lora-rank" in capsys.readouterr().err
