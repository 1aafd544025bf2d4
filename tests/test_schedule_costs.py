"""The AF-Pipe schedule's task costs are data: the job plan (a verify run, a bench: ``planner.runtime_costs.job_costs``)
computes them before any rank starts and every rank generates its schedule from them, so a rank's build imports no
planner. The schedule they give is the one each rank generated when it called the planner itself."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from disagmoe_ds.afpipe.build import build_rank
from disagmoe_ds.afpipe.job_schedule import job_schedule
from disagmoe_ds.config import DisagMoEConfig
from disagmoe_ds.layout import Layout
from disagmoe_ds.models.loading import build_meta_model, load_config
from disagmoe_ds.models.lora_settings import GROUPS, LoraSettings
from disagmoe_ds.models.moe_pattern import moe_layer_pattern
from disagmoe_ds.planner.lora import FULL, LoRA
from disagmoe_ds.planner.runtime_costs import job_costs, runtime_costs
from disagmoe_ds.schedule import Costs, PipeShape, Schedule, generate, unit_costs
from disagmoe_ds.train import run as job
from disagmoe_ds.train.args import parse_args

ROOT = Path(__file__).resolve().parent.parent
MODELS = ROOT / "hf_models"


def test_a_ranks_build_imports_no_planner() -> None:
    """Every module of the disaggregated mode a rank imports (all but the verify tool's driver, which costs a
    verify run's schedule itself) loads no planner module."""
    afpipe = sorted(p.stem for p in (ROOT / "disagmoe_ds" / "afpipe").glob("*.py") if p.stem != "verify_run")
    # One interpreter for both checks (each start imports torch, DeepSpeed and transformers): first the module
    # every disaggregated rank imports, alone, then every other one on top of it.
    planner = "sorted(m for m in sys.modules if m.startswith('disagmoe_ds.planner'))"
    imports = "; ".join(f"import disagmoe_ds.afpipe.{name}" for name in afpipe)
    code = f"import sys, disagmoe_ds.afpipe.build; print({planner}); {imports}; print({planner})"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    # The exact check, on the module every disaggregated rank imports; then all of them.
    assert out.stdout.splitlines() == ["[]", "[]"], out.stdout


def _costs_in_the_rank(config: dict[str, Any], layout, cfg: DisagMoEConfig, *, seq_len: int | None, mbs: int) -> Costs:
    """What each rank's build computed before the costs became data: the planner called from the build on the
    rank's own model config (``afpipe.build.schedule_costs`` as it was)."""
    if seq_len is None:
        return unit_costs(split_backward=cfg.split_backward, compiled=cfg.compile, ffn_zero3=cfg.experts_sharded)
    lora: LoRA = FULL
    if cfg.lora is not None:
        lora = LoRA(cfg.lora.rank, tuple({t if t in GROUPS else "attention" for t in cfg.lora.targets}),
                    cfg.lora.train_router)  # fmt: skip
    return runtime_costs(
        config,
        layout,
        seq_len=seq_len,
        micro_batch_size=mbs,
        cluster=cfg.cluster,
        profile=cfg.profile,
        resend=cfg.resend,
        split_backward=cfg.split_backward,
        compiled=cfg.compile,
        ffn_zero_stage=3 if cfg.experts_sharded else None,
        lora=lora,
    )


def _in_the_rank(config: dict[str, Any], layout, cfg: DisagMoEConfig, costs: Costs) -> Schedule:
    shape = PipeShape(layout.depth, layout.num_layers, moe_layer_pattern(config))
    return generate(shape, cfg.micro_batches, costs=costs, max_in_flight=cfg.max_in_flight)


def _same_streams(a: Schedule, b: Schedule) -> None:
    assert a.streams.keys() == b.streams.keys()
    for worker in a.streams:
        assert a.streams[worker] == b.streams[worker], worker
    assert a.render() == b.render()


CASES = [  # family, cfg, seq_len, micro-batch size
    ("qwen2-moe", DisagMoEConfig(attention_gpus=2, ffn_gpus=2, depth=2, micro_batches=4), 64, 1),  # a dense layer
    (
        "mixtral",
        DisagMoEConfig(attention_gpus=2, ffn_gpus=1, micro_batches=3, split_backward=True, compile=True),
        32,
        2,
    ),
    (
        "qwen3-moe",
        DisagMoEConfig(
            attention_gpus=4,
            ffn_gpus=4,
            depth=2,
            micro_batches=5,
            resend=True,
            split_backward=True,
            zero_stage={"ffn": 3},
            lora=LoraSettings(rank=4, targets=("q_proj", "experts")),
            cluster="h800",
        ),
        128,
        1,
    ),
    ("qwen3-moe", DisagMoEConfig(attention_gpus=2, ffn_gpus=2, micro_batches=3, split_backward=True), None, 1),
]


@pytest.mark.parametrize(("family", "cfg", "seq_len", "mbs"), CASES, ids=["depth2", "split-compiled", "lora", "unit"])
def test_costs_as_data_give_the_schedule_each_rank_computed(family: str, cfg: DisagMoEConfig, seq_len, mbs) -> None:
    model_dir = MODELS / f"tiny-{family}"
    planned = load_config(model_dir)  # the job plan's config
    layout = build_rank.preflight(planned, cfg, {"zero_optimization": {"stage": 1}}, cfg.world_size)
    costs = job_costs(planned.to_dict(), layout, cfg, seq_len=seq_len, micro_batch_size=mbs)
    rank_config = build_meta_model(model_dir).config.to_dict()  # what a rank's stage holds
    before = _costs_in_the_rank(rank_config, layout, cfg, seq_len=seq_len, mbs=mbs)
    assert costs == before
    _same_streams(job_schedule(rank_config, layout, cfg, costs), _in_the_rank(rank_config, layout, cfg, before))
    if seq_len is None:
        _same_streams(job_schedule(rank_config, layout, cfg, None), _in_the_rank(rank_config, layout, cfg, before))


def test_the_job_plan_holds_the_costs_each_rank_computed() -> None:
    """``run_pretrain.py``'s default job: the plan's costs are the ones a rank computed from its meta model."""
    args, _ = parse_args(["--steps", "1"], root=ROOT, description="")
    plan = job.preflight_run(args, args.cfg.world_size, local=True)
    assert args.mode == "disaggregated" and plan.schedule_costs is not None
    rank_config = build_meta_model(args.model, dtype=args.torch_dtype).config.to_dict()
    before = _costs_in_the_rank(rank_config, plan.layout, args.cfg, seq_len=args.seq_len, mbs=args.micro_batch_size)
    assert plan.schedule_costs == before
    _same_streams(
        job_schedule(rank_config, plan.layout, args.cfg, plan.schedule_costs),
        _in_the_rank(rank_config, plan.layout, args.cfg, before),
    )


def test_an_fp8_jobs_schedule_is_costed_with_fp8() -> None:
    """A job with ``"fp8"`` gets the planner's FP8 task costs: the m2n rows in e4m3 (H + 4 bytes instead of 2H), the
    experts' GEMMs at the FP8 rates; casting the expert weights in every call makes the expert calls dearer again."""
    config = load_config(str(ROOT / "hf_models" / "DeepSeek-V3"))
    layout = Layout(attention_gpus=8, ffn_gpus=8, num_layers=config.num_hidden_layers, num_experts=256)
    base = {"attention_gpus": 8, "ffn_gpus": 8}
    bf16, fp8, per_call = (
        job_costs(config.to_dict(), layout, DisagMoEConfig(**base, **extra), seq_len=4096, micro_batch_size=1)
        for extra in ({}, {"fp8": True}, {"fp8": True, "fp8_cast_per_call": True})
    )
    assert fp8.m2n == pytest.approx(bf16.m2n * (7168 + 4) / (2 * 7168), rel=0.05)
    assert fp8.f_fwd < 0.8 * bf16.f_fwd and fp8.f_fwd < per_call.f_fwd and fp8.a_fwd < bf16.a_fwd
