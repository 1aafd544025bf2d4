"""Checkpoint bookkeeping of run_pretrain.py: keep-last-N, which checkpoint --resume means, resume checks."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from disagmoe_ds.checkpoint.manifest import file_digest, model_fingerprint, verify_files
from disagmoe_ds.checkpoint.resume import check_resume, effective_freezing, locate, prune
from disagmoe_ds.config import DisagMoEConfig
from disagmoe_ds.errors import CheckpointError
from disagmoe_ds.models.loading import load_config

ROOT = Path(__file__).resolve().parent.parent
MODEL = ROOT / "hf_models" / "tiny-qwen3-moe-lm"
LAYOUT = DisagMoEConfig(attention_gpus=2, ffn_gpus=2).layout(num_layers=4, num_experts=8)


def _fake_checkpoint(
    root: Path, step: int, *, model: Path = MODEL, complete: bool = True, entries: dict | None = None, **client
) -> Path:
    """A checkpoint directory with the manifest ``checkpoint.resume.save`` writes (no engine files); ``entries``
    replace or add manifest entries (None values remove them)."""
    tag = f"step{step}"
    path = root / (tag if complete else f".partial-{tag}")
    path.mkdir(parents=True)
    layout = {k: getattr(LAYOUT, k) for k in ("attention_gpus", "ffn_gpus", "depth", "expert_data_parallel",
                                               "num_layers", "num_experts")}  # fmt: skip
    manifest = {"tag": tag, "layout": layout, "model": model_fingerprint(load_config(model)),
                "client_state": {"step": step, "seed": 0, "num_samples": 100, **client},
                "frozen": {"router": True, "attention": False}, "data": {"loader_states": {"0": {}, "1": {}}},
                "ds_config": {"zero_optimization": {"stage": 1}}}  # fmt: skip
    manifest.update(entries or {})
    manifest = {k: v for k, v in manifest.items() if v is not None}
    if complete:
        (path / "manifest.json").write_text(json.dumps(manifest))
        (root / "latest").write_text(tag)
    return path


def test_prune_keeps_the_newest_and_removes_partial_saves(tmp_path: Path) -> None:
    for step in (2, 4, 10, 6, 8):
        _fake_checkpoint(tmp_path, step)
    (tmp_path / "latest").write_text("step10")
    _fake_checkpoint(tmp_path, 12, complete=False)  # a save that crashed
    (tmp_path / "notes").mkdir()  # not ours: left alone
    removed = prune(tmp_path, keep_last=2)
    assert sorted(removed) == [".partial-step12", "step2", "step4", "step6"]  # by step number, not by name
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "notes", "step10", "step8"]


def test_prune_never_removes_latest(tmp_path: Path) -> None:
    for step in (1, 2, 3):
        _fake_checkpoint(tmp_path, step)
    (tmp_path / "latest").write_text("step1")  # e.g. a resumed run that points back at an older save
    prune(tmp_path, keep_last=1)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step1", "step3"]


def test_locate(tmp_path: Path) -> None:
    _fake_checkpoint(tmp_path, 3)
    _fake_checkpoint(tmp_path, 5)
    assert locate("", tmp_path) == (tmp_path, "step5")  # bare --resume: the newest complete one
    assert locate(str(tmp_path), None) == (tmp_path, "step5")
    assert locate(str(tmp_path / "step3"), None) == (tmp_path, "step3")
    with pytest.raises(CheckpointError, match="no checkpoint in"):
        locate(str(tmp_path / "elsewhere"), None)


def test_check_resume(tmp_path: Path) -> None:
    _fake_checkpoint(tmp_path, 3)
    assert check_resume(tmp_path, "step3", load_config(MODEL), LAYOUT, num_samples=100).step == 3
    with pytest.raises(CheckpointError, match="trained on 100 samples, this run's data gives 99"):
        check_resume(tmp_path, "step3", load_config(MODEL), LAYOUT, num_samples=99)
    other = DisagMoEConfig(attention_gpus=1, ffn_gpus=2).layout(num_layers=4, num_experts=8)
    with pytest.raises(CheckpointError, match="has layout .* this run has"):
        check_resume(tmp_path, "step3", load_config(MODEL), other, num_samples=None)
    other_model = load_config(ROOT / "hf_models" / "tiny-qwen3-moe")
    with pytest.raises(CheckpointError, match="written for a different model architecture"):
        check_resume(tmp_path, "step3", other_model, LAYOUT, num_samples=None)


def test_resume_refusals_name_the_flag_to_pass(tmp_path: Path) -> None:
    _fake_checkpoint(tmp_path, 3)
    config, zero1 = load_config(MODEL), {"zero_optimization": {"stage": 1}}
    with pytest.raises(CheckpointError, match="trained with --seed 0, this run has --seed 7; resume with --seed 0"):
        check_resume(tmp_path, "step3", config, LAYOUT, num_samples=None, seed=7)
    with pytest.raises(CheckpointError, match="saved under ZeRO stage 1 in fp32, this run has stage 0 in fp32; pass "
                       "--zero 1 --dtype fp32"):  # fmt: skip
        check_resume(tmp_path, "step3", config, LAYOUT, num_samples=None, ds_config={"bf16": {"enabled": False}})
    with pytest.raises(CheckpointError, match="trained with --freeze-router, this run adds --freeze-attention.*"
                       "pass --freeze-router or nothing"):  # fmt: skip
        check_resume(tmp_path, "step3", config, LAYOUT, num_samples=None, frozen={"router": False, "attention": True})
    point = check_resume(tmp_path, "step3", config, LAYOUT, num_samples=100, seed=0, ds_config=zero1,
                         frozen={"router": False, "attention": False})  # fmt: skip
    assert point.frozen == {"router": True, "attention": False} and point.has_data_position
    assert effective_freezing(point, router=False, attention=False) == {"router": True, "attention": False}


def test_converted_checkpoint_resumes_from_the_start_of_the_data(tmp_path: Path) -> None:
    """hf-to-disagmoe writes step 0 without data position, seed or freezing: any data and seed may continue it."""
    _fake_checkpoint(tmp_path, 0, entries={"data": None, "frozen": None, "client_state": {"step": 0}})
    point = check_resume(tmp_path, "step0", load_config(MODEL), LAYOUT, num_samples=99, seed=5)
    assert (point.step, point.has_data_position, point.frozen) == (0, False, None)
    assert "from its start" in point.describe_data()


def test_damaged_file_is_named_with_the_newest_intact_older_checkpoint(tmp_path: Path) -> None:
    for step in (2, 4, 6):
        path = _fake_checkpoint(tmp_path, step)
        (path / "attention_g0").mkdir()
        (path / "attention_g0" / "model.pt").write_bytes(b"x" * 64)
        files = {"attention_g0/model.pt": {"bytes": 64, "sha256": file_digest(path / "attention_g0" / "model.pt")}}
        manifest = json.loads((path / "manifest.json").read_text())
        (path / "manifest.json").write_text(json.dumps({**manifest, "files": files}))
    (tmp_path / "step6" / "attention_g0" / "model.pt").write_bytes(b"x" * 10)  # truncated
    (tmp_path / "step4" / "attention_g0" / "model.pt").write_bytes(b"y" * 64)  # same size, other bytes
    with pytest.raises(CheckpointError, match=r"step6: attention_g0/model.pt is damaged \(10 bytes, the save wrote "
                       r"64; truncated\?\); resume from .*step2 \(--resume .*step2\)"):  # fmt: skip
        verify_files(tmp_path, "step6")
    with pytest.raises(CheckpointError, match="step4: attention_g0/model.pt is damaged .*sha256"):
        verify_files(tmp_path, "step4")
    verify_files(tmp_path, "step4", hashes=False)  # sizes only: the launched ranks' quick check
    verify_files(tmp_path, "step2")


def test_resume_checks_each_sides_recorded_zero_stage(tmp_path: Path) -> None:
    """A disaggregated checkpoint records each side's stage: a resume must match it side by side; where both are
    one stage on both sides, the refusal names --zero as before."""
    config, zero1 = load_config(MODEL), {"zero_optimization": {"stage": 1}}
    _fake_checkpoint(tmp_path / "mixed", 3, entries={"zero_stage": {"attention": 1, "ffn": 3}})
    with pytest.raises(CheckpointError, match=r'stage 1 \(attention\) / 3 \(experts\) in fp32, this run has 1 / 1 in '
                       r'fp32; resume with the ds_config\'s "disagmoe": \{"zero_stage": \{"attention": 1, "ffn": 3\}\}'
                       r".*relayout --zero-stage 1 1 --dtype fp32"):  # fmt: skip
        check_resume(tmp_path / "mixed", "step3", config, LAYOUT, num_samples=None, ds_config=zero1)
    per_side = {**zero1, "disagmoe": {"zero_stage": {"ffn": 3}}}
    assert check_resume(tmp_path / "mixed", "step3", config, LAYOUT, num_samples=None, ds_config=per_side).step == 3
    _fake_checkpoint(tmp_path / "one", 3, entries={"zero_stage": {"attention": 1, "ffn": 1}})
    zero2 = {"zero_optimization": {"stage": 2}}
    with pytest.raises(CheckpointError, match="saved under ZeRO stage 1 in fp32, this run has stage 2 in fp32; pass "
                       "--zero 1"):  # fmt: skip
        check_resume(tmp_path / "one", "step3", config, LAYOUT, num_samples=None, ds_config=zero2)
