"""Multi-process parity: the disaggregated AF-Pipe job equals the single-process HF model after 2 steps.

Each case runs ``disagmoe-verify``'s own code path: CPU ranks with gloo, real DeepSpeed engines per role, then
the HF reference on the same batches; loss, global grad norm, every gradient and every parameter are compared.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from disagmoe_ds.afpipe.verify_run import run_verify
from disagmoe_ds.config import DisagMoEConfig
from disagmoe_ds.launch.local import free_port
from disagmoe_ds.launch.testing import run_ranks
from disagmoe_ds.parity.reference import VerifyArgs
from tests.conftest import all_families_only
from tests.parity_cases import Job

# Per-layer balancing, with a coefficient large enough that the pooled loss would fail the comparison.
PER_LAYER_AUX = {"router_aux_loss_per_layer": True, "router_aux_loss_coef": 0.5}
# Cover p = 1 and 2, M != N both ways, an F-group of one rank, 3 FFN ranks, expert-data-parallel replicas, 1/3/8
# micro-batches, ZeRO 0/1/2, shared experts and a dense layer (qwen2), grouped top-k with a bias (deepseek-v3),
# all-tokens-to-one-expert routing, and ZeRO-2 on expert shards that some micro-batches route no token to.
CASES = [
    Job(M=1, N=1, K=1, zero=0),
    Job(M=2, N=2, K=1, zero=0),
    Job(family="qwen2-moe", M=1, N=2, K=8, zero=1, skew=True),
    Job(overrides={"num_experts": 6}, M=2, N=3, K=8, zero=0),
    Job(family="qwen2-moe", M=2, N=2, K=3, zero=1),
    Job(M=2, N=1, K=8, zero=2, skew=True),
    Job(family="deepseek-v3", M=1, N=2, K=3, zero=0, skew=True),
    Job(family="qwen2-moe", M=2, N=2, p=2, K=3, zero=2),
    Job(family="mixtral", M=2, N=2, p=2, K=8, zero=1, skew=True),
    Job(overrides={"num_experts": 6}, M=2, N=3, K=3, zero=1, skew=True),
    Job(family="olmoe", M=2, N=4, edp=2, K=3, zero=1),
    Job(family="deepseek-v3", M=2, N=4, edp=2, K=3, zero=1, skew=True),  # replicas where some experts get no token
    Job(M=1, N=4, K=6, zero=2),  # ZeRO-2 backwards that reach no expert of a shard (issue 15)
    Job(M=1, N=2, edp=2, K=3, zero=2),  # fewer lanes than replicas: a replica no lane sends to
    Job(family="glm4-moe", M=2, N=2, p=2, K=3, zero=1, skew=True),  # DeepSeek-V3's router with GQA, no headers
    # each layer's aux term where it runs, on both A-groups
    Job(overrides=PER_LAYER_AUX, label="per_layer_aux", M=2, N=2, p=2, K=3, zero=1, skew=True),
    # Qwen3-Next / Qwen3.5-MoE: each A-group holds a linear- (Gated DeltaNet) and a full-attention layer; 2 ep ranks
    Job(family="qwen3.5-moe", M=2, N=4, p=2, K=3, zero=1, skew=True),
    all_families_only(Job(family="qwen3-next", M=2, N=4, p=2, K=3, zero=2)),  # ZeRO-2; layer 0 dense
    all_families_only(Job(family="ernie4.5-moe", M=2, N=4, p=2, K=3, zero=2, skew=True)),  # frozen correction bias
    all_families_only(Job(family="hunyuan-v1-moe", M=2, N=4, p=2, K=3, zero=0, skew=True)),
    all_families_only(Job(family="dots1", M=2, N=4, p=2, K=3, zero=1, skew=True)),
    all_families_only(Job(family="minimax-m2", M=2, N=4, p=2, K=3, zero=2, skew=True)),  # router takes the bias
    # DeepSeek-V3.2: sparse attention (the indexer keeps 4 of the 8 keys), its indexers frozen; 2 ep ranks, depth 2
    Job(family="deepseek-v32", M=2, N=4, p=2, K=3, zero=1, skew=True),
    # DeepSeek-V4: hyper-connection streams and the routed sum's weights in the hand-off, hash-routed layers 0-1 (one
    # per A-group: the token ids travel to A-group 1) and learned ones 2-3; 2 ep ranks, depth 2
    Job(family="deepseek-v4", M=2, N=4, p=2, K=3, zero=1),  # unskewed: a skewed table would route every id alike
    all_families_only(Job(family="deepseek-v4", M=1, N=2, K=3, zero=2, skew=True)),  # one A-group, all on expert 0
]
ROOT = Path(__file__).resolve().parent.parent
CLIP = 0.05  # below the tiny models' gradient norms (about 0.1-1), so global-norm clipping is active


@pytest.mark.parametrize("case", CASES, ids=str)
def test_disaggregated_equals_hf(tiny_checkpoint, case: Job):
    # Under the rendezvous transport (a send completes only once its receive started, as on NCCL's network
    # transport), except the first case, which keeps gloo's own point-to-point (the transport of CPU jobs).
    transport = "auto" if (case.family, case.M, case.N, case.K) == ("qwen3-moe", 1, 1, 1) else "rendezvous"
    cfg = case.config(transport=transport)
    model = str(tiny_checkpoint(case.family, **case.overrides))
    args = VerifyArgs(model, cfg, zero=case.zero, seq_len=8, clip=CLIP, skew=case.skew)
    summary = run_verify(args, timeout_s=240)
    assert all(n > CLIP for n in summary["reference_grad_norms"]), "clipping must be active in this test"
    assert summary["pass"], summary


@pytest.mark.parametrize("landing", ["second-poll", "never"])
@pytest.mark.parametrize(("M", "N", "p"), [(1, 2, 1), (2, 4, 2)])
def test_sends_waiting_for_device_sizes_keep_parity_under_rendezvous(tiny_checkpoint, monkeypatch, landing, M, N, p):
    """With several ep ranks the m2n (and, p > 1, resid) sizes come from the device: the mailbox queues those sends
    until the sizes land, keeps every later send behind them and sends them all before anything that may block
    the host. Here the sizes land on the second poll, or never (then only the blocking calls send them), on the
    transport where a send completes only once its receive is posted: still HF's result, no deadlock."""
    from disagmoe_ds.comm.routing import PendingDispatch, sizes_landing_late

    monkeypatch.setattr(PendingDispatch, "ready", sizes_landing_late(landing))
    cfg = DisagMoEConfig(attention_gpus=M, ffn_gpus=N, depth=p, micro_batches=3, transport="rendezvous")
    args = VerifyArgs(str(tiny_checkpoint("qwen3-moe")), cfg, zero=1, seq_len=8, clip=CLIP, skew=landing == "never")
    assert run_verify(args, timeout_s=240)["pass"]


