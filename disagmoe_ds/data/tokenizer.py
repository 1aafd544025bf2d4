"""Tokenizers: a SentencePiece model trained once per corpus and cached, or a model directory's own HF tokenizer.

Both kinds expose the same small interface (``Tokenizer``) so packing and SFT code never ask which one they hold.
The SentencePiece model keeps text exactly (identity normalisation, whitespace kept, "\\n" a piece of its own,
byte fallback for unseen characters), so ``decode(encode(text)) == text`` for any text. Below ``BYTE_FALLBACK_MIN``
ids the 256 byte pieces would crowd out the corpus's own (SentencePiece refuses them outright under about 350): such
a vocabulary is trained without them, and characters it never saw become ``<unk>``.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import shutil
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

import sentencepiece as spm

from disagmoe_ds.data.errors import DataError
from disagmoe_ds.data.sources import TxtUnit, is_hub_spec, load_documents, resolve_files

UNK_ID, BOS_ID, EOS_ID, PAD_ID = 0, 1, 2, 3
# Bump when the training options below change, so that cached models trained the old way are not reused.
_TRAINING_VERSION = 1
BYTE_FALLBACK_MIN = 512  # the smallest vocabulary trained with byte pieces by default
_HF_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "vocab.json", "spiece.model")

Message = Mapping[str, str]


class Tokenizer(Protocol):
    """What packing and SFT need from a tokenizer."""

    @property
    def vocab_size(self) -> int: ...
    @property
    def bos_id(self) -> int | None: ...
    @property
    def eos_id(self) -> int: ...
    @property
    def pad_id(self) -> int: ...
    @property
    def has_chat_template(self) -> bool: ...
    def encode(self, text: str) -> list[int]: ...
    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]: ...
    def decode(self, ids: Sequence[int]) -> str: ...
    def apply_chat_template(self, messages: Sequence[Message], *, add_generation_prompt: bool) -> list[int]: ...
    @property
    def hf_problem(self) -> str | None: ...
    def auto_class_problem(self, config_path: str | os.PathLike) -> str | None: ...
    def save_hf(self, out: str | os.PathLike) -> None: ...
    def save(self, out: str | os.PathLike) -> None: ...


# Texts on which an HF conversion of a SentencePiece model must encode exactly like SentencePiece (with every piece).
_CONVERSION_PROBES = (
    "It is a truth universally acknowledged, that a single man in possession of a good fortune.",
    " leading space,  two spaces\n\nnewlines\n indented\ttab 1234 3.14 \u00fcn\u00efc\u00f6de \u2014 \U0001f600",
    "\nstarts with a newline",
)


class SentencePieceTokenizer:
    """A SentencePiece model (ours: unk 0, bos 1, eos 2, pad 3, or any other .model); ``encode`` adds no specials."""

    def __init__(self, model_path: str | os.PathLike) -> None:
        self.model_path = Path(model_path)
        self._sp = spm.SentencePieceProcessor(model_file=str(self.model_path))
        if self._sp.eos_id() < 0:
            raise DataError(f"SentencePiece model {self.model_path} has no eos piece; packing needs one")

    @property
    def vocab_size(self) -> int:
        return self._sp.get_piece_size()

    @property
    def bos_id(self) -> int | None:
        return None if self._sp.bos_id() < 0 else self._sp.bos_id()

    @property
    def eos_id(self) -> int:
        return self._sp.eos_id()

    @property
    def pad_id(self) -> int:
        """The pad piece, else eos (e.g. Llama's model has none): padding has label -100 and its own segment."""
        return self.eos_id if self._sp.pad_id() < 0 else self._sp.pad_id()

    @property
    def has_chat_template(self) -> bool:
        return False

    def encode(self, text: str) -> list[int]:
        return self._sp.encode(text)

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """Encodes many texts at once (SentencePiece spreads them over threads)."""
        return self._sp.encode(list(texts))

    def decode(self, ids: Sequence[int]) -> str:
        return self._sp.decode([int(i) for i in ids])

    def apply_chat_template(self, messages: Sequence[Message], *, add_generation_prompt: bool) -> list[int]:
        raise DataError(f"SentencePiece tokenizer {self.model_path} has no chat template; SFT uses plain text")

    @functools.cached_property
    def hf_problem(self) -> str | None:
        """Why this model has no exact HF tokenizer (a text the conversion encodes differently), or None."""
        hf = _hf_from_sentencepiece(self._sp)
        probes = [*_CONVERSION_PROBES, *(self._sp.decode([i]) for i in range(self.vocab_size))]
        wrong = next((t for t in probes if hf.encode(t, add_special_tokens=False) != self.encode(t)), None)
        if wrong is None:
            return None
        return (
            f"SentencePiece model {self.model_path} cannot be converted to an HF tokenizer exactly (it encodes "
            f"{wrong!r} differently)"
        )

    def auto_class_problem(self, config_path: str | os.PathLike) -> str | None:
        """Why ``AutoTokenizer`` would misread this tokenizer beside the model's ``config_path`` (config.json), or
        None: for some model types (Qwen3.5's, ERNIE-4.5's, MiniMax-M2's) transformers ignores the saved class
        and builds the family's own byte-level pipeline from the vocabulary."""
        import tempfile

        from transformers import AutoTokenizer

        if self.hf_problem is not None:
            return None  # save_hf refuses it anyway
        with tempfile.TemporaryDirectory() as tmp:
            self.save_hf(tmp)
            shutil.copy2(config_path, Path(tmp) / "config.json")
            auto = AutoTokenizer.from_pretrained(tmp)
        if all(auto.encode(t, add_special_tokens=False) == self.encode(t) for t in _CONVERSION_PROBES):
            return None
        return (
            f"AutoTokenizer reads it beside this config as {type(auto).__name__}, which encodes differently: load "
            f"an export's tokenizer with PreTrainedTokenizerFast.from_pretrained(DIR)"
        )

    def save_hf(self, out: str | os.PathLike) -> None:
        """Write this model as an HF tokenizer (``AutoTokenizer.from_pretrained(out)`` encodes the same ids), plus
        the .model file itself; refuses a model whose conversion would not encode exactly like SentencePiece."""
        problem = self.hf_problem
        if problem is not None:
            raise DataError(f"{problem}; pass --tokenizer an HF tokenizer directory to export with one")
        _hf_from_sentencepiece(self._sp).save_pretrained(str(out))
        shutil.copy2(self.model_path, Path(out) / "tokenizer.model")

    def save(self, out: str | os.PathLike) -> None:
        """What a checkpoint keeps: the HF form (``save_hf``) where it is exact, else the .model file alone, which
        ``--tokenizer`` and ``disagmoe-convert --tokenizer`` read as well; never fails on the conversion."""
        if self.hf_problem is None:
            self.save_hf(out)
            return
        Path(out).mkdir(parents=True, exist_ok=True)
        shutil.copy2(self.model_path, Path(out) / "tokenizer.model")


def _hf_from_sentencepiece(sp: spm.SentencePieceProcessor) -> Any:
    """A ``PreTrainedTokenizerFast`` for a BPE model trained by ``train_or_load_tokenizer`` (dummy prefix, spaces as
    pieces' prefix, digits split, byte fallback if it has byte pieces, "\\n" a piece of its own). Without protobuf:
    vocabulary and merges are read through the processor (a piece's merges are its splits into two pieces, in the
    order of its id). Split digits need no pre-tokenizer of their own: no merge joins two digits, and one would keep
    HF from fusing a run of unknown ones into one ``<unk>`` as SentencePiece does."""
    from tokenizers import Tokenizer as RustTokenizer
    from tokenizers import decoders, models, normalizers, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {sp.id_to_piece(i): i for i in range(sp.get_piece_size())}
    merges = []
    for piece, i in vocab.items():
        if sp.is_control(i) or sp.is_unknown(i) or sp.is_byte(i) or len(piece) < 2:
            continue
        splits = [(piece[:k], piece[k:]) for k in range(1, len(piece)) if piece[:k] in vocab and piece[k:] in vocab]
        merges += [(i, vocab[a], vocab[b], a, b) for a, b in splits]
    unk = sp.id_to_piece(sp.unk_id())
    byte_fallback = any(sp.is_byte(i) for i in range(sp.get_piece_size()))
    model = models.BPE(vocab=vocab, merges=[(a, b) for *_, a, b in sorted(merges)], unk_token=unk, fuse_unk=True,
                       byte_fallback=byte_fallback)  # fmt: skip
    rust = RustTokenizer(model)
    rust.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")])
    rust.pre_tokenizer = pre_tokenizers.Split("\u2581", "merged_with_next")
    strip = decoders.Strip(" ", 1, 0)
    rust.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(), strip])
    ids = {"unk_token": sp.unk_id(), "bos_token": sp.bos_id(), "eos_token": sp.eos_id(), "pad_token": sp.pad_id()}
    specials = {name: sp.id_to_piece(i) for name, i in ids.items() if i >= 0}
    rust.add_special_tokens(list(specials.values()))
    return PreTrainedTokenizerFast(tokenizer_object=rust, **specials)


