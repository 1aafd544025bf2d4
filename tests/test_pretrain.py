"""run_pretrain.py end to end on 4 CPU ranks: the embedded default, exact resume, crash-safe saves, fine-tuning,
auxiliary-loss-free balancing, the deepspeed launcher, SIGINT to a launcher's PID alone (a clean stop with a
checkpoint), and one-line errors for bad input.

Runs are short (seq 32, 2-6 steps). Most call ``run_pretrain.main`` in this process (it forks the ranks, which
inherit monkeypatches); the embedded default, ``--help``, the launcher and the interrupted runs are real
subprocesses (each in its own session, so that a signal reaches only the process it is sent to).
"""

from __future__ import annotations

import json
import os
import re
import signal
import sys
import tempfile
import time
import warnings
from pathlib import Path

import pytest
import torch

from disagmoe_ds.launch.local import free_port
from disagmoe_ds.train import run as job
from tests.conftest import all_families_only, write_tiny_checkpoint
from tests.runs import (
    ROOT,
    SHORT,
    STEPS,
    STOP_BOUND_S,
    assert_refused_before_launch,
    assert_saved_at_the_stopped_step,
    kill_session,
    pretrain,
    records,
    run_script,
    same,
    sigint_the_launcher_alone,
    start_job,
    wait_for_steps,
    write_sft_jsonl,
)


def test_sigint_to_the_parent_alone_stops_saves_and_exits_130(tok_cache, tmp_path) -> None:
    """No launcher: the parent that forked the ranks gets the signal; the ranks never see a SIGINT."""
    proc = start_job([sys.executable], tmp_path, tok_cache)
    try:
        wait_for_steps(proc, tmp_path, 2)
        sent = time.monotonic()
        os.kill(proc.pid, signal.SIGINT)
        assert proc.wait(timeout=STOP_BOUND_S) == 130
        assert time.monotonic() - sent < STOP_BOUND_S
    finally:
        kill_session(proc)
    stopped = assert_saved_at_the_stopped_step(tmp_path)
    out, err = (tmp_path / "out").read_text(), (tmp_path / "err").read_text()
    assert f"stopped on request after step {stopped} of {STEPS}; continue with --resume" in out
    assert err.count("stopping after this step and saving") == 1 and "Traceback" not in err, err


@pytest.fixture(scope="module")
def default_run(tmp_path_factory, tok_cache) -> tuple[str, list[dict], str]:
    """The README's first command, shortened to 6 steps of 32 tokens: (stdout, metrics, stderr)."""
    metrics = tmp_path_factory.mktemp("default") / "metrics.jsonl"
    done = run_script("--steps", 6, *SHORT, "--tokenizer-cache", tok_cache, "--metrics-file", metrics)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout, records(metrics), done.stderr


def test_embedded_default_loss_falls(default_run) -> None:
    out, recs, _ = default_run
    assert [r["step"] for r in recs] == [1, 2, 3, 4, 5, 6]
    assert recs[-1]["loss"] < recs[0]["loss"] - 0.1, [r["loss"] for r in recs]
    for fact in (
        "tokens per step: 1,024 = 2 lanes x 4 micro-batches x 4 sequences x 32 tokens",
        "A:F split: 2:2 of 4 ranks",
        "layout: M=2 attention ranks (1 A-groups x 2 lanes), N=2 FFN ranks",
        "in flight per worker",
        "tokenizer: SentencePiece trained on",
    ):
        assert fact in out
    assert all(r["tokens_per_s"] > 0 and r["tflops_per_gpu"] > 0 and r["mfu"] is None for r in recs)  # CPU: no peak
    assert all(len(r["expert_imbalance"]) == 4 and r["max_imbalance"] >= 1.0 for r in recs)
    assert "balancing: aux loss x 0.01 (each MoE layer's own, averaged)" in out


# What DeepSpeed prints on every import without a GPU, and warnings of its scheduler a user cannot act on.
THIRD_PARTY_NOISE = ("Setting accelerator to CPU", "Attempting to get learning rate from scheduler")


def test_the_default_job_and_help_print_nothing_a_user_cannot_act_on(default_run) -> None:
    out, _, err = default_run
    help_run = run_script("--help")
    for text in (out, err, help_run.stdout, help_run.stderr):
        assert not [noise for noise in THIRD_PARTY_NOISE if noise in text], text[-2000:]


