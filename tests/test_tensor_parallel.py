"""Tensor parallelism inside an A-lane (issue 28): t lanes hold one micro-batch in slices and every attention
module's heads in shards (all-gather before, reduce-scatter after). The contract is the usual one: every layout equals
the single-process HF model on the same batches (loss, grad norm, every gradient and parameter after two steps),
under the rendezvous transport; checkpoints resume exactly, export and re-lay out to the same HF tensors."""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch
from transformers import AutoConfig

from disagmoe_ds.config import DisagMoEConfig
from disagmoe_ds.errors import ConfigError, LayoutError
from disagmoe_ds.layout import Layout
from disagmoe_ds.models.tensor_parallel import check_tensor_parallel
from tests.conftest import ROOT, all_families_only
from tests.parity_cases import LaneJob, warm_each_rank_up, whole_layer_zero

CLIP = 0.05  # below the tiny models' gradient norms: clipping is active


def TPJob(**fields: Any) -> LaneJob:  # noqa: N802 (a case type, as the other parity cases)
    return LaneJob(t=2, **fields)


# GQA (KV heads split), 2 ep ranks, ZeRO 2 (the replicated gradients summed inside each backward); depth 2 at ZeRO 1;
# MLA (DeepSeek-V3: q_b/kv_b cut, the low-rank projections whole) with packed documents; Mixtral with two TP groups
# per A-group at ZeRO 0 (the fp32 clipping path); GPT-OSS's sinks and projection biases; Qwen2-MoE's q/k/v biases
# and its shared expert (a gated MLP cut by columns, beside its whole sigmoid gate); the split backward with selective
# recompute (the gathers re-run in the backward, the sums in the deferred weight pass); full recompute with attention
# offload and messages at a capacity.
CASES = [
    TPJob(M=2, N=2, zero=2),
    TPJob(M=4, N=4, p=2, zero=1, resend=True),
    TPJob(family="deepseek-v3", M=2, N=2, zero=2, packed=True),
    TPJob(family="mixtral", M=4, N=2, B=2, zero=0),
    TPJob(family="gpt-oss", M=2, N=1, zero=1),
    TPJob(family="qwen2-moe", M=2, N=2, zero=2),
    TPJob(M=2, N=2, zero=2, extra={"split_backward": True, "selective_recompute": True}, label="split_selective"),
    TPJob(
        M=2,
        N=2,
        zero=1,
        factor=1.25,
        extra={"activation_checkpointing": True, "offload": {"attention": 0.5}},
        label="ckpt_offload",
    ),  # fmt: skip
    all_families_only(TPJob(family="deepseek-v3", M=4, N=4, p=2, zero=1)),
    # SP x TP lanes (Ulysses over a TP rank's heads): GQA with the TP rank's one KV head replicated, MLA packed at
    # ZeRO 2, Mixtral with two lanes of 4 at ZeRO 0.
    TPJob(s=2, M=4, N=2, zero=1),
    TPJob(family="deepseek-v3", s=2, M=4, N=2, zero=2, packed=True),
    all_families_only(TPJob(family="mixtral", s=2, M=8, N=1, zero=0)),
]


@pytest.mark.parametrize("case", CASES, ids=str)
def test_tensor_parallel_equals_hf(tiny_checkpoint, case: LaneJob):
    case.verify(tiny_checkpoint, CLIP)


def test_compiled_parts_warmed_up_on_slices_equal_hf(tiny_checkpoint, monkeypatch):
    """``compile`` with TP lanes: the parts compiled through the gather and reduce-scatter hooks, warmed up before
    the first step as compiled jobs are (every part on a slice, the collectives matched across the TP group), and
    the job still equals HF exactly (``aot_eager``: dynamo's graphs through the hooks, differentiated as inductor gets
    them, without inductor's CPU code generation, which other tests cover)."""
    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend="aot_eager"))
    warm_each_rank_up(monkeypatch)
    TPJob(M=2, N=1, zero=1, extra={"compile": True}, label="compile").verify(tiny_checkpoint, CLIP)


