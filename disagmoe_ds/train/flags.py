"""The flags of ``run_pretrain.py``, in the groups ``--help`` shows them; ``train.args`` turns them into ``TrainArgs``.

DeepSpeed's conventions come first: ``--deepspeed_config`` (as ``deepspeed.add_config_arguments`` names it) names the
ds_config and ``--local_rank`` (appended by the ``deepspeed`` launcher) is accepted.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from disagmoe_ds.config import LAYOUT_KEYS, add_section_flags, flag_of
from disagmoe_ds.models.lora_settings import add_lora_args

PRECISIONS = ("bf16", "fp32")  # --dtype (train.args maps them to torch dtypes)
MODES = ("disaggregated", "colocated")
DEFAULT_MICRO_BATCH_SIZE = 4
# --mode colocated only: the job's ranks and how they share the experts.
COLOCATED_FLAGS = {
    "world_size": "colocated: ranks in the job [the ds_config's disagmoe.colocated.world_size, else the launcher's "
    "world size, else 1]",
    "ep_size": "colocated: ranks of a pipeline stage that share one copy of its experts; divides the stage's ranks "
    "and the expert count [disagmoe.colocated.ep_size, else the largest that does]",
    "pp_size": "colocated: pipeline stages over the decoder layers, run 1F1B; divides --world-size "
    "[disagmoe.colocated.pp_size, else 1]",
    "virtual_stages": "colocated: chunks of layers per pipeline stage, run as Megatron's interleaved 1F1B "
    "(micro-batches a multiple of --pp-size) [disagmoe.colocated.virtual_stages, else 1]",
    "stage_layers": "colocated: decoder layers per (virtual) pipeline stage, in execution order, e.g. 5,6,6,5 "
    "[disagmoe.colocated.stage_layers, else as even as they go]",
}


def layer_counts(text: str) -> tuple[int, ...]:
    """``--stage-layers``'s value: comma-separated layer counts."""
    try:
        return tuple(int(n) for n in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated layer counts like 2,3, got {text!r}") from None


# Section keys as flags (config.SECTION_FLAGS), each replacing the key of its name in the ds_config's "disagmoe"
# section: the layout's in --mode disaggregated only (but the lanes', which in --mode colocated replace
# disagmoe.colocated's), micro_batches, fp8 and attention in both modes.
LAYOUT_FLAGS = LAYOUT_KEYS
LANE_KEYS = ("sequence_parallel", "tensor_parallel")
BOTH_MODES_KEYS = ("micro_batches", "fp8", "attention")
SECTION_KEYS = (*LAYOUT_KEYS, *BOTH_MODES_KEYS)

_EPILOG = """\
Every setting not given as a flag comes from --deepspeed_config: its "disagmoe" section holds the layout (the
layout flags override its keys), the rest is DeepSpeed's own config (optimizer, scheduler, ZeRO stage, precision;
--lr, --zero and --dtype override those). ds_configs/ holds examples; `disagmoe-plan --write-ds-config` writes one
for a model and a cluster.
"""


class _HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Keeps the description's layout (the launch lines) and shows defaults that are not None/False."""

    def _get_help_string(self, action: argparse.Action) -> str:
        if action.default in (None, False, "", argparse.SUPPRESS) or "%(default)" in (action.help or ""):
            return action.help or ""
        return f"{action.help} (default: %(default)s)"


def default_model(root: Path) -> Path:
    """The embedded default model (``root``: the directory of run_pretrain.py)."""
    return root / "hf_models" / "tiny-qwen3-moe-lm"


def read_command_line(argv: list[str], *, root: Path, description: str) -> argparse.Namespace:
    """The flags as given (``train.args.resolve_command_line`` derives the run's settings from them); ``--help`` and
    a malformed flag end here, before anything loads torch. ``root``: where hf_models/, ds_configs/ and .cache/ hold
    the defaults."""
    parser = build_parser(
        description=description,
        default_model=default_model(root),
        default_ds_config=root / "ds_configs" / "tiny-cpu.json",
        default_cache=root / ".cache" / "tokenizers",
    )
    return parser.parse_args(argv)


def build_parser(
    *, description: str, default_model: Path, default_ds_config: Path, default_cache: Path
) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="run_pretrain.py", description=description, epilog=_EPILOG, formatter_class=_HelpFormatter
    )
    _model_and_data(p.add_argument_group("model and data"), default_model, default_cache)
    _layout(p.add_argument_group('layout (overrides the ds_config\'s "disagmoe" section)'))
    _optimisation(p.add_argument_group("optimisation"))
    _fine_tuning(p.add_argument_group("fine-tuning"))
    add_lora_args(p, verify=False)
    _checkpoints(p.add_argument_group("checkpoints"))
    _evaluation(p.add_argument_group("evaluation (the LM loss on held-out data)"))
    _output(p.add_argument_group("output"))
    _launch(p.add_argument_group("launch"))
    _deepspeed(p.add_argument_group("DeepSpeed"), default_ds_config)
    return p


