"""Packs tokenised documents into fixed-length samples with per-document position ids (HF convention).

A sample is a dict of int64 tensors, each of shape [S] (S = seq_len):
    input_ids     each document is laid out as [bos] + tokens + [eos] (bos only where the tokenizer has one)
    labels        input_ids unshifted (the HF model shifts them), -100 where there is no loss: the first token
                  of every document, which would otherwise be predicted from the previous document, and padding
    position_ids  0, 1, 2, ... restarting at every document start and at every sample start. HF's
                  create_causal_mask detects the restarts and builds a block-diagonal causal mask, so a token
                  attends only to earlier tokens of its own document.
A document longer than the room left in a sample continues in the next one, its positions restarting there;
the tail of the corpus that does not fill a whole sample is dropped.

Call the model with ``use_cache=False`` and no attention_mask: HF looks for position restarts only when it has
no cache, and its models create one whenever ``config.use_cache`` is True (the default), in training too; with
a cache every token silently attends across document boundaries.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from disagmoe_ds.data.corpus import CorpusStats, corpus_stats
from disagmoe_ds.data.errors import DataError
from disagmoe_ds.data.sources import TxtUnit, load_documents
from disagmoe_ds.data.tokenizer import Tokenizer

IGNORE_INDEX = -100  # torch.nn.CrossEntropyLoss's default ignore_index, which HF losses use
SAMPLE_KEYS = ("input_ids", "labels", "position_ids")
PackedRow = tuple[Sequence[int], Sequence[int], Sequence[int]]  # one sample's columns, in SAMPLE_KEYS order


@dataclass(frozen=True)
class PackedDataset:
    """N samples of S tokens, stored as int32 [N, S] tensors; indexing returns int64 [S] tensors."""

    input_ids: torch.Tensor
    labels: torch.Tensor
    position_ids: torch.Tensor

    def __post_init__(self) -> None:
        shapes = [tuple(t.shape) for t in (self.input_ids, self.labels, self.position_ids)]
        if self.input_ids.dim() != 2 or len(set(shapes)) != 1:
            raise DataError(
                f"packed data must be input_ids, labels and position_ids of one [N, S] shape, got {shapes}; "
                "delete the packed cache and let the job pack the data again"
            )

    @property
    def seq_len(self) -> int:
        return self.input_ids.shape[1]

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {key: getattr(self, key)[index].long() for key in SAMPLE_KEYS}

    def select(self, indices: torch.Tensor) -> PackedDataset:
        """The samples at ``indices``, in that order."""
        return PackedDataset(self.input_ids[indices], self.labels[indices], self.position_ids[indices])

    @classmethod
    def from_rows(cls, rows: Sequence[PackedRow]) -> PackedDataset:
        """Builds the dataset from (input_ids, labels, position_ids) rows of equal length."""
        columns = [torch.tensor([row[k] for row in rows], dtype=torch.int32) for k in range(3)]
        return cls(*columns)


def labelled_tokens(labels_BS: torch.Tensor) -> torch.Tensor:
    """The tokens HF's causal-LM loss of ``labels_BS`` averages over (it shifts them by one), as a 0-dim tensor."""
    return (labels_BS[..., 1:] != IGNORE_INDEX).sum()


def check_seq_len(seq_len: int, max_positions: int | None) -> None:
    """A sample longer than the model's position table would silently wrap or crash inside attention."""
    if seq_len < 2:
        raise DataError(f"seq_len ({seq_len}) must be at least 2: a causal LM needs a token to predict from")
    if max_positions is not None and seq_len > max_positions:
        raise DataError(
            f"seq_len ({seq_len}) exceeds the model's max_position_embeddings ({max_positions}); lower seq_len"
        )


def document_order(num_documents: int, seed: int | None) -> list[int]:
    """A seeded permutation of the documents (source order when seed is None), so samples mix sources."""
    if seed is None:
        return list(range(num_documents))
    generator = torch.Generator().manual_seed(seed)
    return torch.randperm(num_documents, generator=generator).tolist()


def _lay_out(token_ids: Sequence[Sequence[int]], order: Sequence[int], eos_id: int, bos_id: int | None):
    """Concatenates [bos] + doc + [eos] in ``order``; returns the flat tokens and each document's offset."""
    prefix = np.array([] if bos_id is None else [bos_id], dtype=np.int64)
    suffix = np.array([eos_id], dtype=np.int64)
    parts = [part for i in order for part in (prefix, np.asarray(token_ids[i], dtype=np.int64), suffix)]
    lengths = np.array([len(token_ids[i]) + len(prefix) + 1 for i in order], dtype=np.int64)
    return np.concatenate(parts), np.cumsum(lengths) - lengths


def pack_documents(
    token_ids: Sequence[Sequence[int]],
    *,
    seq_len: int,
    eos_id: int,
    bos_id: int | None = None,
    seed: int | None = 0,
) -> PackedDataset:
    """Packs documents into samples of ``seq_len`` tokens (see the module docstring for the layout).

    Args:
        token_ids: each document's tokens, without special tokens.
        seq_len: S, tokens per sample.
        eos_id: appended to every document.
        bos_id: prepended to every document when given.
        seed: shuffles the documents before packing (None keeps their order); the result depends on nothing else.
    """
    check_seq_len(seq_len, None)
    if not token_ids:
        raise DataError("no documents to pack")
    flat, offsets = _lay_out(token_ids, document_order(len(token_ids), seed), eos_id, bos_id)
    num_samples = len(flat) // seq_len
    if num_samples == 0:
        raise DataError(f"the corpus has {len(flat)} tokens, fewer than one sample of seq_len {seq_len}")
    tokens = flat[: num_samples * seq_len]
    index = np.arange(len(tokens))
    doc_start = np.zeros(len(tokens), dtype=bool)
    doc_start[offsets[offsets < len(tokens)]] = True
    segment_start = doc_start | (index % seq_len == 0)
    positions = index - np.maximum.accumulate(np.where(segment_start, index, 0))
    labels = np.where(doc_start, IGNORE_INDEX, tokens)
    columns = (torch.from_numpy(a.reshape(num_samples, seq_len).astype(np.int32)) for a in (tokens, labels, positions))
    return PackedDataset(*columns)


def build_pretrain_dataset(
    spec: str | os.PathLike,
    tokenizer: Tokenizer,
    *,
    seq_len: int,
    max_positions: int | None = None,
    seed: int | None = 0,
    text_field: str = "text",
    txt_unit: TxtUnit = "block",
    limit: int | None = None,
) -> tuple[PackedDataset, CorpusStats]:
    """Loads, tokenises and packs a pretraining source; the stats are for the run log.

    Every rank that calls this with the same arguments gets the same samples, so lanes only need to agree
    on the sampler's seed to read disjoint shares.
    """
    check_seq_len(seq_len, max_positions)
    documents = load_documents(spec, text_field=text_field, txt_unit=txt_unit, limit=limit)
    token_ids = tokenizer.encode_batch(documents)
    dataset = pack_documents(token_ids, seq_len=seq_len, eos_id=tokenizer.eos_id, bos_id=tokenizer.bos_id, seed=seed)
    return dataset, corpus_stats(documents, token_ids)
