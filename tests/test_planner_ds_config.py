"""The planner's ds_config runs in the runtime as planned: each variant the runtime runs is written into the
"disagmoe" section and passes the runtime's own checks; each it refuses is left out, and the planner's reason
(``runtime_files.runtime_refusal``) is the runtime's. The files ``disagmoe-plan --write-ds-config`` writes pass
``run_pretrain.py``'s own parsing and pre-launch checks unedited (1 and 2 nodes, LoRA, AF-Pipe and co-located), hold
the shipped optimizer and schedule and only keys the runtime reads, and start CPU ranks as they are."""

from __future__ import annotations

import itertools
import json
import re
import warnings
from dataclasses import fields
from pathlib import Path
from types import SimpleNamespace

import pytest

from disagmoe_ds.capabilities.rules import check
from disagmoe_ds.config import SECTION, DisagMoEConfig
from disagmoe_ds.config.levers import job_of
from disagmoe_ds.errors import ConfigError
from disagmoe_ds.layout import Layout
from disagmoe_ds.planner.cli import main
from disagmoe_ds.planner.cluster import Cluster, save_cluster
from disagmoe_ds.planner.runtime_files import TRAINING, ds_config, runtime_refusal
from disagmoe_ds.planner.workload import Workload
from disagmoe_ds.train import run as job
from disagmoe_ds.train.args import TrainArgs, parse_args
from disagmoe_ds.train.checks import _deepspeed_keys
from tests.runs import pretrain, records


def _written(work: Workload, depth: int) -> dict:
    layout = Layout(attention_gpus=2 * depth, ffn_gpus=2 * depth, num_layers=4, num_experts=8, depth=depth)
    candidate = SimpleNamespace(layout=layout, micro_batches=8, work=work)
    request = SimpleNamespace(work=Workload(4096, 1), cluster=SimpleNamespace(name="h800"))
    return ds_config(SimpleNamespace(request=request, af=SimpleNamespace(candidate=candidate, in_flight=5)))


def _runtime_accepts(ds: dict) -> bool:
    try:
        cfg = DisagMoEConfig.from_ds_config(ds)
        check(job_of(None, cfg, ds))  # what the preflight checks of the levers (runtime.rank)
    except ConfigError:
        return False
    return True


def _full_variant(work: Workload, depth: int) -> dict:
    """The ds_config with every switch of ``work`` set, as if the planner wrote it whatever the runtime refuses."""
    ds = _written(Workload(4096, 1), depth)
    ds["disagmoe"] |= {
        "activation_checkpointing": work.recompute == "full",
        "selective_recompute": work.recompute == "selective",
        "resend": work.resend,
        "split_backward": work.split_backward,
        "offload": {"attention": work.offload[0], "ffn": work.offload[1]},
        "zero_stage": {"attention": work.zero_of("attention"), "ffn": work.zero_of("ffn")},
    }
    return ds


VARIANTS = list(
    itertools.product(
        ("none", "selective", "full"), (False, True), (False, True), (1, 2), (1, 2, 3), (0.0, 0.5), (1, 2)
    )
)


@pytest.mark.parametrize(("recompute", "resend", "split", "za", "zf", "offload_f", "depth"), VARIANTS)
def test_the_planners_refusals_are_the_runtimes(recompute, resend, split, za, zf, offload_f, depth):
    work = Workload(
        4096,
        1,
        recompute=recompute,
        resend=resend,
        split_backward=split,
        attention_zero_stage=za,
        ffn_zero_stage=zf,
        offload=(0.15000000000000002, offload_f),  # the writer rounds
    )
    refusal = runtime_refusal(work)
    assert _runtime_accepts(_full_variant(work, depth)) == (refusal is None), refusal
    written = _written(work, depth)
    assert _runtime_accepts(written)  # what the planner writes always launches
    section = written["disagmoe"]
    if refusal is None:  # the variant as planned
        cfg = DisagMoEConfig.from_ds_config(written)
        assert cfg.selective_recompute == (recompute == "selective")
        assert cfg.activation_checkpointing == (recompute == "full")
        assert (cfg.resend, cfg.split_backward) == (resend, split)
        assert cfg.zero_stage == {"attention": za, "ffn": zf} and cfg.offload_share("attention") == 0.15
    else:  # the layout alone
        assert "zero_stage" not in section and "offload" not in section