def test_deepspeed_launcher_matches_the_local_run_and_sigint_to_it_alone_stops(default_run, tok_cache, tmp_path):
    """``deepspeed --num_gpus 4`` on CPU: 4 ranks through DeepSpeed's launcher, the same first two steps. Then SIGINT
    to the ``deepspeed`` command alone: it dies at once and leaves its per-node launcher running; the ranks notice
    the launcher orphaned, stop after their step, save, and exit 130, which the per-node launcher passes on."""
    launcher = [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", "4", "--master_port", str(free_port())]
    sigint_the_launcher_alone(launcher, tmp_path, tok_cache, processes=5)  # the per-node launcher and the 4 ranks
    # Steps 1-2 sit in the warm-up, whose learning rates do not depend on --steps.
    assert same(records(tmp_path / "m.jsonl")[:2], default_run[1][:2])
    stopped = assert_saved_at_the_stopped_step(tmp_path)
    out = (tmp_path / "out").read_text()
    assert f"stopped on request after step {stopped} of {STEPS}" in out
    assert "exits with return code = 130" in out  # the per-node launcher's log of the ranks' exit


def test_help() -> None:
    done = run_script("--help")
    assert done.returncode == 0
    for text in ("deepspeed --hostfile hostfiles/2nodes-16gpu", "--attention-gpus", "--bias-update-rate", "--resume"):
        assert text in done.stdout


def test_resume_continues_exactly_and_keeps_the_last_n(tok_cache, tmp_path) -> None:
    full, resumed, timeline = tmp_path / "full.jsonl", tmp_path / "resumed.jsonl", tmp_path / "trace.json"
    ck = tmp_path / "ck"
    argv = ("--steps", 6, "--save-dir", ck, "--save-every", 2, "--keep-last", 2)
    assert pretrain(tok_cache, *argv, "--metrics-file", full, "--timeline", timeline) == 0
    assert sorted(os.listdir(ck)) == ["latest", "step4", "step6"]  # step2 pruned
    # Each of the two lanes reads its own share: the loader states of both are in the checkpoint.
    assert pretrain(tok_cache, "--steps", 6, "--save-dir", tmp_path / "ck2", "--resume", ck / "step4",
                    "--metrics-file", resumed) == 0  # fmt: skip
    assert same(records(resumed), records(full)[4:])
    trace = json.loads(timeline.read_text())["traceEvents"]
    assert {e["pid"] for e in trace if e["ph"] == "X"} == {0, 1, 2, 3}  # every rank's events, one step


def test_crash_during_save_resumes_from_the_last_complete_checkpoint(tok_cache, tmp_path, monkeypatch) -> None:
    import disagmoe_ds.checkpoint.manifest as checkpoint

    write_atomic = checkpoint._write_atomic

    def crash_before_the_manifest_of_step4(path: Path, text: str) -> None:
        if path.parent.name == ".partial-step4":  # every engine has written its files; the save is not committed
            raise OSError("simulated crash during save")
        write_atomic(path, text)

    ck, crashed, resumed = tmp_path / "ck", tmp_path / "crashed.jsonl", tmp_path / "resumed.jsonl"
    monkeypatch.setattr(checkpoint, "_write_atomic", crash_before_the_manifest_of_step4)  # the forked ranks inherit it
    assert pretrain(tok_cache, "--steps", 4, "--save-dir", ck, "--save-every", 2, "--metrics-file", crashed) == 1
    assert (ck / "latest").read_text() == "step2" and (ck / ".partial-step4").is_dir() and not (ck / "step4").exists()
    monkeypatch.undo()
    assert pretrain(tok_cache, "--steps", 4, "--save-dir", ck, "--resume", "--metrics-file", resumed) == 0
    assert same(records(resumed), records(crashed)[2:4])  # steps 3-4 again, exactly as before the crash
    assert sorted(os.listdir(ck)) == ["latest", "step2", "step4"]  # the partial save was cleaned up


def test_init_from_sft_with_frozen_router_and_attention(tok_cache, tmp_path) -> None:
    from transformers import AutoConfig, AutoModelForCausalLM

    from disagmoe_ds.data import bundled_corpus, train_or_load_tokenizer

    torch.manual_seed(1)
    hf_dir = tmp_path / "pretrained"
    AutoModelForCausalLM.from_config(
        AutoConfig.from_pretrained(ROOT / "hf_models" / "tiny-qwen3-moe-lm")
    ).save_pretrained(hf_dir)
    write_sft_jsonl(tmp_path / "sft.jsonl", n=40)
    tokenizer = train_or_load_tokenizer(bundled_corpus(), 512, tok_cache)
    ck = tmp_path / "ck"
    assert pretrain(tok_cache, "--init-from", hf_dir, "--sft", "--data", tmp_path / "sft.jsonl", "--tokenizer",
                    tokenizer.model_path, "--seq-len", 64, "--steps", 2, "--freeze-router", "--freeze-attention",
                    "--save-dir", ck) == 0  # fmt: skip
    before = AutoModelForCausalLM.from_pretrained(hf_dir).state_dict()
    after = torch.load(ck / "step2" / "attention_g0" / "state" / "mp_rank_00_model_states.pt", weights_only=False)
    after = {f"model.{k}" if not k.startswith("head.") else k: v for k, v in after["module"].items()}
    for i in range(4):
        for frozen in (
            "mlp.gate.weight",
            "self_attn.q_proj.weight",
            "self_attn.k_norm.weight",
            "input_layernorm.weight",
        ):
            assert torch.equal(after[f"model.layers.{i}.{frozen}"], before[f"model.layers.{i}.{frozen}"]), (i, frozen)
        trained = f"model.layers.{i}.post_attention_layernorm.weight"
        assert not torch.equal(after[trained], before[trained])
    assert not torch.equal(after["model.embed_tokens.weight"], before["model.embed_tokens.weight"])


def test_aux_loss_free_bias_moves_in_the_job(tok_cache, tmp_path) -> None:
    """DeepSeek-V3 (vocab widened for the 512-piece tokenizer): the routers' biases move by rate per step."""
    model = tmp_path / "tiny-deepseek-v3"
    model.mkdir()
    config = json.loads((ROOT / "hf_models" / "tiny-deepseek-v3" / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "vocab_size": 512}))
    ck, metrics = tmp_path / "ck", tmp_path / "metrics.jsonl"
    rate, steps = 0.01, 3
    argv = ("--model", model, "--steps", steps, "--bias-update-rate", rate, "--save-dir", ck, "--metrics-file", metrics)
    assert pretrain(tok_cache, *argv) == 0
    state = torch.load(
        ck / f"step{steps}" / "attention_g0" / "state" / "mp_rank_00_model_states.pt", weights_only=False
    )
    for layer in (1, 2, 3):  # layer 0 is dense (first_k_dense_replace = 1)
        bias_E = state["module"][f"layers.{layer}.mlp.gate.e_score_correction_bias"]
        units = bias_E / rate  # each step adds -rate, 0 or +rate per expert
        assert torch.allclose(units, units.round(), atol=1e-4) and units.abs().max() <= steps and units.abs().sum() > 0
        assert abs(units.sum().item()) < steps * len(units)  # overloaded experts went down, underloaded ones up
    assert all(r["expert_imbalance"][0] is None for r in records(metrics))


