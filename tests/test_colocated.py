"""Co-located EP+DP mode equals the single-process HF model after 2 steps, and its layout and checks.

Each parity case runs ``disagmoe_ds.colocated.verify``: CPU ranks with gloo, one DeepSpeed engine per rank (expert
slices as DeepSpeed MoE parameters), the classic dispatch/combine all-to-all, then the HF reference on the same
batches; loss, global grad norm, every gradient and every parameter are compared (fp32, ``verify.TOLERANCE``).
"""

from __future__ import annotations

import doctest
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from disagmoe_ds.colocated import ColocatedConfig, ColocatedLayout, layout
from disagmoe_ds.colocated.model import ExpertStageMoE
from disagmoe_ds.colocated.verify import ColocatedVerifyArgs, run_colocated_verify
from disagmoe_ds.errors import ConfigError, LayoutError
from disagmoe_ds.launch.local import free_port
from disagmoe_ds.models.loading import load_model
from disagmoe_ds.models.parts import ExpertStage
from tests.parity_cases import ColocatedJob

# EDP 1 and 2, ZeRO 0 and 1 at both sizes, shared experts + a dense layer (qwen2-moe) and a family without
# (qwen3-moe), every token's first choice on one expert, top-1 routing to one expert (the slices of ep rank 1 never
# get a token: zero-filled gradients, ZeRO partitions over EDP), and ep 1 (no communication, ZeRO 2).
CASES = [
    ColocatedJob(W=2, ep=2, K=2, zero=0),
    ColocatedJob(family="qwen2-moe", W=2, ep=2, K=3, zero=1, skew=True),
    ColocatedJob(family="qwen2-moe", W=4, ep=2, K=2, zero=1),
    ColocatedJob(W=4, ep=2, K=2, zero=0, skew=True),
    ColocatedJob(overrides={"num_experts_per_tok": 1}, W=4, ep=2, K=2, zero=1, skew=True),
    ColocatedJob(family="mixtral", W=2, ep=1, K=2, zero=2),
    ColocatedJob(
        overrides={"router_aux_loss_per_layer": True, "router_aux_loss_coef": 0.5},
        label="per_layer_aux",
        W=2,
        ep=2,
        K=2,
        zero=0,
        skew=True,
    ),
    ColocatedJob(family="deepseek-v4", W=2, ep=2, K=2, zero=1, skew=True),  # hyper-connections and hash routing
]
CLIP = 0.05  # below the tiny models' gradient norms (about 0.1-3), so global-norm clipping is active


@pytest.mark.parametrize("case", CASES, ids=str)
def test_colocated_equals_hf(tiny_checkpoint, case: ColocatedJob):
    model = tiny_checkpoint(case.family, **case.overrides)
    summary = _verify(model, case.W, case.ep, case.K, case.zero, case.skew, dtype="fp32")
    assert all(n > CLIP for n in summary["reference_grad_norms"]), "clipping must be active in this test"
    assert summary["pass"], summary


def test_colocated_bf16_equals_hf_within_bf16_tolerance(tiny_checkpoint):
    """bf16 + ZeRO 1 (the GPU configuration) with EP 2, within ``verify.TOLERANCE["bf16"]`` of the fp32 HF model."""
    summary = _verify(tiny_checkpoint("qwen3-moe"), 2, 2, 2, 1, False, dtype="bf16")
    assert summary["pass"], summary


def _verify(model, W, ep, K, zero, skew, *, dtype):
    cfg = ColocatedConfig(world_size=W, ep_size=ep, micro_batches=K)
    args = ColocatedVerifyArgs(str(model), cfg, zero=zero, dtype=dtype, seq_len=8, clip=CLIP, skew=skew)
    return run_colocated_verify(args, timeout_s=120)


def test_expert_state_dict_uses_deepspeed_moe_names(tiny_checkpoint):
    """DeepSpeed's MoE checkpointing writes one file per expert from ``deepspeed_experts.<local id>`` entries; the
    stacked expert parameters are split into them and restacked on load."""
    model = load_model(tiny_checkpoint("qwen3-moe"), seed=0)
    layers = tuple(range(model.config.num_hidden_layers))

    def moe(seed: int) -> ExpertStageMoE:
        torch.manual_seed(seed)
        stage = ExpertStage(model, layers, 4, 8)
        for param in stage.parameters():
            param.data.normal_()
        return ExpertStageMoE(stage, num_experts=8, ep_size=2, group_name="ep_size_2")

    saved = moe(0)
    state = saved.state_dict()
    moe_layers = [int(layer) for layer in saved.stage.layers]  # layer 0 is dense (mlp_only_layers)
    assert sorted(state) == sorted(
        f"deepspeed_moe.experts.deepspeed_experts.{i}.layers.{layer}.{name}"
        for i in range(4)
        for layer in moe_layers
        for name in ("gate_up_proj", "down_proj")
    )
    stacked = saved.stage.shard(1).experts.down_proj
    assert torch.equal(state["deepspeed_moe.experts.deepspeed_experts.2.layers.1.down_proj"], stacked[2])
    loaded = moe(1)
    loaded.load_state_dict(state)  # strict: every parameter restacked, no key left over
    for (name, a), (_, b) in zip(saved.named_parameters(), loaded.named_parameters(), strict=True):
        assert torch.equal(a, b), name


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
        ColocatedConfig(world_size=4, ep_size=4).layout(num_experts=6, num_layers=2)
    with pytest.raises(ConfigError, match="colocated.micro_batches must be a positive int"):
        ColocatedConfig(micro_batches=0)


LAUNCHERS = {  # how each launcher starts 2 local ranks of the co-located verify
    "torchrun": ["torch.distributed.run", "--nproc_per_node", "2", "--master_port", "{port}", "-m"],
    "deepspeed": ["deepspeed.launcher.runner", "--num_gpus", "2", "--master_port", "{port}"],  # adds --local_rank
}


@pytest.mark.parametrize("launcher", sorted(LAUNCHERS))
def test_colocated_verify_under_a_launcher(tiny_checkpoint, launcher):
    """Under a launcher the verify runs as one of its ranks (gloo here, NCCL on GPUs); rank 0 prints the summary."""
    root = Path(__file__).resolve().parent.parent
    script = "disagmoe_ds.colocated.verify" if launcher == "torchrun" else str(root / "disagmoe_ds/colocated/verify.py")
    cmd = [sys.executable, "-m", *(a.format(port=free_port()) for a in LAUNCHERS[launcher]), script]
    cmd += ["--model", str(tiny_checkpoint("qwen3-moe")), "--json"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=240, cwd=root)
    summaries = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    assert out.returncode == 0 and len(summaries) == 1 and summaries[0]["pass"], out.stdout[-2000:] + out.stderr[-2000:]