# With several ep ranks at a fixed capacity; 0.5 is below what balanced routing needs, so a step outgrows it and runs
# again (the skewed router makes every case do so).
CAPACITY_CASES = [
    Job(M=1, N=2, K=3, zero=0, skew=True, factor=0.5),
    Job(family="deepseek-v3", M=2, N=4, p=2, K=3, zero=1, skew=True, factor=0.5),
    Job(family="mixtral", M=2, N=4, p=2, K=3, zero=2, skew=True, resend=True, factor=0.5),
    Job(family="qwen2-moe", M=2, N=4, edp=2, K=3, zero=2, skew=True, factor=1.25),  # replicas; a dense layer's resid
    # streams, weights and token ids at a capacity
    all_families_only(Job(family="deepseek-v4", M=2, N=4, p=2, K=3, zero=1, skew=True, resend=True, factor=0.5)),
]


@pytest.mark.parametrize("case", CAPACITY_CASES, ids=str)
def test_messages_at_a_capacity_equal_hf(tiny_checkpoint, case: Job):
    """``capacity_factor``: every m2n message padded to a fixed capacity, no headers; a step that outgrows it is
    discarded (ZeRO 0-2 gradients included) and run again at a larger one: still HF's result, under rendezvous."""
    cfg = case.config(transport="rendezvous")
    args = VerifyArgs(str(tiny_checkpoint(case.family)), cfg, zero=case.zero, seq_len=8, clip=CLIP, skew=case.skew)
    assert run_verify(args, timeout_s=240)["pass"]


