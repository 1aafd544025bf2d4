"""disagmoe-convert: move a model between Hugging Face and DisagMoE-DS checkpoints, or re-lay out a checkpoint.

  hf-to-disagmoe   HF weights -> step 0 of a disaggregated checkpoint, for a run to start from with --resume
                   (run_pretrain.py --init-from HF_DIR starts from HF weights without this step)
  disagmoe-to-hf   a checkpoint of either mode -> an HF directory with the run's tokenizer, which
                   AutoModelForCausalLM and AutoTokenizer.from_pretrained load; a LoRA run's checkpoint -> its
                   PEFT adapter directory (base: --model, the run's --init-from), or --merged the merged model
  relayout         a checkpoint of either mode -> the same state under another layout of either mode (GPU split,
                   depth, ZeRO stage, precision; co-located pipeline stages with --mode colocated): weights,
                   optimizer state, scheduler, step and data position, so run_pretrain.py --resume with the new
                   layout continues the run exactly
  to-fp8           an HF directory -> the same model in FP8 blocks (DeepSeek-V3's checkpoint layout): a LoRA run
                   over it (--init-from) keeps its frozen base in FP8 on the ranks, about half a bf16 base's memory

examples:
    disagmoe-convert hf-to-disagmoe --model HF_DIR --out CKPT --attention-gpus 2 --ffn-gpus 2 [--zero 1]
    disagmoe-convert disagmoe-to-hf --ckpt CKPT --model HF_DIR --out OUT_DIR
    disagmoe-convert relayout --ckpt CKPT --model HF_DIR --out CKPT_1x4 --attention-gpus 1 --ffn-gpus 4
    disagmoe-convert relayout --ckpt CKPT --model HF_DIR --out CKPT_Z3 --attention-gpus 2 --ffn-gpus 2 \\
        --expert-data-parallel 2 --zero-stage 1 3
    disagmoe-convert relayout --ckpt CKPT --model HF_DIR --out CKPT_PP --mode colocated --world-size 4 --ep-size 2 \\
        --pp-size 2
    disagmoe-convert to-fp8 --model HF_DIR --out HF_DIR_FP8 [--block 128 128] [--device cuda]

Every conversion of a DisagMoE checkpoint runs the layout's ranks as processes on this machine's CPU, whatever the
layout's size: host memory must hold the whole model and every rank's optimizer state (to-fp8 streams one weight
file at a time). A checkpoint is read under the DeepSpeed config
it was trained with, after its files are checked against their recorded sizes and checksums. Nothing is
overwritten: an --out that exists is refused. `disagmoe-convert COMMAND --help` lists a command's options.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from disagmoe_ds.config import LAYOUT_KEYS, SIDES, DisagMoEConfig, add_section_flags, flag_of, load_ds_config
from disagmoe_ds.errors import ConfigError, DisagMoEError
from disagmoe_ds.train.flags import COLOCATED_FLAGS, MODES, layer_counts

_LAYOUT = "the layout that --attention-gpus, --ffn-gpus, --depth, --expert-data-parallel and the lane flags give"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="disagmoe-convert", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND", help="one of:")
    to_ds = sub.add_parser(
        "hf-to-disagmoe",
        help="HF directory -> step 0 of a DisagMoE checkpoint of a layout",
        description=f"Write the weights of an HF directory as step 0 of a disaggregated checkpoint for {_LAYOUT}.",
    )
    to_ds.add_argument("--model", required=True, help="HF model directory with weights (written by save_pretrained)")
    to_ds.add_argument("--out", required=True, help="checkpoint root to write (tag step0)")
    _add_layout_args(
        to_ds,
        ds_config_help="DeepSpeed config JSON (optimizer, scheduler, ZeRO, precision)",
        zero_stage_default="both sides at --zero's stage, else at the --ds-config's zero_optimization.stage, else 0",
        zero_help="ZeRO stage of both sides; overrides the --ds-config's zero_optimization.stage",
    )
    for part in ("router", "attention"):
        to_ds.add_argument(
            f"--freeze-{part}", action="store_true", help=f"for a run that resumes it with --freeze-{part}"
        )
    to_hf = sub.add_parser(
        "disagmoe-to-hf",
        help="DisagMoE checkpoint (either mode) -> HF directory",
        description="Write a checkpoint's weights and tokenizer as an HF directory with the model's original keys.",
    )
    to_hf.add_argument("--ckpt", required=True, help="checkpoint root (run_pretrain.py's --save-dir)")
    to_hf.add_argument("--tag", help="tag to convert, e.g. step500 (default: the newest, named by CKPT/latest)")
    to_hf.add_argument("--model", required=True, help="the HF directory (weights not needed) the run trained")
    to_hf.add_argument("--out", required=True, help="new HF directory")
    to_hf.add_argument("--ds-config", help="DeepSpeed config JSON, for checkpoints that do not record theirs")
    to_hf.add_argument(
        "--merged",
        action="store_true",
        help="a LoRA checkpoint: write the model with its adapters merged (default: a PEFT adapter directory "
        "whose base is --model, which must then hold the weights the run started from)",
    )
    re = sub.add_parser(
        "relayout",
        help="checkpoint -> checkpoint of another layout (weights + optimizer state)",
        description=f"Write a checkpoint (either mode) again for {_LAYOUT}, or with --mode colocated for a "
        "co-located layout (--world-size, --ep-size, --pp-size, --virtual-stages, --stage-layers), with its "
        "optimizer state, scheduler, step and data position.",
    )
    re.add_argument("--ckpt", required=True, help="source checkpoint root (run_pretrain.py's --save-dir)")
    re.add_argument("--tag", help="tag to convert (default: the newest); the output keeps the tag")
    re.add_argument("--model", required=True, help="the HF directory (weights not needed) the run trained")
    re.add_argument("--out", required=True, help="destination checkpoint root")
    re.add_argument("--mode", choices=MODES, default="disaggregated", help="the new layout's mode")
    for name, text in COLOCATED_FLAGS.items():
        re.add_argument(flag_of(name), type=layer_counts if name == "stage_layers" else int, help=text)
    _add_layout_args(
        re,
        required=(),
        without_default=("attention_gpus", "ffn_gpus"),  # a disaggregated target names both (_relayout_cfg)
        ds_config_help="DeepSpeed config JSON for the new layout (default: the source's); also used to read a "
        "source that records none",
        zero_stage_default="the source's per-side stages; with --zero, or for a source without them, both sides at "
        "zero_optimization.stage",
        zero_help="ZeRO stage of both sides, in place of the source's per-side stages; overrides the --ds-config's "
        "zero_optimization.stage",
    )
    fp8 = sub.add_parser(
        "to-fp8",
        help="HF directory -> the same model in FP8 blocks (a LoRA base kept in FP8)",
        description="Write an HF directory's decoder-layer projections as e4m3 with a float32 scale per block "
        "(DeepSeek-V3's layout and quantization_config); embeddings, LM head, norms and routers as they are.",
    )
    fp8.add_argument("--model", required=True, help="HF model directory with safetensors weights")
    fp8.add_argument("--out", required=True, help="new HF directory")
    fp8.add_argument(
        "--block", type=int, nargs=2, default=[128, 128], metavar=("ROWS", "COLS"), help="block shape (DeepSeek's)"
    )
    fp8.add_argument("--device", default="cpu", help="where to quantize (cuda: faster on a large model)")
    return p


def _add_layout_args(
    p: argparse.ArgumentParser,
    *,
    ds_config_help: str,
    zero_stage_default: str,
    zero_help: str,
    required: tuple[str, ...] = ("attention_gpus", "ffn_gpus"),
    without_default: tuple[str, ...] = (),
) -> None:
    add_section_flags(
        p,
        (*LAYOUT_KEYS, "zero_stage"),
        cli="convert",
        required=required,
        without_default=without_default,
        notes={"zero_stage": zero_stage_default},
    )
    p.add_argument("--zero", type=int, choices=(0, 1, 2), help=zero_help)
    p.add_argument("--dtype", choices=("bf16", "fp32"), help="training precision; overrides --ds-config")
    p.add_argument("--ds-config", help=ds_config_help)


def _layout_cfg(a: argparse.Namespace, source_stages: dict[str, int] | None = None) -> DisagMoEConfig:
    """The new layout; its per-side ZeRO stages: ``--zero-stage``, else none under ``--zero``, else the source's."""
    if a.zero_stage is not None:
        stages = dict(zip(SIDES, a.zero_stage, strict=True))
    else:
        stages = {} if a.zero is not None else dict(source_stages or {})
    return DisagMoEConfig(**{key: getattr(a, key) for key in LAYOUT_KEYS}, zero_stage=stages)


