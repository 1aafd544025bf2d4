"""Checkpoints of the disaggregated job: exact resume, atomic saves, clear errors."""

from __future__ import annotations

import pytest

from disagmoe_ds.afpipe.build import build_rank
from disagmoe_ds.checkpoint.manifest import resolve_tag
from disagmoe_ds.config import DisagMoEConfig
from disagmoe_ds.errors import CheckpointError
from disagmoe_ds.launch.testing import run_ranks
from disagmoe_ds.parity.reference import VerifyArgs, load_for_verify
from tests.rank_jobs import train_saving

CFG = DisagMoEConfig(attention_gpus=2, ffn_gpus=2, depth=1, micro_batches=2)


def _args(model: str, zero: int) -> VerifyArgs:
    return VerifyArgs(model, CFG, zero=zero, steps=4, seq_len=8, clip=0.05)


def _train(rank: int, args: VerifyArgs, ckpt: str, mode: str) -> list[float]:
    """mode 'full': 4 steps, saving after step 2; 'resume': load that checkpoint and run steps 3-4."""
    rt = build_rank(args.model, args.ds_config(), args.cfg, micro_batch_size=1, model=load_for_verify(args))
    return train_saving(rt, args, ckpt, mode, save_after=2)


@pytest.mark.parametrize("zero", [1, 2])
def test_resume_reproduces_losses_exactly(tiny_checkpoint, tmp_path, zero):
    args = _args(str(tiny_checkpoint("qwen2-moe")), zero)
    full = run_ranks(_train, CFG.world_size, args=(args, str(tmp_path), "full"), timeout_s=120)
    resumed = run_ranks(_train, CFG.world_size, args=(args, str(tmp_path), "resume"), timeout_s=120)
    assert resumed[0] == full[0][2:]  # bit-identical, on CPU
    assert resolve_tag(tmp_path) == "step2"


def test_partial_save_is_ignored(tmp_path):
    (tmp_path / ".partial-step9").mkdir()
    with pytest.raises(CheckpointError, match="no checkpoint in"):
        resolve_tag(tmp_path)
    (tmp_path / "latest").write_text("step9")
    with pytest.raises(CheckpointError, match="step9: it does not exist; no older intact checkpoint"):
        resolve_tag(tmp_path)