def test_packed_documents_equal_hf(tiny_checkpoint):
    """Position ids that restart mid-sequence (a block-diagonal mask): A-group 0 takes them from the batch, A-group
    1 from the residual message; each builds a micro-batch's mask once and reuses it for its layers."""
    cfg = DisagMoEConfig(attention_gpus=2, ffn_gpus=2, depth=2, micro_batches=3, transport="rendezvous")
    args = VerifyArgs(str(tiny_checkpoint("qwen3-moe")), cfg, seq_len=8, clip=CLIP, packed=True)
    assert run_verify(args, timeout_s=240)["pass"]


def test_timeline_has_every_rank(tiny_checkpoint, tmp_path):
    cfg = DisagMoEConfig(attention_gpus=2, ffn_gpus=2, depth=2, micro_batches=3)
    trace = tmp_path / "trace.json"
    args = VerifyArgs(str(tiny_checkpoint("qwen2-moe")), cfg, steps=1, seq_len=8, clip=0.0, timeline=str(trace))
    assert run_verify(args, timeout_s=120)["pass"]
    events = json.loads(trace.read_text())["traceEvents"]
    names = {e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "process_name"}
    assert len(names) == cfg.world_size
    kinds = {e["name"].split("(")[0] for e in events if e["ph"] == "X"}
    assert {"ForwardAttn", "BackwardAttn", "ForwardExperts", "BackwardExperts", "WaitRecv", "Send"} <= kinds


def test_verify_under_the_deepspeed_launcher(tiny_checkpoint):
    """The real launcher on CPU: 4 processes, gloo, rank 0 prints the summary."""
    cmd = [
        sys.executable,
        "-m",
        "deepspeed.launcher.runner",
        "--num_gpus",
        "4",
        "--master_port",
        str(free_port()),
        str(ROOT / "disagmoe_ds" / "afpipe" / "verify.py"),
        "--model",
        str(tiny_checkpoint("qwen2-moe")),
        "--attention-gpus",
        "2",
        "--ffn-gpus",
        "2",
        "--micro-batches",
        "2",
        "--zero",
        "1",
        "--json",
    ]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=240, cwd=ROOT)
    summaries = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    assert out.returncode == 0 and len(summaries) == 1 and summaries[0]["pass"], out.stdout[-2000:] + out.stderr[-2000:]


def _train_from_config(rank: int, model_dir: str) -> dict:
    from disagmoe_ds.afpipe.build import build_rank

    cfg = DisagMoEConfig(attention_gpus=2, ffn_gpus=2, micro_batches=2)
    ds = {"zero_optimization": {"stage": 1}, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}}
    rt = build_rank(model_dir, ds, cfg, micro_batch_size=2)  # no weights: built on meta, parts materialised
    params = {n: p.detach().clone() for n, p in rt.module.named_parameters()}
    losses = []
    for step in range(3):
        batches = None
        if rt.role.is_attention:
            gen = torch.Generator().manual_seed(step)
            batches = [{"input_ids": (ids := torch.randint(3, 128, (2, 8), generator=gen)), "labels": ids}] * 2
        losses.append(rt.executor.train_batch(batches).loss)
    return {"role": (rt.role.role, rt.role.group), "params": params, "losses": losses}


def test_from_scratch_builds_only_the_parts_of_each_rank():
    results = run_ranks(_train_from_config, 4, args=(str(ROOT / "hf_models" / "tiny-qwen2-moe"),), timeout_s=120)
    losses = results[0]["losses"]
    assert 4.0 < losses[0] < 5.5 and losses[-1] < losses[0]  # about ln(vocab) at init, then it learns
    lane0, lane1 = results[0]["params"], results[1]["params"]  # DeepSpeed broadcast the replicas' init
    assert lane0.keys() == lane1.keys() and all(torch.equal(lane0[n], lane1[n]) for n in lane0)
    stds = [p.float().std().item() for n, p in lane0.items() if n.endswith("proj.weight")]
    assert all(0.015 < s < 0.025 for s in stds)  # HF's initializer_range 0.02


