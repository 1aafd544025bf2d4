"""Co-located pipeline stages (1F1B) equal the single-process HF model, under the rendezvous transport; the
schedule's deadlock check; the layout's checks; and a pipelined run_pretrain.py job that resumes exactly and exports.

Each parity case runs ``disagmoe_ds.colocated.verify`` with ``pp_size`` > 1: CPU ranks, one DeepSpeed engine per
rank over its stage's layers, hand-offs between stages on the rendezvous transport (a send completes only once its
receive has started), then the HF reference on the same batches: loss, global grad norm (clipping active), every
gradient and every parameter after 2 steps.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from disagmoe_ds.colocated import ColocatedConfig, ColocatedLayout
from disagmoe_ds.colocated.pipe_schedule import PipelineScheduleError, check_pipeline, schedule
from disagmoe_ds.colocated.verify import ColocatedVerifyArgs, run_colocated_verify
from disagmoe_ds.convert import main as convert
from disagmoe_ds.errors import ConfigError, LayoutError
from disagmoe_ds.models.attention_part import AttentionPart
from disagmoe_ds.models.expert_shard import ExpertShard
from disagmoe_ds.models.lora_settings import LoraSettings
from disagmoe_ds.planner.rank_state import rank_state_bytes

ROOT = Path(__file__).resolve().parents[1]
CLIP = 0.05  # below the tiny models' gradient norms, so global-norm clipping is active


@dataclass(frozen=True)
class PipeCase:
    family: str
    W: int
    ep: int
    pp: int
    K: int
    zero: int
    stages: tuple[int, ...] | None = None  # layers per virtual stage (None: as even as they go)
    v: int = 1  # virtual stages per stage
    dtype: str = "fp32"
    overrides: tuple[tuple[str, object], ...] = ()
    lora: bool = False  # adapters on attention and experts, every base weight frozen
    fp8: bool = False  # the FP8 lever, against the FP8 reference
    recompute: tuple[str, str] = ("none", "none")  # what the attention parts and the expert shards rebuild
    offload: bool = False  # DeepSpeed's optimizer offload (the host copies sum a chunk's backwards)
    sp: int = 1  # Ulysses ranks of a stage sharing a micro-batch
    tp: int = 1  # TP ranks of a stage sharing a micro-batch and each attention module's heads

    def __str__(self) -> str:
        split = "x".join(map(str, self.stages)) if self.stages else "even"
        extra = "-per_layer_aux" if self.overrides else ""
        extra += "-lora" if self.lora else ""
        extra += "-fp8" if self.fp8 else ""
        extra += "" if self.recompute == ("none", "none") else "-recompute-" + "-".join(self.recompute)
        extra += "-offload" if self.offload else ""
        extra += "".join(f"-{name}{n}" for name, n in (("sp", self.sp), ("tp", self.tp)) if n > 1)
        return (
            f"{self.family}{extra}-W{self.W}ep{self.ep}pp{self.pp}v{self.v}-{split}-K{self.K}-z{self.zero}-{self.dtype}"
        )


PER_LAYER_AUX = (("router_aux_loss_per_layer", True), ("router_aux_loss_coef", 0.5))
# Even and uneven stages, a first stage of dense layers alone (DeepSeek-V3's, MLA), one layer per stage with more
# micro-batches than stages (GPT-OSS: sinks, sliding windows, biased experts), one micro-batch (all warm-up), EP 2
# inside a stage, ZeRO 0/1/2, HF's pooled aux loss and per-layer balancing, shared experts, hyper-connections with
# hash routing (DeepSeek-V4), bf16, the embedding and the head alone on the end stages (Megatron's split), and
# virtual stages (interleaved 1F1B, the last stage handing on to the first), one of them empty; LoRA, FP8 and
# each side's recompute (full: the part's forward again in its backward; selective: ``models.recompute``). TP and
# Ulysses lanes inside a stage: TP with two batch lanes (its DP groups one per TP rank) under ZeRO 0's own clipping,
# across pipeline stages (MLA), with FP8, SP x TP with sinks (GPT-OSS) and over EP 4, and SP with LoRA and virtual
# stages.
CASES = [
    PipeCase("deepseek-v3", W=4, ep=2, pp=2, K=3, zero=2, stages=(1, 3)),
    PipeCase("gpt-oss", W=4, ep=1, pp=4, K=5, zero=1),
    PipeCase("qwen2-moe", W=4, ep=2, pp=2, K=1, zero=0, stages=(3, 1)),
    PipeCase("qwen3-moe", W=2, ep=1, pp=2, K=3, zero=0, stages=(1, 3), overrides=PER_LAYER_AUX),
    PipeCase("deepseek-v4", W=2, ep=1, pp=2, K=2, zero=1),
    PipeCase("qwen3-moe", W=4, ep=2, pp=2, K=3, zero=2, dtype="bf16"),
    PipeCase("qwen3-moe", W=3, ep=1, pp=3, K=3, zero=1, stages=(0, 4, 0)),
    PipeCase("qwen3-moe", W=2, ep=1, pp=2, K=4, zero=1, v=2),
    PipeCase("deepseek-v3", W=4, ep=2, pp=2, K=2, zero=2, stages=(0, 1, 2, 1), v=2),
    PipeCase("qwen3-moe", W=4, ep=2, pp=2, K=2, zero=1, v=2, lora=True),
    PipeCase("qwen3-moe", W=4, ep=2, pp=2, K=2, zero=2, v=2, offload=True),
    PipeCase("qwen3-moe", W=2, ep=1, pp=2, K=2, zero=1, fp8=True),
    PipeCase("deepseek-v3", W=2, ep=2, pp=1, K=2, zero=1, recompute=("full", "full")),  # one stage, as before
    PipeCase("deepseek-v3", W=4, ep=2, pp=2, K=2, zero=2, v=2, recompute=("full", "selective")),
    PipeCase("gpt-oss", W=2, ep=1, pp=2, K=2, zero=1, recompute=("selective", "full")),
    PipeCase("qwen3-moe", W=4, ep=2, pp=1, K=2, zero=0, tp=2),
    PipeCase("deepseek-v3", W=4, ep=2, pp=2, K=2, zero=1, stages=(1, 3), tp=2),
    PipeCase("qwen3-moe", W=2, ep=2, pp=1, K=2, zero=2, tp=2, fp8=True),
    PipeCase("gpt-oss", W=4, ep=2, pp=1, K=2, zero=1, sp=2, tp=2),
    PipeCase("qwen3-moe", W=4, ep=4, pp=1, K=2, zero=2, sp=2, tp=2),
    PipeCase("deepseek-v3", W=4, ep=2, pp=2, K=2, zero=0, v=2, sp=2, lora=True),
]


@pytest.mark.parametrize("case", CASES, ids=str)
def test_pipeline_stages_equal_hf(tiny_checkpoint, case: PipeCase):
    cfg = ColocatedConfig(
        world_size=case.W,
        ep_size=case.ep,
        pp_size=case.pp,
        virtual_stages=case.v,
        stage_layers=case.stages,
        micro_batches=case.K,
        transport="rendezvous",
        lora=LoraSettings(rank=4, init_lora_weights=False) if case.lora else None,  # a non-zero update at once
        fp8=case.fp8,
        fp8_bf16_width=0,  # the tiny models' projections and experts in FP8 too (the shape rules would keep them bf16)
        fp8_expert_bf16_width=0,
        recompute=dict(zip(("attention", "ffn"), case.recompute, strict=True)),
        sequence_parallel=case.sp,
        tensor_parallel=case.tp,
    )
    model = tiny_checkpoint(case.family, **dict(case.overrides))
    args = ColocatedVerifyArgs(
        str(model),
        cfg,
        zero=case.zero,
        dtype=case.dtype,
        seq_len=8,
        clip=CLIP,
        skew=True,
        zero_offload=case.offload,
    )
    summary = run_colocated_verify(args, timeout_s=180)
    assert all(n > CLIP for n in summary["reference_grad_norms"]), "clipping must be active in this test"
    assert summary["pass"], summary


@pytest.mark.parametrize("chunks", [1, 2, 3])
def test_every_schedule_runs_to_the_end_and_takes_its_messages_in_order(chunks):
    for stages in range(1 if chunks == 1 else 2, 7):
        for micro_batches in range(1, 13):
            if chunks > 1 and micro_batches % stages:
                continue
            orders = [schedule(stage, stages, chunks, micro_batches) for stage in range(stages)]
            check_pipeline(orders, chunks=chunks)
            if chunks == 1:  # 1F1B's memory bound
                assert [max(_in_flight(o)) for o in orders] == [min(stages - s, micro_batches) for s in range(stages)]


def test_the_check_names_a_deadlock_a_lost_micro_batch_and_a_mismatched_message():
    # stage 0 waits for micro-batch 0's gradient before sending micro-batch 1, which stage 1 waits for first
    F0, F1, B0, B1 = ("F", 0, 0), ("F", 0, 1), ("B", 0, 0), ("B", 0, 1)
    with pytest.raises(PipelineScheduleError, match="deadlock"):
        check_pipeline([[F0, B0, F1, B1], [F0, F1, B0, B1]])
    with pytest.raises(PipelineScheduleError, match="once forward then backward"):
        check_pipeline([[F0, F1, B0]])
    with pytest.raises(PipelineScheduleError, match="in another order than they are sent"):  # a message read as another
        check_pipeline([[F0, F1, B0, B1], [F1, F0, B1, B0]])


def test_layout_places_stages_outermost_and_ep_inside_a_stage():
    lay = ColocatedLayout(world_size=8, ep_size=2, num_experts=8, stage_layers=(1, 2))
    ranks = lay.group_ranks()
    assert ranks.data_parallel == ((0, 1, 2, 3), (4, 5, 6, 7))
    assert ranks.expert_parallel == ((0, 1), (2, 3), (4, 5), (6, 7))
    assert ranks.expert_data_parallel == ((0, 2), (1, 3), (4, 6), (5, 7))
    assert [lay.role_of(r).group for r in range(8)] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert lay.pipeline_peers(6) == (2, 6) and lay.checkpoint_dir(lay.role_of(6)) == "colocated_stage1"
    assert lay.manifest_layout()["stage_layers"] == [1, 2]
    one = ColocatedLayout(world_size=4, ep_size=2, num_experts=8)  # one stage: today's layout and checkpoints
    assert one.pp_size == 1 and "stage_layers" not in one.manifest_layout() and one.checkpoint_dir(one.role_of(3))


def test_a_ranks_training_state_is_its_stages_share():
    """The planner's training state of a co-located rank (the banner's line, the CPU memory check): half the layers'
    with 2 stages, the same with 2 chunks each (a stage holds chunks k * 2 + s), every layer's with one stage."""
    config = json.loads((ROOT / "hf_models" / "tiny-qwen3-moe" / "config.json").read_text())

    def state(**layout) -> float:
        lay = ColocatedLayout(world_size=4, ep_size=1, num_experts=8, **layout)
        return rank_state_bytes(config, lay, precision="fp32", zero_stage_a=0, zero_stage_f=0)["colocated"]

    whole, stages, chunks = state(), state(stage_layers=(2, 2)), state(stage_layers=(1, 1, 1, 1), virtual_stages=2)
    assert stages == chunks and 0.3 * whole < stages < 0.7 * whole  # half the layers, the embedding or the head