def _sharded_shapes(rank: int, family: str) -> dict[str, tuple[int, ...]]:
    """The shapes of layer 0's attention part on TP rank ``rank`` of 2 after the cut, whose output on the slices
    equals the uncut part's on the whole sequence (and whose input gradient is the uncut one's slice)."""
    import torch.distributed as dist

    from disagmoe_ds.models.sequence_parallel import SequenceParallel
    from disagmoe_ds.models.tensor_parallel import TensorParallel, glu_blocks, shard_attention, shard_mlp

    config, stage, part, h_BSH, want, g_BSH = whole_layer_zero(family)
    B, S = h_BSH.shape[:2]
    tp = TensorParallel(dist.group.WORLD, 2, rank, SequenceParallel(dist.group.WORLD, 2, rank))
    shard_attention(part.mixer, tp)
    for mlp in glu_blocks(part.mlp):
        shard_mlp(mlp, tp)
    h_slice = tp.slice_of(h_BSH.detach()).requires_grad_()
    ctx = tp.context(stage, h_slice, tp.slice_of(torch.arange(S).expand(B, S)), None)
    got = part(h_slice, ctx, config).residual_BSH
    (got * tp.slice_of(g_BSH)).sum().backward()
    assert torch.allclose(got, tp.slice_of(want), atol=1e-6)
    assert torch.allclose(h_slice.grad, tp.slice_of(h_BSH.grad), atol=1e-6)
    return {n: tuple(p.shape) for n, p in part.named_parameters()}