@pytest.mark.parametrize(
    ("family", "layout"),
    [
        ("qwen3.5-moe", (2, 2, 2)),  # linear- and full-attention layers
        ("ernie4.5-moe", (1, 2, 1)),  # a frozen correction-bias parameter in the checkpoints
        all_families_only("qwen3-next", (1, 1, 1)),
        all_families_only("hunyuan-v1-moe", (1, 2, 1)),
        all_families_only("dots1", (1, 2, 1)),
        all_families_only("minimax-m2", (1, 2, 1)),
        all_families_only("deepseek-v32", (1, 2, 1)),
        ("deepseek-v4", (2, 4, 2)),  # hyper-connection streams, token ids and tid2eid tables; 2 ep ranks, depth 2
    ],
)
def test_init_from_fine_tune_resumes_exactly(tok_cache, tmp_path, family, layout) -> None:
    """The families of issue 29 (vocab widened for the 512-piece tokenizer): ``--init-from`` its weights, save at
    step 2, and the run resumed there repeats steps 3-4 bit for bit."""
    hf_dir = write_tiny_checkpoint(family, tmp_path / "hf", seed=1, vocab_size=512)
    m, n, p = layout
    argv = ("--init-from", hf_dir, "--attention-gpus", m, "--ffn-gpus", n, "--depth", p, "--micro-batches", 2)
    full, resumed, ck = tmp_path / "full.jsonl", tmp_path / "resumed.jsonl", tmp_path / "ck"
    assert pretrain(tok_cache, *argv, "--steps", 4, "--save-dir", ck, "--save-every", 2, "--metrics-file", full) == 0
    assert pretrain(tok_cache, *argv, "--steps", 4, "--resume", ck / "step2", "--metrics-file", resumed) == 0
    assert [r["step"] for r in records(resumed)] == [3, 4] and same(records(resumed), records(full)[2:])


