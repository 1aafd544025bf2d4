"""Checkpoint bookkeeping of run_pretrain.py: keep-last-N, which checkpoint --resume means, resume checks."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from disagmoe_ds.config import DisagMoEConfig
from disagmoe_ds.engine.checkpoint import model_fingerprint
from disagmoe_ds.errors import CheckpointError
from disagmoe_ds.models.loading import load_config
from disagmoe_ds.train.checkpoints import check_resume, locate, prune

ROOT = Path(__file__).resolve().parent.parent
MODEL = ROOT / "hf_models" / "tiny-qwen3-moe-lm"
LAYOUT = DisagMoEConfig(attention_gpus=2, ffn_gpus=2).layout(num_layers=4, num_experts=8)


def _fake_checkpoint(root: Path, step: int, *, model: Path = MODEL, complete: bool = True, **client) -> Path:
    """A checkpoint directory with the manifest ``engine.checkpoint.save_checkpoint`` writes (no engine files)."""
    tag = f"step{step}"
    path = root / (tag if complete else f".partial-{tag}")
    path.mkdir(parents=True)
    layout = {k: getattr(LAYOUT, k) for k in ("attention_gpus", "ffn_gpus", "depth", "expert_data_parallel",
                                               "num_layers", "num_experts")}  # fmt: skip
    manifest = {"tag": tag, "layout": layout, "model": model_fingerprint(load_config(model)),
                "client_state": {"step": step, "num_samples": 100, **client}}  # fmt: skip
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
    assert check_resume(tmp_path, "step3", load_config(MODEL), LAYOUT, num_samples=100) == 3
    with pytest.raises(CheckpointError, match="trained on 100 samples, this run's data gives 99"):
        check_resume(tmp_path, "step3", load_config(MODEL), LAYOUT, num_samples=99)
    other = DisagMoEConfig(attention_gpus=1, ffn_gpus=2).layout(num_layers=4, num_experts=8)
    with pytest.raises(CheckpointError, match="has layout .* this run has"):
        check_resume(tmp_path, "step3", load_config(MODEL), other, num_samples=None)
    other_model = load_config(ROOT / "hf_models" / "tiny-qwen3-moe")
    with pytest.raises(CheckpointError, match="written for a different model architecture"):
        check_resume(tmp_path, "step3", other_model, LAYOUT, num_samples=None)
