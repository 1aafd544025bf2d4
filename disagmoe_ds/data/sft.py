"""Supervised fine-tuning data: prompt/response examples, tokenised with the loss only on the response.

Rows come from .jsonl/.parquet files or a hub dataset (see ``sources``), either as a ``messages`` chat list
(``[{"role": ..., "content": ...}, ...]`` ending with the assistant turn to learn) or as prompt and response
fields. With a chat template (an HF tokenizer that has one) the conversation is rendered by the template;
otherwise as plain text, ``[bos] prompt "\\n" response [eos]``. Labels are -100 on every token before the
final response and on padding. Samples have the layout of ``packing`` (position ids restart per example).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass

from disagmoe_ds.data.errors import DataError
from disagmoe_ds.data.packing import IGNORE_INDEX, PackedDataset, PackedRow, check_seq_len, document_order
from disagmoe_ds.data.sources import Record, iter_records, text_of
from disagmoe_ds.data.tokenizer import Message, Tokenizer


@dataclass(frozen=True)
class SFTExample:
    """A conversation whose last message is the assistant response to learn; ``where`` names its source row."""

    messages: tuple[Message, ...]
    where: str = "example"


@dataclass(frozen=True)
class TokenizedExample:
    """Token ids and their labels (-100 on the prompt), of equal length."""

    input_ids: list[int]
    labels: list[int]
    where: str


def _messages_of(record: Record, field: str) -> tuple[Message, ...]:
    messages = record.fields[field]
    ok = isinstance(messages, list) and messages and all(isinstance(m, dict) and "content" in m for m in messages)
    if not ok:
        raise DataError(f"{record.where}: {field!r} must be a non-empty list of {{'role', 'content'}} objects")
    if messages[-1].get("role") != "assistant":
        raise DataError(f"{record.where}: the last of {field!r} must have role 'assistant' (the response to learn)")
    return tuple({"role": str(m.get("role", "user")), "content": str(m["content"])} for m in messages)


def example_from_record(record: Record, *, prompt_field: str, response_field: str, messages_field: str) -> SFTExample:
    """Reads one row, preferring the chat list; a row with neither form is a one-line error naming its fields."""
    if messages_field in record.fields:
        return SFTExample(_messages_of(record, messages_field), record.where)
    if prompt_field not in record.fields or response_field not in record.fields:
        have = ", ".join(sorted(record.fields)) or "none"
        raise DataError(
            f"{record.where} needs fields {prompt_field!r} and {response_field!r} or a {messages_field!r} list "
            f"(fields: {have}); name the fields with --prompt-field/--response-field or --messages-field"
        )
    prompt, response = text_of(record, prompt_field), text_of(record, response_field)
    return SFTExample(({"role": "user", "content": prompt}, {"role": "assistant", "content": response}), record.where)


def load_sft_examples(
    spec: str | os.PathLike,
    *,
    prompt_field: str = "prompt",
    response_field: str = "response",
    messages_field: str = "messages",
    split: str = "train",
    limit: int | None = None,
) -> list[SFTExample]:
    """SFT examples of a .jsonl/.parquet file, a directory of them or a hub dataset, in source order."""
    examples: list[SFTExample] = []
    for record in iter_records(spec, split=split):
        if limit is not None and len(examples) >= limit:
            break
        examples.append(
            example_from_record(
                record, prompt_field=prompt_field, response_field=response_field, messages_field=messages_field
            )
        )
    if not examples:
        raise DataError(f"no SFT examples in {spec}: the source is empty")
    return examples


def _tokenize_with_template(tokenizer: Tokenizer, example: SFTExample) -> TokenizedExample:
    prompt = tokenizer.apply_chat_template(example.messages[:-1], add_generation_prompt=True)
    full = tokenizer.apply_chat_template(example.messages, add_generation_prompt=False)
    if full[: len(prompt)] != prompt:
        raise DataError(
            f"{example.where}: the chat template does not render the prompt as a prefix of the conversation, "
            f"so prompt tokens cannot be masked; use a tokenizer without a chat template or fix the template"
        )
    return TokenizedExample(full, [IGNORE_INDEX] * len(prompt) + full[len(prompt) :], example.where)


def _tokenize_plain(tokenizer: Tokenizer, example: SFTExample) -> TokenizedExample:
    prompt_text = "\n".join(m["content"] for m in example.messages[:-1]) + "\n"
    bos = [] if tokenizer.bos_id is None else [tokenizer.bos_id]
    prompt = bos + tokenizer.encode(prompt_text)
    response = tokenizer.encode(example.messages[-1]["content"]) + [tokenizer.eos_id]
    return TokenizedExample(prompt + response, [IGNORE_INDEX] * len(prompt) + response, example.where)


def tokenize_sft_example(tokenizer: Tokenizer, example: SFTExample) -> TokenizedExample:
    """Tokens of one example with labels -100 on everything before the final response."""
    if tokenizer.has_chat_template:
        return _tokenize_with_template(tokenizer, example)
    return _tokenize_plain(tokenizer, example)


def _fit(example: TokenizedExample, seq_len: int, max_positions: int | None, truncate: bool) -> TokenizedExample:
    """Truncates an example longer than a sample, or stops the run when truncation is off."""
    if len(example.input_ids) <= seq_len:
        return example
    if not truncate:
        limit = f"seq_len {seq_len}" + ("" if max_positions is None else f", model max positions {max_positions}")
        raise DataError(
            f"SFT example {example.where} has {len(example.input_ids)} tokens, more than fit ({limit}); "
            f"shorten or drop it, or pass --sft-truncate to cut it to its first {seq_len} tokens"
        )
    return TokenizedExample(example.input_ids[:seq_len], example.labels[:seq_len], example.where)


def _finish_row(segments: list[TokenizedExample], seq_len: int, pad_id: int) -> PackedRow:
    """Concatenates examples and pads to seq_len; padding is a segment of its own with label -100."""
    ids = [t for seg in segments for t in seg.input_ids]
    labels = [t for seg in segments for t in seg.labels]
    positions = [p for seg in segments for p in range(len(seg.input_ids))]
    num_pad = seq_len - len(ids)
    return ids + [pad_id] * num_pad, labels + [IGNORE_INDEX] * num_pad, positions + list(range(num_pad))


def _rows(examples: Sequence[TokenizedExample], seq_len: int, pad_id: int, pack: bool) -> list[PackedRow]:
    """Greedy packing in order: an example that does not fit in the current row starts the next one."""
    rows: list[PackedRow] = []
    current: list[TokenizedExample] = []
    used = 0
    for example in examples:
        if current and (not pack or used + len(example.input_ids) > seq_len):
            rows.append(_finish_row(current, seq_len, pad_id))
            current, used = [], 0
        current.append(example)
        used += len(example.input_ids)
    rows.append(_finish_row(current, seq_len, pad_id))
    return rows


def build_sft_dataset(
    examples: Sequence[SFTExample],
    tokenizer: Tokenizer,
    *,
    seq_len: int,
    max_positions: int | None = None,
    pack: bool = True,
    truncate: bool = False,
    seed: int | None = 0,
) -> PackedDataset:
    """Tokenised SFT samples of ``seq_len`` tokens.

    Args:
        examples: from ``load_sft_examples``.
        tokenizer: its chat template is used when it has one.
        seq_len: S, tokens per sample; must not exceed ``max_positions``.
        max_positions: the model's max_position_embeddings, checked against seq_len.
        pack: several whole examples per sample (an example is never split); False puts one per sample.
        truncate: cut examples longer than seq_len instead of failing.
        seed: shuffles the examples before packing (None keeps their order).
    """
    check_seq_len(seq_len, max_positions)
    if not examples:
        raise DataError("no SFT examples to build a dataset from")
    order = document_order(len(examples), seed)
    tokenized = [_fit(tokenize_sft_example(tokenizer, examples[i]), seq_len, max_positions, truncate) for i in order]
    return PackedDataset.from_rows(_rows(tokenized, seq_len, tokenizer.pad_id, pack))
