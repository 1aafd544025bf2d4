"""DeepSpeed checkpoints of a job: one directory per DeepSpeed engine group, tied together by a manifest.

    <root>/<tag>/manifest.json           mode, layout, model fingerprint, step, directories, the size and sha256 of
                                         every other file, and what the caller adds (written last)
    <root>/<tag>/attention_g<g>/...      disaggregated: DeepSpeed files of A-group g (its lanes are DeepSpeed's DP)
    <root>/<tag>/ffn_g<g>_ep<e>/...      disaggregated: DeepSpeed files of expert shard e of F-group g (its replicas)
    <root>/<tag>/colocated/...           co-located: the one DeepSpeed MoE job (one file per expert, its own naming)
    <root>/latest                        the newest complete tag

The manifest records the mode and the layout values a resume must match, so a checkpoint never loads into a job
of the other mode or of another layout. Manifests written before the co-located mode existed have no "mode": they
are disaggregated.

Atomic: every rank saves into ``<root>/.partial-<tag>``; after a barrier global rank 0 writes the manifest,
renames the directory to ``<tag>`` and only then replaces ``latest`` (write to a temp file, ``os.replace``).
A crash at any point leaves the previous ``latest`` and its directory untouched.

Integrity: the ranks hash the files (each a share of them) before the manifest is written; ``verify_files``
checks sizes and hashes before a resume or a conversion starts any rank, names the damaged file and the newest
older checkpoint whose files are intact.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import shutil
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch.distributed as dist

from disagmoe_ds.errors import CheckpointError
from disagmoe_ds.layout import JobLayout, Layout, RankRole

MANIFEST = "manifest.json"
LATEST = "latest"
_DS_TAG = "state"  # the tag inside each role directory; DeepSpeed's own 'latest' there is not used
DISAGGREGATED = Layout.mode


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


def file_digest(path: Path) -> str:
    """The sha256 of a file, read in chunks (checkpoint files are GiB)."""
    with path.open("rb") as handle:
        return hashlib.file_digest(handle, "sha256").hexdigest()


def _hash_files(directory: Path) -> dict[str, dict[str, Any]]:
    """Size and sha256 of every file under ``directory`` (its manifest excluded). Collective: rank 0 lists the
    files, every rank hashes every world_size-th of them, so a large checkpoint is read once, in parallel."""
    names: list[Any] = [None]
    if dist.get_rank() == 0:
        names = [sorted(str(f.relative_to(directory)) for f in directory.rglob("*") if f.is_file())]
        names[0] = [n for n in names[0] if n != MANIFEST]
    dist.broadcast_object_list(names, src=0)
    mine = {
        name: {"bytes": (directory / name).stat().st_size, "sha256": file_digest(directory / name)}
        for name in names[0][dist.get_rank() :: dist.get_world_size()]
    }
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    return {name: entry for share in gathered for name, entry in sorted(share.items())}


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def save_checkpoint(
    engine,
    role: RankRole,
    layout: JobLayout,
    config,
    root: str | Path,
    tag: str,
    client_state: dict[str, Any],
    *,
    ds_config: dict[str, Any] | None = None,
    manifest_extra: Mapping[str, Any] | None = None,
    attach: Callable[[Path], None] | None = None,
    frozen_excluded: bool = False,
) -> Path:
    """Save every rank's engine under ``root/tag`` atomically. Collective: every rank must call it.

    ``role`` is this rank's role in ``layout`` (either mode's). ``ds_config`` (the user's DeepSpeed config) goes
    into the manifest so conversions can rebuild the engines. ``manifest_extra``: more JSON entries of the manifest
    (what was frozen, the data position). ``attach(tag_dir)``: rank 0 writes more files there (the tokenizer)
    before they are hashed. ``frozen_excluded``: the engines leave their frozen parameters out (a LoRA run: its
    base weights come from ``--init-from`` again at a resume), recorded in the manifest.
    """
    root = Path(root)
    partial = root / f".partial-{tag}"
    if dist.get_rank() == 0:
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir(parents=True)
    dist.barrier()
    try:
        engine.save_checkpoint(
            str(partial / layout.checkpoint_dir(role)),
            tag=_DS_TAG,
            client_state=client_state,
            exclude_frozen_parameters=frozen_excluded,
        )
        if dist.get_rank() == 0 and attach is not None:
            attach(partial)
    except (OSError, RuntimeError) as err:
        raise _save_failed(root, tag, err) from err
    dist.barrier()
    files = _hash_files(partial)
    stages = _side_stages(engine, role) if layout.mode == DISAGGREGATED else None
    final = root / tag
    if dist.get_rank() == 0:
        manifest = {
            "tag": tag,
            "mode": layout.mode,
            "layout": layout.manifest_layout(),
            **({} if stages is None else {"zero_stage": stages}),
            "model": model_fingerprint(config),
            "roles": sorted({layout.checkpoint_dir(layout.role_of(r)) for r in range(layout.world_size)}),
            "client_state": {k: v for k, v in client_state.items() if isinstance(v, (int, float, str))},
            "ds_config": None if ds_config is None else {k: v for k, v in ds_config.items() if k != "disagmoe"},
            **(manifest_extra or {}),
            **({FROZEN_EXCLUDED: True} if frozen_excluded else {}),
            "files": files,
        }
        _write_atomic(partial / MANIFEST, json.dumps(manifest, indent=2))
        if final.exists():
            shutil.rmtree(final)
        os.replace(partial, final)
        _write_atomic(root / LATEST, tag)
    dist.barrier()
    return final


def _save_failed(root: Path, tag: str, err: BaseException) -> CheckpointError:
    """The one line for a save that failed (``torch.save`` reports a full disk as "unexpected pos"); its partial
    directory is removed, to give the space back, and the newest complete checkpoint is named."""
    shutil.rmtree(root / f".partial-{tag}", ignore_errors=True)
    full = (isinstance(err, OSError) and err.errno == errno.ENOSPC) or "unexpected pos" in str(err)
    free = shutil.disk_usage(root).free / 2**20
    reason = f"no space left on the device ({free:,.0f} MiB free now)" if full else str(err).strip().splitlines()[0]
    latest = root / LATEST
    kept = (
        f"the last complete checkpoint, {root / latest.read_text().strip()}, is intact: resume from it"
        if latest.is_file()
        else "no earlier checkpoint exists"
    )
    fix = "free space or pick another --save-dir" if full else "fix the cause"
    return CheckpointError(f"saving checkpoint {root / tag} failed: {reason}; {fix}; {kept}")


def _side_stages(engine, role: RankRole) -> dict[str, int]:
    """Each side's ZeRO stage as its engines ran (collective). The manifest records it: the optimizer state is laid
    out by it, and a side's stage may differ from the ds_config's (``"disagmoe": {"zero_stage": ...}``)."""
    every: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, ("attention" if role.is_attention else "ffn", engine.zero_optimization_stage()))
    return dict(sorted(set(every)))


def resolve_tag(root: str | Path, tag: str | None = None) -> str:
    """The tag to load: the given one, or the newest complete one named by ``latest``."""
    root = Path(root)
    if tag is None:
        latest = root / LATEST
        if not latest.is_file():
            raise CheckpointError(f"no checkpoint in {root}: {latest} does not exist")
        try:
            tag = latest.read_text(encoding="utf-8").strip()
        except UnicodeDecodeError:
            raise damaged(root, None, f"its {LATEST} file is not a tag name") from None
    if not (root / tag).is_dir():
        raise damaged(root, tag, "it does not exist")
    return tag


# What every manifest this code writes holds (older ones may lack "files": they list no checksums).
_REQUIRED = ("tag", "layout", "model", "client_state")


def read_manifest(root: str | Path, tag: str) -> dict[str, Any]:
    manifest, problem = _manifest_of(Path(root) / tag)
    if manifest is None:
        raise damaged(Path(root), tag, problem)
    return manifest


def _manifest_of(tag_dir: Path) -> tuple[dict[str, Any] | None, str]:
    """The checkpoint's manifest, or None and what is wrong with it."""
    path = tag_dir / MANIFEST
    if not path.is_file():
        return None, f"it has no {MANIFEST} (a save that did not finish, or a deleted file)"
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except ValueError:  # not JSON, or not UTF-8
        return None, f"its {MANIFEST} is not valid JSON (truncated or overwritten)"
    missing = [key for key in _REQUIRED if not isinstance(manifest, dict) or key not in manifest]
    if missing:
        return None, f"its {MANIFEST} lacks {', '.join(missing)}"
    return manifest, ""


def damaged(root: Path, tag: str | None, problem: str) -> CheckpointError:
    """The one line for a damaged checkpoint (``tag`` None: the root's ``latest``), naming the newest intact one
    older than it."""
    good = previous_intact(root, tag)
    hint = f"resume from {root / good} (--resume {root / good})" if good else f"no older intact checkpoint is in {root}"
    return CheckpointError(f"checkpoint {root if tag is None else root / tag}: {problem}; {hint}")


def _file_problem(where: Path, files: Mapping[str, Any], *, hashes: bool) -> str | None:
    """What is wrong with the first damaged file of a checkpoint, or None."""
    for name, entry in files.items():
        path = where / name
        if not path.is_file():
            return f"{name} is missing"
        size = path.stat().st_size
        if size != entry["bytes"]:
            return f"{name} is damaged ({size:,} bytes, the save wrote {entry['bytes']:,}; truncated?)"
        if hashes and file_digest(path) != entry["sha256"]:
            return f"{name} is damaged (its sha256 differs from the one recorded when it was saved)"
    return None


def _step_of(tag: str) -> int | None:
    match = re.fullmatch(r"step(\d+)", tag)
    return int(match.group(1)) if match else None


def previous_intact(root: Path, tag: str | None) -> str | None:
    """The newest complete checkpoint older than ``tag`` (any, for None) in ``root`` whose files are intact, or
    None."""
    step = None if tag is None else _step_of(tag)
    older = [(s, d.name) for d in root.iterdir() if (s := _step_of(d.name)) is not None and d.is_dir()]
    for _, name in sorted((s, n) for s, n in older if step is None or s < step)[::-1]:
        manifest, _ = _manifest_of(root / name)
        if manifest is not None and _file_problem(root / name, manifest.get("files", {}), hashes=True) is None:
            return name
    return None


def verify_files(root: str | Path, tag: str, *, hashes: bool = True) -> None:
    """Raise, naming the file and the newest intact older checkpoint, unless every file the manifest lists has its
    recorded size (and, with ``hashes``, sha256). Manifests written before checksums existed list no files."""
    root = Path(root)
    problem = _file_problem(root / tag, read_manifest(root, tag).get("files", {}), hashes=hashes)
    if problem is not None:
        raise damaged(root, tag, problem)


def check_compatible(manifest: dict[str, Any], config, layout: JobLayout, where: Path) -> None:
    """Raise unless the checkpoint at ``where`` (its ``manifest``) can load into this job: same mode, same model
    architecture, same layout."""
    saved_mode = manifest.get("mode", DISAGGREGATED)
    if saved_mode != layout.mode:
        raise CheckpointError(
            f"checkpoint {where} was written by a {saved_mode} job, this run is {layout.mode}; "
            f"resume it with --mode {saved_mode}"
        )
    if manifest["model"] != model_fingerprint(config):
        raise CheckpointError(f"checkpoint {where} was written for a different model architecture than this run's")
    saved, current = manifest["layout"], layout.manifest_layout()
    if saved != current:
        raise CheckpointError(f"checkpoint {where} has layout {saved}, this run has {current}; {layout.relayout_hint}")


# Manifest entry of a checkpoint that holds weights only (``disagmoe-convert hf-to-disagmoe``): its optimizer state
# is the converter's fresh one, so a run that resumes it loads the module alone and keeps its own optimizer and LR
# scheduler, as its ds_config makes them.
WEIGHTS_ONLY = "weights_only"
# Manifest entry of a checkpoint without its frozen parameters (LoRA): the module loads non-strictly over the base
# weights the run rebuilt (``--init-from``, or the seed's initialisation).
FROZEN_EXCLUDED = "frozen_excluded"


def load_checkpoint(
    engine, role: RankRole, layout: JobLayout, config, root: str | Path, tag: str | None = None
) -> tuple[str, dict[str, Any]]:
    """Load this rank's engine state; returns ``(tag, client_state)``. Collective: every rank must call it."""
    tag = resolve_tag(root, tag)
    manifest = read_manifest(root, tag)
    check_compatible(manifest, config, layout, Path(root) / tag)
    path = Path(root) / tag / layout.checkpoint_dir(role)
    if manifest.get(WEIGHTS_ONLY):  # HF weights converted: the run's own optimizer and scheduler start fresh
        load_path, client_state = engine.load_checkpoint(str(path), tag=_DS_TAG, load_module_only=True)
    else:
        # A checkpoint written without a scheduler has no state for this engine's one, which then starts fresh
        # (checkpoint.resume allows that at step 0 only); one that records no ds_config at all predates the record.
        saved_ds_config = manifest.get("ds_config")
        saved_scheduler = saved_ds_config is None or saved_ds_config.get("scheduler") is not None
        load_path, client_state = engine.load_checkpoint(
            str(path),
            tag=_DS_TAG,
            load_lr_scheduler_states=saved_scheduler,
            load_module_strict=not manifest.get(FROZEN_EXCLUDED),
        )
    if load_path is None:
        raise CheckpointError(f"DeepSpeed found no checkpoint in {path}")
    return tag, client_state
