"""The run's training and held-out samples: which tokenizer, which datasets, and each lane's resumable loader.

Only the lanes of A-group 0 read data (they hold the embedding; in co-located mode every rank is such a lane);
lane j of d reads lane j's share of every epoch (``ShardedSampler``), so the d lanes together see each sample once
per epoch. Without a launcher the parent process builds the datasets once and the forked ranks inherit them; under
a launcher each lane builds them (deterministically: the same samples on every lane). The held-out samples of the
evaluation loss are ``--eval-data``'s, tokenised and packed as ``--data``'s, or the ``--eval-split`` fraction of
``--data``'s samples (``data.held_out``), which the run then never trains on.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import cast

from disagmoe_ds.data import (
    BYTE_FALLBACK_MIN,
    DataError,
    HeldOutBatches,
    MicroBatchLoader,
    PackedDataset,
    SentencePieceTokenizer,
    ShardedSampler,
    Tokenizer,
    build_pretrain_dataset,
    build_sft_dataset,
    bundled_corpus,
    check_seq_len,
    check_vocab,
    hold_out,
    labelled_tokens,
    load_hf_tokenizer,
    load_sft_examples,
    resolve_files,
    train_or_load_tokenizer,
)
from disagmoe_ds.data.sources import TxtUnit, is_hub_spec
from disagmoe_ds.train.args import TrainArgs

# Files whose presence means a model directory carries its own HF tokenizer.
_HF_TOKENIZER_MARKERS = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


@dataclass(frozen=True)
class TrainData:
    """The packed samples every lane draws from, and how they were made (for the start banner)."""

    dataset: PackedDataset | None  # None: --eval-only on --eval-data (no training sample is needed)
    tokenizer: str
    summary: str
    tok: Tokenizer  # saved with every checkpoint and --export-hf
    held_out: PackedDataset | None = None  # the evaluation loss's samples (--eval-data, --eval-split)
    held_out_summary: str = ""


def data_spec(args: TrainArgs) -> str:
    return args.data or str(bundled_corpus())


def check_data_args(args: TrainArgs, model_config) -> None:
    """Cheap checks every rank can run before anything starts: lengths, vocabulary, that local data exists."""
    check_seq_len(args.seq_len, getattr(model_config, "max_position_embeddings", None))
    if args.sft and not args.data:
        raise DataError("--sft needs --data: a .jsonl/.parquet file of prompt/response or messages rows")
    for spec in (data_spec(args), args.eval_data):
        if spec is not None and not is_hub_spec(spec):
            resolve_files(spec)
    if args.vocab_size is not None:
        check_vocab(args.vocab_size, model_config.vocab_size)


def load_tokenizer(args: TrainArgs, model_config) -> tuple[Tokenizer, str]:
    """The tokenizer (see ``--tokenizer``) and a one-line description; its ids must fit the model's vocab."""
    tokenizer, what = _pick_tokenizer(args, model_config)
    check_vocab(tokenizer.vocab_size, model_config.vocab_size)
    exports = [
        flag for flag, out in (("--export-hf", args.export_hf), ("--export-hf-merged", args.export_hf_merged)) if out
    ]
    if exports and tokenizer.hf_problem is not None:  # found now, not after the last step
        raise DataError(
            f"{exports[0]} writes an HF tokenizer and {tokenizer.hf_problem}: pass --tokenizer an HF tokenizer "
            f"directory, or drop {exports[0]} (checkpoints keep the .model file)"
        )
    what = f"{what}, {tokenizer.vocab_size} ids (model vocab_size {model_config.vocab_size})"
    misread = tokenizer.auto_class_problem(args.model / "config.json") if exports else None
    return tokenizer, what if misread is None else f"{what}; note: {misread}"


def _pick_tokenizer(args: TrainArgs, model_config) -> tuple[Tokenizer, str]:
    if args.tokenizer not in ("auto", "sentencepiece"):
        path = Path(args.tokenizer)
        if path.is_dir():
            return load_hf_tokenizer(path), f"HF tokenizer {path}"
        if path.is_file():
            return SentencePieceTokenizer(path), f"SentencePiece {path}"
        raise DataError(f"--tokenizer {path}: no such file or directory; use auto, sentencepiece or a path")
    if args.tokenizer == "auto" and any((args.model / name).is_file() for name in _HF_TOKENIZER_MARKERS):
        return load_hf_tokenizer(args.model), f"HF tokenizer of {args.model}"
    if args.sft:
        raise DataError(
            f"--sft needs the tokenizer the model was trained with, and {args.model} has none: pass --tokenizer "
            f"PATH (an HF tokenizer directory, or the SentencePiece .model the pretraining run's 'tokenizer:' line "
            f"names)"
        )
    vocab_size = args.vocab_size or model_config.vocab_size
    tokenizer = train_or_load_tokenizer(
        data_spec(args),
        vocab_size,
        args.tokenizer_cache,
        text_field=args.text_field,
        txt_unit=cast(TxtUnit, args.txt_documents),
    )
    what = f"SentencePiece trained on {data_spec(args)} ({tokenizer.model_path})"
    if vocab_size < BYTE_FALLBACK_MIN:
        what += f", no byte pieces (under {BYTE_FALLBACK_MIN} ids; characters it never saw become <unk>)"
    return tokenizer, what