def test_the_planner_knows_which_a_lane_degrees_the_runtime_runs():
    """``runtime_files.RUNTIME_LANE_FIELDS`` names which of "sequence_parallel" and "tensor_parallel"
    ``DisagMoEConfig`` reads (the planner cannot import it): a plan with a degree > 1 the runtime does not read gets
    no ds_config."""
    from disagmoe_ds.planner.runtime_files import RUNTIME_LANE_FIELDS

    names = {f.name for f in fields(DisagMoEConfig)}
    assert RUNTIME_LANE_FIELDS == {"sequence_parallel", "tensor_parallel"} & names


# ----- the written files run in run_pretrain.py as they are -----
ROOT = Path(__file__).resolve().parent.parent
MODELS = ROOT / "hf_models"
Q30 = str(MODELS / "Qwen3-30B-A3B")
DS16_2_NODES = (str(MODELS / "DeepSeek-MoE-16B"), "--seq-len", "4096", "--nodes", "2")
# The training settings a ds_config needs beside the batch keys, none of which run_pretrain.py derives.
TRAINING_KEYS = {"train_micro_batch_size_per_gpu", "bf16", "zero_optimization", "optimizer", "scheduler"}


def _cluster(path: Path) -> str:
    """One node of 4 GPUs: CPU ranks can run its plans."""
    save_cluster(Cluster("test", nodes=1, gpus_per_node=4, peak_flops=400e12, hbm_bytes=80e9, nvlink_bw=200e9,
                         nics_per_node=4, nic_bw=50e9), path)  # fmt: skip
    return str(path)


def _write(capsys, ds: Path, *flags: str) -> tuple[dict, str]:
    """``disagmoe-plan flags --write-ds-config ds``: the file, and stderr."""
    rc = main([*flags, "--write-ds-config", str(ds)])
    err = capsys.readouterr().err
    assert rc == 0, err
    return json.loads(ds.read_text()), err


def _preflight(ds: Path, *flags: object) -> TrainArgs:
    """The file through run_pretrain.py's own parsing and pre-launch checks, unedited; the plan's own
    --micro-batches given too, which must not conflict with it."""
    section = json.loads(ds.read_text())["disagmoe"]
    argv = ["--deepspeed_config", str(ds), "--micro-batches", str(section["micro_batches"]), *map(str, flags)]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        args, _ = parse_args(argv, root=ROOT, description="")
    assert not [w for w in caught if "ignored" in str(w.message)], [str(w.message) for w in caught]
    job.preflight_run(args, args.cfg.world_size)
    return args


def _holds_only_what_the_runtime_reads(ds: dict) -> None:
    assert TRAINING_KEYS <= set(ds) and ds["optimizer"]["type"] == "AdamW" and ds["scheduler"]["params"]
    assert "gradient_accumulation_steps" not in ds and "train_batch_size" not in ds  # run_pretrain.py derives them
    assert set(ds) <= _deepspeed_keys() | {SECTION}
    assert set(ds[SECTION]) <= {f.name for f in fields(DisagMoEConfig)}  # no "placement", no NIC split


def test_the_training_settings_are_the_shipped_configs():
    for name in ("1node-8gpu-bf16.json", "2node-16gpu-bf16.json"):
        shipped = json.loads((ROOT / "ds_configs" / name).read_text())
        assert {key: shipped[key] for key in TRAINING} == TRAINING, name


