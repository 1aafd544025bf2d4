"""run_pretrain.py as the tests run it: in this process (``pretrain``: it forks the ranks, which inherit
monkeypatches) or as a subprocess (``run_script``), its metrics records compared exactly, its one-line refusals, and
the SFT data they train on."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from tests.conftest import ROOT

_spec = importlib.util.spec_from_file_location("run_pretrain", ROOT / "run_pretrain.py")
run_pretrain = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(run_pretrain)

SHORT = ["--seq-len", "32", "--log-every", "1"]
# Exact, not approximate: on CPU a resumed run must reproduce the uninterrupted one bit for bit.
COMPARED = ("step", "loss", "lm_loss", "aux_loss", "grad_norm", "lr", "expert_imbalance")
SUBPROCESS_TIMEOUT_S = 180


def pretrain(tok_cache: Path, *argv: object) -> int:
    return run_pretrain.main([*SHORT, "--tokenizer-cache", str(tok_cache), *map(str, argv)])


def assert_refused_before_launch(tok_cache: Path, capfd, argv: list, message: str) -> None:
    """``run_pretrain.py argv`` exits 2 at once with one error line matching ``message``; no rank started."""
    start = time.monotonic()
    assert pretrain(tok_cache, *argv) == 2
    assert time.monotonic() - start < 10  # nothing was launched
    out, err = capfd.readouterr()
    lines = [line for line in err.splitlines() if line.startswith("run_pretrain.py")]
    assert len(lines) == 1 and lines[0].startswith("run_pretrain.py: error: ") and "Traceback" not in err, err
    assert re.search(message, lines[0]), lines[0]
    assert "model:" not in out  # no rank printed its banner


def records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def same(a: list[dict], b: list[dict]) -> bool:
    return [{k: r[k] for k in COMPARED} for r in a] == [{k: r[k] for k in COMPARED} for r in b]


def assert_resumes_exactly_and_exports(tok_cache: Path, tmp_path: Path, *argv: object) -> None:
    """``run_pretrain.py argv`` for 4 steps, saved every 2 (``tmp_path/ck``) with an HF export (``tmp_path/hf``);
    resumed at step 2 it repeats steps 3-4 bit for bit, and the export loads with ``from_pretrained`` and gives
    finite logits."""
    import torch
    from transformers import AutoModelForCausalLM

    full, resumed, ck, export = (tmp_path / name for name in ("full.jsonl", "resumed.jsonl", "ck", "hf"))
    saving = ("--save-dir", ck, "--save-every", 2, "--metrics-file", full, "--export-hf", export)
    assert pretrain(tok_cache, *argv, "--steps", 4, *saving) == 0
    assert pretrain(tok_cache, *argv, "--steps", 4, "--resume", ck / "step2", "--metrics-file", resumed) == 0
    assert [r["step"] for r in records(resumed)] == [3, 4] and same(records(resumed), records(full)[2:])
    assert torch.isfinite(AutoModelForCausalLM.from_pretrained(export)(torch.arange(8).view(1, 8)).logits).all()


def sft_from_deepseek_v3(tok_cache: Path, tmp_path: Path) -> tuple[object, ...]:
    """run_pretrain.py's flags for SFT from tiny DeepSeek-V3 (MLA) weights with its own tokenizer, on 40 bundled
    prompt/response pairs (written under ``tmp_path``)."""
    from disagmoe_ds.data import bundled_corpus, train_or_load_tokenizer
    from tests.conftest import write_tiny_checkpoint

    hf_dir = write_tiny_checkpoint("deepseek-v3", tmp_path / "hf-init", seed=1, vocab_size=512)
    train_or_load_tokenizer(bundled_corpus(), 512, tok_cache).save_hf(hf_dir)  # the model's own tokenizer
    write_sft_jsonl(tmp_path / "sft.jsonl", n=40)
    return ("--init-from", hf_dir, "--sft", "--data", tmp_path / "sft.jsonl")


def run_script(*argv: object, launcher: tuple[str, ...] = (sys.executable,)) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    command = [*launcher, str(ROOT / "run_pretrain.py"), *map(str, argv)]
    return subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=SUBPROCESS_TIMEOUT_S)


# ----- interrupted jobs: a launcher's process session, SIGINT to one PID, the checkpoint it leaves -----
STEPS = 1000
STARTUP_S = 150  # 4 ranks importing torch and DeepSpeed on 2 shared cores, then two steps
# From the signal to the last process gone: the current step (~0.3 s), the save (~1 s), teardown, on busy cores.
STOP_BOUND_S = 30
# Both hold beside a concurrent xdist worker (these tests are not 'serial'): whole tests, start-up and stop included,
# took 12-60 s on 2 cores at load average 4-10.


def start_job(launcher: list[str], tmp: Path, tok_cache: Path, *extra: object) -> subprocess.Popen:
    """``launcher run_pretrain.py`` for STEPS steps in its own session, saving to tmp/ck; output in tmp/out, tmp/err."""
    argv = [*extra, "--steps", STEPS, *SHORT, "--tokenizer-cache", tok_cache, "--save-dir", tmp / "ck"]
    command = [*launcher, str(ROOT / "run_pretrain.py"), *map(str, argv), "--metrics-file", str(tmp / "m.jsonl")]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    with (tmp / "out").open("w") as out, (tmp / "err").open("w") as err:
        return subprocess.Popen(
            command, cwd=ROOT, env=env, stdout=out, stderr=err, start_new_session=True, preexec_fn=_default_sigint
        )


def _default_sigint() -> None:
    # As from a terminal: a suite started in the background by a shell (``pytest &``) inherits SIGINT ignored, and
    # a Python launcher that starts with SIGINT ignored never installs its KeyboardInterrupt handler.
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def logged_steps(metrics: Path) -> list[int]:
    if not metrics.exists():
        return []
    return [json.loads(line)["step"] for line in metrics.read_text().splitlines() if line.endswith("}")]


def wait_for_steps(proc: subprocess.Popen, tmp: Path, n: int) -> None:
    deadline = time.monotonic() + STARTUP_S
    while len(logged_steps(tmp / "m.jsonl")) < n:
        assert proc.poll() is None, (tmp / "err").read_text()[-3000:]
        assert time.monotonic() < deadline, f"fewer than {n} steps after {STARTUP_S} s"
        time.sleep(0.2)


def assert_saved_at_the_stopped_step(tmp: Path) -> int:
    steps = logged_steps(tmp / "m.jsonl")
    stopped = steps[-1]
    assert 2 <= stopped < STEPS and steps == list(range(1, stopped + 1)), steps
    assert (tmp / "ck" / "latest").read_text() == f"step{stopped}"
    manifest = json.loads((tmp / "ck" / f"step{stopped}" / "manifest.json").read_text())
    assert manifest["client_state"]["step"] == stopped
    return stopped


def kill_session(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # the test's own session: only what it started
    except ProcessLookupError:
        pass
    proc.wait()


def signal_state(pid: int) -> str:
    """The process's signal masks (blocked, ignored, caught; hex bit sets) and where its main thread waits."""
    status = Path(f"/proc/{pid}/status").read_text().splitlines()
    masks = [line for line in status if line.startswith(("SigBlk", "SigIgn", "SigCgt"))]
    return f"{', '.join(masks)}; state {psutil.Process(pid).status()}"