def _run(a: argparse.Namespace) -> Path:
    # Imported once the command line is read: --help loads neither torch nor DeepSpeed.
    if a.command == "to-fp8":  # torch and safetensors only
        from disagmoe_ds.checkpoint.fp8_blocks import to_fp8_blocks

        out = Path(a.out)
        if out.exists():
            raise ConfigError(f"--out {out} exists; nothing is overwritten")
        count = to_fp8_blocks(Path(a.model), out, block=tuple(a.block), device=a.device)
        print(f"disagmoe-convert: {count} weights in FP8 blocks of {a.block[0]} x {a.block[1]}")
        return out
    from disagmoe_ds.train.conversion import disagmoe_to_hf, hf_to_disagmoe, relayout
    from disagmoe_ds.train.conversion_jobs import Job, open_checkpoint, resolve_ds_config

    ds_file = load_ds_config(a.ds_config) if a.ds_config else None
    if a.command == "hf-to-disagmoe":
        frozen = {"router": a.freeze_router, "attention": a.freeze_attention}
        job = Job(a.model, _layout_cfg(a), resolve_ds_config(ds_file, zero=a.zero, dtype=a.dtype), frozen)
        return hf_to_disagmoe(job, a.out)
    source = open_checkpoint(a.ckpt, a.model, tag=a.tag, ds_config=ds_file, command=a.command)
    if a.command == "disagmoe-to-hf":
        return disagmoe_to_hf(source, a.out, merged=a.merged)
    base = ds_file if ds_file is not None else source.job.ds_config
    recorded = source.job.cfg
    cfg = _colocated_cfg(a) if a.mode == "colocated" else _relayout_cfg(a, recorded)
    job = Job(source.job.model_dir, cfg, resolve_ds_config(base, zero=a.zero, dtype=a.dtype), source.job.frozen)
    return relayout(source, job, a.out)