def _deepspeed(g: argparse._ArgumentGroup, default_ds_config: Path) -> None:
    """``deepspeed.add_config_arguments``' flags, made here: building the parser (and so ``--help``) loads neither
    DeepSpeed nor torch."""
    g.add_argument("--deepspeed_config", default=str(default_ds_config), help="the DeepSpeed JSON config")
    g.add_argument("--deepspeed", action="store_true", help="accepted, as DeepSpeed scripts take it; no effect")
    g.add_argument("--deepscale", action="store_true", help=argparse.SUPPRESS)  # DeepSpeed's deprecated names
    g.add_argument("--deepscale_config", help=argparse.SUPPRESS)


def _model_and_data(g: argparse._ArgumentGroup, default_model: Path, default_cache: Path) -> None:
    g.add_argument(
        "--model",
        type=Path,
        help=f"the model to train: an HF model directory, of which only config.json is read (training starts from "
        f"fresh weights; see --init-from) [{default_model}]",
    )
    g.add_argument(
        "--init-from",
        type=Path,
        metavar="HF_DIR",
        help="start from the pretrained weights in HF_DIR (written by save_pretrained; from safetensors each rank "
        "reads only the tensors it holds; a checkpoint in FP8 blocks, DeepSeek-V3's, is dequantized exactly, or with "
        "--lora-rank its base stays FP8 on the ranks); its config is the model, --model is then not needed",
    )
    g.add_argument(
        "--data",
        help="training data: .txt/.jsonl/.parquet file or directory (.gz ok), or a hub "
        "dataset 'hf:owner/name' [the bundled Jane Austen corpus]",
    )
    g.add_argument("--text-field", default="text", help="field holding the document in .jsonl/.parquet/hub rows")
    g.add_argument(
        "--txt-documents",
        choices=("block", "file"),
        default="block",
        help=".txt data: each blank-line-separated block is a document (block), or each whole file is (file)",
    )
    g.add_argument(
        "--tokenizer",
        default="auto",
        help="'auto': the model directory's HF tokenizer when it has one, else a SentencePiece model trained on "
        "--data and cached; 'sentencepiece': always the latter; or a path to an HF tokenizer directory or a "
        "SentencePiece .model file",
    )
    g.add_argument(
        "--vocab-size",
        type=int,
        help="vocabulary of a trained SentencePiece tokenizer (at most the model's vocab_size) [the model's "
        "vocab_size]",
    )
    g.add_argument("--tokenizer-cache", type=Path, default=default_cache, help="where trained tokenizers are kept")
    g.add_argument("--seq-len", type=int, default=128, help="tokens per packed sample (<= max_position_embeddings)")


def _layout(g: argparse._ArgumentGroup) -> None:
    g.add_argument(
        "--mode",
        choices=MODES,
        help="disaggregated: attention and experts on disjoint GPUs, pipelined against each other (AF-Pipe); "
        "colocated: every GPU holds the attention layers and a slice of the experts (expert + data parallel, "
        "all-to-all dispatch): runs on one GPU, and is the baseline to compare with [colocated where the "
        'ds_config\'s "disagmoe" section holds "colocated", else disaggregated]',
    )
    for name, text in COLOCATED_FLAGS.items():  # the co-located layout's keys, not the section's
        g.add_argument(flag_of(name), type=layer_counts if name == "stage_layers" else int, help=text)
    add_section_flags(g, SECTION_KEYS, cli="run_pretrain")


def _optimisation(g: argparse._ArgumentGroup) -> None:
    g.add_argument(
        "--steps",
        type=int,
        default=200,
        help="optimizer steps of the whole run (a resumed run continues to this step); also fills the scheduler's "
        "total_num_steps when it has none",
    )
    g.add_argument(
        "--micro-batch-size",
        type=int,
        help=f"sequences per micro-batch [ds_config train_micro_batch_size_per_gpu, else {DEFAULT_MICRO_BATCH_SIZE}]",
    )
    g.add_argument(
        "--lr",
        type=float,
        help="peak learning rate: sets the ds_config optimizer's lr (and warmup_max_lr of WarmupLR/WarmupDecayLR) "
        "[the ds_config's]",
    )
    g.add_argument(
        "--zero",
        type=int,
        choices=(0, 1, 2),
        help="ZeRO stage of the attention and expert engines: sets zero_optimization.stage [the ds_config's]",
    )
    g.add_argument(
        "--dtype",
        choices=sorted(PRECISIONS),
        help="parameter dtype; bf16 sets bf16.enabled [bf16 when the ds_config enables it, else fp32]",
    )
    g.add_argument("--seed", type=int, default=0, help="model initialisation, data order and per-step RNG")
    g.add_argument(
        "--bias-update-rate",
        type=float,
        help="DeepSeek-V3 auxiliary-loss-free balancing: after every step each router's e_score_correction_bias "
        "moves by rate * sign(mean load - load); 0 disables [1e-3 for routers with that bias, else 0]",
    )