def _config_with(model_dir: Path, tiny: str, **fields) -> Path:
    """A model directory holding ``hf_models/<tiny>``'s config.json with ``fields`` changed."""
    model_dir.mkdir()
    config = json.loads((ROOT / "hf_models" / tiny / "config.json").read_text())
    (model_dir / "config.json").write_text(json.dumps({**config, **fields}))
    return model_dir


def _other_model_checkpoint(root: Path) -> Path:
    """A complete-looking checkpoint whose manifest names another architecture (tiny-qwen3-moe: vocab 128)."""
    from disagmoe_ds.checkpoint.manifest import model_fingerprint
    from disagmoe_ds.models.loading import load_config

    (root / "step5").mkdir(parents=True)
    layout = {"attention_gpus": 2, "ffn_gpus": 2, "depth": 1, "expert_data_parallel": 1, "num_layers": 4,
              "num_experts": 8}  # fmt: skip
    manifest = {"tag": "step5", "layout": layout, "client_state": {"step": 5},
                "model": model_fingerprint(load_config(ROOT / "hf_models" / "tiny-qwen3-moe"))}  # fmt: skip
    (root / "step5" / "manifest.json").write_text(json.dumps(manifest))
    (root / "latest").write_text("step5")
    return root


@pytest.mark.parametrize(
    ("case", "message"),
    [
        ("missing data", r"data file /no/such/corpus.jsonl does not exist"),
        ("empty data", r"no documents in .*empty.txt: it is empty or every document in it is blank"),
        ("too long", r"seq_len \(1024\) exceeds the model's max_position_embeddings \(512\); lower seq_len"),
        ("vocab", r"tokenizer has 1000 token ids but the model's vocab_size is 512"),
        ("other model", r"checkpoint .*step5 was written for a different model architecture"),
        ("hostfile", r"hostfile .*bad line 2: 'worker-1 slots=eight' is malformed"),
        ("check hostfile", r"hostfile .*bad line 2: 'worker-1 slots=eight' is malformed"),
        ("layout", r"num_experts \(8\) must be divisible by the expert-parallel size \(3"),
        ("unknown host", r"host 'no-such-host.invalid' does not resolve from this machine"),
        ("save-dir is a file", r"--save-dir .*a-file is a file; it must be a directory"),
        ("export-hf under a file", r"--export-hf .*hf cannot be made: .*a-file is a file, not a directory"),
        ("metrics-file is a folder", r"--metrics-file .* is a directory; it must be a file"),
        ("misspelt ds_config key", r'ds_config key "zero_optimisation" .* did you mean "zero_optimization"\?'),
        ("optimizer without type", r'ds_config "optimizer" has no "type"; name one'),
        ("scheduler without its params", r'ds_config "scheduler.params" lacks cycle_min_lr, cycle_max_lr'),
        ("per-layer top-k", r"layer 2 of the hunyuan_v1_moe config has its own moe_topk \(1; layer 0: 2\)"),
        (
            "deepseek-v4 with sequence parallelism",
            r"sequence_parallel 2: deepseek_v4 is not supported: its compressors",
        ),
        ("gemma4", r"the gemma4_text config cannot be cut by DisagMoE-DS: layers 0-3 run their experts beside"),
    ],
)
def test_bad_input_is_a_one_line_error_before_any_rank_starts(tok_cache, tmp_path, capfd, case, message) -> None:
    (tmp_path / "empty.txt").write_text("\n")
    (tmp_path / "bad").write_text("worker-0 slots=8\nworker-1 slots=eight\n")
    (tmp_path / "unknown").write_text("localhost slots=2\nno-such-host.invalid slots=2\n")
    (tmp_path / "a-file").write_text("not a directory")
    ds = json.loads((ROOT / "ds_configs" / "tiny-cpu.json").read_text())
    edits = {
        "misspelt ds_config key": lambda d: d.update(zero_optimisation=d.pop("zero_optimization")),
        "optimizer without type": lambda d: d["optimizer"].pop("type"),
        "scheduler without its params": lambda d: d.update(scheduler={"type": "OneCycle", "params": {}}),
    }
    if case in edits:
        edits[case](ds)
        (tmp_path / "ds.json").write_text(json.dumps(ds))
    argv = {
        "missing data": ["--data", "/no/such/corpus.jsonl"],
        "empty data": ["--data", tmp_path / "empty.txt"],
        "too long": ["--seq-len", 1024],
        "vocab": ["--vocab-size", 1000],
        "other model": ["--save-dir", _other_model_checkpoint(tmp_path / "ck"), "--resume"],
        "hostfile": ["--hostfile", tmp_path / "bad"],
        "check hostfile": ["--check-hostfile", tmp_path / "bad"],
        "layout": ["--ffn-gpus", 3],
        "unknown host": ["--check-hostfile", tmp_path / "unknown"],
        "save-dir is a file": ["--save-dir", tmp_path / "a-file"],
        "export-hf under a file": ["--export-hf", tmp_path / "a-file" / "hf"],
        "metrics-file is a folder": ["--metrics-file", tmp_path],
        "per-layer top-k": ["--model", _config_with(tmp_path / "hy", "tiny-hunyuan-v1-moe", moe_topk=[2, 2, 1, 1])],
        "deepseek-v4 with sequence parallelism": [
            "--model",
            ROOT / "hf_models" / "tiny-deepseek-v4",
            "--sequence-parallel",
            2,
        ],
        "gemma4": ["--model", ROOT / "hf_models" / "tiny-gemma4"],
    }.get(case, ["--deepspeed_config", tmp_path / "ds.json"])
    assert_refused_before_launch(tok_cache, capfd, argv, message)


