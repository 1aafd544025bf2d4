"""disagmoe-convert: Hugging Face directory <-> DisagMoE checkpoint, and re-layout of a checkpoint.

    disagmoe-convert hf-to-disagmoe --model HF_DIR --out CKPT --attention-gpus 2 --ffn-gpus 2 [--zero 1]
    disagmoe-convert disagmoe-to-hf --ckpt CKPT --model HF_DIR --out OUT_DIR
    disagmoe-convert relayout --ckpt CKPT --model HF_DIR --out CKPT_1x3 --attention-gpus 1 --ffn-gpus 3

Every conversion runs a layout's ranks as CPU processes (``spawn_local``, gloo) through the same ``build_rank``,
``load_checkpoint`` and ``save_checkpoint`` as training, so what it writes is exactly what training writes and
reads. The HF model is loaded once in this process; the forked ranks share it copy-on-write.

``disagmoe-to-hf`` also exports checkpoints of co-located jobs (``run_pretrain.py --mode colocated``; the manifest
records the mode): their ranks are built with ``build_colocated_rank`` instead, and each rank's attention side and
expert slice are read like a disaggregated attention rank's and expert rank's. ``hf-to-disagmoe`` and ``relayout``
write and read disaggregated checkpoints only.

Between layouts the state travels as a ``TrainState``: full tensors under HF's in-memory names (expert slices are
rows of HF's fused expert tensors, joined by expert id), the fp32 master weights, the optimizer's per-element
state (Adam: exp_avg, exp_avg_sq) and its shared scalars (Adam: step), the LR scheduler and the engine counters.
With ZeRO 1/2 the masters and moments are read from and written to each rank's flat fp32 partition at the
parameter's ``_hp_mapping`` fragment, the addresses ``deepspeed.utils.safe_get_full_fp32_param`` uses; DeepSpeed's
``safe_*_optimizer_state`` helpers cannot be used here because they need the state fragments that only
``step()`` links, and a freshly built engine has no optimizer state to write into.

A checkpoint's manifest records the DeepSpeed config it was trained with (``save_checkpoint(..., ds_config=)``): it
is loaded again under its own ZeRO stage and precision. It also records what training froze (``--freeze-router``,
``--freeze-attention``): the ranks are built with the same parameters frozen, so the optimizer's parameter groups
match, and frozen parameters travel as their module weights without optimizer state. Before any rank starts, every
file of the checkpoint is checked against the size and sha256 in its manifest.

A re-layout carries the manifest's training entries (what was frozen, every lane's data position, the tokenizer
directory), so ``run_pretrain.py --resume`` continues the re-laid-out checkpoint where the source stood.
``hf-to-disagmoe`` writes step 0 with no data position (a resume starts at the beginning of the data), the HF
directory's tokenizer, and the freezing of ``--freeze-router`` / ``--freeze-attention`` for the run that resumes it.
The client state a re-layout carries is the manifest's (its int/float/str entries, e.g. ``step``): what
DeepSpeed's ``load_checkpoint`` returns as client state also holds DeepSpeed's own entries of the old layout.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from disagmoe_ds.config import SECTION, DisagMoEConfig, load_ds_config
from disagmoe_ds.engine.checkpoint import (
    DISAGGREGATED,
    LATEST,
    MANIFEST,
    load_checkpoint,
    model_fingerprint,
    read_manifest,
    resolve_tag,
    save_checkpoint,
    verify_files,
)
from disagmoe_ds.engine.ds_state import (
    TrainState,
    Weights,
    engine_extras,
    holds_read_copy,
    join_pieces,
    one_scalar_set,
    rank_share,
    set_rank_state,
)
from disagmoe_ds.errors import CheckpointError, DisagMoEError
from disagmoe_ds.models.families import family_of
from disagmoe_ds.models.hf_writer import TOKENIZER_FILES, write_hf
from disagmoe_ds.models.loading import load_config, load_model

if TYPE_CHECKING:
    from disagmoe_ds.colocated.layout import ColocatedConfig

# engine.build, engine.deepspeed_role, launch.local and disagmoe_ds.colocated import deepspeed (~5 s): they are
# imported where they are used, so that --help and bad arguments answer at once.

# Not "ds_config": DeepSpeed keeps its own entry of that name in the model-states file, and client state would
# replace it.
FIRST_TAG = "step0"
# Conversions of real models load and save many GiB per rank; a rank that fails still ends the job at once.
TIMEOUT_S = 3600.0
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
# Manifest entries of run_pretrain.py's checkpoints (train.checkpoints) that a re-layout carries unchanged.
TRAINING_ENTRIES = ("frozen", "data", "tokenizer")


# ----------------------------------------------------------------------------------------------------------------
# What travels between layouts
# ----------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Job:
    """One layout to run: the model directory, the layout and the user's DeepSpeed config (no ``disagmoe``).

    ``cfg`` is a co-located job's ``ColocatedConfig`` only for a checkpoint being exported to HF.
    """

    model_dir: str
    cfg: DisagMoEConfig | ColocatedConfig
    ds_config: dict[str, Any]
    frozen: dict[str, bool] = field(default_factory=dict)  # {"router": bool, "attention": bool}, as training froze

    @property
    def dtype(self) -> torch.dtype:
        return torch.bfloat16 if self.ds_config.get("bf16", {}).get("enabled") else torch.float32


@dataclass(frozen=True)
class Source:
    """A checkpoint opened for reading: where it is and the job that wrote it."""

    root: Path
    tag: str
    job: Job
    client_state: dict[str, Any]  # the manifest's copy: the trainer's int/float/str entries
    mode: str = DISAGGREGATED  # the manifest's: disaggregated or colocated
    extra: dict[str, Any] = field(default_factory=dict)  # the manifest's training entries: frozen, data, tokenizer

    @property
    def tokenizer_dir(self) -> Path | None:
        name = self.extra.get("tokenizer")
        return None if name is None else self.root / self.tag / name


def _without_section(ds_config: dict[str, Any]) -> dict[str, Any]:
    # The layout lives in the manifest; a stale "disagmoe" section would contradict a re-layout.
    return {k: v for k, v in ds_config.items() if k != SECTION}


# ----------------------------------------------------------------------------------------------------------------
# The three conversions
# ----------------------------------------------------------------------------------------------------------------


def hf_to_disagmoe(job: Job, out: str | Path, *, tag: str = FIRST_TAG) -> Path:
    """Write the weights of the HF directory ``job.model_dir`` as a checkpoint of ``job``'s layout (step 0)."""
    _refuse_checkpoint_as_model(job.model_dir)  # at once: before importing DeepSpeed (seconds, and a warning)
    from disagmoe_ds.launch.local import spawn_local

    _check_job(job)
    _refuse_existing(Path(out) / tag, "checkpoint tag")
    model = _job_model(job, require_weights=True)
    spawn_local(_save_initial_rank, job.cfg.world_size, args=(job, model, str(out), tag), timeout_s=TIMEOUT_S)
    return Path(out) / tag