def _relayout_cfg(a: argparse.Namespace, recorded: object) -> DisagMoEConfig:
    """The disaggregated target: the layout flags (both GPU counts needed), the source's per-side stages if it
    has them."""
    missing = [flag_of(key) for key in ("attention_gpus", "ffn_gpus") if getattr(a, key) is None]
    if missing:
        raise ConfigError(f"relayout to a disaggregated layout needs {' and '.join(missing)} (or --mode colocated)")
    return _layout_cfg(a, recorded.zero_stage if isinstance(recorded, DisagMoEConfig) else None)


def _colocated_cfg(a: argparse.Namespace):
    """The co-located target (pipeline stages included); a conversion steps nothing, so its micro-batches are only
    what interleaved stages need (a multiple of the stages)."""
    from disagmoe_ds.colocated.layout import ColocatedConfig  # imports DeepSpeed (seconds)

    if a.world_size is None:
        raise ConfigError("relayout --mode colocated needs --world-size")
    pp = a.pp_size or 1
    return ColocatedConfig(
        world_size=a.world_size,
        ep_size=a.ep_size,
        pp_size=pp,
        virtual_stages=a.virtual_stages or 1,
        stage_layers=a.stage_layers,
        tensor_parallel=a.tensor_parallel or 1,  # the head shards a rank saves; Ulysses changes no saved tensor
        micro_batches=pp,
    )


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
