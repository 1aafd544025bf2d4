"""ZeRO-2 with expert replicas equals the single-process HF model, also when routing leaves a replica's shard idle.

ZeRO-2 reduces each backward's gradients over the replicas of an expert shard, bucket by bucket in the order
DeepSpeed's gradient hooks fire. A replica whose shard no token reached in a micro-batch used to produce no gradient
and skip the reductions its peer issued (a hang on NCCL, a crash under gloo). ``ExpertShard.forward`` now reaches
every parameter in that case too, with exact zeros, in the order routed pairs do; the parity cases below assert that
such a backward happened on one replica while its peer had tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig

from disagmoe_ds.afpipe.verify_run import run_verify
from disagmoe_ds.colocated import ColocatedConfig
from disagmoe_ds.colocated.verify import ColocatedVerifyArgs, run_colocated_verify
from disagmoe_ds.layout import Layout
from disagmoe_ds.models import expert_shard
from disagmoe_ds.models.loading import load_model
from disagmoe_ds.models.model_facts import num_experts_of
from disagmoe_ds.models.parts import ExpertStage
from disagmoe_ds.parity.reference import TOLERANCE, VerifyArgs
from tests.parity_cases import Job
from tests.rank_jobs import idle_beside_busy

ROOT = Path(__file__).resolve().parent.parent
FAMILIES = ("qwen2-moe", "qwen3-moe", "mixtral", "deepseek-v2", "deepseek-v3", "gpt-oss", "olmoe")
CLIP = 0.05  # below the tiny models' gradient norms, so global-norm clipping is active


# ----- one shard: what a backward gives its parameters, whatever the routing -----
def _shard(family: str):
    """The second half of the experts of ``family``'s first MoE layer (ids >= half are sentinels)."""
    model = load_model(ROOT / "hf_models" / f"tiny-{family}", seed=0)
    layer = next(i for i, lay in enumerate(model.model.layers) if hasattr(lay.mlp, "experts"))
    num_experts = model.model.layers[layer].mlp.experts.gate_up_proj.shape[0]
    half = num_experts // 2
    return ExpertStage(model, (layer,), half, num_experts).shard(layer), model.config.hidden_size


def _routings(num_local: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    one = torch.full((5, 2), num_local)
    one[3, 1] = num_local - 1
    return {
        "no rows": torch.zeros(0, 2, dtype=torch.long),
        "all ids elsewhere": torch.full((5, 2), num_local),
        "one pair": one,
        "some pairs": torch.randint(0, 2 * num_local, (5, 2), generator=gen).clamp(max=num_local),
        "all pairs": torch.randint(0, num_local, (5, 2), generator=gen),
    }


def _backward(shard, hidden: int, idx_RK: torch.Tensor) -> tuple[list[str], torch.Tensor, torch.Tensor]:
    """The order in which the shard's parameters get their gradient (DeepSpeed's hooks fire in it), the output and
    the input's gradient."""
    names = {p: n for n, p in shard.named_parameters()}
    order: list[str] = []
    handles = [p.register_post_accumulate_grad_hook(lambda p: order.append(names[p])) for p in names]
    shard.zero_grad(set_to_none=True)
    x_RH = torch.randn(idx_RK.shape[0], hidden, requires_grad=True)
    w_RK = torch.rand(idx_RK.shape, requires_grad=True)
    y_RH = shard(x_RH, idx_RK, w_RK, int((idx_RK < shard.num_local).sum()))
    (y_RH * torch.randn_like(y_RH)).sum().backward()
    for handle in handles:
        handle.remove()
    return order, y_RH.detach(), x_RH.grad


@pytest.mark.parametrize("path", ["grouped", "hf module"])
@pytest.mark.parametrize("family", FAMILIES)
def test_every_backward_reaches_every_parameter_in_one_order(monkeypatch, family, path):
    if path == "hf module":
        monkeypatch.setattr(expert_shard, "supports_grouped", lambda *a: False)
    shard, hidden = _shard(family)
    orders = {}
    for routing, idx_RK in _routings(shard.num_local).items():
        order, y_RH, dx_RH = _backward(shard, hidden, idx_RK)
        orders[routing] = order
        if not (idx_RK < shard.num_local).any():  # nothing routed here: exact zeros everywhere
            assert torch.count_nonzero(y_RH) == 0 and torch.count_nonzero(dx_RH) == 0
            assert all(torch.count_nonzero(p.grad) == 0 for p in shard.parameters()), routing
    assert sorted(orders["all pairs"]) == sorted(n for n, _ in shard.named_parameters())
    assert all(order == orders["all pairs"] for order in orders.values()), orders


# ----- jobs: the replicas of a shard, one of them without a token in some backward -----
def _config(model: Path):
    return AutoConfig.from_pretrained(model)


def _assert_exact(summary: dict) -> None:
    assert all(n > CLIP for n in summary["reference_grad_norms"]), "clipping must be active in this test"
    assert summary["max_abs_diff"]["params"] <= TOLERANCE["fp32"], summary  # after the optimizer steps
    assert summary["pass"], summary


@dataclass(frozen=True, kw_only=True)
class ReplicaJob(Job):
    """A job at ZeRO-2 over expert replicas: ``seq_len`` tokens a sequence, ``idle``: some replica's shard must get
    no pair in a backward its peer has pairs in."""

    zero: int = 2
    seq_len: int = 8
    idle: bool = False

    def run_tags(self) -> list[str]:
        return super().run_tags() + [f"seq{self.seq_len}"] + ["idle"] * self.idle


# ep 1 x edp 2 (each replica holds every expert), and ep 2 x edp 2 with 2-token sequences whose first choice is
# expert 0, so ep rank 1's replicas often get no pair.
AF_CASES = [
    ReplicaJob(M=2, N=2, edp=2, K=3, seq_len=8),
    ReplicaJob(M=2, N=4, edp=2, K=3, seq_len=2, skew=True, idle=True),
]


@pytest.mark.parametrize("case", AF_CASES, ids=str)
def test_af_pipe_zero2_with_expert_replicas_equals_hf(pairs_log, case: ReplicaJob):
    model = ROOT / "hf_models" / f"tiny-{case.family}"
    cfg = case.config(transport="rendezvous")
    args = VerifyArgs(str(model), cfg, zero=case.zero, seq_len=case.seq_len, clip=CLIP, skew=case.skew)
    summary = run_verify(args, timeout_s=180)
    _assert_exact(summary)
    config = _config(model)
    layout = Layout(case.M, case.N, config.num_hidden_layers, num_experts_of(config), expert_data_parallel=case.edp)
    groups = [layout.edp_group_ranks(0, e) for e in range(layout.ep_size)]
    assert (idle_beside_busy(pairs_log, groups) > 0) == case.idle


def test_colocated_zero2_with_expert_replicas_equals_hf(pairs_log):
    """W 4 = EP 2 x EDP 2: attention and expert gradients share ZeRO-2's buckets, reduced over different groups."""
    cfg = ColocatedConfig(world_size=4, ep_size=2, micro_batches=4)
    model = ROOT / "hf_models" / "tiny-qwen3-moe"
    args = ColocatedVerifyArgs(str(model), cfg, zero=2, seq_len=2, clip=CLIP, skew=True, seed=2)
    _assert_exact(run_colocated_verify(args, timeout_s=180))
    layout = cfg.layout(num_experts=num_experts_of(_config(model)), num_layers=_config(model).num_hidden_layers)
    assert idle_beside_busy(pairs_log, [layout.edp_group_ranks(e) for e in range(layout.ep_size)]) > 0