@pytest.mark.parametrize(
    ("cfg", "error", "says"),
    [
        (dict(world_size=6, pp_size=4), LayoutError, "pp_size .4. must divide world_size .6."),
        (dict(world_size=8, pp_size=2, ep_size=8), LayoutError, "must divide the 4 ranks of a pipeline stage"),
        (
            dict(world_size=4, pp_size=2, stage_layers=(1, 2, 1)),
            LayoutError,
            "names 3 stages, pp_size x virtual_stages is 2",
        ),
        (
            dict(world_size=4, pp_size=2, virtual_stages=2, micro_batches=3),
            LayoutError,
            "micro_batches a multiple of it",
        ),
        (dict(world_size=4, virtual_stages=2), LayoutError, "need pp_size > 1"),
        (dict(world_size=4, pp_size=2, transport="carrier pigeon"), ConfigError, "transport must be one of"),
        (dict(world_size=4, pp_size=2, sequence_parallel=4), LayoutError, "must divide the 2 ranks of a pipeline"),
        (dict(world_size=4, ep_size=2, tensor_parallel=4), LayoutError, r"tensor_parallel \(4\) must divide ep_size"),
    ],
)
def test_bad_pipeline_configs_are_one_line(cfg, error, says):
    with pytest.raises(error, match=says):
        ColocatedConfig(**cfg)


