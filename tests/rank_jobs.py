"""Rank bodies and rank logs shared by the multi-rank tests."""

from __future__ import annotations

from pathlib import Path

from disagmoe_ds.checkpoint.manifest import load_checkpoint, save_checkpoint
from disagmoe_ds.parity.reference import VerifyArgs, make_batches


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


def idle_beside_busy(log: Path, replica_groups: list[tuple[int, ...]]) -> int:
    """How many expert forwards ran on a replica with no pair while another replica of its shard had pairs (the
    replicas run the same schedule, so their i-th forwards are the same layer and micro-batch)."""
    count = 0
    for ranks in replica_groups:
        runs = [[int(n) for n in (log / f"rank{r}.txt").read_text().split()] for r in ranks]
        count += sum(min(pairs) == 0 < max(pairs) for pairs in zip(*runs, strict=True))
    return count