def _training_options(vocab_size: int, model_type: str, byte_fallback: bool) -> dict[str, Any]:
    """SentencePiece trainer options; everything that changes the model is part of the cache key."""
    return {
        "vocab_size": vocab_size,
        "model_type": model_type,
        "byte_fallback": byte_fallback,
        "unk_id": UNK_ID,
        "bos_id": BOS_ID,
        "eos_id": EOS_ID,
        "pad_id": PAD_ID,
        "user_defined_symbols": ["\n"],  # training lines hold no newline; without this it would cost bytes
        "normalization_rule_name": "identity",  # exact round trip of the text
        "remove_extra_whitespaces": False,
        "split_digits": True,
        "input_sentence_size": 0,  # use every line: sampling them would make the model depend on the sampler
        "max_sentence_length": 1 << 16,  # bytes; novel paragraphs exceed the default 4192
        "hard_vocab_limit": True,
    }


def _cache_path(files: Sequence[Path], options: Mapping[str, Any], extra: Mapping[str, Any], cache_dir: Path) -> Path:
    """Cache file named by a hash of the corpus bytes and of every training setting."""
    key = hashlib.sha256()
    for path in files:
        with path.open("rb") as handle:
            key.update(hashlib.file_digest(handle, "sha256").hexdigest().encode())
    key.update(json.dumps({**options, **extra, "version": _TRAINING_VERSION}, sort_keys=True).encode())
    return cache_dir / f"spm-{options['model_type']}-{options['vocab_size']}-{key.hexdigest()[:16]}.model"