def test_stage_layers_must_cover_the_model():
    with pytest.raises(LayoutError, match="add up to the model's 4 decoder layers"):
        ColocatedConfig(world_size=2, pp_size=2, stage_layers=(1, 2)).layout(num_experts=8, num_layers=4)


@pytest.mark.parametrize(("policy", "runs"), [("none", 1), ("full", 2)])
def test_full_recompute_runs_each_part_again_in_its_backward(tiny_checkpoint, tmp_path, monkeypatch, policy, runs):
    """Every attention part's and expert shard's forward runs once per micro-batch, twice with full recompute: the
    checkpoint keeps its inputs and re-runs it in the backward (the dispatch between them does not run again)."""
    for cls in (AttentionPart, ExpertShard):
        monkeypatch.setattr(cls, "forward", _counted(cls.forward, cls.__name__, tmp_path))
    cfg = ColocatedConfig(
        world_size=2,
        ep_size=1,
        pp_size=2,
        micro_batches=2,
        transport="rendezvous",
        activation_checkpointing=policy == "full",
    )
    args = ColocatedVerifyArgs(str(tiny_checkpoint("qwen3-moe")), cfg, zero=1, dtype="fp32", seq_len=8, steps=1)
    assert run_colocated_verify(args, timeout_s=120)["pass"]
    calls = [line.split() for f in tmp_path.glob("calls-*") for line in f.read_text().splitlines()]
    for name, layers in (("AttentionPart", 4), ("ExpertShard", 3)):  # 4 layers, 3 of them MoE, 2 micro-batches
        assert sum(kind == name for kind, _ in calls) == runs * layers * 2, name