def sigint_the_launcher_alone(launcher: list[str], tmp: Path, tok_cache: Path, *extra: object, processes: int) -> None:
    """Start ``launcher run_pretrain.py``, let it log 2 steps, SIGINT the launcher's PID only; it must exit non-zero
    within STOP_BOUND_S and take its ``processes`` descendants with it."""
    proc = start_job(launcher, tmp, tok_cache, *extra)
    try:
        wait_for_steps(proc, tmp, 2)
        job = psutil.Process(proc.pid).children(recursive=True)
        assert len(job) == processes, job
        sent = time.monotonic()
        os.kill(proc.pid, signal.SIGINT)
        try:
            code = proc.wait(timeout=STOP_BOUND_S)
        except subprocess.TimeoutExpired:
            pytest.fail(f"the launcher outlived a SIGINT by {STOP_BOUND_S} s; {signal_state(proc.pid)}")
        assert code != 0
        _, alive = psutil.wait_procs(job, timeout=max(1.0, STOP_BOUND_S - (time.monotonic() - sent)))
        assert not alive, alive
    finally:
        kill_session(proc)


def write_sft_jsonl(path: Path, n: int = 24) -> list[tuple[str, str]]:
    """``n`` prompt/response pairs as a JSON-lines SFT file; returns the pairs."""
    pairs = [(f"What is {i} plus {i + 1}?", f"It is {2 * i + 1}.") for i in range(n)]
    path.write_text("".join(json.dumps({"prompt": p, "response": r}) + "\n" for p, r in pairs))
    return pairs
