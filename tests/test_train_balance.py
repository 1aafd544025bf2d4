"""Expert-load imbalance and DeepSeek-V3 auxiliary-loss-free balancing (bias updates on the routers)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from disagmoe_ds.colocated.layout import ColocatedLayout
from disagmoe_ds.errors import ConfigError
from disagmoe_ds.launch.testing import run_ranks
from disagmoe_ds.models.loading import load_config, load_model
from disagmoe_ds.models.parts import AttentionStage
from disagmoe_ds.train.balance import DEEPSEEK_V3_RATE, bias_update_rate, expert_load, imbalance, update_expert_bias

ROOT = Path(__file__).resolve().parent.parent
DSV3 = ROOT / "hf_models" / "tiny-deepseek-v3"


def test_rate_defaults_to_deepseek_where_the_router_has_a_bias() -> None:
    assert bias_update_rate(None, load_config(DSV3)) == DEEPSEEK_V3_RATE
    assert bias_update_rate(0.0, load_config(DSV3)) == 0.0
    qwen = load_config(ROOT / "hf_models" / "tiny-qwen3-moe-lm")
    assert bias_update_rate(None, qwen) == 0.0
    with pytest.raises(ConfigError, match=r"--bias-update-rate 0.01: model_type 'qwen3_moe' has no router correction"):
        bias_update_rate(0.01, qwen)


def test_imbalance_is_max_over_mean_per_layer() -> None:
    load_LE = torch.tensor([[2, 2, 2, 2], [8, 0, 0, 0], [0, 0, 0, 0]])
    assert imbalance(load_LE) == [1.0, 4.0, None]  # the last row: a dense layer (or one owned elsewhere)


def _skewed_stage() -> AttentionStage:
    """The attention side of tiny DeepSeek-V3 whose routers send every token to expert 0 at first (with inputs of
    positive mean, see ``_inputs``)."""
    model = load_model(DSV3, seed=0)
    stage = AttentionStage(model, tuple(range(model.config.num_hidden_layers)), with_embedding=False, with_head=False)
    with torch.no_grad():
        for part in stage.layers.values():
            if part.is_moe:
                part.router.weight[0] += 0.05  # expert 0's affinity rises by 0.05 * sum(x)
    return stage


def _load_LE(stage: AttentionStage, x_TH: torch.Tensor, num_experts: int) -> torch.Tensor:
    load_LE = torch.zeros(len(stage.layers), num_experts, dtype=torch.int64)
    for name, part in stage.layers.items():
        if part.is_moe:
            _, _, idx_TK = part.router(x_TH)
            load_LE[int(name)] = torch.bincount(idx_TK.reshape(-1), minlength=num_experts)
    return load_LE


def test_bias_updates_move_the_load_toward_balance() -> None:
    stage = _skewed_stage()
    runtime = SimpleNamespace(role=SimpleNamespace(is_attention=True), module=stage)
    x_TH = torch.randn(512, stage.config.hidden_size, generator=torch.Generator().manual_seed(0)) + 1.0
    num_experts = stage.config.n_routed_experts
    before = imbalance(_load_LE(stage, x_TH, num_experts))
    for _ in range(60):  # converges in ~40 steps, then oscillates (sign updates on a fixed batch)
        update_expert_bias(runtime, _load_LE(stage, x_TH, num_experts), rate=0.01)
    after = imbalance(_load_LE(stage, x_TH, num_experts))
    moe = [i for i, v in enumerate(before) if v is not None]
    assert moe == [1, 2, 3]  # first_k_dense_replace = 1
    for i in moe:
        assert before[i] == 4.0 and after[i] < 1.5, (i, before[i], after[i])  # 4.0 = E / top_k: all on one
    bias_E = stage.layers["1"].router.e_score_correction_bias
    assert bias_E[0] < 0 and bias_E.dtype == torch.float32  # the overloaded expert became less attractive


def test_ffn_ranks_and_rate_zero_change_nothing() -> None:
    stage = _skewed_stage()
    load_LE = torch.zeros(4, 8, dtype=torch.int64)
    load_LE[1, 0] = 10
    update_expert_bias(SimpleNamespace(role=SimpleNamespace(is_attention=True), module=stage), load_LE, rate=0.0)
    update_expert_bias(SimpleNamespace(role=SimpleNamespace(is_attention=False), module=stage), load_LE, rate=1.0)
    assert all(
        not part.is_moe or part.router.e_score_correction_bias.abs().sum() == 0 for part in stage.layers.values()
    )


def _colocated_unreported_load_body(rank: int) -> tuple[int, ...]:
    module = torch.nn.Module()
    module.config = load_config(DSV3)  # 4 layers, 8 routed experts
    runtime = SimpleNamespace(
        layout=ColocatedLayout(world_size=1, ep_size=1, num_experts=8),
        module=module,
        engine=SimpleNamespace(device=torch.device("cpu")),
    )
    load_LE = expert_load(runtime, SimpleNamespace(expert_counts_LE=None))
    assert load_LE.sum() == 0
    return tuple(load_LE.shape)


def test_a_rank_that_reports_no_load_adds_zeros_of_the_models_shape_in_either_mode() -> None:
    # The zeros' [L, E] once came from the layout, and a co-located layout has no num_layers: a co-located module
    # that reports no load (bench_e2e's DeepSpeed-MoE model) failed with an AttributeError. mypy found it.
    assert run_ranks(_colocated_unreported_load_body, 1, timeout_s=60) == [(4, 8)]