def _job_model(job: Job, *, require_weights: bool = False) -> nn.Module:
    """The whole HF model the ranks cut their parts from, frozen as the job's training froze it."""
    from disagmoe_ds.train.model import freeze

    model = load_model(job.model_dir, dtype=job.dtype, require_weights=require_weights)
    freeze(model, router=job.frozen.get("router", False), attention=job.frozen.get("attention", False))
    return model


def disagmoe_to_hf(source: Source, out: str | Path) -> Path:
    """Write a checkpoint's module weights as an HF directory (``from_pretrained`` loads it), atomically.

    Either mode: ``source.job`` rebuilds the ranks of the disaggregated or co-located job that wrote it.
    """
    out = Path(out)
    _refuse_existing(out, "output directory")
    state = read_state(source, weights="module")
    tensors = {**state.params, **state.buffers}
    return write_hf(source.job.model_dir, tensors, out, dtype=source.job.dtype, tokenizer_dir=source.tokenizer_dir)


def relayout(source: Source, job: Job, out: str | Path) -> Path:
    """Write ``source`` under ``job``'s layout with the same masters, optimizer state, scheduler and step."""
    from disagmoe_ds.launch.local import spawn_local

    _require_disaggregated(source.root / source.tag, source.mode, "relayout")
    _check_job(job)
    _refuse_existing(Path(out) / source.tag, "checkpoint tag")
    state = read_state(source, weights="master")
    model = _job_model(job)
    target = (job, model, state, str(out), source.tag, source.extra, source.tokenizer_dir)
    spawn_local(_restore_rank, job.cfg.world_size, args=target, timeout_s=TIMEOUT_S)
    return Path(out) / source.tag


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
    records none (saved without ``ds_config``). ``command`` is the conversion that will read it: only
    disagmoe-to-hf reads co-located checkpoints; the others are refused here, before the co-located runtime (and
    DeepSpeed) is imported.
    """
    root = Path(root)
    if not root.is_dir():
        raise CheckpointError(f"checkpoint directory {root} does not exist; pass --ckpt the --out of a training run")
    tag = resolve_tag(root, tag)
    verify_files(root, tag)
    manifest = read_manifest(root, tag)
    _check_same_model(manifest, model_dir, root / tag)
    mode = manifest.get("mode", DISAGGREGATED)
    if command != "disagmoe-to-hf":
        _require_disaggregated(root / tag, mode, command)
    cfg = _recorded_cfg(mode, manifest["layout"], root / tag)
    recorded = manifest.get("ds_config")
    if recorded is None and ds_config is None:
        raise CheckpointError(
            f"checkpoint {root / tag} does not record its DeepSpeed config; pass --ds-config with the one it was "
            "trained with (its ZeRO stage and precision)"
        )
    frozen = dict(manifest.get("frozen") or {})
    job = Job(str(model_dir), cfg, _without_section(recorded if recorded is not None else ds_config), frozen)
    extra = {key: manifest[key] for key in TRAINING_ENTRIES if key in manifest}
    return Source(root, tag, job, dict(manifest["client_state"]), mode, extra)


def _recorded_cfg(mode: str, saved: dict[str, int], path: Path) -> DisagMoEConfig | ColocatedConfig:
    """The config that rebuilds the layout a manifest records (its ``manifest_layout`` values)."""
    if mode == DISAGGREGATED:
        keys = ("attention_gpus", "ffn_gpus", "depth", "expert_data_parallel")
        return DisagMoEConfig(**{key: saved[key] for key in keys})
    from disagmoe_ds.colocated.layout import ColocatedConfig, ColocatedLayout

    if mode != ColocatedLayout.mode:
        raise CheckpointError(f"checkpoint {path} was written by a {mode} job, a mode disagmoe-convert does not know")
    return ColocatedConfig(world_size=saved["world_size"], ep_size=saved["ep_size"])


def _require_disaggregated(path: Path, mode: str, command: str) -> None:
    if mode != DISAGGREGATED:
        raise CheckpointError(
            f"checkpoint {path} was written by a {mode} job; disagmoe-convert {command} handles disaggregated "
            f"checkpoints only (export it to HF with disagmoe-convert disagmoe-to-hf, or resume it with "
            f"run_pretrain.py --mode {mode})"
        )


def _refuse_checkpoint_as_model(model_dir: str | Path) -> None:
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


def _check_job(job: Job) -> None:
    """Fail in this process, before any rank starts, on a layout or DeepSpeed config that cannot run."""
    from disagmoe_ds.engine.build import preflight
    from disagmoe_ds.engine.deepspeed_role import role_ds_config

    preflight(job.model_dir, job.cfg, job.ds_config, job.cfg.world_size)
    role_ds_config(job.ds_config, micro_batches=job.cfg.micro_batches, micro_batch_size=1, dp_size=1)


def _refuse_existing(path: Path, what: str) -> None:
    if path.exists():
        raise CheckpointError(
            f"{what} {path} already exists; remove it or choose another --out (nothing is overwritten)"
        )


# ----------------------------------------------------------------------------------------------------------------
# Rank bodies (run by spawn_local in forked ranks)
# ----------------------------------------------------------------------------------------------------------------


def _build(job: Job, model: nn.Module):
    """This rank of ``job``, built as training builds it (collective)."""
    if isinstance(job.cfg, DisagMoEConfig):
        from disagmoe_ds.engine.build import build_rank as build
    else:
        from disagmoe_ds.colocated.build import build_colocated_rank as build

    return build(job.model_dir, job.ds_config, job.cfg, micro_batch_size=1, dtype=job.dtype, model=model)


def _save_initial_rank(rank: int, job: Job, model: nn.Module, out: str, tag: str) -> None:
    rt = _build(job, model)
    tokenizer = [name for name in TOKENIZER_FILES if (Path(job.model_dir) / name).is_file()]
    extra = {"frozen": job.frozen, **({"tokenizer": "tokenizer"} if tokenizer else {})}

    def attach(tag_dir: Path) -> None:
        (tag_dir / "tokenizer").mkdir()
        for name in tokenizer:
            shutil.copy2(Path(job.model_dir) / name, tag_dir / "tokenizer" / name)

    config = rt.module.config
    save_checkpoint(rt.engine, rt.role, rt.layout, config, out, tag, {"step": 0}, ds_config=job.ds_config,
                    manifest_extra=extra, attach=attach if tokenizer else None)  # fmt: skip


def _read_rank(rank: int, source: Source, model: nn.Module, weights: Weights) -> dict[str, Any]:
    """Load the checkpoint under its own layout; return this rank's share of the state (writers only)."""
    rt = _build(source.job, model)
    load_checkpoint(rt.engine, rt.role, rt.layout, rt.module.config, source.root, source.tag)
    share = rank_share(rt, weights)  # collective inside each data-parallel group: every rank runs it
    if not holds_read_copy(rt):
        return {}
    if rank == 0:
        share["extras"] = engine_extras(rt.engine)
    return share


