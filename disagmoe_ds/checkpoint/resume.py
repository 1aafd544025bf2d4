"""Training checkpoints on top of ``checkpoint.manifest``: what a resume needs, where it is, how many to keep.

``checkpoint.manifest.save_checkpoint`` makes a save atomic (``.partial-<tag>``, manifest, rename, ``latest``) and
records a checksum per file. This module adds the training state to the manifest:

    client_state   step, seed, num_samples (also in every engine's DeepSpeed client state)
    frozen         {"router": bool, "attention": bool, "lora": {...} or null}: what --freeze-* fixed and the LoRA
                   settings (every base weight frozen); a resume keeps the first and must repeat the second
    data           {"loader_states": {lane: state}}: every lane's loader position (gathered from the lanes)
    tokenizer      "tokenizer": the run's tokenizer, saved as an HF tokenizer directory under the tag

A checkpoint without "data" (``disagmoe-convert hf-to-disagmoe``) resumes at the start of the data; one whose lanes
differ from the run's (``disagmoe-convert relayout``) continues at the same place of the epoch (``regroup``).

Tags are ``step<N>``; ``--keep-last`` removes the oldest complete ones after a save (never ``latest``), and
the ``.partial-*`` directories that a crashed save left behind.
"""

from __future__ import annotations

import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypedDict

import torch.distributed as dist

from disagmoe_ds.checkpoint.manifest import (
    LATEST,
    MANIFEST,
    WEIGHTS_ONLY,
    check_compatible,
    load_checkpoint,
    read_manifest,
    resolve_tag,
    save_checkpoint,
    verify_files,
)
from disagmoe_ds.config import SECTION, DisagMoEConfig, ds_stage
from disagmoe_ds.data import MicroBatchLoader, Tokenizer
from disagmoe_ds.data.sampler import regroup
from disagmoe_ds.errors import CheckpointError
from disagmoe_ds.layout import JobLayout
from disagmoe_ds.runtime.rank import RankRuntime

_TAG = re.compile(r"^step(\d+)$")
TOKENIZER_DIR = "tokenizer"
FREEZE_FLAGS = {"router": "--freeze-router", "attention": "--freeze-attention"}


class Freezing(TypedDict):
    """What a run freezes, as its checkpoints record it (the manifest's ``frozen``)."""

    router: bool
    attention: bool
    lora: dict[str, Any] | None  # the LoRA settings (``LoraSettings.to_dict``); None: every weight trains


def tag_of(step: int) -> str:
    return f"step{step}"


