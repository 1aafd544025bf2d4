"""Sequence parallelism inside an A-lane (issue 28): s lanes hold one micro-batch in slices, Ulysses around the
attention core. The contract is the usual one: every layout equals the single-process HF model on the same batches
(loss, grad norm, every gradient and parameter after two steps), under the rendezvous transport."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from transformers import AutoConfig

from disagmoe_ds.afpipe.verify_run import run_verify
from disagmoe_ds.config import DisagMoEConfig
from disagmoe_ds.errors import LayoutError
from disagmoe_ds.launch.testing import run_ranks
from disagmoe_ds.layout import Layout
from disagmoe_ds.models.sequence_parallel import IGNORE_INDEX, SequenceParallel, check_sequence_parallel, slice_batch
from disagmoe_ds.parity.reference import VerifyArgs
from tests.conftest import ROOT, all_families_only
from tests.parity_cases import LaneJob, warm_each_rank_up, whole_layer_zero

CLIP = 0.05  # below the tiny models' gradient norms: clipping is active
PER_LAYER_AUX = {"router_aux_loss_per_layer": True, "router_aux_loss_coef": 0.5}


def SPJob(**fields: Any) -> LaneJob:  # noqa: N802 (a case type, as the other parity cases)
    return LaneJob(**{"s": 2, **fields})


# GQA with KV heads split (s 2) and replicated (s 4 over 2 KV heads), MLA (DeepSeek-V3: values narrower than keys),
# Mixtral with two SP groups per A-group, depth 2 with 2 ep ranks, packed documents (the whole sequence's block
# mask), ZeRO 1 and 2, per-layer balancing, resend at depth 2, messages at a capacity under skewed routing, and
# GPT-OSS (eager attention with per-head sinks, sliding windows).
CASES = [
    SPJob(M=4, N=4, p=2, s=2, zero=1),
    SPJob(M=4, N=2, s=4, zero=0, factor=1.25),
    SPJob(family="deepseek-v3", M=2, N=2, s=2, zero=2, packed=True),
    SPJob(family="mixtral", M=4, N=2, s=2, B=2, zero=1),
    SPJob(overrides=PER_LAYER_AUX, label="per_layer_aux", M=4, N=4, p=2, s=2, zero=2, packed=True, resend=True),
    SPJob(family="deepseek-v3", M=4, N=4, p=2, s=2, zero=1),
    SPJob(family="gpt-oss", M=2, N=2, s=2, zero=1),
    all_families_only(SPJob(family="mixtral", M=4, N=4, p=2, s=2, B=2, zero=2, packed=True)),
]


@pytest.mark.parametrize("case", CASES, ids=str)
def test_sequence_parallel_equals_hf(tiny_checkpoint, case: LaneJob):
    case.verify(tiny_checkpoint, CLIP)


def test_the_kernel_warm_up_runs_on_slices_and_leaves_no_trace(tiny_checkpoint, monkeypatch):
    """``warm_up`` (compiled jobs) on SP lanes: every part on a slice, the Ulysses all-to-alls matched across the
    group, the head as a share; the job still equals HF exactly."""
    warm_each_rank_up(monkeypatch)
    cfg = DisagMoEConfig(attention_gpus=2, ffn_gpus=1, sequence_parallel=2, micro_batches=2, transport="rendezvous")
    assert run_verify(VerifyArgs(str(tiny_checkpoint("qwen3-moe")), cfg, seq_len=8, clip=CLIP), timeout_s=240)["pass"]


def _slice_attention(rank: int, family: str) -> tuple[float, float, float]:
    """One attention part on a rank's slice with Ulysses against the same part on the whole sequence."""
    import torch.distributed as dist

    from disagmoe_ds.models.sequence_parallel import install_ulysses

    config, stage, part, h_BSH, out, g_BSH = whole_layer_zero(family)
    B, S = h_BSH.shape[:2]
    want = [p.grad.clone() for p in part.parameters() if p.grad is not None]
    part.zero_grad(set_to_none=True)
    sp = SequenceParallel(dist.group.WORLD, 2, rank)
    install_ulysses([part.mixer], sp)
    h_slice = sp.slice_of(h_BSH.detach()).requires_grad_()
    positions = sp.slice_of(torch.arange(S).expand(B, S))
    out_slice = part(h_slice, sp.context(stage, h_slice, positions, None), config).residual_BSH
    (out_slice * sp.slice_of(g_BSH)).sum().backward()
    got = [p.grad.clone() for p in part.parameters() if p.grad is not None]
    for grad in got:
        dist.all_reduce(grad)  # each slice's share of the weight gradients
    grad_diff = max((a - b).abs().max().item() for a, b in zip(got, want, strict=True))
    return (
        (out_slice - sp.slice_of(out)).abs().max().item(),
        grad_diff,
        (h_slice.grad - sp.slice_of(h_BSH.grad)).abs().max().item(),
    )