def prepare_data(args: TrainArgs, model_config) -> TrainData:
    """Tokenize and pack the training source (pretraining documents, or SFT examples with the prompt masked) and the
    held-out samples; ``--eval-only`` on ``--eval-data`` packs that alone."""
    check_data_args(args, model_config)
    tokenizer, what = load_tokenizer(args, model_config)
    held_out, held_summary = None, ""
    if args.eval_data is not None:
        held_out, source = _pack(args.eval_data, args, tokenizer, model_config)
        held_summary = f"{source}; {_samples(held_out, args)}"
    if args.eval_only and held_out is not None:  # no training sample needed
        return TrainData(None, what, "", tokenizer, _checked_held_out(held_out, args), held_summary)
    dataset, summary = _pack(data_spec(args), args, tokenizer, model_config)
    split = ""
    if args.eval_split:
        held_summary = f"of the {_samples(dataset, args)} from {data_spec(args)}"
        dataset, held_out = hold_out(dataset, args.eval_split, seed=args.seed)
        held_summary = f"{len(held_out):,} {held_summary} (--eval-split {args.eval_split:g}, never trained on)"
        split = f" to train on and {len(held_out):,} held out"
    if len(dataset) < args.lanes:
        raise DataError(
            f"{data_spec(args)} gives {_samples(dataset, args)}{split}, fewer than the {args.lanes} lanes that read "
            f"it; use more data or a shorter --seq-len"
        )
    held_out = _checked_held_out(held_out, args) if held_out is not None else None
    summary = f"{summary}; {_samples(dataset, args)}{split}"
    return TrainData(dataset, what, summary, tokenizer, held_out, held_summary)


def _samples(dataset: PackedDataset, args: TrainArgs) -> str:
    return f"{len(dataset):,} samples of {args.seq_len} tokens"


def _pack(spec: str, args: TrainArgs, tokenizer: Tokenizer, model_config) -> tuple[PackedDataset, str]:
    """``spec``'s samples as the run trains on them (SFT: examples with the prompt masked), and where they are from."""
    max_positions = getattr(model_config, "max_position_embeddings", None)
    if args.sft:
        prompt, response, messages = args.sft_fields
        examples = load_sft_examples(spec, prompt_field=prompt, response_field=response, messages_field=messages)
        dataset = build_sft_dataset(
            examples,
            tokenizer,
            seq_len=args.seq_len,
            max_positions=max_positions,
            seed=args.seed,
            truncate=args.sft_truncate,
        )
        summary = f"{len(examples)} SFT examples from {spec}, loss on responses only"
        multi_turn = sum(len(example.messages) > 2 for example in examples)
        if multi_turn and not tokenizer.has_chat_template:
            summary += (
                f" ({multi_turn} multi-turn: without a chat template each is plain text, its earlier turns joined "
                f"without roles as the prompt, the loss on its last assistant turn)"
            )
        return dataset, summary
    dataset, stats = build_pretrain_dataset(
        spec,
        tokenizer,
        seq_len=args.seq_len,
        max_positions=max_positions,
        seed=args.seed,
        text_field=args.text_field,
        txt_unit=cast(TxtUnit, args.txt_documents),
    )
    return dataset, f"{spec}: {stats}"


def _checked_held_out(held_out: PackedDataset, args: TrainArgs) -> PackedDataset:
    if not labelled_tokens(held_out.labels):
        source = args.eval_data or f"--eval-split {args.eval_split:g} of {data_spec(args)}"
        raise DataError(f"the held-out samples ({source}) have no token to compute a loss on; use other data")
    return held_out


def eval_batches(data: TrainData, args: TrainArgs, lane: int) -> HeldOutBatches:
    """Lane ``lane``'s micro-batches of every evaluation (``--eval-steps`` batches of one step's shape, or all)."""
    assert data.held_out is not None, "only a run with held-out data evaluates"
    return HeldOutBatches(
        data.held_out,
        lanes=args.lanes,
        lane=lane,
        micro_batches=args.cfg.micro_batches,
        micro_batch_size=args.micro_batch_size,
        limit=args.eval_steps,
    )


def lane_loader(data: TrainData, args: TrainArgs, lane: int, *, pin_memory: bool) -> MicroBatchLoader:
    """Lane ``lane``'s steps of micro-batches, prefetched by a background thread."""
    assert data.dataset is not None, "a run that trains has training samples"
    sampler = ShardedSampler(len(data.dataset), num_lanes=args.lanes, lane=lane, seed=args.seed)
    return MicroBatchLoader(
        data.dataset,
        sampler,
        micro_batch_size=args.micro_batch_size,
        num_micro_batches=args.cfg.micro_batches,
        pin_memory=pin_memory,
    )


def steps_per_epoch(data: TrainData, args: TrainArgs) -> int:
    """Steps until every lane has read its share once (each lane reads N // d samples per epoch)."""
    assert data.dataset is not None, "a run that trains has training samples"
    return (len(data.dataset) // args.lanes) // (args.cfg.micro_batches * args.micro_batch_size)


def epoch_text(data: TrainData, args: TrainArgs) -> str:
    """The banner's epoch length; a step can read more than an epoch (its later micro-batches repeat samples)."""
    steps = steps_per_epoch(data, args)
    if steps >= 1:
        return f"one epoch = {steps:,} steps"
    per_step = args.cfg.micro_batches * args.micro_batch_size
    assert data.dataset is not None  # steps_per_epoch checked it
    return (
        f"one epoch = {len(data.dataset) // args.lanes:,} samples per lane, fewer than the {per_step} a step reads: "
        f"every step repeats samples"
    )
