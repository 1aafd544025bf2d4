"""Co-located EP+DP mode equals the single-process HF model after 2 steps, and its layout and checks.

Each parity case runs ``disagmoe_ds.colocated.verify``: CPU ranks with gloo, one DeepSpeed engine per rank (expert
slices as DeepSpeed MoE parameters), the classic dispatch/combine all-to-all, then the HF reference on the same
batches; loss, global grad norm, every gradient and every parameter are compared (fp32, ``verify.TOLERANCE``).
"""

from __future__ import annotations

import doctest

import pytest

from disagmoe_ds.colocated import ColocatedConfig, ColocatedLayout, layout
from disagmoe_ds.colocated.build import check_zero
from disagmoe_ds.colocated.verify import ColocatedVerifyArgs, run_colocated_verify
from disagmoe_ds.errors import ConfigError, LayoutError

# (family, overrides, W, ep, micro-batches, ZeRO, skew): EDP 1 and 2, ZeRO 0 and 1 at both sizes, shared experts +
# a dense layer (qwen2-moe) and a family without (qwen3-moe), every token's first choice on one expert, top-1 routing
# to one expert (the slices of ep rank 1 never get a token: zero-filled gradients, ZeRO partitions over EDP), and
# ep 1 (no communication, ZeRO 2).
CASES = [
    ("qwen3-moe", {}, 2, 2, 2, 0, False),
    ("qwen2-moe", {}, 2, 2, 3, 1, True),
    ("qwen2-moe", {}, 4, 2, 2, 1, False),
    ("qwen3-moe", {}, 4, 2, 2, 0, True),
    ("qwen3-moe", {"num_experts_per_tok": 1}, 4, 2, 2, 1, True),
    ("mixtral", {}, 2, 1, 2, 2, False),
]
CLIP = 0.05  # below the tiny models' gradient norms (about 0.1-3), so global-norm clipping is active


@pytest.mark.parametrize(("family", "overrides", "W", "ep", "K", "zero", "skew"), CASES)
def test_colocated_equals_hf(tiny_checkpoint, family, overrides, W, ep, K, zero, skew):
    args = ColocatedVerifyArgs(
        model=str(tiny_checkpoint(family, **overrides)),
        cfg=ColocatedConfig(world_size=W, ep_size=ep, micro_batches=K),
        zero=zero,
        steps=2,
        dtype="fp32",
        seq_len=8,
        micro_batch_size=1,
        clip=CLIP,
        lr=1e-3,
        seed=0,
        skew=skew,
    )
    summary = run_colocated_verify(args, timeout_s=120)
    assert all(n > CLIP for n in summary["reference_grad_norms"]), "clipping must be active in this test"
    assert summary["pass"], summary


def test_layout_maps_follow_deepspeed_e_plus_d_order():
    lay = ColocatedLayout(world_size=8, ep_size=4, num_experts=8)
    # EP groups are runs of ep consecutive ranks, EDP groups stride by ep (DeepSpeed's docstring example).
    assert [lay.ep_group_ranks(r) for r in range(lay.expert_data_parallel)] == [(0, 1, 2, 3), (4, 5, 6, 7)]
    assert [lay.edp_group_ranks(e) for e in range(4)] == [(0, 4), (1, 5), (2, 6), (3, 7)]
    assert [lay.expert_range(lay.ep_rank(r)) for r in (1, 5)] == [range(2, 4), range(2, 4)]
    assert lay.expert_group_name == "ep_size_4"
    assert doctest.testmod(layout).failed == 0


def test_bad_configs_fail_at_build_time():
    with pytest.raises(LayoutError, match=r"ep_size \(3\) must divide world_size \(4\)"):
        ColocatedConfig(world_size=4, ep_size=3)
    with pytest.raises(LayoutError, match=r"num_experts \(6\) must be divisible by ep_size \(4\)"):
        ColocatedConfig(world_size=4, ep_size=4).layout(num_experts=6)
    with pytest.raises(ConfigError, match="micro_batches must be a positive number"):
        ColocatedConfig(micro_batches=0)
    lay = ColocatedLayout(world_size=2, ep_size=2, num_experts=8)
    with pytest.raises(ConfigError, match="ZeRO stage 2 with ep_size 2 is not supported"):
        check_zero(lay, {"zero_optimization": {"stage": 2}})