@pytest.mark.parametrize("family", ["qwen3-moe", "deepseek-v3", "gpt-oss"])  # GQA, MLA, sinks and windows
def test_ulysses_attention_on_slices_equals_the_whole_sequence(family):
    for out_diff, grad_diff, input_grad_diff in run_ranks(_slice_attention, 2, args=(family,), timeout_s=120):
        assert max(out_diff, grad_diff, input_grad_diff) < 1e-5, (out_diff, grad_diff, input_grad_diff)


def test_a_slice_predicts_the_next_slices_first_token():
    labels = torch.arange(8).view(1, 8)
    batch = {"input_ids": labels + 100, "labels": labels}
    first, second = (slice_batch(batch, SequenceParallel(None, 2, r)) for r in range(2))
    assert first["shift_labels"].tolist() == [[1, 2, 3, 4]] and second["shift_labels"].tolist() == [
        [5, 6, 7, IGNORE_INDEX]
    ]
    assert first["input_ids"].tolist() == [[100, 101, 102, 103]] and int(first["num_items"]) == 7
    assert second["position_ids"].tolist() == [[4, 5, 6, 7]] and "full_position_ids" not in second
    packed = slice_batch(
        {**batch, "position_ids": torch.tensor([[0, 1, 2, 0, 1, 2, 3, 4]])}, SequenceParallel(None, 2, 1)
    )
    assert packed["position_ids"].tolist() == [[1, 2, 3, 4]] and packed["full_position_ids"].shape == (1, 8)


def test_layouts_and_models_sequence_parallelism_cannot_split_are_refused():
    with pytest.raises(LayoutError, match="divisible by sequence_parallel"):
        Layout(attention_gpus=3, ffn_gpus=1, num_layers=2, num_experts=8, sequence_parallel=2)
    groups = Layout(attention_gpus=4, ffn_gpus=2, num_layers=2, num_experts=8, depth=2, sequence_parallel=2)
    assert groups.group_ranks().sequence_parallel == ((0, 1), (2, 3)) and groups.batch_lanes == 1
    qwen = AutoConfig.from_pretrained(ROOT / "hf_models" / "tiny-qwen3-moe")  # 4 heads, 2 KV heads
    check_sequence_parallel(qwen, 4)  # KV heads replicated
    with pytest.raises(LayoutError, match="must divide num_attention_heads"):
        check_sequence_parallel(qwen, 8)
    with pytest.raises(LayoutError, match="sequence length"):
        check_sequence_parallel(qwen, 2, seq_len=9)
    refused = [("qwen3-next", "recurrent"), ("deepseek-v32", "indexer")]
    for family, reason in [*refused, ("deepseek-v4", "compressors pool windows of the whole sequence")]:
        with pytest.raises(LayoutError, match=reason):
            check_sequence_parallel(AutoConfig.from_pretrained(ROOT / "hf_models" / f"tiny-{family}"), 2)


def test_pretraining_with_sequence_parallelism_resumes_exactly_and_exports(tok_cache, tmp_path):
    """The README job's model on 2 SP lanes and 2 expert ranks (``runs.assert_resumes_exactly_and_exports``)."""
    from tests.runs import assert_resumes_exactly_and_exports

    argv = ("--attention-gpus", 2, "--ffn-gpus", 2, "--sequence-parallel", 2, "--micro-batches", 2)
    assert_resumes_exactly_and_exports(tok_cache, tmp_path, *argv)


def test_fine_tuning_with_sequence_parallelism_resumes_exactly_and_exports(tok_cache, tmp_path):
    """SFT from DeepSeek-V3 (MLA) weights on 2 SP lanes at depth 2 (packed prompt/response pairs: the slices' block
    masks; ``runs.assert_resumes_exactly_and_exports``)."""
    from tests.runs import assert_resumes_exactly_and_exports, sft_from_deepseek_v3

    argv = (*sft_from_deepseek_v3(tok_cache, tmp_path), "--attention-gpus", 4, "--ffn-gpus", 2, "--depth", 2)
    assert_resumes_exactly_and_exports(tok_cache, tmp_path, *argv, "--sequence-parallel", 2, "--micro-batches", 2)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--seq-len", 33], r"sequence_parallel 2 must divide the sequence length \(33\)"),
        (["--attention-gpus", 3], r"lanes per A-group \(3\) must be divisible by sequence_parallel \(2\)"),
        (["--model", ROOT / "hf_models" / "tiny-qwen3-next"], r"qwen3_next is not supported: its Gated DeltaNet"),
    ],
    ids=["sequence", "lanes", "recurrent"],
)
def test_run_pretrain_refuses_what_it_cannot_slice_before_launch(tok_cache, capfd, argv, message):
    from tests.runs import assert_refused_before_launch

    layout = ["--attention-gpus", 2, "--ffn-gpus", 1, "--sequence-parallel", 2]
    assert_refused_before_launch(tok_cache, capfd, [*layout, *argv], message)