def test_activation_checkpointing_keeps_parity(tiny_checkpoint):
    cfg = DisagMoEConfig(attention_gpus=2, ffn_gpus=2, depth=2, micro_batches=3, activation_checkpointing=True)
    args = VerifyArgs(str(tiny_checkpoint("qwen2-moe")), cfg, zero=1, seq_len=8, clip=CLIP)
    assert run_verify(args, timeout_s=120)["pass"]


def _noting_mask(ctx, seen: set):
    """Note the context's mask by the number of (query, key) pairs it allows (None: the default causal mask)."""
    mask = next(iter(ctx.masks.values()))
    seen.add(None if mask is None else int((mask if mask.dtype == torch.bool else mask == 0).sum()))
    return ctx


def test_kernel_warm_up_leaves_no_trace(tiny_checkpoint, monkeypatch):
    """``warm_up`` (compiled jobs run it before the first step, so no kernel loads while receives are posted) runs
    every part's forward and backward (the head's too), 0- and 1-row shards included, with the default and the packed
    documents' mask, and leaves no gradient, RNG state or result behind: the job still equals HF exactly."""
    from disagmoe_ds.afpipe import build
    from disagmoe_ds.afpipe.attention_runner import AttentionRunner

    original = build.build_rank

    def build_and_warm(*args, **kwargs):
        runtime = original(*args, **kwargs)
        rng = torch.get_rng_state()
        runner, masks, heads = runtime.executor.runner, set(), []
        head = getattr(getattr(runner, "stage", None), "head", None)
        if isinstance(runner, AttentionRunner):
            context = runner.stage.context
            runner.stage.context = lambda h, positions, *ids: _noting_mask(context(h, positions, *ids), masks)
        if head is not None:
            head.register_forward_hook(lambda *_: heads.append(1))
        runtime.executor.warm_up(seq_len=8, packed=True)
        assert head is None or heads, "warm-up skipped the head"
        assert all(p.grad is None for p in runtime.module.parameters()), "warm-up touched a gradient"
        assert torch.equal(rng, torch.get_rng_state()), "warm-up moved the RNG"
        if isinstance(runner, AttentionRunner):
            runner.stage.context = context
            assert len(masks) == 2, f"warm-up built {len(masks)} kind of mask, not the default and the packed one"
        return runtime

    monkeypatch.setattr(build, "build_rank", build_and_warm)
    cfg = DisagMoEConfig(  # checkpointing and resend: the warm-up runs the graphs of both
        attention_gpus=1,
        ffn_gpus=2,
        micro_batches=2,
        transport="rendezvous",
        activation_checkpointing=True,
        resend=True,
    )
    args = VerifyArgs(str(tiny_checkpoint("deepseek-v3")), cfg, zero=1, seq_len=8, clip=CLIP)
    assert run_verify(args, timeout_s=240)["pass"]


@pytest.mark.parametrize(("M", "N", "p", "zero"), [(2, 2, 1, 1), (4, 4, 2, 2)])
def test_resend_keeps_nothing_on_the_expert_side_and_equals_hf(tiny_checkpoint, monkeypatch, M, N, p, zero):
    """``resend``: between a micro-batch's forward and backward an FFN rank holds no tensor of it (the attention side
    sends the tokens again with the gradients; with p > 1 A_next, which got them with the residual); the result is
    still HF's, exactly. Depth 2 with 2 lanes and 2 ep ranks per group, ZeRO-2."""
    from disagmoe_ds.afpipe.expert_runner import ExpertRunner

    forward = ExpertRunner.forward

    def forward_holding_nothing(self, layer, mb, incoming):
        outgoing = forward(self, layer, mb, incoming)
        held = [t for chunk in self.chunks.values() for t in (chunk.x_SH, chunk.w_SK, chunk.y_SH) if t is not None]
        assert not held, f"an FFN rank holds {len(held)} tensors between forward and backward"
        return outgoing

    monkeypatch.setattr(ExpertRunner, "forward", forward_holding_nothing)
    cfg = DisagMoEConfig(attention_gpus=M, ffn_gpus=N, depth=p, micro_batches=3, transport="rendezvous", resend=True)
    args = VerifyArgs(str(tiny_checkpoint("deepseek-v3")), cfg, zero=zero, seq_len=8, clip=CLIP, skew=True)
    assert run_verify(args, timeout_s=240)["pass"]
