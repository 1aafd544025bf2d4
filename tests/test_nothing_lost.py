"""Nothing a run trained is lost after training, and what would lose it is refused before launch (issue 45).

Each case is the command a user ran: its exit code, its one line, and the checkpoint it leaves (intact, resumable).
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import sys
from pathlib import Path

import psutil
import pytest

from disagmoe_ds.data import SentencePieceTokenizer, bundled_corpus, train_or_load_tokenizer
from disagmoe_ds.launch.local import free_port
from tests.runs import (
    ROOT,
    STOP_BOUND_S,
    assert_refused_before_launch,
    assert_saved_at_the_stopped_step,
    kill_session,
    pretrain,
    records,
    same,
    start_job,
    wait_for_steps,
)


def test_a_128_id_model_trains_on_the_bundled_corpus_and_exports_its_tokenizer(tok_cache, tmp_path, capfd) -> None:
    """A vocabulary too small for SentencePiece's 256 byte pieces is trained without them; its HF form (in the
    checkpoint and the export) encodes exactly as SentencePiece does, unknown characters included."""
    from transformers import PreTrainedTokenizerFast

    ck, export = tmp_path / "ck", tmp_path / "hf"
    model = ROOT / "hf_models" / "tiny-qwen3.5-moe"  # vocab_size 128
    assert pretrain(tok_cache, "--model", model, "--steps", 2, "--save-dir", ck, "--export-hf", export) == 0
    text = "Mr. Darcy\tpaid 1,234 \u00e9cus \u2014 \U0001f600 at 3.14 p.m.\n"
    for saved in (ck / "step2" / "tokenizer", export):
        sp = SentencePieceTokenizer(saved / "tokenizer.model")  # the run's, saved beside its HF form
        assert sp.vocab_size == 128 and sp.encode(text).count(0) >= 3  # no byte pieces: <unk>s
        # AutoTokenizer builds Qwen3.5's own byte-level tokenizer beside its config.json (the banner says so)
        assert PreTrainedTokenizerFast.from_pretrained(saved).encode(text, add_special_tokens=False) == sp.encode(text)
    banner = capfd.readouterr().out
    assert (
        "no byte pieces" in banner and "note: AutoTokenizer reads it beside this config as Qwen3_5Tokenizer" in banner
    )


def test_a_tokenizer_without_an_hf_form_is_refused_before_launch_only_when_exporting(
    tok_cache, tmp_path, capfd
) -> None:
    """A SentencePiece model the HF conversion cannot reproduce (a unigram one): ``--export-hf`` is refused before
    any rank starts; without it the run trains and every checkpoint keeps the .model file."""
    unigram = train_or_load_tokenizer(bundled_corpus(), 128, tmp_path / "tok", model_type="unigram").model_path
    model = ROOT / "hf_models" / "tiny-qwen3-moe"
    argv = ["--model", model, "--tokenizer", unigram, "--steps", 2, "--save-dir", tmp_path / "ck"]
    message = r"--export-hf writes an HF tokenizer and SentencePiece model .* cannot be converted .* pass --tokenizer"
    assert_refused_before_launch(tok_cache, capfd, [*argv, "--export-hf", tmp_path / "hf"], message)
    assert not (tmp_path / "ck").exists()
    assert pretrain(tok_cache, *argv, "--metrics-file", tmp_path / "m.jsonl") == 0
    saved = tmp_path / "ck" / "step2" / "tokenizer" / "tokenizer.model"
    assert saved.read_bytes() == unigram.read_bytes()
    assert [r["step"] for r in records(tmp_path / "m.jsonl")] == [1, 2]
    assert not list((tmp_path / "ck").glob(".partial-*"))


def test_lora_adapters_peft_cannot_load_are_refused_before_launch(tok_cache, tmp_path, capfd) -> None:
    """DeepSeek-V4's attention holds compressor ``gate_proj``s that PEFT would move onto the fused experts: a LoRA
    run exporting an adapter directory is refused before launch (it used to train, save, then fail); without the
    export, or with targets that leave them out, it is not."""
    from tests.conftest import write_tiny_checkpoint

    hf_dir = write_tiny_checkpoint("deepseek-v4", tmp_path / "hf", seed=1, vocab_size=512)
    argv = ["--init-from", hf_dir, "--lora-rank", 4, "--steps", 1, "--attention-gpus", 1, "--ffn-gpus", 1]
    message = r"PEFT cannot load adapters on model\.layers\.1\.self_attn\.compressor\.gate_proj .*--export-hf-merged"
    assert_refused_before_launch(tok_cache, capfd, [*argv, "--export-hf", tmp_path / "adapter"], message)
    targets = ("--lora-targets", "q_a_proj,q_b_proj,kv_proj,o_b_proj,experts")
    assert pretrain(tok_cache, *argv, *targets, "--export-hf", tmp_path / "adapter") == 0
    assert (tmp_path / "adapter" / "adapter_model.safetensors").is_file()


def test_lora_on_a_fresh_init_is_refused_before_launch(tok_cache, capfd) -> None:
    message = r"LoRA trains adapters over pretrained weights, and .* fresh init .* pass --init-from HF_DIR"
    assert_refused_before_launch(tok_cache, capfd, ["--lora-rank", 8], message)


def test_kill_9_of_the_parent_stops_its_ranks_with_a_checkpoint(tok_cache, tmp_path) -> None:
    """No launcher: SIGKILL of the process that forked the ranks (it can pass nothing on) leaves them orphaned; they
    notice after their step, save it and exit, instead of training to the end with nobody reading their output."""
    proc = start_job([sys.executable], tmp_path, tok_cache)
    try:
        wait_for_steps(proc, tmp_path, 2)
        ranks = psutil.Process(proc.pid).children(recursive=True)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        _, alive = psutil.wait_procs(ranks, timeout=STOP_BOUND_S)
        assert not alive, alive
    finally:
        kill_session(proc)
    assert_saved_at_the_stopped_step(tmp_path)


def test_a_save_that_runs_out_of_disk_names_it_and_keeps_the_last_checkpoint(
    tok_cache, tmp_path, capfd, monkeypatch
) -> None:
    """torch.save reports a full disk as "[enforce fail at inline_container.cc:...] unexpected pos"; the save of
    step 4 failing that way is one line about space, its partial directory is gone, and step 2 resumes."""
    from deepspeed.runtime.engine import DeepSpeedEngine

    save = DeepSpeedEngine.save_checkpoint

    def short_of_space(self, save_dir, *args, **kwargs):
        if ".partial-step4" in str(save_dir):
            raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 4480 vs 4374")
        return save(self, save_dir, *args, **kwargs)

    monkeypatch.setattr(DeepSpeedEngine, "save_checkpoint", short_of_space)  # the forked ranks inherit it
    ck, metrics = tmp_path / "ck", tmp_path / "m.jsonl"
    argv = ["--steps", 4, "--save-dir", ck, "--save-every", 2]
    assert pretrain(tok_cache, *argv, "--metrics-file", metrics) == 1
    err = capfd.readouterr().err
    assert re.search(
        r"saving checkpoint .*step4 failed: no space left on the device \(.* MiB free now\); free "
        r"space or pick another --save-dir; the last complete checkpoint, .*step2, is intact",
        err,
    ), err
    assert (ck / "latest").read_text() == "step2" and not list(ck.glob(".partial-*"))
    monkeypatch.setattr(DeepSpeedEngine, "save_checkpoint", save)
    assert pretrain(tok_cache, *argv, "--resume", "--metrics-file", tmp_path / "resumed.jsonl") == 0
    assert same(records(tmp_path / "resumed.jsonl"), records(metrics)[2:4])


@pytest.mark.parametrize(
    ("short", "message"),
    [
        (
            "disk",
            r"--save-dir .*ck: a checkpoint of this run takes about 0\.0 GiB \(planner\) and its disk has 0\.0 GiB",
        ),
        ("memory", r"the 4 CPU ranks' training state alone is 0\.0 GiB \(planner\) and this machine has 0\.0 GiB"),
    ],
)
def test_a_run_this_machine_cannot_hold_is_refused_before_launch(
    tok_cache, tmp_path, capfd, monkeypatch, short, message
) -> None:
    """Host memory of CPU ranks and disk space for a checkpoint, from the planner's training state (the machine is
    made 1 KiB small, as if Qwen3-30B-A3B's 478 GiB were asked of it)."""
    import shutil
    from collections import namedtuple

    if short == "disk":
        usage = shutil.disk_usage(tmp_path)
        monkeypatch.setattr(shutil, "disk_usage", lambda path: usage._replace(free=1024))
    else:
        monkeypatch.setattr(psutil, "virtual_memory", lambda: namedtuple("Memory", "available")(1024))
    assert_refused_before_launch(tok_cache, capfd, ["--save-dir", tmp_path / "ck"], message)