def _train(lines: list[str], options: Mapping[str, Any], seed: int, target: Path) -> None:
    """Trains into a temporary file, then renames it, so concurrent ranks never read a half-written model."""
    spm.set_random_generator_seed(seed)
    tmp = target.with_name(f"{target.name}.{os.getpid()}.tmp")
    with tmp.open("wb") as writer:
        try:
            spm.SentencePieceTrainer.train(
                sentence_iterator=iter(lines),
                model_writer=writer,
                num_threads=min(os.cpu_count() or 1, 16),
                minloglevel=2,
                **options,
            )
        except RuntimeError as err:
            tmp.unlink()
            reason = str(err).strip().splitlines()[-1]
            raise DataError(
                f"SentencePiece cannot train vocab_size={options['vocab_size']} on this corpus ({reason}); "
                f"pass a larger --vocab-size (and model vocab_size)"
            ) from err
    os.replace(tmp, target)


def train_or_load_tokenizer(
    corpus_paths: str | os.PathLike | Sequence[str | os.PathLike],
    vocab_size: int,
    cache_dir: str | os.PathLike,
    *,
    model_type: str = "bpe",
    byte_fallback: bool | None = None,
    text_field: str = "text",
    txt_unit: TxtUnit = "block",
    limit: int | None = None,
    seed: int = 0,
) -> SentencePieceTokenizer:
    """A SentencePiece tokenizer for local corpus files, trained on the first call and loaded from the cache after.

    Args:
        corpus_paths: local .txt/.jsonl/.parquet files or directories, or one of them (hub datasets cannot
            be hashed for the cache key).
        vocab_size: number of token ids, special and byte pieces included.
        cache_dir: where trained models are kept, keyed by (corpus bytes, vocab_size, every option below).
        model_type: "bpe" or "unigram".
        byte_fallback: encode unseen characters as bytes (needs 256 ids), so no text maps to <unk>; None: when
            ``vocab_size >= BYTE_FALLBACK_MIN``.
        text_field: the document field of .jsonl/.parquet rows.
        txt_unit: .txt documents are blank-line-separated blocks ("block") or whole files ("file").
        limit: train on the first ``limit`` documents of each path (fast tests).
        seed: SentencePiece's random seed; with the corpus it fixes the model.
    """
    if isinstance(corpus_paths, (str, os.PathLike)):
        corpus_paths = [corpus_paths]
    for spec in corpus_paths:
        if is_hub_spec(spec):
            raise DataError(f"tokenizer corpus {spec} must be local files; hub datasets cannot be hashed for the cache")
    files = [path for spec in corpus_paths for path in resolve_files(spec)]
    if byte_fallback is None:
        byte_fallback = vocab_size >= BYTE_FALLBACK_MIN
    options = _training_options(vocab_size, model_type, byte_fallback)
    extra = {
        "text_field": text_field,
        "limit": limit,
        "seed": seed,
        **({"txt_unit": txt_unit} if txt_unit != "block" else {}),  # the default keeps the keys it always had
    }
    target = _cache_path(files, options, extra, Path(cache_dir))
    if not target.exists():
        docs = [
            doc
            for spec in corpus_paths
            for doc in load_documents(spec, text_field=text_field, txt_unit=txt_unit, limit=limit)
        ]
        lines = [line for doc in docs for line in doc.split("\n") if line.strip()]
        target.parent.mkdir(parents=True, exist_ok=True)
        _train(lines, options, seed, target)
    return SentencePieceTokenizer(target)