def _restore_rank(
    rank: int,
    job: Job,
    model: nn.Module,
    state: TrainState,
    out: str,
    tag: str,
    extra: dict[str, Any],
    tokenizer_dir: Path | None,
) -> None:
    rt = _build(job, model)
    set_rank_state(rt, state)
    attach = (
        None if tokenizer_dir is None else lambda tag_dir: shutil.copytree(tokenizer_dir, tag_dir / extra["tokenizer"])
    )
    config = rt.module.config
    save_checkpoint(rt.engine, rt.role, rt.layout, config, out, tag, state.client_state, ds_config=job.ds_config,
                    manifest_extra=extra, attach=attach if tokenizer_dir else None)  # fmt: skip


# ----------------------------------------------------------------------------------------------------------------
# Reading: one rank's share, then the job's state
# ----------------------------------------------------------------------------------------------------------------


def read_state(source: Source, *, weights: Weights) -> TrainState:
    """Load ``source`` under its own layout and gather its state by HF name.

    Args:
        weights: "module" (the module weights, what an HF export holds) or "master" (fp32 masters, plus the
            optimizer state, the scheduler and the counters: what a re-layout carries).
    """
    from disagmoe_ds.launch.local import spawn_local

    model = _job_model(source.job)
    shares = spawn_local(_read_rank, source.job.cfg.world_size, args=(source, model, weights), timeout_s=TIMEOUT_S)
    shares = [s for s in shares if s]
    extras = next(s["extras"] for s in shares if "extras" in s)
    moments = {key: join_pieces([s["moments"].get(key, {}) for s in shares]) for key in shares[0]["moments"]}
    return TrainState(
        params=join_pieces([s["params"] for s in shares]),
        buffers=join_pieces([s["buffers"] for s in shares]),
        moments=moments,
        scalars=one_scalar_set([s["scalars"] for s in shares]),
        client_state=dict(source.client_state),
        **extras,
    )


