"""run_pretrain.py --mode colocated end to end on CPU ranks: training, exact resume under ZeRO 0 and 1, one rank by
default, the world size of a launcher, and checkpoints of the other mode refused with a one-line error.

Runs are short (seq 32, 2-6 steps) and call ``run_pretrain.main`` in this process (it forks the ranks), except the
torchrun run, a real subprocess. Helpers and the exactness rule (bit for bit on CPU) are ``test_pretrain``'s.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from disagmoe_ds.launch.local import free_port
from tests.runs import (
    ROOT,
    SHORT,
    STEPS,
    assert_refused_before_launch,
    assert_saved_at_the_stopped_step,
    pretrain,
    records,
    run_script,
    same,
    sigint_the_launcher_alone,
)

TORCHRUN_2 = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2"]  # and a free --master_port

MODEL = ROOT / "hf_models" / "tiny-qwen3-moe-lm"  # the embedded default: 8 experts, 4 MoE layers
TWO_RANKS = ("--mode", "colocated", "--world-size", 2)


@pytest.fixture(scope="module")
def two_rank_run(tmp_path_factory, tok_cache) -> tuple[list[dict], Path]:
    """The embedded default on 2 co-located ranks (EP 2 by default, ZeRO 0), 6 steps, saved every 3."""
    out = tmp_path_factory.mktemp("colocated")
    ck, metrics = out / "ck", out / "metrics.jsonl"
    argv = (*TWO_RANKS, "--steps", 6, "--save-dir", ck, "--save-every", 3, "--metrics-file", metrics)
    assert pretrain(tok_cache, *argv) == 0
    return records(metrics), ck


def test_two_ranks_train_and_save_deepspeed_moe_checkpoints(two_rank_run) -> None:
    recs, ck = two_rank_run
    assert [r["step"] for r in recs] == [1, 2, 3, 4, 5, 6]
    assert recs[-1]["loss"] < recs[0]["loss"] - 0.1, [r["loss"] for r in recs]
    assert all(len(r["expert_imbalance"]) == 4 and r["max_imbalance"] >= 1.0 for r in recs)
    assert sorted(os.listdir(ck)) == ["latest", "step3", "step6"]
    manifest = json.loads((ck / "step6" / "manifest.json").read_text())
    assert manifest["mode"] == "colocated" and manifest["roles"] == ["colocated"]
    assert manifest["layout"] == {"world_size": 2, "ep_size": 2, "num_experts": 8}
    # DeepSpeed's MoE layout: one file per global expert (written by its first replica), the rest once.
    files = sorted(os.listdir(ck / "step6" / "colocated" / "state"))
    assert files == sorted(
        [f"layer_0_expert_{e}_mp_rank_00_model_states.pt" for e in range(8)]
        + ["mp_rank_00_model_states.pt", "expp_rank_0_mp_rank_00_optim_states.pt"]
        + ["expp_rank_1_mp_rank_00_optim_states.pt"]
    )


def test_resume_continues_exactly(two_rank_run, tok_cache, tmp_path) -> None:
    recs, ck = two_rank_run
    resumed = tmp_path / "resumed.jsonl"
    argv = (*TWO_RANKS, "--steps", 6, "--save-dir", tmp_path / "ck", "--resume", ck / "step3")
    assert pretrain(tok_cache, *argv, "--metrics-file", resumed) == 0
    assert same(records(resumed), recs[3:])


def test_zero1_with_expert_replicas_resumes_exactly(tok_cache, tmp_path) -> None:
    """EP 1 x EDP 2 under ZeRO 1: both the attention and the expert optimizer states are partitioned."""
    ds_config = json.loads((ROOT / "ds_configs" / "tiny-cpu.json").read_text())
    ds_config["zero_optimization"] = {"stage": 1}
    (tmp_path / "zero1.json").write_text(json.dumps(ds_config))
    argv = (*TWO_RANKS, "--ep-size", 1, "--deepspeed_config", tmp_path / "zero1.json", "--steps", 4)
    full, resumed, ck = tmp_path / "full.jsonl", tmp_path / "resumed.jsonl", tmp_path / "ck"
    assert pretrain(tok_cache, *argv, "--save-dir", ck, "--save-every", 2, "--metrics-file", full) == 0
    assert sorted(os.listdir(ck / "step2" / "colocated" / "state"))[-2:] == [
        "zero_pp_rank_0_mp_rank_00_optim_states.pt",
        "zero_pp_rank_1_mp_rank_00_optim_states.pt",
    ]
    assert pretrain(tok_cache, *argv, "--save-dir", tmp_path / "ck2", "--resume", ck / "step2",
                    "--metrics-file", resumed) == 0  # fmt: skip
    assert same(records(resumed), records(full)[2:])


def test_one_rank_by_default(tok_cache, tmp_path) -> None:
    """The one-GPU path, as a user types it: no --world-size, no launcher: one rank holding every expert.

    A real subprocess: a rank forked from this test process (which ran multi-threaded torch code) with more than one
    intra-op thread can hang in OpenMP; the other runs here have one thread per rank.
    """
    metrics = tmp_path / "metrics.jsonl"
    done = run_script("--mode", "colocated", "--steps", 2, *SHORT, "--tokenizer-cache", tok_cache,
                      "--metrics-file", metrics)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    for fact in (
        "layout: co-located EP+DP: 1 ranks, EP 1 x EDP 1, 8 experts per rank",
        "pipeline: 4 micro-batches per rank per step, one at a time (forward, backward); no token exchange",
        "tokens per step: 512 = 1 lanes x 4 micro-batches x 4 sequences x 32 tokens",
    ):
        assert fact in done.stdout, done.stdout
    assert [r["step"] for r in records(metrics)] == [1, 2]


def test_torchrun_gives_the_world_size_and_sigint_to_it_alone_stops(two_rank_run, tok_cache, tmp_path) -> None:
    """Under a launcher the world size is the launcher's: the same first two steps as the local 2-rank run. Then
    SIGINT to torchrun alone: it passes the signal to its ranks, which stop after their step and save; torchrun
    exits non-zero (its SignalException)."""
    launcher = [*TORCHRUN_2, "--master_port", str(free_port())]
    sigint_the_launcher_alone(launcher, tmp_path, tok_cache, "--mode", "colocated", processes=2)  # the 2 ranks
    # Steps 1-2 sit in the warm-up, whose learning rates do not depend on --steps.
    assert same(records(tmp_path / "m.jsonl")[:2], two_rank_run[0][:2])
    stopped = assert_saved_at_the_stopped_step(tmp_path)
    assert f"stopped on request after step {stopped} of {STEPS}" in (tmp_path / "out").read_text()


def _disaggregated_checkpoint(root: Path) -> Path:
    """A complete-looking checkpoint of the default disaggregated job, with a manifest from before the co-located
    mode (no "mode" key): such manifests are disaggregated."""
    from disagmoe_ds.checkpoint.manifest import model_fingerprint
    from disagmoe_ds.models.loading import load_config

    (root / "step5").mkdir(parents=True)
    layout = {"attention_gpus": 2, "ffn_gpus": 2, "depth": 1, "expert_data_parallel": 1, "num_layers": 4,
              "num_experts": 8}  # fmt: skip
    manifest = {"tag": "step5", "layout": layout, "client_state": {"step": 5},
                "model": model_fingerprint(load_config(MODEL))}  # fmt: skip
    (root / "step5" / "manifest.json").write_text(json.dumps(manifest))
    (root / "latest").write_text("step5")
    return root


@pytest.mark.parametrize(
    ("case", "message"),
    [
        ("disaggregated checkpoint", r"checkpoint .*step5 was written by a disaggregated job, this run is colocated; "
                                     r"resume it with --mode disaggregated$"),
        ("colocated checkpoint", r"checkpoint .*step6 was written by a colocated job, this run is disaggregated; "
                                 r"resume it with --mode colocated$"),
        ("other layout", r"checkpoint .*step6 has layout \{'world_size': 2, 'ep_size': 2, 'num_experts': 8\}, this "
                         r"run has \{'world_size': 2, 'ep_size': 1, .*resume with the same --world-size, --ep-size "
                         r"and pipeline stages"),
        ("ep size", r"num_experts \(8\) must be divisible by ep_size \(3\)"),
        ("layout flag", r"--ffn-gpus sets the disaggregated layout; --mode colocated takes --world-size, --ep-size, "
                        r"--pp-size and the lanes' --sequence-parallel and --tensor-parallel"),
        ("colocated flag", r"--ep-size is a --mode colocated flag"),
    ],
)  # fmt: skip
def test_bad_input_is_a_one_line_error_before_any_rank_starts(
    two_rank_run, tok_cache, tmp_path, capfd, case, message
) -> None:
    ck = two_rank_run[1]
    argv = {
        "disaggregated checkpoint": [*TWO_RANKS, "--save-dir", _disaggregated_checkpoint(tmp_path / "ck"), "--resume"],
        "colocated checkpoint": ["--save-dir", ck, "--resume"],
        "other layout": [*TWO_RANKS, "--ep-size", 1, "--save-dir", ck, "--resume"],
        "ep size": ["--mode", "colocated", "--world-size", 3, "--ep-size", 3],
        "layout flag": ["--mode", "colocated", "--ffn-gpus", 2],
        "colocated flag": ["--ep-size", 2],
    }[case]
    assert_refused_before_launch(tok_cache, capfd, argv, message)


_FAIL_IN_RANK_1 = """
import os
if os.environ.get("RANK") == "1":  # a rank of the launched job, not the launcher
    from disagmoe_ds.colocated import executor

    original, calls = executor.ColocatedExecutor.train_batch, []

    def train_batch(self, *args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("injected failure in rank 1")
        return original(self, *args, **kwargs)

    executor.ColocatedExecutor.train_batch = train_batch
"""


def test_a_failure_under_torchrun_is_one_line_from_the_failing_rank(tok_cache, tmp_path) -> None:
    """Rank 1 raises in step 2 under torchrun (injected through sitecustomize); its peer then fails or is ended. Our
    output is one line naming rank 1's exception and where every rank's traceback went; the launcher's own
    report follows it."""
    (tmp_path / "sitecustomize.py").write_text(_FAIL_IN_RANK_1)
    launcher = [*TORCHRUN_2, "--master_port", str(free_port())]
    argv = ["--mode", "colocated", "--steps", 4, *SHORT, "--tokenizer-cache", tok_cache]
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{ROOT}", "TMPDIR": str(tmp_path)}
    command = [*launcher, str(ROOT / "run_pretrain.py"), *map(str, argv)]
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode != 0
    ours = [line for line in done.stderr.splitlines() if line.startswith("run_pretrain.py:")]
    assert len(ours) == 1, done.stderr[-3000:]
    match = re.fullmatch(
        r"run_pretrain\.py: rank 1 failed: RuntimeError: injected failure in rank 1 \(tracebacks: (.*)\)", ours[0]
    )
    assert match, ours[0]
    pattern = Path(match[1])  # names every rank's log of this job
    assert pattern.parent == tmp_path and pattern.name.endswith("-rank*.log"), pattern
    rank1 = (tmp_path / pattern.name.replace("*", "1")).read_text()
    assert "injected failure in rank 1" in rank1 and "Traceback" in rank1