def _counted(forward, name: str, directory: Path):
    def counting(self, *args, **kwargs):
        if torch.is_grad_enabled():  # the verify's reference and evaluations run without gradients
            with open(directory / f"calls-{os.getpid()}", "a", encoding="utf-8") as f:
                f.write(f"{name} {os.getpid()}\n")
        return forward(self, *args, **kwargs)

    return counting


def test_cuda_graphs_with_stages_are_refused_before_launch(tiny_checkpoint):
    cfg = ColocatedConfig(world_size=2, ep_size=1, pp_size=2, cuda_graphs=True, transport="rendezvous")
    args = ColocatedVerifyArgs(str(tiny_checkpoint("qwen3-moe")), cfg, zero=1, dtype="fp32", seq_len=8)
    with pytest.raises(ConfigError, match="cuda_graphs.* does not run with co-located pipeline stages yet"):
        run_colocated_verify(args, timeout_s=60)


def test_a_pipelined_run_resumes_exactly_evaluates_exports_and_relays_out(tmp_path, tok_cache, capfd):
    """run_pretrain.py with 2 stages of 2 ranks (EP 2), 2 chunks each: 4 steps saving at 2 and 4, then a resume
    from step 2 that must log step 4's loss and eval loss to the digit, and an HF export that transformers loads and
    disagmoe-convert gives again from the checkpoint. Then step 2 re-laid out (optimizer state and data position
    included) as AF-Pipe on 2 attention + 2 FFN ranks, and that again as 2 plain pipeline stages: each resumes to
    the same step 4."""
    model = str(ROOT / "hf_models" / "tiny-qwen3-moe-lm")
    run = ["--model", model, "--micro-batches", "2", "--steps", "4"]
    run += ["--log-every", "1", "--seq-len", "32", "--micro-batch-size", "2", "--tokenizer-cache", str(tok_cache)]
    run += ["--eval-every", "2", "--eval-split", "0.05", "--eval-steps", "2"]
    pipeline = ["--mode", "colocated", "--world-size", "4", "--ep-size", "2", "--pp-size", "2"]
    save = tmp_path / "ckpt"
    first = _run(capfd, [*run, *pipeline, "--virtual-stages", "2", "--save-every", "2", "--save-dir", str(save)])
    assert "layout: co-located EP+DP: 4 ranks in 2 x 2 virtual pipeline stages of 2 (layers [1, 1, 1, 1])" in first
    resumed = _run(
        capfd, [*run, *pipeline, "--virtual-stages", "2", "--save-dir", str(save), "--resume", str(save / "step2"),
         "--export-hf", str(tmp_path / "hf")]
    )  # fmt: skip
    assert _step_line(resumed, 4) == _step_line(first, 4)
    assert sorted(p.name for p in (save / "step4").iterdir() if p.is_dir()) == [
        "colocated_stage0",
        "colocated_stage1",
        "tokenizer",
    ]
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["num_hidden_layers"] == 4
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    # disagmoe-convert reads the stages' checkpoint into the same HF tensors, as a re-layout's first half
    assert convert(["disagmoe-to-hf", "--ckpt", str(save), "--model", model, "--out", str(tmp_path / "hf2")]) == 0
    exported, converted = (load_file(tmp_path / d / "model.safetensors") for d in ("hf", "hf2"))
    assert exported.keys() == converted.keys() and all(exported[k].equal(converted[k]) for k in exported)

    afpipe, again = tmp_path / "afpipe", tmp_path / "pipeline"
    relayout = ["relayout", "--tag", "step2", "--model", model]
    assert (
        convert([*relayout, "--ckpt", str(save), "--out", str(afpipe), "--attention-gpus", "2", "--ffn-gpus", "2"]) == 0
    )
    disaggregated = _run(
        capfd, [*run, "--attention-gpus", "2", "--ffn-gpus", "2", "--save-dir", str(afpipe), "--resume"]
    )
    assert _step_line(disaggregated, 4) == _step_line(first, 4)
    assert convert([*relayout, "--ckpt", str(afpipe), "--out", str(again), "--mode", "colocated", *pipeline[2:]]) == 0
    back = _run(capfd, [*run, *pipeline, "--save-dir", str(again), "--resume", str(again / "step2")])
    assert _step_line(back, 4) == _step_line(first, 4)


