"""The bundled English corpus and the one-line corpus statistics written to training logs.

The bundled corpus (six Jane Austen novels, one JSON line per chapter, see ``corpus/LICENSE-CORPUS.md``)
lets tests, examples and smoke runs train on real prose without a network.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

CORPUS_DIR = Path(__file__).resolve().parent / "corpus"
BUNDLED_CORPUS = CORPUS_DIR / "austen.jsonl.gz"


def bundled_corpus() -> Path:
    """Path of the bundled corpus, a gzipped JSONL file with fields text, title, year, chapter."""
    return BUNDLED_CORPUS


@dataclass(frozen=True)
class CorpusStats:
    """Sizes of a tokenised corpus, so a run log shows what the model was trained on."""

    num_documents: int
    num_chars: int
    num_tokens: int

    @property
    def tokens_per_document(self) -> float:
        return self.num_tokens / max(self.num_documents, 1)

    @property
    def chars_per_token(self) -> float:
        return self.num_chars / max(self.num_tokens, 1)

    def __str__(self) -> str:
        return (
            f"{self.num_documents} documents, {self.num_tokens:,} tokens, {self.num_chars:,} chars "
            f"({self.tokens_per_document:.0f} tokens/doc, {self.chars_per_token:.2f} chars/token)"
        )


def corpus_stats(documents: Sequence[str], token_ids: Sequence[Sequence[int]]) -> CorpusStats:
    """Counts documents, characters and tokens (``token_ids[i]`` is the encoding of ``documents[i]``)."""
    return CorpusStats(
        num_documents=len(documents),
        num_chars=sum(len(doc) for doc in documents),
        num_tokens=sum(len(ids) for ids in token_ids),
    )