class HFTokenizer:
    """A Hugging Face tokenizer behind the ``Tokenizer`` interface; ``encode`` adds no special tokens."""

    def __init__(self, tokenizer: Any, source: str) -> None:
        if tokenizer.eos_token_id is None:
            raise DataError(f"tokenizer of {source} has no eos token; packing needs one to separate documents")
        self._tok = tokenizer
        self.source = source

    @property
    def vocab_size(self) -> int:
        """Every id the tokenizer can emit, added tokens included (``tokenizer.vocab_size`` omits them)."""
        return len(self._tok)

    @property
    def bos_id(self) -> int | None:
        return self._tok.bos_token_id

    @property
    def eos_id(self) -> int:
        return self._tok.eos_token_id

    @property
    def pad_id(self) -> int:
        """The pad token, else eos: padded positions carry label -100 and their own segment, so any id works."""
        return self.eos_id if self._tok.pad_token_id is None else self._tok.pad_token_id

    @property
    def has_chat_template(self) -> bool:
        return self._tok.chat_template is not None

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False)

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return self._tok(list(texts), add_special_tokens=False)["input_ids"]

    def decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode([int(i) for i in ids])

    def apply_chat_template(self, messages: Sequence[Message], *, add_generation_prompt: bool) -> list[int]:
        return self._tok.apply_chat_template(
            [dict(m) for m in messages], add_generation_prompt=add_generation_prompt, tokenize=True, return_dict=False
        )

    @property
    def hf_problem(self) -> str | None:
        return None

    def auto_class_problem(self, config_path: str | os.PathLike) -> str | None:
        return None  # the model's own tokenizer, read as transformers reads it

    def save_hf(self, out: str | os.PathLike) -> None:
        self._tok.save_pretrained(str(out))

    def save(self, out: str | os.PathLike) -> None:
        self.save_hf(out)


def load_hf_tokenizer(model_dir: str | os.PathLike) -> HFTokenizer:
    """The tokenizer saved with a Hugging Face model (transformers is imported here, not at package import)."""
    path = Path(model_dir)
    if not any((path / name).is_file() for name in _HF_TOKENIZER_FILES):
        raise DataError(
            f"{path} has no tokenizer files ({', '.join(_HF_TOKENIZER_FILES)}); "
            f"train one with train_or_load_tokenizer instead"
        )
    from transformers import AutoTokenizer

    return HFTokenizer(AutoTokenizer.from_pretrained(str(path)), source=str(path))


def check_vocab(tokenizer_vocab_size: int, model_vocab_size: int) -> None:
    """Fails before training when a token id could index past the model's embedding table."""
    if tokenizer_vocab_size > model_vocab_size:
        raise DataError(
            f"tokenizer has {tokenizer_vocab_size} token ids but the model's vocab_size is {model_vocab_size}; "
            f"ids >= {model_vocab_size} would index past the embedding: use a tokenizer of at most "
            f"{model_vocab_size} tokens or a model vocab_size >= {tokenizer_vocab_size}"
        )