def test_a_rank_killed_under_deepspeed_is_named_as_the_root_cause(tok_cache, tmp_path) -> None:
    """``kill -9`` of rank 3 under ``deepspeed``: the line names rank 3, not the peer whose collective then failed
    with "Connection reset by peer"."""
    launcher = [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", "4", "--master_port", str(free_port())]
    proc = start_job(launcher, tmp_path, tok_cache)
    try:
        wait_for_steps(proc, tmp_path, 2)
        ranks = psutil.Process(proc.pid).children(recursive=True)
        victim = next(p for p in ranks if p.environ().get("RANK") == "3")
        victim.kill()
        assert proc.wait(timeout=STOP_BOUND_S) != 0
    finally:
        kill_session(proc)
    lines = [line for line in (tmp_path / "err").read_text().splitlines() if line.startswith("run_pretrain.py:")]
    assert len(lines) == 1 and "rank 3 ended without a Python error (killed by a signal" in lines[0], lines


@pytest.fixture(scope="module")
def two_checkpoints(tok_cache, tmp_path_factory):
    """A default run saved at steps 2 and 4 (``latest`` is step4)."""
    root = tmp_path_factory.mktemp("two") / "ck"
    assert pretrain(tok_cache, "--steps", 4, "--save-dir", root, "--save-every", 2) == 0
    return root


def _largest_file(tag: Path) -> Path:
    return max((p for p in tag.rglob("*") if p.is_file() and p.name != "manifest.json"), key=lambda p: p.stat().st_size)


DAMAGES = {  # how step4 (or the root's latest) is damaged, and the intact checkpoint the line names
    "file truncated": (lambda tag: _largest_file(tag).write_bytes(_largest_file(tag).read_bytes()[:100]), "step2"),
    "file changed": (lambda tag: _largest_file(tag).write_bytes(bytes(_largest_file(tag).stat().st_size)), "step2"),
    "file missing": (lambda tag: _largest_file(tag).unlink(), "step2"),
    "manifest missing": (lambda tag: (tag / "manifest.json").unlink(), "step2"),
    "manifest truncated": (lambda tag: (tag / "manifest.json").write_bytes(b'{"tag": "st'), "step2"),
    "manifest not an object": (lambda tag: (tag / "manifest.json").write_text("[1, 2]"), "step2"),
    "manifest not text": (lambda tag: (tag / "manifest.json").write_bytes(b"\xff\xfe{}"), "step2"),
    "tag folder gone": (lambda tag: shutil.rmtree(tag), "step2"),
    "latest not text": (lambda tag: (tag.parent / "latest").write_bytes(b"\xff\xfe\x00"), "step4"),
}


@pytest.mark.parametrize("damage", DAMAGES)
def test_every_way_a_checkpoint_can_be_damaged_is_one_line_naming_the_last_intact_one(
    two_checkpoints, tok_cache, tmp_path, capfd, damage
) -> None:
    root = tmp_path / "ck"
    shutil.copytree(two_checkpoints, root)
    damage_it, intact = DAMAGES[damage]
    damage_it(root / "step4")
    message = rf"checkpoint {root}.*; resume from {root / intact} \(--resume {root / intact}\)"
    assert_refused_before_launch(tok_cache, capfd, ["--steps", 6, "--save-dir", root, "--resume"], message)