@pytest.mark.parametrize(
    ("flags", "mode", "nodes"),
    [
        # the AF-Pipe plan's files (on 1 node the fastest co-located layout the runtime runs beats it)
        ((Q30, "--seq-len", "4096", "--nodes", "1", "--write-mode", "disaggregated"), "disaggregated", 1),
        # the verdict's layout needs TP; the fastest the runtime runs is co-located with virtual stages
        (DS16_2_NODES, "colocated", 2),
        # the verdict's co-located layout is one the runtime runs: the files are for it
        ((*DS16_2_NODES, "--baseline-layout", "tp=1,pp=1,vpp=1,ep=8,cp=1"), "colocated", 2),
        ((*DS16_2_NODES, "--write-mode", "colocated"), "colocated", 2),
    ],
    ids=["1-node", "2-nodes", "2-nodes-ep-verdict", "2-nodes-write-colocated"],
)
def test_written_configs_pass_run_pretrains_preflight(tmp_path, capsys, flags, mode, nodes):
    ds, hosts = tmp_path / "ds.json", tmp_path / "hosts"
    written, _ = _write(capsys, ds, "--model", *flags, "--write-hostfile", str(hosts))
    _holds_only_what_the_runtime_reads(written)
    args = _preflight(ds, "--model", flags[0], "--seq-len", 4096)
    assert args.mode == mode and args.cfg.world_size == 8 * nodes
    lines = hosts.read_text().splitlines()
    assert [line for line in lines if not line.startswith("#")] == [f"node-{n} slots=8" for n in range(nodes)]
    if mode == "disaggregated":  # a launch numbers ranks node by node: the plan's placement is contiguous
        assert "# placement: contiguous" in lines[1] and "layout ranks [0, 1, 2, 3, 4, 5, 6, 7]" in lines[2]


def test_an_unrunnable_co_located_verdict_is_said_in_one_line(tmp_path, capsys):
    """Qwen3-30B-A3B at 4K on 2 nodes: the verdict's co-located layout has ring CP, which the runtime's co-located
    mode (EP x DP in 1F1B stages with Ulysses and TP lanes) does not run; the files are for the faster of AF-Pipe
    and what it runs, said so with the other's step."""
    ds = tmp_path / "ds.json"
    written, err = _write(capsys, ds, "--model", Q30, "--seq-len", "4096", "--nodes", "2")
    notes = [line for line in err.splitlines() if line.startswith("note:")]
    assert len(notes) == 1, err
    layout = r"EP \d+ x EDP \d+( x PP \d+( x v \d+)?)?(, SP \d+)?(, TP \d+)?"
    match = re.fullmatch(
        r"note: the verdict's co-located layout \(TP 2 CP 2 EP 2 PP 2 .*: [\d.]+ s/step\) is not one DisagMoE-DS "
        r"runs \(ring CP 2; its co-located mode is EP x DP under ZeRO in 1F1B pipeline stages, with Ulysses and TP "
        r"lanes\); the "
        rf"files are for (?P<chosen>the AF-Pipe plan|co-located {layout}) instead: (?P<chosen_s>[\d.]+) s/step "
        rf"predicted \((?P<other>the AF-Pipe plan|the best co-located layout it runs, {layout}): "
        r"(?P<other_s>[\d.]+) s\)",
        notes[0],
    )
    assert match and float(match["chosen_s"]) < float(match["other_s"]), notes[0]
    _holds_only_what_the_runtime_reads(written)
    mode = "disaggregated" if match["chosen"] == "the AF-Pipe plan" else "colocated"
    assert _preflight(ds, "--model", Q30, "--seq-len", 4096).mode == mode


def test_a_verdict_with_lanes_the_job_refuses_is_not_written(tmp_path, capsys):
    """A LoRA job whose verdict is co-located TP 2: the runtime refuses TP with LoRA (``capabilities.rules``), so the
    files are for a layout it runs, and the note gives the rule's own reason."""
    flags = ("--model", str(MODELS / "tiny-qwen3-moe"), "--seq-len", "128", "--cluster", _cluster(tmp_path / "c.json"),
             "--baseline-layout", "tp=2,pp=1,vpp=1,ep=2,cp=1", "--lora-rank", "8",
             "--write-mode", "colocated")  # fmt: skip
    written, err = _write(capsys, tmp_path / "ds.json", *flags)
    assert "is not one DisagMoE-DS runs (tensor_parallel 2 does not work with lora yet" in err, err
    assert written[SECTION]["colocated"].get("tensor_parallel", 1) == 1