def test_a_tensor_parallel_run_resumes_exactly_exports_and_relays_out(tmp_path, tok_cache, capfd):
    """run_pretrain.py on 2 ranks holding each micro-batch as TP 2 (the ds_config's "colocated" section): 4 steps
    saving at 2, a resume from step 2 that logs step 4 to the digit and exports HF weights that disagmoe-convert
    gives again from the head shards; step 2 re-laid out as AF-Pipe with Ulysses 2 (the same tokens per step) resumes
    to the same step 4."""
    model = str(ROOT / "hf_models" / "tiny-qwen3-moe-lm")
    ds_config = json.loads((ROOT / "ds_configs" / "tiny-cpu.json").read_text())
    ds_config["disagmoe"] = {"colocated": {"world_size": 2, "tensor_parallel": 2}}
    (tmp_path / "tp.json").write_text(json.dumps(ds_config))
    run = ["--model", model, "--micro-batches", "2", "--steps", "4"]
    run += ["--log-every", "1", "--seq-len", "32", "--micro-batch-size", "2", "--tokenizer-cache", str(tok_cache)]
    tp = ["--deepspeed_config", str(tmp_path / "tp.json"), "--mode", "colocated"]
    save = tmp_path / "ckpt"
    first = _run(capfd, [*run, *tp, "--save-every", "2", "--save-dir", str(save)])
    assert "layout: co-located EP+DP: 2 ranks, EP 2 x EDP 1, TP 2" in first
    resumed = _run(
        capfd,
        [*run, *tp, "--save-dir", str(save), "--resume", str(save / "step2"), "--export-hf", str(tmp_path / "hf")],
    )
    assert _step_line(resumed, 4) == _step_line(first, 4)
    assert sorted(p.name for p in (save / "step4").iterdir() if p.is_dir()) == [
        "colocated_tp0",
        "colocated_tp1",
        "tokenizer",
    ]
    from safetensors.torch import load_file

    assert convert(["disagmoe-to-hf", "--ckpt", str(save), "--model", model, "--out", str(tmp_path / "hf2")]) == 0
    exported, converted = (load_file(tmp_path / d / "model.safetensors") for d in ("hf", "hf2"))
    assert exported.keys() == converted.keys() and all(exported[k].equal(converted[k]) for k in exported)

    afpipe = tmp_path / "afpipe"
    layout = ["--attention-gpus", "2", "--ffn-gpus", "2", "--sequence-parallel", "2"]
    relayout = ["relayout", "--tag", "step2", "--model", model, "--ckpt", str(save), "--out", str(afpipe), *layout]
    assert convert(relayout) == 0
    disaggregated = _run(capfd, [*run, *layout, "--save-dir", str(afpipe), "--resume"])
    assert _step_line(disaggregated, 4) == _step_line(first, 4)


def _run(capfd, argv: list[str]) -> str:
    """``run_pretrain.py argv`` in this process (``tests.runs.run_pretrain``: its ranks are forked from here, which
    spares each job the interpreter's start and torch's, DeepSpeed's and transformers' imports); its stdout."""
    from tests.runs import run_pretrain

    capfd.readouterr()
    rc = run_pretrain.main(argv)
    out, err = capfd.readouterr()
    assert rc == 0, out[-3000:] + err[-3000:]
    return out


def _step_line(log: str, step: int) -> str:
    """Step ``step``'s loss, eval loss and aux (not its timings)."""
    line = next(line for line in log.splitlines() if line.startswith(f"step {step}/"))
    return re.sub(r" tok/s.*", "", line)


def _in_flight(order) -> list[int]:
    """The micro-batches holding activations after each pass of ``order``."""
    live, counts = 0, []
    for kind, *_ in order:
        live += 1 if kind == "F" else -1
        counts.append(live)
    return counts