def save(
    runtime: RankRuntime,
    root: Path,
    step: int,
    loader: MicroBatchLoader | None,
    *,
    keep_last: int,
    seed: int,
    frozen: Freezing,
    tokenizer: Tokenizer | None = None,
    ds_config: dict[str, Any] | None = None,
    tokens_per_step: int | None = None,
) -> Path:
    """Save the job at ``step`` (with the ds_config, for conversions). Collective: every rank calls it.

    ``tokenizer``: rank 0's (it reads data), saved under the tag as an HF tokenizer directory.
    """
    gathered: list[Any] = [None] * dist.get_world_size()
    mine = (runtime.role.index, loader.state_dict()) if loader is not None else None
    dist.all_gather_object(gathered, mine)
    loader_states = {str(lane): state for lane, state in filter(None, gathered)}
    num_samples = next(iter(loader_states.values()))["sampler"]["num_samples"]
    client_state = {"step": step, "seed": seed, "num_samples": num_samples, "loader_states": loader_states}
    if tokens_per_step is not None:  # a resume under another layout says when its batch differs
        client_state["tokens_per_step"] = tokens_per_step
    extra: dict[str, Any] = {"frozen": frozen, "data": {"loader_states": loader_states}}
    if tokenizer is not None:
        extra["tokenizer"] = TOKENIZER_DIR
    path = save_checkpoint(
        runtime.engine,
        runtime.role,
        runtime.layout,
        runtime.module.config,
        root,
        tag_of(step),
        client_state,
        ds_config=ds_config,
        manifest_extra=extra,
        frozen_excluded=frozen.get("lora") is not None,  # a LoRA run's base weights are --init-from's
        attach=None if tokenizer is None else lambda tag_dir: tokenizer.save(tag_dir / TOKENIZER_DIR),
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
        if save_dir is None:
            raise CheckpointError("--resume without a checkpoint path needs --save-dir (the run's checkpoint root)")
        return save_dir, resolve_tag(save_dir)
    path = Path(resume)
    if (path / MANIFEST).is_file():
        return path.parent, path.name
    return path, resolve_tag(path)


@dataclass(frozen=True)
class ResumePoint:
    """What a checkpoint tells a run that continues it."""

    root: Path
    tag: str
    step: int
    frozen: dict[str, Any] | None  # None: not recorded (checkpoints written before freezing was recorded)
    has_data_position: bool  # False: the run starts at the beginning of the data
    weights_only: bool = False  # converted HF weights: the run's optimizer and LR scheduler start fresh
    tokens_per_step: int | None = None  # what the checkpointed run trained on per step (None: not recorded)

    @property
    def path(self) -> Path:
        return self.root / self.tag

    def describe_data(self) -> str:
        data = (
            "data continues where the checkpoint stood"
            if self.has_data_position
            else "data from its start (the checkpoint records no data position)"
        )
        if self.weights_only:
            data += "; weights only (converted from HF): the optimizer and LR scheduler start from this run's ds_config"
        return data


def check_resume(
    root: Path,
    tag: str,
    config,
    layout: JobLayout,
    *,
    num_samples: int | None,
    seed: int | None = None,
    frozen: Freezing | None = None,
    ds_config: dict[str, Any] | None = None,
    hashes: bool = True,
) -> ResumePoint:
    """Fail before launch when the checkpoint cannot continue this run (files, mode, model, layout, ZeRO stage and
    precision, data, seed, freezing). ``layout`` is either mode's; ``frozen``: what this run's flags freeze (a
    checkpoint's own freezing is kept; freezing more than it did is refused)."""
    manifest = read_manifest(root, tag)
    where = root / tag
    verify_files(root, tag, hashes=hashes)
    check_compatible(manifest, config, layout, where)
    state = manifest["client_state"]
    if "step" not in state:
        raise CheckpointError(f"checkpoint {where} holds no training step: it was not written by run_pretrain.py")
    saved_seed = state.get("seed")
    if seed is not None and saved_seed is not None and saved_seed != seed:
        raise CheckpointError(
            f"checkpoint {where} was trained with --seed {saved_seed}, this run has --seed {seed}; resume with "
            f"--seed {saved_seed} (the seed fixes the data order and every step's random numbers)"
        )
    # Checkpoints written before the manifest held the data position keep it in the engines' client state only.
    has_data = _loader_states(manifest) is not None or "num_samples" in state
    if has_data and num_samples is not None and state.get("num_samples") != num_samples:
        raise CheckpointError(
            f"checkpoint {where} was trained on {state.get('num_samples')} samples, this run's data gives "
            f"{num_samples}; resume with the same --data, --eval-split, --seq-len, --seed and tokenizer"
        )
    if ds_config is not None and manifest.get("ds_config") is not None:
        _check_engine_settings(where, manifest["ds_config"], ds_config, manifest.get("zero_stage"))
        if int(state["step"]) > 0 and ds_config.get("scheduler") and not manifest["ds_config"].get("scheduler"):
            raise CheckpointError(
                f"checkpoint {where} was trained without an LR scheduler and this run's ds_config has one, which "
                f'would restart at step 0; remove "scheduler" from the ds_config to resume it'
            )
    recorded = manifest.get("frozen")
    if recorded is not None and frozen is not None:
        _check_freezing(where, recorded, frozen)
    tokens = state.get("tokens_per_step")
    return ResumePoint(root, tag, int(state["step"]), recorded, has_data, bool(manifest.get(WEIGHTS_ONLY)), tokens)


def _engine_settings(ds_config: dict[str, Any]) -> tuple[int, str]:
    return ds_stage(ds_config), "bf16" if ds_config.get("bf16", {}).get("enabled") else "fp32"


def _stages_by_side(ds_config: dict[str, Any]) -> dict[str, int]:
    """Each side's ZeRO stage under ``ds_config``: its ``"disagmoe": {"zero_stage": ...}``, else its stage."""
    return DisagMoEConfig.from_ds_config(ds_config).zero_stages(ds_config)


def _check_engine_settings(
    where: Path, saved: dict[str, Any], current: dict[str, Any], saved_sides: dict[str, int] | None
) -> None:
    """DeepSpeed lays the optimizer state out by ZeRO stage and precision: a resume needs the same ones, on each
    side where the checkpoint records each side's (``saved_sides``: disaggregated checkpoints)."""
    (saved_stage, saved_dtype), (stage, dtype) = _engine_settings(saved), _engine_settings(current)
    if saved_sides is not None:
        sides = _stages_by_side(current)
        if len(set(saved_sides.values())) > 1 or len(set(sides.values())) > 1:
            if (saved_sides, saved_dtype) != (sides, dtype):
                a, f = saved_sides["attention"], saved_sides["ffn"]
                raise CheckpointError(
                    f"checkpoint {where} was saved under ZeRO stage {a} (attention) / {f} (experts) in "
                    f"{saved_dtype}, this run has {sides['attention']} / {sides['ffn']} in {dtype}; resume with the "
                    f'ds_config\'s "{SECTION}": {{"zero_stage": {{"attention": {a}, "ffn": {f}}}}} and --dtype '
                    f"{saved_dtype} (or convert it with disagmoe-convert relayout --zero-stage {sides['attention']} "
                    f"{sides['ffn']} --dtype {dtype})"
                )
            return
        saved_stage, stage = saved_sides["attention"], sides["attention"]  # one stage on both sides: as below
    if (saved_stage, saved_dtype) != (stage, dtype):
        raise CheckpointError(
            f"checkpoint {where} was saved under ZeRO stage {saved_stage} in {saved_dtype}, this run has stage "
            f"{stage} in {dtype}; pass --zero {saved_stage} --dtype {saved_dtype} (or convert it with "
            f"disagmoe-convert relayout --zero {stage} --dtype {dtype})"
        )


def _check_freezing(where: Path, recorded: dict[str, Any], requested: Freezing) -> None:
    """``requested``'s freezing adds nothing to the checkpoint's, and its LoRA settings (``"lora"``) are the same."""
    if recorded.get("lora") != requested.get("lora"):
        saved, asked = (_describe_lora(d.get("lora")) for d in (recorded, requested))
        raise CheckpointError(
            f"checkpoint {where} trained {saved}, this run asks for {asked}; resume it with the same --lora-* flags, "
            "or export it and start a new run from the export (--init-from)"
        )
    extra = [FREEZE_FLAGS[k] for k in FREEZE_FLAGS if requested.get(k) and not recorded.get(k, False)]
    if extra:
        kept = [FREEZE_FLAGS[k] for k in FREEZE_FLAGS if recorded.get(k)]
        keep = f"pass {' '.join(kept)} or nothing" if kept else "pass no --freeze-* flag"
        raise CheckpointError(
            f"checkpoint {where} was trained with {' '.join(kept) or 'nothing frozen'}, this run adds "
            f"{' '.join(extra)}, which changes the optimizer's parameter groups; to resume, {keep}; to freeze more, "
            f"export it (disagmoe-convert disagmoe-to-hf) and start a new run with --init-from OUT {' '.join(extra)}"
        )


def _describe_lora(lora: dict[str, Any] | None) -> str:
    if lora is None:
        return "every weight (no LoRA)"
    return f"LoRA adapters {', '.join(f'{k}={v}' for k, v in lora.items())}"


def effective_freezing(point: ResumePoint | None, router: bool, attention: bool) -> dict[str, bool]:
    """This run's freezing: the flags, plus whatever the checkpoint it resumes froze."""
    recorded = (point.frozen if point is not None else None) or {}
    return {
        "router": router or recorded.get("router", False),
        "attention": attention or recorded.get("attention", False),
    }


def _loader_states(manifest: dict[str, Any]) -> dict[str, Any] | None:
    return (manifest.get("data") or {}).get("loader_states")


def restore(runtime: RankRuntime, root: Path, tag: str, loader: MicroBatchLoader | None, *, lanes: int) -> int:
    """Load this rank's engine (and its lane's loader position); returns the step to continue from. Collective.

    The loader position is the manifest's (else the engine's client state, in checkpoints written before it was in
    the manifest); positions saved by another number of lanes are regrouped, none means the start of the data.
    """
    _, state = load_checkpoint(runtime.engine, runtime.role, runtime.layout, runtime.module.config, root, tag)
    states = _loader_states(read_manifest(root, tag)) or state.get("loader_states")
    if loader is not None and states:
        saved = next(iter(states.values()))["sampler"]  # every lane stands at the same place of the epoch
        loader.load_state_dict({"sampler": regroup(saved, lanes)})
    return int(state["step"])
