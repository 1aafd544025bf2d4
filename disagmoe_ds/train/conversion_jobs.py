"""What ``disagmoe-convert`` runs: the job of a layout, and a checkpoint opened with the job that wrote it.

A checkpoint's manifest records the DeepSpeed config it was trained with (``save_checkpoint(..., ds_config=)``): it
is loaded again under its own ZeRO stage and precision. It also records what training froze (``--freeze-router``,
``--freeze-attention``): the ranks are built with the same parameters frozen, so the optimizer's parameter groups
match. ``open_checkpoint`` checks, before any rank starts, every file of the checkpoint against the size and sha256
in its manifest, and that the checkpoint belongs to the model given.

``disagmoe-to-hf`` also reads checkpoints of co-located jobs (``run_pretrain.py --mode colocated``; the manifest
records the mode); ``hf-to-disagmoe`` and ``relayout`` write and read disaggregated checkpoints only.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Generic, TypeVar

import torch

from disagmoe_ds.checkpoint.manifest import (
    DISAGGREGATED,
    LATEST,
    MANIFEST,
    model_fingerprint,
    read_manifest,
    resolve_tag,
    verify_files,
)
from disagmoe_ds.config import SECTION, DisagMoEConfig
from disagmoe_ds.errors import CheckpointError
from disagmoe_ds.models.families import family_of
from disagmoe_ds.models.loading import has_weights, load_config

if TYPE_CHECKING:
    from disagmoe_ds.colocated.layout import ColocatedConfig

# Manifest entries of run_pretrain.py's checkpoints (checkpoint.resume) that a re-layout carries unchanged.
TRAINING_ENTRIES = ("frozen", "data", "tokenizer", "weights_only")  # a re-layout keeps them


# Either mode's config; a co-located job's ``ColocatedConfig`` only for a checkpoint being exported to HF.
Cfg = TypeVar("Cfg", bound="DisagMoEConfig | ColocatedConfig", covariant=True)


@dataclass(frozen=True)
class Job(Generic[Cfg]):
    """One layout to run: the model directory, the layout and the user's DeepSpeed config (no ``disagmoe``).

    ``Job[DisagMoEConfig]`` is what hf-to-disagmoe and relayout write; a ``Source``'s job is of either mode.
    """

    model_dir: str
    cfg: Cfg
    ds_config: dict[str, Any]
    frozen: dict[str, bool] = field(default_factory=dict)  # {"router": bool, "attention": bool}, as training froze

    @property
    def dtype(self) -> torch.dtype:
        return torch.bfloat16 if self.ds_config.get("bf16", {}).get("enabled") else torch.float32


AnyJob = Job["DisagMoEConfig | ColocatedConfig"]  # a job of either mode


@dataclass(frozen=True)
class Source:
    """A checkpoint opened for reading: where it is and the job that wrote it."""

    root: Path
    tag: str
    job: AnyJob
    client_state: dict[str, Any]  # the manifest's copy: the trainer's int/float/str entries
    mode: str = DISAGGREGATED  # the manifest's: disaggregated or colocated
    extra: dict[str, Any] = field(default_factory=dict)  # the manifest's training entries: frozen, data, tokenizer

    @property
    def tokenizer_dir(self) -> Path | None:
        name = self.extra.get("tokenizer")
        return None if name is None else self.root / self.tag / name


def without_section(ds_config: dict[str, Any]) -> dict[str, Any]:
    """The layout lives in the manifest; a stale "disagmoe" section would contradict a re-layout."""
    return {k: v for k, v in ds_config.items() if k != SECTION}


def resolve_ds_config(base: dict[str, Any] | None, *, zero: int | None, dtype: str | None) -> dict[str, Any]:
    """``base`` (or DeepSpeed's defaults) with the ``--zero`` / ``--dtype`` flags applied.

    >>> resolve_ds_config(None, zero=1, dtype="bf16")
    {'zero_optimization': {'stage': 1}, 'bf16': {'enabled': True}}
    """
    config = without_section(copy.deepcopy(base or {}))
    if zero is not None:
        config.setdefault("zero_optimization", {})["stage"] = zero
    if dtype is not None:
        config["bf16"] = {"enabled": dtype == "bf16"}
    return config


def open_checkpoint(
    root: str | Path,
    model_dir: str | Path,
    *,
    tag: str | None = None,
    ds_config: dict[str, Any] | None = None,
    command: str = "disagmoe-to-hf",
) -> Source:
    """Check that ``root`` holds a complete checkpoint of the model in ``model_dir`` and read its job.

    A checkpoint is always read under the DeepSpeed config it records; ``ds_config`` is used only for one that
    records none (saved without ``ds_config``). ``command`` is the conversion that will read it (a LoRA checkpoint
    is read by disagmoe-to-hf alone).
    """
    root = Path(root)
    if not root.is_dir():
        raise CheckpointError(f"checkpoint directory {root} does not exist; pass --ckpt the --out of a training run")
    tag = resolve_tag(root, tag)
    verify_files(root, tag)
    manifest = read_manifest(root, tag)
    _check_same_model(manifest, model_dir, root / tag)
    mode = manifest.get("mode", DISAGGREGATED)
    cfg = _recorded_cfg(mode, manifest, root / tag)
    base = manifest.get("ds_config")
    base = ds_config if base is None else base
    if base is None:
        raise CheckpointError(
            f"checkpoint {root / tag} does not record its DeepSpeed config; pass --ds-config with the one it was "
            "trained with (its ZeRO stage and precision)"
        )
    frozen = dict(manifest.get("frozen") or {})
    if frozen.get("lora"):
        if command != "disagmoe-to-hf":
            raise CheckpointError(
                f"checkpoint {root / tag} holds LoRA adapters, which disagmoe-convert {command} does not carry yet; "
                "export them with disagmoe-convert disagmoe-to-hf (a PEFT adapter directory, or --merged), or "
                "resume the run with run_pretrain.py and its --lora-* flags"
            )
        if not has_weights(model_dir):
            raise CheckpointError(
                f"checkpoint {root / tag} holds only LoRA adapters, and {model_dir} has no weights to put them on; "
                "pass --model the HF directory the run started from (its --init-from)"
            )
        cfg = replace(cfg, lora=frozen["lora"])  # the ranks get the run's adapters over --model's base weights
    job = Job(str(model_dir), cfg, without_section(base), frozen)
    extra = {key: manifest[key] for key in TRAINING_ENTRIES if key in manifest}
    return Source(root, tag, job, dict(manifest["client_state"]), mode, extra)


def _recorded_cfg(mode: str, manifest: dict[str, Any], path: Path) -> DisagMoEConfig | ColocatedConfig:
    """The config that rebuilds the layout a manifest records (its ``manifest_layout`` values); a disaggregated
    one with the per-side ZeRO stages it was written under, which the ranks that read it are built with."""
    saved: dict[str, Any] = manifest["layout"]
    if mode == DISAGGREGATED:
        return DisagMoEConfig(
            attention_gpus=saved["attention_gpus"],
            ffn_gpus=saved["ffn_gpus"],
            depth=saved["depth"],
            expert_data_parallel=saved["expert_data_parallel"],
            tensor_parallel=saved.get("tensor_parallel", 1),
            zero_stage=dict(manifest.get("zero_stage") or {}),
        )
    from disagmoe_ds.colocated.layout import ColocatedConfig, ColocatedLayout  # imports DeepSpeed (seconds)

    if mode != ColocatedLayout.mode:
        raise CheckpointError(f"checkpoint {path} was written by a {mode} job, a mode disagmoe-convert does not know")
    stage_layers, chunks = saved.get("stage_layers"), saved.get("virtual_stages", 1)  # a pipelined job's
    pp_size = len(stage_layers) // chunks if stage_layers else 1
    return ColocatedConfig(
        world_size=saved["world_size"],
        ep_size=saved["ep_size"],
        pp_size=pp_size,
        virtual_stages=chunks,
        stage_layers=tuple(stage_layers) if stage_layers else None,
        tensor_parallel=saved.get("tensor_parallel", 1),
        micro_batches=pp_size,  # a conversion steps nothing; interleaved stages need a multiple of pp_size
    )


def refuse_checkpoint_as_model(model_dir: str | Path) -> None:
    """A checkpoint where an HF directory belongs (``load_config`` would only say that config.json is missing)."""
    path = Path(model_dir)
    if (path / LATEST).is_file() or (path / MANIFEST).is_file():
        raise CheckpointError(
            f"{path} is a DisagMoE checkpoint, not an HF directory; hf-to-disagmoe reads HF weights: export the "
            "checkpoint with disagmoe-convert disagmoe-to-hf (disaggregated or colocated) and pass that directory, "
            "or re-lay out a disaggregated checkpoint with disagmoe-convert relayout"
        )


def _check_same_model(manifest: dict[str, Any], model_dir: str | Path, path: Path) -> None:
    """The fingerprint covers type, sizes and layer count, the manifest's layout the expert count."""
    config = load_config(model_dir)
    num_experts = getattr(config, family_of(config).num_experts_attr)
    saved = manifest["layout"]
    if manifest["model"] != model_fingerprint(config) or saved["num_experts"] != num_experts:
        layers = f"{saved['num_layers']} layers, " if "num_layers" in saved else ""  # co-located ones do not say
        raise CheckpointError(
            f"checkpoint {path} was written for another model than {model_dir} ({config.model_type}, "
            f"{config.num_hidden_layers} layers, {num_experts} experts; the checkpoint has {layers}"
            f"{saved['num_experts']} experts); pass --model the directory the checkpoint was trained from"
        )