# ----------------------------------------------------------------------------------------------------------------
# Command line
# ----------------------------------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="disagmoe-convert", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = p.add_subparsers(dest="command", required=True)
    to_ds = sub.add_parser("hf-to-disagmoe", help="HF directory -> DisagMoE checkpoint of a layout (step 0)")
    to_ds.add_argument("--model", required=True, help="HF model directory with weights")
    to_ds.add_argument("--out", required=True, help="checkpoint root to write (tag step0)")
    _add_layout_args(to_ds, ds_config_help="DeepSpeed config JSON (optimizer, scheduler, ZeRO, precision)")
    for part in ("router", "attention"):
        to_ds.add_argument(
            f"--freeze-{part}", action="store_true", help=f"for a run that resumes it with --freeze-{part}"
        )
    to_hf = sub.add_parser("disagmoe-to-hf", help="DisagMoE checkpoint (either mode) -> HF directory (original keys)")
    to_hf.add_argument("--ckpt", required=True, help="checkpoint root")
    to_hf.add_argument("--tag", help="tag to convert (default: the one named by <ckpt>/latest)")
    to_hf.add_argument("--model", required=True, help="HF directory (or config-only directory) of the model")
    to_hf.add_argument("--out", required=True, help="new HF directory")
    to_hf.add_argument("--ds-config", help="DeepSpeed config JSON, for checkpoints that do not record theirs")
    re = sub.add_parser("relayout", help="checkpoint -> checkpoint of another layout (weights + optimizer state)")
    re.add_argument("--ckpt", required=True, help="source checkpoint root")
    re.add_argument("--tag", help="tag to convert (default: latest); the output keeps the tag")
    re.add_argument("--model", required=True, help="HF directory (or config-only directory) of the model")
    re.add_argument("--out", required=True, help="destination checkpoint root")
    _add_layout_args(
        re,
        ds_config_help="DeepSpeed config JSON for the new layout (default: the source's); also used to read a "
        "source that records none",
    )
    return p


