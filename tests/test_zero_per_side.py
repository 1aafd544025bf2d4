"""A ZeRO stage per side (``"disagmoe": {"zero_stage": {"attention": a, "ffn": f}}``), and ZeRO-3 on the expert side.

Each case is ``disagmoe-verify``'s own path (CPU ranks, gloo, the rendezvous transport) against the single-process
HF model: loss, global gradient norm, every applied gradient and every updated parameter. At ZeRO-3 an FFN rank
holds only its 1/edp of each expert tensor, gathers them around each expert forward and backward, and sums the
gradients of the many backwards of a step into its partition; the cases check that each rank runs its side's stage
and, with replicas, that parameters really are sharded, gradients scaled by edp / lanes, and that a replica no token
reached beside a busy one keeps the replicas' collectives in step.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM

from disagmoe_ds.afpipe import build
from disagmoe_ds.afpipe.verify_run import run_verify
from disagmoe_ds.checkpoint.ds_state import gathered
from disagmoe_ds.checkpoint.export import export_hf
from disagmoe_ds.checkpoint.resume import check_resume
from disagmoe_ds.colocated import ColocatedConfig
from disagmoe_ds.colocated.build import preflight_colocated
from disagmoe_ds.config import SECTION, DisagMoEConfig
from disagmoe_ds.convert import main as convert_main
from disagmoe_ds.errors import CheckpointError, ConfigError
from disagmoe_ds.launch.testing import run_ranks
from disagmoe_ds.layout import Layout, RankRole
from disagmoe_ds.models.model_facts import num_experts_of
from disagmoe_ds.parity.compare import assemble, hf_named
from disagmoe_ds.parity.reference import TOLERANCE, VerifyArgs, load_for_verify
from disagmoe_ds.runtime.deepspeed_role import role_ds_config
from disagmoe_ds.train.checks import check_engine_config
from tests.parity_cases import Job
from tests.rank_jobs import idle_beside_busy, train_saving

ROOT = Path(__file__).resolve().parent.parent
CLIP = 0.05  # below the tiny models' gradient norms, so global-norm clipping is active


@pytest.fixture
def engines_log(monkeypatch, tmp_path):
    """Every rank (forked) writes its side, its engine's ZeRO stage and whether it holds only its 1/dp share of
    each parameter (ZeRO-3's partition, nothing gathered) right after the build to ``engine<r>.json``."""
    original = build.build_rank

    def logged(*args, **kwargs):
        rt = original(*args, **kwargs)
        dp = dist.get_world_size(rt.engine.optimizer.dp_process_group) if rt.engine.zero_optimization() else 1
        params = list(rt.module.parameters())
        share_only = all(
            p.numel() == 0 and p.ds_tensor.numel() == math.ceil(p.ds_numel / dp) for p in params if hasattr(p, "ds_id")
        )
        entry = {"attention": rt.role.is_attention, "stage": rt.engine.zero_optimization_stage(), "dp": dp}
        entry["share_only"] = share_only and all(hasattr(p, "ds_id") for p in params)
        (tmp_path / f"engine{dist.get_rank()}.json").write_text(json.dumps(entry))
        return rt

    monkeypatch.setattr(build, "build_rank", logged)
    return tmp_path


def _engines(log: Path, world_size: int) -> list[dict]:
    return [json.loads((log / f"engine{r}.json").read_text()) for r in range(world_size)]


@dataclass(frozen=True, kw_only=True)
class SidesJob(Job):
    """A job with a ZeRO stage per side (``stages``: attention, FFN) and a dtype; ``zero`` is what ``VerifyArgs``
    gets, which the per-side stages override."""

    stages: tuple[int, int] = (1, 2)
    dtype: str = "fp32"
    zero: int = 2

    def config(self, **fields: Any) -> DisagMoEConfig:
        return super().config(zero_stage=dict(zip(("attention", "ffn"), self.stages, strict=True)), **fields)

    def run_tags(self) -> list[str]:
        tags = super().run_tags()
        tags[1] = f"zA{self.stages[0]}F{self.stages[1]}"
        return tags + ([self.dtype] if self.dtype != "fp32" else [])


# A1/F2 and A0/F3 in fp32, at depth 1 and 2, the GPT-OSS path (HF's experts module called by the shard: its biases
# too) with activation checkpointing; A1/F3 over 2 replicas of 2 ep ranks with one lane (gradients scaled by
# edp / lanes = 2, one replica's shard gets no token from any lane, and skewed routing leaves ep rank 1's shard
# idle) with resend (the expert forward re-run in backward); bf16 within its tolerance, with selective recompute
# (the gate/up GEMM re-run in backward).
CASES = [
    SidesJob(M=2, N=2, K=3, stages=(1, 2)),
    SidesJob(family="gpt-oss", M=2, N=2, p=2, K=3, stages=(0, 3), extra={"activation_checkpointing": True}),
    SidesJob(family="deepseek-v3", M=1, N=4, edp=2, K=3, stages=(1, 3), skew=True, resend=True),
    SidesJob(M=2, N=2, edp=2, K=3, stages=(1, 3), dtype="bf16", extra={"selective_recompute": True}),
]


@pytest.mark.parametrize("case", CASES, ids=str)
def test_per_side_stages_equal_hf(engines_log, pairs_log, case: SidesJob):  # noqa: F811
    cfg = case.config(transport="rendezvous")
    model = ROOT / "hf_models" / f"tiny-{case.family}"
    args = VerifyArgs(str(model), cfg, zero=case.zero, seq_len=8, clip=CLIP, skew=case.skew, dtype=case.dtype)
    summary = run_verify(args, timeout_s=240)
    assert all(n > CLIP for n in summary["reference_grad_norms"]), "clipping must be active in this test"
    assert summary["max_abs_diff"]["params"] <= TOLERANCE[case.dtype], summary  # after the optimizer steps
    assert summary["pass"], summary
    engines = _engines(engines_log, cfg.world_size)
    assert [e["stage"] for e in engines] == [case.stages[0]] * case.M + [case.stages[1]] * case.N
    if case.stages[1] == 3:  # each FFN rank built its engine holding 1/edp of every expert tensor, nothing gathered
        assert all(e["share_only"] and e["dp"] == case.edp for e in engines[case.M :]), engines
    if case.skew:
        config = load_for_verify(args).config
        layout = Layout(case.M, case.N, config.num_hidden_layers, num_experts_of(config), expert_data_parallel=case.edp)
        groups = [layout.edp_group_ranks(0, e) for e in range(layout.ep_size)]
        assert idle_beside_busy(pairs_log, groups) > 0


# ----- checkpoint save -> resume and HF export with the experts at ZeRO-3 -----
CKPT_CFG = DisagMoEConfig(
    attention_gpus=2,
    ffn_gpus=2,
    micro_batches=2,
    expert_data_parallel=2,
    transport="rendezvous",
    zero_stage={"attention": 1, "ffn": 3},
)


def _train(rank: int, args: VerifyArgs, ckpt: str, export: str, mode: str) -> dict:
    """'full': 3 steps, saving after step 1, then an HF export; 'resume': load that checkpoint, run steps 2-3. Returns
    the losses and the trained parameters by HF name (gathered; one copy of each)."""
    rt = build.build_rank(args.model, args.ds_config(), args.cfg, micro_batch_size=1, model=load_for_verify(args))
    losses = train_saving(rt, args, ckpt, mode, save_after=1, ds_config=args.ds_config())
    if mode == "full":
        export_hf(rt, Path(args.model), Path(export), dtype=torch.float32, tokenizer=None)
    writer = rt.role.index == 0 if rt.role.is_attention else rt.role.edp_rank == 0
    with gathered(rt.engine, rt.module):
        params = hf_named(rt, {n: p.detach() for n, p in rt.module.named_parameters()})
    return {"losses": losses, "params": params if writer else {}}


@pytest.mark.parametrize(
    "sides",
    [{}, {"zero_stage": {"attention": 1, "ffn": 2}, "offload_optimizer": {"ffn": True}}],
    ids=["ffn-zero3", "ffn-optimizer-on-host"],
)
def test_resume_and_hf_export_under_the_expert_sides_memory_levers(tiny_checkpoint, tmp_path, sides):
    """Also with the expert side's optimizer in host memory (ZeRO-Offload on that side): its state saved from and
    loaded back into host memory, the resume bit-identical."""
    cfg = replace(CKPT_CFG, **sides)
    args = VerifyArgs(str(tiny_checkpoint("qwen3-moe")), cfg, zero=1, steps=3, seq_len=8, clip=CLIP, lr=1e-2)
    ckpt, export = str(tmp_path / "ckpt"), str(tmp_path / "hf")
    full = run_ranks(_train, CKPT_CFG.world_size, args=(args, ckpt, export, "full"), timeout_s=180)
    resumed = run_ranks(_train, CKPT_CFG.world_size, args=(args, ckpt, export, "resume"), timeout_s=180)
    assert resumed[0]["losses"] == full[0]["losses"][1:]  # bit-identical, on CPU
    trained, again = assemble([r["params"] for r in full]), assemble([r["params"] for r in resumed])
    assert trained.keys() == again.keys() and all(torch.equal(trained[n], again[n]) for n in trained)
    loaded = dict(AutoModelForCausalLM.from_pretrained(export, dtype=torch.float32).named_parameters())
    assert loaded.keys() == trained.keys()
    assert all(torch.equal(loaded[n], trained[n]) for n in trained)
    initial = dict(load_for_verify(args).named_parameters())
    experts = [n for n in trained if ".experts." in n]
    assert experts and not any(torch.equal(initial[n], trained[n]) for n in experts)  # the shards did train


def test_conversions_of_a_checkpoint_with_the_experts_at_zero3(tiny_checkpoint, tmp_path):
    """The manifest records each side's stage, so disagmoe-convert reads the expert side as ZeRO-3 (it used to
    rebuild it at the ds_config's stage and fail inside DeepSpeed's load), re-lays it out to ZeRO-1 and back, and a
    resume under other stages is refused before launch with the fix."""
    model = str(tiny_checkpoint("qwen3-moe"))
    args = VerifyArgs(model, CKPT_CFG, zero=1, steps=3, seq_len=8, clip=CLIP, lr=1e-2)
    ckpt, zero1, back = tmp_path / "ckpt", tmp_path / "zero1", tmp_path / "back"
    full = run_ranks(_train, CKPT_CFG.world_size, args=(args, str(ckpt), str(tmp_path / "hf"), "full"), timeout_s=180)
    manifest = json.loads((ckpt / "step1" / "manifest.json").read_text())
    assert manifest["zero_stage"] == {"attention": 1, "ffn": 3}

    # ZeRO-3 experts (2 replicas) -> ZeRO-1 experts split over 2 ranks -> back: the runs continue the original's
    layout = f"--model {model} --attention-gpus 2 --ffn-gpus 2"
    assert convert_main(f"relayout --ckpt {ckpt} --out {zero1} {layout} --zero 1".split()) == 0
    assert json.loads((zero1 / "step1" / "manifest.json").read_text())["zero_stage"] == {"attention": 1, "ffn": 1}
    cfg_zero1 = replace(CKPT_CFG, expert_data_parallel=1, zero_stage={})
    resumed = run_ranks(_train, 4, args=(replace(args, cfg=cfg_zero1), str(zero1), "", "resume"), timeout_s=180)
    assert max(abs(a - b) for a, b in zip(resumed[0]["losses"], full[0]["losses"][1:], strict=True)) <= 1e-5
    relayout = f"relayout --ckpt {zero1} --out {back} {layout} --expert-data-parallel 2 --zero-stage 1 3"
    assert convert_main(relayout.split()) == 0
    again = run_ranks(_train, 4, args=(args, str(back), "", "resume"), timeout_s=180)
    assert again[0]["losses"] == full[0]["losses"][1:]  # the original layout and stages, bit for bit

    # The HF export reads the ZeRO-3 shards whole: the same weights as from the ZeRO-1 copy.
    for source in (ckpt, zero1):
        assert convert_main(f"disagmoe-to-hf --ckpt {source} --model {model} --out {source}-hf".split()) == 0
    hf_z3, hf_z1 = (AutoModelForCausalLM.from_pretrained(f"{d}-hf", dtype=torch.float32) for d in (ckpt, zero1))
    assert all(torch.equal(a, b) for a, b in zip(hf_z3.state_dict().values(), hf_z1.state_dict().values(), strict=True))

    config = load_for_verify(args).config
    layout_z3 = CKPT_CFG.layout(num_layers=config.num_hidden_layers, num_experts=num_experts_of(config))
    without_sides = {k: v for k, v in args.ds_config().items() if k != SECTION}
    with pytest.raises(CheckpointError, match=r'ZeRO stage 1 \(attention\) / 3 \(experts\).*"zero_stage"'):
        check_resume(ckpt, "step1", config, layout_z3, num_samples=None, ds_config=without_sides)
    check_resume(ckpt, "step1", config, layout_z3, num_samples=None, ds_config=args.ds_config())


# ----- what is refused, before any rank starts -----
def _ds(stage: int, *, bf16: bool = False, **zero) -> dict:
    config = {"zero_optimization": {"stage": stage, **zero}}
    if bf16:
        config["bf16"] = {"enabled": True}
    return config


def test_refused_combinations_name_the_fix():
    model = str(ROOT / "hf_models" / "tiny-qwen3-moe")
    per_side = {"attention": 1, "ffn": 3}

    def preflight(ds_config: dict, **fields) -> None:
        cfg = DisagMoEConfig(attention_gpus=1, ffn_gpus=2, expert_data_parallel=2, **fields)
        build.preflight(model, cfg, {**ds_config, SECTION: cfg.to_dict()}, cfg.world_size)

    refused = [
        (_ds(3), {}, r'"zero_optimization.stage" 3 is not supported; .*"ffn": 3'),
        (_ds(1, bf16=True), {"zero_stage": {"ffn": 0}}, r"bf16 needs ZeRO stage >= 1 on the expert side"),
        (_ds(0, bf16=True), {"zero_stage": {"ffn": 1}}, r'bf16 needs "zero_optimization.stage" 1 or 2 on the att'),
        (_ds(1), {"zero_stage": per_side, "compile": True}, r"ZeRO-3 on the expert side does not work with compile"),
        (_ds(1), {"zero_stage": per_side, "offload": {"ffn": 0.5}}, r"does not work with offload \{\"ffn\": > 0\}"),
        (_ds(1, offload_optimizer={"device": "cpu"}), {"zero_stage": per_side}, r"zero_optimization.offload_optim"),
        (_ds(1), {"zero_stage": per_side, "offload_optimizer": {"ffn": True}}, r"disagmoe.offload_optimizer"),
        (_ds(1), {"offload_optimizer": {"ffn": 1}}, r'"disagmoe.offload_optimizer.ffn" must be true or false'),
    ]
    for ds_config, fields, message in refused:
        with pytest.raises(ConfigError, match=message):
            preflight(ds_config, **fields)
    preflight(_ds(0, bf16=True), zero_stage={"attention": 2, "ffn": 3})  # every side >= 1: accepted
    preflight(_ds(1), zero_stage=per_side, offload={"attention": 0.5})  # offload on the attention side: accepted
    cfg = DisagMoEConfig(attention_gpus=1, ffn_gpus=2, expert_data_parallel=2, zero_stage=per_side)
    check_engine_config(_ds(0, bf16=True), cfg, 1, lr_flag=False)  # the flags' check knows the per-side stages
    with pytest.raises(ConfigError, match=r'"zero_optimization.stage" 3 is not supported; use 0, 1 or 2'):
        role_ds_config(_ds(3), micro_batches=1, micro_batch_size=1, dp_size=1)
    colocated = ColocatedConfig(world_size=2, ep_size=2)
    with pytest.raises(ConfigError, match=r"co-located rank has one engine .*set \"zero_optimization.stage\""):
        preflight_colocated(model, colocated, {**_ds(1), SECTION: {"zero_stage": {"ffn": 2}}}, 2)
    with pytest.raises(ConfigError, match=r"co-located rank has one engine .*zero_optimization.offload_optimizer"):
        preflight_colocated(model, colocated, {**_ds(1), SECTION: {"offload_optimizer": {"ffn": True}}}, 2)
    with pytest.raises(ConfigError, match=r'"zero_optimization.stage" 3 is not supported; .* one engine'):
        preflight_colocated(model, colocated, _ds(3), 2)


@pytest.mark.parametrize(("stages", "per_side"), [((1, 1), None), ((2, 2), None), ((1, 2), {"ffn": True})], ids=str)
def test_optimizer_offload_equals_hf(stages, per_side) -> None:
    """DeepSpeed's ZeRO-Offload (optimizer state and step in host memory) on the sides at ZeRO-1 and 2, under
    rendezvous: with a backward per layer chunk, ZeRO-2's host copies must add up every backward of the step (they
    took the previous step's gradient into a parameter's first one: grad norm off by 0.81 here before the fix).
    ``per_side``: on the expert side alone (``"disagmoe.offload_optimizer"``), the attention side stepping on its
    device, under one global clip."""
    fields = {"offload_optimizer": per_side} if per_side else {}
    cfg = SidesJob(M=2, N=2, K=3, stages=stages).config(transport="rendezvous", **fields)
    model = ROOT / "hf_models" / "tiny-qwen3-moe"
    args = VerifyArgs(str(model), cfg, zero=1, seq_len=8, clip=CLIP, zero_offload=per_side is None)
    summary = run_verify(args, timeout_s=240)
    assert all(n > CLIP for n in summary["reference_grad_norms"]), "clipping must be active in this test"
    assert summary["pass"], summary


def test_each_sides_engines_get_that_sides_optimizer_offload():
    """The per-side switch reaches each side's engine config; a side left out follows the ds_config's offload."""
    mode = build.Disaggregated(DisagMoEConfig(attention_gpus=1, ffn_gpus=1, offload_optimizer={"attention": False}))
    ds = _ds(1, offload_optimizer={"device": "cpu", "pin_memory": True})
    attention, ffn = (RankRole(role, 0, 0) for role in ("attention", "ffn"))
    offloads = {role.role: mode.offload_optimizer(role, ds) for role in (attention, ffn)}
    assert offloads == {"attention": False, "ffn": True}
    configs = {
        side: role_ds_config(ds, micro_batches=1, micro_batch_size=1, dp_size=1, stage=1, offload_optimizer=on)
        for side, on in offloads.items()
    }
    assert "offload_optimizer" not in configs["attention"]["zero_optimization"]
    assert configs["ffn"]["zero_optimization"]["offload_optimizer"] == {"device": "cpu", "pin_memory": True}
    only_ffn = build.Disaggregated(DisagMoEConfig(attention_gpus=1, ffn_gpus=1, offload_optimizer={"ffn": True}))
    assert [only_ffn.offload_optimizer(role, _ds(2)) for role in (attention, ffn)] == [False, True]
    with pytest.raises(ConfigError, match=r"ZeRO-Offload of the expert side's optimizer needs ZeRO stage 1 or 2"):
        only_ffn.offload_optimizer(ffn, _ds(0))