def test_each_rank_holds_its_heads_and_mlp_columns_and_the_slices_equal_the_whole():
    """GPT-OSS (sinks, biases on q, k, v and o) and Qwen3-MoE's dense layer 0 (a gated MLP cut by columns)."""
    from disagmoe_ds.launch.testing import run_ranks

    for family in ("gpt-oss", "qwen3-moe"):
        config = AutoConfig.from_pretrained(ROOT / "hf_models" / f"tiny-{family}")
        hidden, heads = config.hidden_size, config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or hidden // heads
        for shapes in run_ranks(_sharded_shapes, 2, args=(family,)):
            assert shapes["self_attn.q_proj.weight"] == (heads * head_dim // 2, hidden)
            assert shapes["self_attn.o_proj.weight"] == (hidden, heads * head_dim // 2)
            if family == "gpt-oss":
                assert shapes["self_attn.k_proj.bias"] == (config.num_key_value_heads * head_dim // 2,)
                assert shapes["self_attn.o_proj.bias"] == (hidden,) and shapes["self_attn.sinks"] == (heads // 2,)
            else:
                assert shapes["mlp.gate_proj.weight"] == (config.intermediate_size // 2, hidden)
                assert shapes["mlp.down_proj.weight"] == (hidden, config.intermediate_size // 2)


def test_layouts_models_and_levers_tensor_parallelism_cannot_run_are_refused():
    lay = Layout(attention_gpus=4, ffn_gpus=2, num_layers=2, num_experts=8, tensor_parallel=2)
    groups = lay.group_ranks()
    assert groups.tensor_parallel == ((0, 1), (2, 3)) and groups.data_parallel[:2] == ((0, 2), (1, 3))
    assert lay.batch_lanes == 2 and lay.checkpoint_dir(lay.role_of(3)) == "attention_g0_tp1"
    assert lay.manifest_layout()["tensor_parallel"] == 2
    assert "tensor_parallel" not in Layout(attention_gpus=2, ffn_gpus=2, num_layers=2, num_experts=8).manifest_layout()
    with pytest.raises(LayoutError, match="divisible by tensor_parallel"):
        Layout(attention_gpus=3, ffn_gpus=1, num_layers=2, num_experts=8, tensor_parallel=2)
    both = Layout(attention_gpus=8, ffn_gpus=1, num_layers=2, num_experts=8, tensor_parallel=2, sequence_parallel=2)
    ranks = both.group_ranks()  # 2 lanes of 4: 2 TP groups each, the lanes of one TP rank an SP group
    assert ranks.tensor_parallel == ((0, 1), (2, 3), (4, 5), (6, 7)) and ranks.lane_slices == (
        (0, 1, 2, 3),
        (4, 5, 6, 7),
    )
    assert ranks.sequence_parallel == ((0, 2), (1, 3), (4, 6), (5, 7)) and both.batch_lanes == 2
    assert ranks.data_parallel[:2] == ((0, 2, 4, 6), (1, 3, 5, 7))  # the replicas of each TP rank's shards
    with pytest.raises(LayoutError, match=r"divisible by sequence_parallel \(2\) x tensor_parallel \(2\)"):
        Layout(attention_gpus=2, ffn_gpus=1, num_layers=2, num_experts=8, tensor_parallel=2, sequence_parallel=2)
    qwen = AutoConfig.from_pretrained(ROOT / "hf_models" / "tiny-qwen3-moe")  # 4 heads, 2 KV heads
    check_tensor_parallel(qwen, 2)
    with pytest.raises(LayoutError, match=r"must divide num_key_value_heads \(2\)"):
        check_tensor_parallel(qwen, 4)
    with pytest.raises(LayoutError, match="sequence length"):
        check_tensor_parallel(qwen, 2, seq_len=9)
    for family, reason in [("olmoe", "normalise all heads together"), ("qwen3-next", "Gated DeltaNet")]:
        with pytest.raises(LayoutError, match=reason):
            check_tensor_parallel(AutoConfig.from_pretrained(ROOT / "hf_models" / f"tiny-{family}"), 2)
    from disagmoe_ds.afpipe.build import preflight

    model = ROOT / "hf_models" / "tiny-qwen3-moe"
    cfg = DisagMoEConfig(attention_gpus=2, ffn_gpus=1, tensor_parallel=2)
    preflight(model, cfg, {"zero_optimization": {"stage": 0}}, 3)  # fp32 at ZeRO 0: runs
    with pytest.raises(ConfigError, match="offload_optimizer"):
        preflight(model, cfg, {"zero_optimization": {"stage": 1, "offload_optimizer": {"device": "cpu"}}}, 3)


def test_pretraining_with_tensor_parallelism_resumes_exactly_exports_and_relays_out(tok_cache, tmp_path):
    """The README job's model on 2 TP lanes and 2 expert ranks (``runs.assert_resumes_exactly_and_exports``); a
    re-layout to one attention rank and back to TP 2 exports the same tensors as the run."""
    from safetensors.torch import load_file

    from disagmoe_ds import convert
    from tests.runs import assert_resumes_exactly_and_exports

    argv = ("--attention-gpus", 2, "--ffn-gpus", 2, "--tensor-parallel", 2, "--micro-batches", 2)
    assert_resumes_exactly_and_exports(tok_cache, tmp_path, *argv)
    model = str(ROOT / "hf_models" / "tiny-qwen3-moe-lm")
    ck, plain, back, again = (tmp_path / name for name in ("ck", "plain", "back", "again"))
    assert convert.main(["relayout", "--ckpt", str(ck), "--model", model, "--out", str(plain),
                         "--attention-gpus", "1", "--ffn-gpus", "2"]) == 0  # fmt: skip
    assert convert.main(["relayout", "--ckpt", str(plain), "--model", model, "--out", str(back),
                         "--attention-gpus", "2", "--ffn-gpus", "1", "--tensor-parallel", "2"]) == 0  # fmt: skip
    assert convert.main(["disagmoe-to-hf", "--ckpt", str(back), "--model", model, "--out", str(again)]) == 0
    ours, theirs = (load_file(next(d.glob("*.safetensors"))) for d in (tmp_path / "hf", again))
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)


def test_pretraining_on_sp_x_tp_lanes_resumes_exactly_and_exports(tok_cache, tmp_path):
    """One micro-batch on 4 lanes (SP 2 x TP 2) beside 2 expert ranks (``runs.assert_resumes_exactly_and_exports``)."""
    from tests.runs import assert_resumes_exactly_and_exports

    argv = ("--attention-gpus", 4, "--ffn-gpus", 2, "--sequence-parallel", 2, "--tensor-parallel", 2)
    assert_resumes_exactly_and_exports(tok_cache, tmp_path, *argv, "--micro-batches", 2)


def test_fine_tuning_with_tensor_parallelism_resumes_exactly_and_exports(tok_cache, tmp_path):
    """SFT from DeepSeek-V3 (MLA) weights on 2 TP lanes at depth 2: each rank cuts its shards from the HF weights
    of a meta model (``runs.assert_resumes_exactly_and_exports``)."""
    from tests.runs import assert_resumes_exactly_and_exports, sft_from_deepseek_v3

    argv = (*sft_from_deepseek_v3(tok_cache, tmp_path), "--attention-gpus", 4, "--ffn-gpus", 2, "--depth", 2)
    assert_resumes_exactly_and_exports(tok_cache, tmp_path, *argv, "--tensor-parallel", 2, "--micro-batches", 2)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--seq-len", 33], r"tensor_parallel 2 must divide the sequence length \(33\)"),
        (["--model", ROOT / "hf_models" / "tiny-olmoe"], r"olmoe is not supported: its q_norm and k_norm"),
        (["--sequence-parallel", 2], r"sequence_parallel \(2\) x tensor_parallel \(2\)"),
        (["--sequence-parallel", 4, "--attention-gpus", 8], r"sequence_parallel 4 must divide the 2 query heads"),
    ],
    ids=["sequence", "olmoe", "with_sp", "sp_heads"],
)
def test_run_pretrain_refuses_what_it_cannot_shard_before_launch(tok_cache, capfd, argv, message):
    from tests.runs import assert_refused_before_launch

    layout = ["--attention-gpus", 2, "--ffn-gpus", 1, "--tensor-parallel", 2]
    assert_refused_before_launch(tok_cache, capfd, [*layout, *argv], message)