def _fine_tuning(g: argparse._ArgumentGroup) -> None:
    g.add_argument(
        "--sft",
        action="store_true",
        help="--data holds prompt/response (or messages) JSONL rows; the loss covers the responses only (chat "
        "template of the tokenizer when it has one)",
    )
    g.add_argument("--prompt-field", default="prompt", help="--sft: field of the prompt in prompt/response rows")
    g.add_argument("--response-field", default="response", help="--sft: field of the response")
    g.add_argument("--messages-field", default="messages", help="--sft: field of the chat list in messages rows")
    g.add_argument(
        "--sft-truncate",
        action="store_true",
        help="--sft: cut an example longer than --seq-len to its first --seq-len tokens (default: refuse it)",
    )
    kept = "(recorded in checkpoints: a resume keeps it)"
    g.add_argument("--freeze-router", action="store_true", help=f"keep every MoE router's weights fixed {kept}")
    g.add_argument(
        "--freeze-attention",
        action="store_true",
        help=f"keep every layer's self-attention (q/k/v/o projections and their norms) fixed {kept}",
    )


def _checkpoints(g: argparse._ArgumentGroup) -> None:
    g.add_argument("--save-dir", type=Path, help="checkpoint root; none: the run saves nothing, not even on Ctrl-C")
    g.add_argument("--save-every", type=int, default=0, help="save every N steps (0: only at the end)")
    g.add_argument("--keep-last", type=int, default=3, help="keep the N newest checkpoints (0: keep all)")
    g.add_argument(
        "--export-hf",
        type=Path,
        metavar="DIR",
        help="also write the model as a save_pretrained directory with its tokenizer (AutoModelForCausalLM and "
        "AutoTokenizer.from_pretrained load it): at the end and with every --save-every checkpoint, replacing DIR; "
        "with --lora-rank a PEFT adapter directory (PeftModel.from_pretrained(base, DIR) loads it)",
    )
    g.add_argument(
        "--export-hf-merged",
        type=Path,
        metavar="DIR",
        help="with --lora-rank: also write the model with the adapters merged into its weights, as --export-hf does",
    )
    g.add_argument(
        "--resume",
        nargs="?",
        const="",
        metavar="CKPT",
        help="continue a run exactly: alone, from the newest complete checkpoint in --save-dir; or from CKPT (a "
        "checkpoint root or ROOT/TAG)",
    )


def _evaluation(g: argparse._ArgumentGroup) -> None:
    g.add_argument(
        "--eval-data",
        metavar="PATH",
        help="held-out data, in any form --data takes (with --sft: SFT rows, prompts masked), tokenised and packed as "
        "the training data; without --eval-every, evaluated after the last step",
    )
    g.add_argument(
        "--eval-split",
        type=float,
        metavar="F",
        help="hold out this fraction of --data's samples (chosen by --seed; never trained on, so a resume needs the "
        "same F) instead of --eval-data [none: every sample trains]",
    )
    g.add_argument(
        "--eval-every",
        type=int,
        metavar="N",
        help="evaluate every N steps and after the last (needs --eval-data or --eval-split): the mean LM loss over "
        "the held-out tokens, beside the training loss in the log, --metrics-file (eval_loss) and --tensorboard",
    )
    g.add_argument(
        "--eval-steps",
        type=int,
        metavar="K",
        help="evaluate the first K held-out batches of one step's size (lanes x micro-batches x micro-batch size "
        "sequences), the same ones every time [all of them]",
    )
    g.add_argument(
        "--eval-only",
        action="store_true",
        help="evaluate the weights of --init-from or --resume once, print the loss and exit: no training, nothing "
        "written but --metrics-file and --tensorboard",
    )


def _output(g: argparse._ArgumentGroup) -> None:
    g.add_argument("--metrics-file", type=Path, help="append one JSON line per step")
    g.add_argument("--tensorboard", type=Path, metavar="DIR", help="TensorBoard event directory (needs tensorboard)")
    g.add_argument(
        "--timeline", type=Path, metavar="PATH", help="Chrome/Perfetto trace of every rank for the run's second step"
    )
    g.add_argument("--log-every", type=int, default=10, help="steps between log lines when stderr is no terminal")
    g.add_argument("--peak-tflops", type=float, help="peak dense bf16 TFLOP/s of one device, for MFU [known GPUs]")


def _launch(g: argparse._ArgumentGroup) -> None:
    g.add_argument(
        "--hostfile",
        type=Path,
        help="validate this DeepSpeed hostfile, then re-run this command under 'deepspeed --hostfile HOSTFILE'",
    )
    g.add_argument(
        "--launcher-args",
        default="",
        help="extra 'deepspeed' launcher arguments with --hostfile, e.g. '--no_ssh_check --master_addr 127.0.0.1' "
        "on one host without ssh",
    )
    g.add_argument(
        "--check-hostfile",
        type=Path,
        metavar="HOSTFILE",
        help="validate a hostfile against the layout's world size and exit",
    )
    g.add_argument("--local_rank", type=int, help="set by the deepspeed launcher; the rank is read from the env")
