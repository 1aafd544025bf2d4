"""Training data: sources, tokenizers, packing, SFT examples, and the lane-sharded, resumable loader.

Pretraining, one lane of d::

    tok = train_or_load_tokenizer([bundled_corpus()], vocab_size=8192, cache_dir=".cache/tokenizers")
    check_vocab(tok.vocab_size, model_config.vocab_size)
    dataset, stats = build_pretrain_dataset(bundled_corpus(), tok, seq_len=1024)
    sampler = ShardedSampler(len(dataset), num_lanes=d, lane=j, seed=0)
    with MicroBatchLoader(dataset, sampler, micro_batch_size=2, num_micro_batches=8) as loader:
        micro_batches = next(loader)  # 8 dicts of [2, 1024] int64 tensors

``datasets``, ``pyarrow`` and ``transformers`` are imported only by the functions that need them.
"""

from disagmoe_ds.data.corpus import BUNDLED_CORPUS, CorpusStats, bundled_corpus, corpus_stats
from disagmoe_ds.data.errors import DataError
from disagmoe_ds.data.held_out import HeldOutBatches, hold_out
from disagmoe_ds.data.loader import MicroBatchLoader, collate
from disagmoe_ds.data.packing import (
    IGNORE_INDEX,
    PackedDataset,
    build_pretrain_dataset,
    check_seq_len,
    labelled_tokens,
    pack_documents,
)
from disagmoe_ds.data.sampler import ShardedSampler
from disagmoe_ds.data.sft import (
    SFTExample,
    TokenizedExample,
    build_sft_dataset,
    load_sft_examples,
    tokenize_sft_example,
)
from disagmoe_ds.data.sources import Record, iter_records, load_documents, resolve_files
from disagmoe_ds.data.tokenizer import (
    BYTE_FALLBACK_MIN,
    HFTokenizer,
    SentencePieceTokenizer,
    Tokenizer,
    check_vocab,
    load_hf_tokenizer,
    train_or_load_tokenizer,
)

__all__ = [
    "BUNDLED_CORPUS",
    "BYTE_FALLBACK_MIN",
    "IGNORE_INDEX",
    "CorpusStats",
    "DataError",
    "HFTokenizer",
    "HeldOutBatches",
    "MicroBatchLoader",
    "PackedDataset",
    "Record",
    "SFTExample",
    "SentencePieceTokenizer",
    "ShardedSampler",
    "TokenizedExample",
    "Tokenizer",
    "build_pretrain_dataset",
    "build_sft_dataset",
    "bundled_corpus",
    "check_seq_len",
    "check_vocab",
    "collate",
    "corpus_stats",
    "hold_out",
    "iter_records",
    "labelled_tokens",
    "load_documents",
    "load_hf_tokenizer",
    "load_sft_examples",
    "pack_documents",
    "resolve_files",
    "tokenize_sft_example",
    "train_or_load_tokenizer",
]
