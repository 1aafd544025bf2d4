"""``disagmoe-convert``'s three conversions: HF -> checkpoint, checkpoint -> HF, checkpoint -> other layout.

Every conversion runs a layout's ranks as CPU processes (``spawn_local``, gloo) through the same ``build_rank``
(``build_colocated_rank`` for a co-located checkpoint), ``load_checkpoint`` and ``save_checkpoint`` as training, so
what it writes is exactly what training writes and reads. The HF model is loaded once in this process; the forked
ranks share it copy-on-write.

Between layouts the state travels as an ``checkpoint.ds_state.TrainState``: full tensors under HF's in-memory names,
the fp32 master weights, the optimizer's state, the LR scheduler and the engine counters. Frozen parameters travel
as their module weights without optimizer state.

A re-layout carries the manifest's training entries (what was frozen, every lane's data position, the tokenizer
directory), so ``run_pretrain.py --resume`` continues the re-laid-out checkpoint where the source stood.
``hf-to-disagmoe`` writes step 0 with no data position (a resume starts at the beginning of the data), the HF
directory's tokenizer, and the freezing of ``--freeze-router`` / ``--freeze-attention`` for the run that resumes it.
The client state a re-layout carries is the manifest's (its int/float/str entries, e.g. ``step``): what
DeepSpeed's ``load_checkpoint`` returns as client state also holds DeepSpeed's own entries of the old layout.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from torch import nn

from disagmoe_ds.checkpoint.ds_state import TrainState, Weights, gather_state, read_share, set_rank_state
from disagmoe_ds.checkpoint.manifest import WEIGHTS_ONLY, load_checkpoint, save_checkpoint
from disagmoe_ds.config import DisagMoEConfig
from disagmoe_ds.errors import CheckpointError
from disagmoe_ds.models.hf_writer import TOKENIZER_FILES, copy_into, present_files
from disagmoe_ds.models.loading import load_model
from disagmoe_ds.train.conversion_jobs import AnyJob, Job, Source, refuse_checkpoint_as_model

if TYPE_CHECKING:
    from disagmoe_ds.runtime.rank import RankRuntime

# afpipe.build, runtime.deepspeed_role, launch.local, train.model and disagmoe_ds.colocated import DeepSpeed (~5 s):
# they are imported where they are used, so that --help and bad arguments answer at once.

FIRST_TAG = "step0"
TOKENIZER_DIR = "tokenizer"  # under the tag, as checkpoint.resume names it
# Conversions of real models load and save many GiB per rank; a rank that fails still ends the job at once.
TIMEOUT_S = 3600.0


def hf_to_disagmoe(job: Job[DisagMoEConfig], out: str | Path, *, tag: str = FIRST_TAG) -> Path:
    """Write the weights of the HF directory ``job.model_dir`` as a checkpoint of ``job``'s layout (step 0)."""
    refuse_checkpoint_as_model(job.model_dir)  # at once: before importing DeepSpeed (seconds, and a warning)
    from disagmoe_ds.launch.local import spawn_local

    # Weights only: the run that resumes it makes its own optimizer and scheduler, so none is built here (a
    # scheduler that needs the run's length, as WarmupCosineLR does, could not be).
    job = replace(job, ds_config={k: v for k, v in job.ds_config.items() if k != "scheduler"})
    _check_job(job)
    _refuse_existing(Path(out) / tag, "checkpoint tag")
    model = _job_model(job, require_weights=True)
    spawn_local(_save_initial_rank, job.cfg.world_size, args=(job, model, str(out), tag), timeout_s=TIMEOUT_S)
    return Path(out) / tag


def disagmoe_to_hf(source: Source, out: str | Path, *, merged: bool = False) -> Path:
    """Write a checkpoint's module weights as an HF directory (``from_pretrained`` loads it), atomically.

    Either mode: ``source.job`` rebuilds the ranks of the disaggregated or co-located job that wrote it. A LoRA
    checkpoint holds only its adapters: the ranks put them over the base weights of ``source.job.model_dir`` (the
    run's ``--init-from``), and the output is a PEFT adapter directory, or with ``merged`` the merged model.
    """
    from disagmoe_ds.checkpoint.export import write_model

    out, job = Path(out), source.job
    lora = job.cfg.lora
    if merged and lora is None:
        raise CheckpointError(
            f"--merged merges a LoRA run's adapters, and checkpoint {source.root / source.tag} holds none; "
            "leave --merged out"
        )
    _refuse_existing(out, "output directory")
    state = read_state(source, weights="module")
    tensors = {**state.params, **state.buffers}
    return write_model(
        tensors, Path(job.model_dir), out, dtype=job.dtype, lora=lora, merged=merged, tokenizer_dir=source.tokenizer_dir
    )


def relayout(source: Source, job: AnyJob, out: str | Path) -> Path:
    """Write ``source`` (either mode) under ``job``'s layout (either mode) with the same masters, optimizer state,
    scheduler and step."""
    from disagmoe_ds.launch.local import spawn_local

    _check_job(job)
    _refuse_existing(Path(out) / source.tag, "checkpoint tag")
    state = read_state(source, weights="master")
    model = _job_model(job)
    target = (job, model, state, str(out), source.tag, source.extra, source.tokenizer_dir)
    spawn_local(_restore_rank, job.cfg.world_size, args=target, timeout_s=TIMEOUT_S)
    return Path(out) / source.tag