def test_a_read_only_output_is_refused_before_launch(tok_cache, tmp_path, capfd, monkeypatch) -> None:
    import errno

    from disagmoe_ds.train import checks

    def read_only(folder):  # as on a read-only mount (root, which tests may run as, passes permission bits)
        raise OSError(errno.EROFS, "Read-only file system")

    monkeypatch.setattr(checks, "_probe", read_only)
    argv = ["--save-dir", tmp_path / "runs"]
    assert_refused_before_launch(tok_cache, capfd, argv, r"--save-dir .*runs cannot be written \(Read-only file")
    assert not (tmp_path / "runs").exists()


def test_every_shipped_ds_config_passes_the_key_checks() -> None:
    from disagmoe_ds.train.checks import check_ds_config_keys
    from disagmoe_ds.train.settings import apply_overrides

    for path in sorted((ROOT / "ds_configs").glob("*.json")):
        config = apply_overrides(json.loads(path.read_text()), lr=None, dtype="fp32", steps=10)  # as a run has it
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # an unknown key would warn
            check_ds_config_keys(config)


def test_tensorboard_without_the_package_is_refused_before_launch(tok_cache, tmp_path, capfd, monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "tensorboard", None)  # as on a machine without it
    argv = ["--tensorboard", tmp_path / "tb"]
    assert_refused_before_launch(tok_cache, capfd, argv, r"needs the tensorboard package.*; pip install tensorboard")
    assert not (tmp_path / "tb").exists()


def test_a_failure_inside_a_rank_is_one_line_naming_the_root_cause_and_the_log(tok_cache, tmp_path, capfd, monkeypatch):
    """Rank 1 raises in step 2; its peers then fail in their collectives. One line names rank 1's exception and the
    log file, which holds every failed rank's traceback."""
    import torch.distributed as dist

    step, calls = job.run_step, []  # each forked rank counts its own calls

    def fail_in_rank_1_at_step_2(runtime, batches, *, timeline):
        calls.append(1)
        if dist.get_rank() == 1 and len(calls) == 2:
            raise RuntimeError("injected failure in rank 1")
        return step(runtime, batches, timeline=timeline)

    monkeypatch.setattr(job, "run_step", fail_in_rank_1_at_step_2)  # the forked ranks inherit it
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # where the log goes ($TMPDIR, read once)
    capfd.readouterr()
    assert pretrain(tok_cache, "--steps", 4) == 1
    out, err = capfd.readouterr()
    assert "step 1/4" in out and "step 2/4" not in out
    lines = [line for line in err.splitlines() if line.startswith("run_pretrain.py")]
    assert len(lines) == 1 and "Traceback" not in err, err
    match = re.fullmatch(
        r"run_pretrain\.py: rank 1 failed: RuntimeError: injected failure in rank 1 "
        r"\(tracebacks of every failed rank: (.*run_pretrain-failure-.*\.log)\)",
        lines[0],
    )
    assert match, lines[0]
    log = Path(match[1])
    assert log.parent == tmp_path
    header, first, *_ = log.read_text().splitlines()
    assert re.fullmatch(r"\d of 4 ranks failed; killing ranks \[.*\]", header) and first == "rank 1 raised:", header
    assert "Traceback" in log.read_text() and "fail_in_rank_1_at_step_2" in log.read_text()
