"""Checkpoints of the disaggregated job: exact resume, atomic saves, clear errors."""

from __future__ import annotations

import pytest

from disagmoe_ds.config import DisagMoEConfig
from disagmoe_ds.engine.build import build_rank
from disagmoe_ds.engine.checkpoint import load_checkpoint, resolve_tag, save_checkpoint
from disagmoe_ds.errors import CheckpointError
from disagmoe_ds.launch.testing import run_ranks
from disagmoe_ds.verify import VerifyArgs, load_for_verify, make_batches

CFG = DisagMoEConfig(attention_gpus=2, ffn_gpus=2, depth=1, micro_batches=2)


def _args(model: str, zero: int) -> VerifyArgs:
    return VerifyArgs(model, CFG, zero=zero, steps=4, seq_len=8, clip=0.05)


def train_saving(rt, args: VerifyArgs, ckpt: str, mode: str, *, save_after: int, ds_config=None) -> list[float]:
    """mode 'full': ``args.steps`` steps, saving after step ``save_after`` (tag ``step{save_after}``, with
    ``ds_config`` in the manifest); 'resume': load that checkpoint and run the steps after it. The losses."""
    config = rt.module.config
    start = load_checkpoint(rt.engine, rt.role, rt.layout, config, ckpt)[1]["step"] if mode == "resume" else 0
    losses = []
    for step in range(start, args.steps):
        vocab = config.vocab_size if rt.role.is_attention else 0
        batches = make_batches(args, vocab, step, rt.role.index) if rt.role.is_attention else None
        losses.append(rt.executor.train_batch(batches).loss)
        if mode == "full" and step + 1 == save_after:
            tag, state = f"step{save_after}", {"step": save_after}
            save_checkpoint(rt.engine, rt.role, rt.layout, config, ckpt, tag, state, ds_config=ds_config)
    return losses


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
    with pytest.raises(CheckpointError, match="incomplete or missing"):
        resolve_tag(tmp_path)
