"""DeepSpeed checkpoints of a disaggregated job: one directory per role group, tied together by a manifest.

    <root>/<tag>/manifest.json           layout, model fingerprint, step, role directories (written last)
    <root>/<tag>/attention_g<g>/...      DeepSpeed files of A-group g (its lanes are DeepSpeed's data parallel)
    <root>/<tag>/ffn_g<g>_ep<e>/...      DeepSpeed files of expert shard e of F-group g (its replicas)
    <root>/latest                        the newest complete tag

Atomic: every rank saves into ``<root>/.partial-<tag>``; after a barrier global rank 0 writes the manifest,
renames the directory to ``<tag>`` and only then replaces ``latest`` (write to a temp file, ``os.replace``).
A crash at any point leaves the previous ``latest`` and its directory untouched.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch.distributed as dist

from disagmoe_ds.errors import CheckpointError
from disagmoe_ds.layout import Layout, RankRole

MANIFEST = "manifest.json"
LATEST = "latest"
_DS_TAG = "state"  # the tag inside each role directory; DeepSpeed's own 'latest' there is not used


def role_dir(role: RankRole) -> str:
    return f"attention_g{role.group}" if role.is_attention else f"ffn_g{role.group}_ep{role.ep_rank}"


def model_fingerprint(config) -> str:
    """Identifies the architecture (not the weights): a checkpoint of another model must not load."""
    keys = (
        "model_type",
        "hidden_size",
        "num_hidden_layers",
        "vocab_size",
        "num_attention_heads",
        "num_key_value_heads",
        "intermediate_size",
        "moe_intermediate_size",
        "num_experts",
        "num_local_experts",
        "n_routed_experts",
    )
    text = json.dumps({k: getattr(config, k, None) for k in keys}, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def save_checkpoint(
    engine,
    role: RankRole,
    layout: Layout,
    config,
    root: str | Path,
    tag: str,
    client_state: dict[str, Any],
    *,
    ds_config: dict[str, Any] | None = None,
) -> Path:
    """Save every rank's engine under ``root/tag`` atomically. Collective: every rank must call it.

    ``ds_config`` (the user's DeepSpeed config) goes into the manifest so conversions can rebuild the engines.
    """
    root = Path(root)
    partial = root / f".partial-{tag}"
    if dist.get_rank() == 0:
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir(parents=True)
    dist.barrier()
    engine.save_checkpoint(str(partial / role_dir(role)), tag=_DS_TAG, client_state=client_state)
    dist.barrier()
    final = root / tag
    if dist.get_rank() == 0:
        manifest = {
            "tag": tag,
            "layout": {
                "attention_gpus": layout.attention_gpus,
                "ffn_gpus": layout.ffn_gpus,
                "depth": layout.depth,
                "expert_data_parallel": layout.expert_data_parallel,
                "num_layers": layout.num_layers,
                "num_experts": layout.num_experts,
            },
            "model": model_fingerprint(config),
            "roles": sorted({role_dir(layout.role_of(r)) for r in range(layout.world_size)}),
            "client_state": {k: v for k, v in client_state.items() if isinstance(v, (int, float, str))},
            "ds_config": None if ds_config is None else {k: v for k, v in ds_config.items() if k != "disagmoe"},
        }
        _write_atomic(partial / MANIFEST, json.dumps(manifest, indent=2))
        if final.exists():
            shutil.rmtree(final)
        os.replace(partial, final)
        _write_atomic(root / LATEST, tag)
    dist.barrier()
    return final


def resolve_tag(root: str | Path, tag: str | None = None) -> str:
    """The tag to load: the given one, or the newest complete one named by ``latest``."""
    root = Path(root)
    if tag is None:
        latest = root / LATEST
        if not latest.is_file():
            raise CheckpointError(f"no checkpoint in {root}: {latest} does not exist")
        tag = latest.read_text().strip()
    if not (root / tag / MANIFEST).is_file():
        raise CheckpointError(f"checkpoint {root / tag} is incomplete or missing (no {MANIFEST})")
    return tag


def read_manifest(root: str | Path, tag: str) -> dict[str, Any]:
    try:
        return json.loads((Path(root) / tag / MANIFEST).read_text())
    except json.JSONDecodeError as err:
        raise CheckpointError(f"{Path(root) / tag / MANIFEST} is corrupt: {err}") from err


def load_checkpoint(engine, role: RankRole, layout: Layout, config, root: str | Path, tag: str | None = None):
    """Load this rank's engine state; returns ``(tag, client_state)``. Collective: every rank must call it."""
    tag = resolve_tag(root, tag)
    manifest = read_manifest(root, tag)
    if manifest["model"] != model_fingerprint(config):
        raise CheckpointError(f"checkpoint {Path(root) / tag} was written for a different model architecture")
    saved = manifest["layout"]
    current = {k: getattr(layout, k) for k in saved}
    if saved != current:
        raise CheckpointError(
            f"checkpoint {Path(root) / tag} has layout {saved}, this job has {current}; "
            "convert it with `disagmoe-convert relayout`"
        )
    path = Path(root) / tag / role_dir(role)
    load_path, client_state = engine.load_checkpoint(str(path), tag=_DS_TAG)
    if load_path is None:
        raise CheckpointError(f"DeepSpeed found no checkpoint in {path}")
    return tag, client_state
