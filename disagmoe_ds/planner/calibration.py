"""The co-located baseline held against published runs: each run's layout priced by the planner, and its error
(pure Python). ``disagmoe-plan calibrate`` prints the table of docs/planner.md section 8; the tests pin it.

Published numbers are the runs' own (step time, model TFLOP/s per GPU, tokens/s per GPU); the planner's TFLOP/s
are its model FLOPs (``ModelSpec.step_flops_per_token``, Megatron's convention: 3x forward, recompute not
counted) over its predicted step, so both columns count the same work.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

from disagmoe_ds.planner.allocator import BaselinePlan, PlanRequest, best_baseline
from disagmoe_ds.planner.baseline_layout import check_layout, parse_layout
from disagmoe_ds.planner.cluster import Efficiency, preset
from disagmoe_ds.planner.gemm_efficiency import shape_rates
from disagmoe_ds.planner.inputs import description
from disagmoe_ds.planner.model import load_model_spec
from disagmoe_ds.planner.recompute import Recompute
from disagmoe_ds.planner.workload import Workload

ZOO = "Megatron-MoE-ModelZoo best_practice/Qwen3/readme.md (yanring/Megatron-MoE-ModelZoo)"
ZOO_MIXTRAL = "Megatron-MoE-ModelZoo Mixtral-8x7B (as quoted in issue 26)"
BRIDGE_H100 = (
    "Megatron-Bridge performance summary, DGX-H100 BF16 recipe gpt_oss_120b_pretrain_64gpu_h100_bf16 (issue 44)"
)
AUTOMODEL = "NeMo AutoModel performance summary, DGX-H100 BF16 (as quoted in issue 26)"


@dataclass(frozen=True)
class PublishedRun:
    """One published training run and its layout (``baseline_layout`` syntax)."""

    name: str
    model: str  # directory under hf_models/
    nodes: int
    seq_len: int
    global_batch: int
    layout: str
    recompute: Recompute
    source: str
    step_s: float | None = None
    tflops: float | None = None
    tokens_per_s_per_gpu: float | None = None
    micro_batch_size: int = 1
    cluster: str = "h100"
    routing_imbalance: float = 1.0  # 1: forced-balanced routing (--moe-router-force-load-balancing)
    note: str = ""
    unmodelled: str = ""  # why the planner misses this run by more than TOLERANCE, with numbers; empty: it does not


TOLERANCE = 0.15  # issue 26: every published row within 15% at its own layout, or explained
# The busiest EP rank's expert load over the mean under Qwen3-235B-A22B's dropless (real) routing at EP 8: the value
# that reproduces the published 16K dropless run (237 TFLOP/s); the 32K-128K dropless rows validate it.
REAL_ROUTING_IMBALANCE = 1.46
PER_OP_GAP = (
    "PP 32 x VPP 3 runs 94 one-layer chunks: 512 micro-batches x 3 chunks x 2 passes = 3,072 ops per rank, so the "
    "7.3 s the planner misses are 2.4 ms per op: the schedule's host work and P2P handshakes per chunk, which the "
    "planner does not charge (Cluster.message_host_s, default 0; 0.3-0.4 ms per exchange op measured on H200 hosts)"
)
NO_RECOMPUTE_4K = (
    "the same TP4 PP8 VPP4 EP8 layout is predicted within 1% at 16K (295 TFLOP/s), but at 4K without recompute the "
    "run reaches 167 TFLOP/s, 44% of the planner's 378 and below every other 4K row (200-276); no planner term is "
    "that large (compute 84%, exposed a2a 10%, bubble 6% of its 12.9 s), and the planner puts the run at 67 of 77 "
    "usable GB: memory pressure (allocator retries, fragmentation) is the likely cause, and it is not modelled"
)
# Megatron's "norm, act" selective recompute modules are priced as the planner's selective recompute (it drops the
# attention and SwiGLU intermediates; docs/planner.md section 1).
LONG = (
    "published with selective recompute of layernorm and moe, which the planner's memory model does not fit at 16K+ "
    "(the ModelZoo's own note: full recompute where it runs out of memory), so priced with full recompute"
)
SINK_ATTENTION = (
    "GPT-OSS's attention has learnable sinks (Transformer Engine's softmax_type 'learnable'); TE turns FlashAttention "
    "off for it and its cuDNN FusedAttention takes it only from cuDNN 9.13.1, below which the run falls back to "
    "UnfusedDotProductAttention: every layer's 64 x S x S scores are written and read (the 128-token windows masked, "
    "not skipped), about 10 passes over 2.1 GB per layer and 4K micro-batch forward and backward: by estimate some "
    "8-10 ms on an H100 beside the flash core's 0.5 ms. The planner prices the flash core with windows; an unfused "
    "core would add about 80 ms to each 9-layer stage's 80-100 ms per micro-batch, about 15-16 s a step against the "
    "published 13.7 s (the planner's 9.1 s is two thirds of it). Which backend and cuDNN the run had is not "
    "published, so the row stays out"
)
RUNS: tuple[PublishedRun, ...] = (
    PublishedRun(
        "Qwen3-235B-A22B 4K, cross-node EP",
        "Qwen3-235B-A22B",
        32,
        4096,
        2048,
        "tp=2,pp=8,vpp=4,ep=32",
        "selective",
        ZOO,
        step_s=19.7,
        tflops=245,
    ),
    PublishedRun(
        "Qwen3-235B-A22B 4K, + 1F1B a2a overlap",
        "Qwen3-235B-A22B",
        32,
        4096,
        2048,
        "tp=2,pp=8,vpp=4,ep=32,overlap=paired",
        "selective",
        ZOO,
        step_s=17.6,
        tflops=276,
    ),
    PublishedRun(
        "Qwen3-235B-A22B 4K, intra-node EP, all-to-all",
        "Qwen3-235B-A22B",
        32,
        4096,
        2048,
        "tp=2,pp=32,vpp=3,ep=8,dispatcher=alltoall",
        "selective",
        ZOO,
        step_s=24.2,
        tflops=200,
        unmodelled=PER_OP_GAP,
    ),
    PublishedRun(
        "Qwen3-235B-A22B 4K, TP4 EP8, no recompute",
        "Qwen3-235B-A22B",
        32,
        4096,
        2048,
        "tp=4,pp=8,vpp=4,ep=8",
        "none",
        ZOO,
        step_s=29.0,
        tflops=167,
        unmodelled=NO_RECOMPUTE_4K,
    ),
    PublishedRun(
        "Qwen3-235B-A22B 16K",
        "Qwen3-235B-A22B",
        32,
        16384,
        256,
        "tp=4,pp=8,vpp=4,ep=8",
        "full",
        ZOO,
        tflops=295,
        note=LONG,
    ),
    PublishedRun(
        "Qwen3-235B-A22B 32K",
        "Qwen3-235B-A22B",
        32,
        32768,
        256,
        "tp=4,pp=8,vpp=4,ep=8,cp=2",
        "full",
        ZOO,
        tflops=335,
        note=LONG,
    ),
    PublishedRun(
        "Qwen3-235B-A22B 64K",
        "Qwen3-235B-A22B",
        32,
        65536,
        256,
        "tp=4,pp=8,vpp=4,ep=8,cp=4",
        "full",
        ZOO,
        tflops=368,
        note=LONG,
    ),
    PublishedRun(
        "Qwen3-235B-A22B 128K",
        "Qwen3-235B-A22B",
        32,
        131072,
        256,
        "tp=4,pp=8,vpp=4,ep=8,cp=8",
        "full",
        ZOO,
        tflops=389,
        note=LONG,
    ),
    *(
        PublishedRun(
            f"Qwen3-235B-A22B {seq // 1024}K, dropless",
            "Qwen3-235B-A22B",
            32,
            seq,
            256,
            f"tp=4,pp=8,vpp=4,ep=8,cp={cp}" if cp > 1 else "tp=4,pp=8,vpp=4,ep=8",
            "full",
            ZOO,
            tflops=tflops,
            routing_imbalance=REAL_ROUTING_IMBALANCE,
            note=LONG,
        )
        for seq, cp, tflops in ((16384, 1, 237), (32768, 2, 277), (65536, 4, 320), (131072, 8, 357))
    ),
    PublishedRun(
        "Mixtral-8x7B 4K",
        "Mixtral-8x7B",
        8,
        4096,
        256,
        "tp=1,pp=4,vpp=8,ep=8",
        "none",
        ZOO_MIXTRAL,
        tflops=468,
    ),
    PublishedRun(
        "Qwen3-30B-A3B 4K (NeMo AutoModel, FSDP2)",
        "Qwen3-30B-A3B",
        1,
        4096,
        512,
        "tp=1,pp=1,ep=8,grads=bf16",
        "full",
        AUTOMODEL,
        tflops=277,
        tokens_per_s_per_gpu=12040,
    ),
)
# Rows held out of the calibration: priced as they are, to check the planner on a model it was not fitted to.
HELD_OUT: tuple[PublishedRun, ...] = (
    PublishedRun(
        "GPT-OSS-120B 4K (held out)",
        "GPT-OSS-120B",
        8,
        4096,
        1280,
        "tp=1,pp=4,ep=8",
        "selective",
        BRIDGE_H100,
        tokens_per_s_per_gpu=5993,
        note="recompute of layernorm and moe_act, forced balanced routing",
        unmodelled=SINK_ATTENTION,
    ),
)


@dataclass(frozen=True)
class Prediction:
    run: PublishedRun
    plan: BaselinePlan | None
    world_size: int
    flops_per_token: float

    @property
    def step_s(self) -> float | None:
        return self.plan.step_time_s if self.plan else None

    @property
    def tokens_per_s_per_gpu(self) -> float | None:
        return self.plan.tokens_per_s / self.world_size if self.plan else None

    @property
    def tflops(self) -> float | None:
        rate = self.tokens_per_s_per_gpu
        return rate * self.flops_per_token / 1e12 if rate is not None else None

    @property
    def error(self) -> float | None:
        """Predicted over published - 1, on the step time if published, else on TFLOP/s (as a step-time error:
        published TFLOP/s over predicted - 1)."""
        if self.plan is None:
            return None
        if self.run.step_s is not None:
            return self.plan.step_time_s / self.run.step_s - 1
        rate = self.plan.tokens_per_s / self.world_size  # tokens_per_s_per_gpu, known with a plan
        if self.run.tflops is not None:
            return self.run.tflops / (rate * self.flops_per_token / 1e12) - 1
        if self.run.tokens_per_s_per_gpu is not None:
            return self.run.tokens_per_s_per_gpu / rate - 1
        return None  # the run publishes none of the three

    def dominant(self) -> str:
        """The largest share of the predicted step: compute, exposed all-to-all or bubble."""
        if self.plan is None:
            return "-"
        sim = self.plan.sim
        shares = {
            "compute": sim.compute_fraction,
            "exposed a2a/TP/CP": sim.exposed_comm_fraction,
            "bubble": sim.bubble_fraction,
        }
        name = max(shares, key=shares.get)  # type: ignore[arg-type]
        return ", ".join(f"{k} {v:.0%}" for k, v in shares.items()) + f" (largest: {name})"


def run_request(run: PublishedRun, models: Path) -> PlanRequest:
    spec = load_model_spec(models / run.model)
    cluster = preset(run.cluster, run.nodes)
    shape = parse_layout(run.layout)
    check_layout(shape, spec, cluster, run.seq_len)
    return PlanRequest(
        spec=spec,
        cluster=cluster,
        rates=shape_rates(cluster, Efficiency(), spec, routing_imbalance=run.routing_imbalance),
        work=Workload(run.seq_len, run.micro_batch_size),
        global_batch=run.global_batch,
        baseline_layout=shape,
        baseline_recompute=run.recompute,
    )


def predict(run: PublishedRun, models: Path) -> Prediction:
    """The planner's co-located step at the run's own layout."""
    req = run_request(run, models)
    plan, _ = best_baseline(req)
    return Prediction(run, plan, req.cluster.world_size, req.spec.step_flops_per_token(run.seq_len))


def _num(value: float | None, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def table_rows(models: Path) -> list[str]:
    rows = [
        "| run | GPUs | layout | recompute | routing | published step / TFLOP/s / tok/s/GPU | predicted | error | "
        "where the predicted step goes | source |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for run in (*RUNS, *HELD_OUT):
        p = predict(run, models)
        published = (
            f"{_num(run.step_s, '.1f')} s / {_num(run.tflops, '.0f')} / {_num(run.tokens_per_s_per_gpu, ',.0f')}"
        )
        predicted = f"{_num(p.step_s, '.2f')} s / {_num(p.tflops, '.0f')} / {_num(p.tokens_per_s_per_gpu, ',.0f')}"
        error = "does not fit" if p.error is None else f"{p.error:+.1%}"
        if run.unmodelled:
            error += f" (not modelled: {run.unmodelled})"
        routing = "balanced" if run.routing_imbalance == 1 else f"dropless ({run.routing_imbalance:g}x busiest rank)"
        rows.append(
            f"| {run.name} | {run.nodes * 8} {run.cluster.upper()} | {run.layout} | {run.recompute} | {routing} | "
            f"{published} | {predicted} | {error} | {p.dominant()} | {run.source} |"
        )
    return rows


def main(argv: list[str]) -> int:
    """``disagmoe-plan calibrate``: the calibration table (Markdown)."""
    p = argparse.ArgumentParser(prog="disagmoe-plan calibrate", description=description(__doc__))
    p.add_argument("--hf-models", default="hf_models", help="directory holding the model config directories")
    args = p.parse_args(argv)
    for row in table_rows(Path(args.hf_models)):
        print(row, flush=True)
    return 0