def read_state(source: Source, *, weights: Weights) -> TrainState:
    """Load ``source`` under its own layout and gather its state by HF name.

    Args:
        weights: "module" (the module weights, what an HF export holds) or "master" (fp32 masters, plus the
            optimizer state, the scheduler and the counters: what a re-layout carries).
    """
    from disagmoe_ds.launch.local import spawn_local

    model = _job_model(source.job)
    shares = spawn_local(_read_rank, source.job.cfg.world_size, args=(source, model, weights), timeout_s=TIMEOUT_S)
    return gather_state(shares, source.client_state)


def _job_model(job: AnyJob, *, require_weights: bool = False) -> nn.Module:
    """The whole HF model the ranks cut their parts from, frozen as the job's training froze it."""
    from disagmoe_ds.train.model import freeze

    model = load_model(job.model_dir, dtype=job.dtype, require_weights=require_weights)
    freeze(model, router=job.frozen.get("router", False), attention=job.frozen.get("attention", False))
    return model


def _check_job(job: AnyJob) -> None:
    """Fail in this process, before any rank starts, on a layout or DeepSpeed config that cannot run."""
    from disagmoe_ds.afpipe.build import preflight
    from disagmoe_ds.runtime.deepspeed_role import role_ds_config

    if not isinstance(job.cfg, DisagMoEConfig):
        from disagmoe_ds.colocated.build import preflight_colocated

        preflight_colocated(job.model_dir, job.cfg, job.ds_config, job.cfg.world_size)
        return
    preflight(job.model_dir, job.cfg, job.ds_config, job.cfg.world_size)  # each side's ZeRO stage too
    for stage in sorted(set(job.cfg.zero_stages(job.ds_config).values())):  # what DeepSpeed would refuse
        role_ds_config(job.ds_config, micro_batches=job.cfg.micro_batches, micro_batch_size=1, dp_size=1, stage=stage)


def _refuse_existing(path: Path, what: str) -> None:
    if path.exists():
        raise CheckpointError(
            f"{what} {path} already exists; remove it or choose another --out (nothing is overwritten)"
        )


# ----- rank bodies (run by spawn_local in forked ranks) -----


def _build(job: AnyJob, model: nn.Module) -> RankRuntime:
    """This rank of ``job``, built as training builds it (collective)."""
    if isinstance(job.cfg, DisagMoEConfig):
        from disagmoe_ds.afpipe.build import build_rank

        return build_rank(job.model_dir, job.ds_config, job.cfg, micro_batch_size=1, dtype=job.dtype, model=model)
    from disagmoe_ds.colocated.build import build_colocated_rank

    return build_colocated_rank(job.model_dir, job.ds_config, job.cfg, micro_batch_size=1, dtype=job.dtype, model=model)


def _save_initial_rank(rank: int, job: Job[DisagMoEConfig], model: nn.Module, out: str, tag: str) -> None:
    rt = _build(job, model)
    tokenizer = present_files(job.model_dir, TOKENIZER_FILES)

    def attach(tag_dir: Path) -> None:
        copy_into(tokenizer, tag_dir / TOKENIZER_DIR)

    extra = {"frozen": job.frozen, WEIGHTS_ONLY: True, **({"tokenizer": TOKENIZER_DIR} if tokenizer else {})}
    _save(rt, job, out, tag, {"step": 0}, extra, attach if tokenizer else None)


def _read_rank(rank: int, source: Source, model: nn.Module, weights: Weights) -> dict[str, Any]:
    """Load the checkpoint under its own layout; return this rank's share of the state (rank 0: with extras)."""
    rt = _build(source.job, model)
    load_checkpoint(rt.engine, rt.role, rt.layout, rt.module.config, source.root, source.tag)
    return read_share(rt, weights, extras=rank == 0)


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
    attach = None if tokenizer_dir is None else _tree_copier(tokenizer_dir, extra["tokenizer"])
    _save(rt, job, out, tag, state.client_state, extra, attach)


def _tree_copier(src: Path, name: str) -> Callable[[Path], None]:
    """What ``save_checkpoint`` calls to put the directory ``src`` under the tag as ``name``."""

    def attach(tag_dir: Path) -> None:
        shutil.copytree(src, tag_dir / name)

    return attach


def _save(
    rt: RankRuntime,
    job: AnyJob,
    out: str,
    tag: str,
    client_state: dict[str, Any],
    extra: dict[str, Any],
    attach: Callable[[Path], None] | None,
) -> None:
    """Save this rank under ``out/tag`` with the job's ds_config and the manifest's training entries (collective)."""
    config = rt.module.config
    save_checkpoint(rt.engine, rt.role, rt.layout, config, out, tag, client_state, ds_config=job.ds_config,
                    manifest_extra=extra, attach=attach)  # fmt: skip