def test_a_pipelined_co_located_plan_is_written_as_it_was_priced_and_passes_preflight(tmp_path, capsys):
    """Qwen3-30B-A3B at 4K on 2 nodes, --write-mode colocated: the best co-located layout the runtime runs has
    pipeline stages and lanes; the file holds them with the planner's layer split, and run_pretrain.py accepts it."""
    ds = tmp_path / "ds.json"
    written, _ = _write(capsys, ds, "--model", Q30, "--seq-len", "4096", "--nodes", "2", "--write-mode", "colocated")
    placed = written[SECTION]["colocated"]
    assert placed["pp_size"] > 1 and sum(placed["stage_layers"]) == 48, placed
    args = _preflight(ds, "--model", Q30, "--seq-len", 4096)
    assert args.mode == "colocated" and args.cfg.pp_size == placed["pp_size"]
    assert list(args.cfg.stage_layers) == placed["stage_layers"]
    lanes = (args.cfg.sequence_parallel, args.cfg.tensor_parallel)  # TP 2 (Ulysses stands in for CP where it pays)
    assert lanes == (placed.get("sequence_parallel", 1), placed.get("tensor_parallel", 1)) and lanes != (1, 1)


def test_a_lora_plan_passes_run_pretrains_preflight(tmp_path, capsys, tiny_checkpoint):
    hf = tiny_checkpoint("qwen3-moe")
    flags = ("--model", str(hf), "--seq-len", "128", "--cluster", _cluster(tmp_path / "cluster.json"))
    for mode in ("disaggregated", "colocated"):
        ds = tmp_path / f"{mode}.json"
        written, _ = _write(capsys, ds, *flags, "--lora-rank", "8", "--write-mode", mode)
        _holds_only_what_the_runtime_reads(written)
        assert written[SECTION]["lora"] == {"rank": 8, "targets": ["attention", "experts"]}
        args = _preflight(ds, "--init-from", hf, "--seq-len", 128)
        assert args.mode == mode and args.cfg.lora is not None and args.cfg.lora.rank == 8


def test_spread_placements_are_not_written(tmp_path, capsys):
    rc = main(["--model", *DS16_2_NODES, "--placement", "spread", "--write-mode", "disaggregated",
               "--write-hostfile", str(tmp_path / "hosts")])  # fmt: skip
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1 and "--placement contiguous" in err, err


@pytest.mark.parametrize("mode", ["disaggregated", "colocated"])
def test_a_written_config_trains_on_cpu_ranks(tmp_path, capfd, tok_cache, mode):
    """The written file starts the embedded tiny model's ranks as it is (no --mode, no layout flag), under the
    shipped schedule."""
    ds, metrics = tmp_path / "ds.json", tmp_path / "metrics.jsonl"
    cluster = _cluster(tmp_path / "cluster.json")
    flags = ("--model", str(MODELS / "tiny-qwen3-moe-lm"), "--seq-len", "32", "--global-batch-size", "16")
    _write(capfd, ds, *flags, "--cluster", cluster, "--precision", "fp32", "--write-mode", mode)
    assert pretrain(tok_cache, "--deepspeed_config", ds, "--steps", 3, "--metrics-file", metrics) == 0
    assert ("layout: co-located EP+DP" in capfd.readouterr().out) == (mode == "colocated")  # the banner's
    lr = [r["lr"] for r in records(metrics)]  # not a constant 1e-3: 0, then a 2,000-step linear warm-up to 3e-4
    assert lr[:2] == [0, 0] and lr[2] == pytest.approx(TRAINING["optimizer"]["params"]["lr"] / 2000)
