"""Training checkpoints on top of ``engine.checkpoint``: what a resume needs, where it is, how many to keep.

``engine.checkpoint.save_checkpoint`` makes a save atomic (``.partial-<tag>``, manifest, rename, ``latest``).
This module adds the training state: the step, and every lane's loader position. DeepSpeed writes the
client state only from data-parallel rank 0 of each engine (lane 0 of an A-group), so the lanes' loader
states are gathered first and every engine saves all of them; on resume each lane takes its own.

Tags are ``step<N>``; ``--keep-last`` removes the oldest complete ones after a save (never ``latest``), and
the ``.partial-*`` directories that a crashed save left behind.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path
from typing import Any

import torch.distributed as dist

from disagmoe_ds.data import MicroBatchLoader
from disagmoe_ds.engine.checkpoint import (
    LATEST,
    MANIFEST,
    RecordedLayout,
    check_compatible,
    load_checkpoint,
    read_manifest,
    resolve_tag,
    save_checkpoint,
)
from disagmoe_ds.errors import CheckpointError
from disagmoe_ds.layout import Layout
from disagmoe_ds.train.modes import Runtime

_TAG = re.compile(r"^step(\d+)$")


def tag_of(step: int) -> str:
    return f"step{step}"


def save(
    runtime: Runtime,
    root: Path,
    step: int,
    loader: MicroBatchLoader | None,
    *,
    keep_last: int,
    ds_config: dict[str, Any] | None = None,
) -> Path:
    """Save the job at ``step`` (with the ds_config, for conversions). Collective: every rank calls it."""
    gathered: list[Any] = [None] * dist.get_world_size()
    mine = (runtime.role.index, loader.state_dict()) if loader is not None else None
    dist.all_gather_object(gathered, mine)
    loader_states = {str(lane): state for lane, state in filter(None, gathered)}
    num_samples = next(iter(loader_states.values()))["sampler"]["num_samples"]
    client_state = {"step": step, "num_samples": num_samples, "loader_states": loader_states}
    path = save_checkpoint(
        runtime.engine,
        runtime.role,
        runtime.layout,
        runtime.module.config,
        root,
        tag_of(step),
        client_state,
        ds_config=ds_config,
    )
    if dist.get_rank() == 0 and keep_last:
        prune(root, keep_last)  # every rank has finished this save (save_checkpoint ends in a barrier)
    return path


def prune(root: Path, keep_last: int) -> list[str]:
    """Remove all but the newest ``keep_last`` complete checkpoints and any ``.partial-*`` leftovers."""
    latest = (root / LATEST).read_text().strip()
    complete = sorted(
        (int(m.group(1)), d) for d in root.iterdir() if (m := _TAG.match(d.name)) and (d / MANIFEST).is_file()
    )
    doomed = [d for _, d in complete[:-keep_last] if d.name != latest]
    doomed += [d for d in root.glob(".partial-*") if d.is_dir()]
    for d in doomed:
        shutil.rmtree(d)
    return [d.name for d in doomed]


def locate(resume: str, save_dir: Path | None) -> tuple[Path, str]:
    """(root, tag) of the checkpoint ``--resume`` names: "" is the newest in save_dir; a path is a root or ROOT/TAG."""
    if resume == "":
        assert save_dir is not None, "args.resolve requires --save-dir for a bare --resume"
        return save_dir, resolve_tag(save_dir)
    path = Path(resume)
    if (path / MANIFEST).is_file():
        return path.parent, path.name
    return path, resolve_tag(path)


def check_resume(root: Path, tag: str, config, layout: Layout | RecordedLayout, *, num_samples: int | None) -> int:
    """Fail before launch when the checkpoint cannot continue this run (mode, model, layout, data); returns its
    step. ``layout`` is either mode's."""
    manifest = read_manifest(root, tag)
    where = root / tag
    check_compatible(manifest, config, layout, where)
    state = manifest["client_state"]
    if "step" not in state:
        raise CheckpointError(f"checkpoint {where} holds no training step: it was not written by run_pretrain.py")
    if num_samples is not None and state.get("num_samples") != num_samples:
        raise CheckpointError(
            f"checkpoint {where} was trained on {state.get('num_samples')} samples, this run's data gives "
            f"{num_samples}; resume with the same --data, --seq-len, --seed and tokenizer"
        )
    return int(state["step"])


def restore(runtime: Runtime, root: Path, tag: str, loader: MicroBatchLoader | None) -> int:
    """Load this rank's engine (and its lane's loader position); returns the step to continue from. Collective."""
    _, state = load_checkpoint(runtime.engine, runtime.role, runtime.layout, runtime.module.config, root, tag)
    if loader is not None:
        loader.load_state_dict(state["loader_states"][str(runtime.role.index)])
    return int(state["step"])