def _add_layout_args(p: argparse.ArgumentParser, *, ds_config_help: str) -> None:
    p.add_argument("--attention-gpus", type=int, required=True, help="M: attention ranks")
    p.add_argument("--ffn-gpus", type=int, required=True, help="N: FFN (expert) ranks")
    p.add_argument("--depth", type=int, default=1, help="p: A-groups = F-groups")
    p.add_argument("--expert-data-parallel", type=int, default=1, help="replicas of each expert shard")
    p.add_argument("--zero", type=int, choices=(0, 1, 2), help="ZeRO stage; overrides --ds-config")
    p.add_argument("--dtype", choices=sorted(DTYPES), help="training precision; overrides --ds-config")
    p.add_argument("--ds-config", help=ds_config_help)


def _layout_cfg(a: argparse.Namespace) -> DisagMoEConfig:
    return DisagMoEConfig(
        attention_gpus=a.attention_gpus,
        ffn_gpus=a.ffn_gpus,
        depth=a.depth,
        expert_data_parallel=a.expert_data_parallel,
    )


def resolve_ds_config(base: dict[str, Any] | None, *, zero: int | None, dtype: str | None) -> dict[str, Any]:
    """``base`` (or DeepSpeed's defaults) with the ``--zero`` / ``--dtype`` flags applied.

    >>> resolve_ds_config(None, zero=1, dtype="bf16")
    {'zero_optimization': {'stage': 1}, 'bf16': {'enabled': True}}
    """
    config = _without_section(json.loads(json.dumps(base or {})))
    if zero is not None:
        config.setdefault("zero_optimization", {})["stage"] = zero
    if dtype is not None:
        config["bf16"] = {"enabled": dtype == "bf16"}
    return config


def _run(a: argparse.Namespace) -> Path:
    ds_file = load_ds_config(a.ds_config) if a.ds_config else None
    if a.command == "hf-to-disagmoe":
        frozen = {"router": a.freeze_router, "attention": a.freeze_attention}
        job = Job(a.model, _layout_cfg(a), resolve_ds_config(ds_file, zero=a.zero, dtype=a.dtype), frozen)
        return hf_to_disagmoe(job, a.out)
    source = open_checkpoint(a.ckpt, a.model, tag=a.tag, ds_config=ds_file, command=a.command)
    if a.command == "disagmoe-to-hf":
        return disagmoe_to_hf(source, a.out)
    base = ds_file if ds_file is not None else source.job.ds_config
    job = replace(source.job, cfg=_layout_cfg(a), ds_config=resolve_ds_config(base, zero=a.zero, dtype=a.dtype))
    return relayout(source, job, a.out)


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    try:
        written = _run(a)
    except DisagMoEError as err:
        print(f"disagmoe-convert: error: {err}", file=sys.stderr)
        return 2
    print(f"disagmoe-convert: wrote {written}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
