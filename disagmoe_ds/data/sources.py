"""Reads training documents and records from local files or a Hugging Face hub dataset.

A source ``spec`` is one of:
    file.txt / file.txt.gz        plain text: one document per blank-line-separated block, or per file
    file.jsonl / file.jsonl.gz    one JSON object per line; the document is its ``text_field``
    file.parquet                  one record per row (read with pyarrow)
    a directory                   every file of the kinds above in it, sorted by name; other files are ignored
    a saved ``datasets`` folder   what ``Dataset.save_to_disk`` or ``DatasetDict.save_to_disk`` wrote (the split
                                  ``split`` of a DatasetDict)
    hf:owner/name or owner/name   a hub dataset through ``datasets.load_dataset`` (needs network)

``datasets`` and ``pyarrow`` are imported only when such a source is read: the GPU machine has neither.
"""

from __future__ import annotations

import gzip
import itertools
import json
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from disagmoe_ds.data.errors import DataError

TXT_SUFFIXES = (".txt", ".txt.gz")
JSONL_SUFFIXES = (".jsonl", ".jsonl.gz")
PARQUET_SUFFIXES = (".parquet",)
HUB_PREFIX = "hf:"
TxtUnit = Literal["block", "file"]
_BLANK_LINE = re.compile(r"\n[ \t\r\f\v]*\n")


@dataclass(frozen=True)
class Record:
    """One row of a source; ``where`` ("data.jsonl line 3") lets errors point at the offending row."""

    where: str
    fields: dict[str, Any]


def _format_of(path: Path) -> str | None:
    """'txt', 'jsonl', 'parquet' or None, from the file name."""
    name = path.name.lower()
    for fmt, suffixes in (("txt", TXT_SUFFIXES), ("jsonl", JSONL_SUFFIXES), ("parquet", PARQUET_SUFFIXES)):
        if name.endswith(suffixes):
            return fmt
    return None


def is_hub_spec(spec: str | os.PathLike) -> bool:
    """True for ``hf:name``, and for a bare name that is no existing path and has no file suffix."""
    text = str(spec)
    if text.startswith(HUB_PREFIX):
        return True
    path = Path(text)
    return not path.exists() and not path.suffix and not text.startswith((".", "/", "~"))


def is_saved_dataset(path: Path) -> bool:
    """A folder written by ``datasets``' ``save_to_disk`` (a Dataset's state, or a DatasetDict's split list)."""
    return (path / "dataset_dict.json").is_file() or (path / "state.json").is_file()


def resolve_files(spec: str | os.PathLike) -> list[Path]:
    """The local files a spec names, in reading order (a directory's files sorted by name; every file of a saved
    dataset, which the tokenizer cache hashes)."""
    path = Path(spec)
    if path.is_dir() and is_saved_dataset(path):
        return sorted(p for p in path.rglob("*") if p.is_file())
    if path.is_dir():
        files = sorted(p for p in path.iterdir() if p.is_file() and _format_of(p) is not None)
        if not files:
            raise DataError(f"data directory {path} has no .txt, .jsonl or .parquet files (optionally .gz)")
        return files
    if not path.is_file():
        raise DataError(f"data file {path} does not exist (for a hub dataset write {HUB_PREFIX}owner/name)")
    if _format_of(path) is None:
        raise DataError(f"data file {path} has an unknown format; use .txt, .jsonl, .parquet (text may be .gz)")
    return [path]


def _open_text(path: Path):
    """Opens a possibly gzipped UTF-8 file for reading."""
    if path.name.lower().endswith(".gz"):
        return gzip.open(path, "rt", encoding="utf-8")
    return path.open(encoding="utf-8")


def _jsonl_records(path: Path) -> Iterator[Record]:
    with _open_text(path) as lines:
        for line_no, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            where = f"{path} line {line_no}"
            try:
                fields = json.loads(line)
            except json.JSONDecodeError as err:
                raise DataError(f"{where} is not valid JSON ({err.msg}); each line must be one JSON object") from err
            if not isinstance(fields, dict):
                raise DataError(f"{where} is a JSON {type(fields).__name__}, expected an object with fields")
            yield Record(where, fields)


def _parquet_records(path: Path) -> Iterator[Record]:
    try:
        import pyarrow.parquet as pq  # lazy: absent on the GPU machine
    except ImportError as err:
        raise DataError(f"reading {path} needs pyarrow; pip install pyarrow or convert it to .jsonl") from err
    row = 0
    for batch in pq.ParquetFile(path).iter_batches(batch_size=1024):
        for fields in batch.to_pylist():
            yield Record(f"{path} row {row}", fields)
            row += 1


def _hub_records(name: str, split: str) -> Iterator[Record]:
    try:
        import datasets  # lazy: absent on the GPU machine
    except ImportError as err:
        raise DataError(f"hub dataset {name!r} needs the datasets package; pip install datasets") from err
    try:
        rows = datasets.load_dataset(name, split=split)
    except Exception as err:  # offline, unknown name or split: all end the run with one line
        reason = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise DataError(
            f"cannot load hub dataset {name!r} split {split!r} ({reason}); no local path of that name exists "
            f"either: without network use a local .txt/.jsonl/.parquet file"
        ) from err
    for row_no, fields in enumerate(rows):
        yield Record(f"hub dataset {name} row {row_no}", fields)


def _saved_records(path: Path, split: str) -> Iterator[Record]:
    import datasets  # lazy: absent on the GPU machine; a saved dataset was written with it

    rows = datasets.load_from_disk(str(path))
    if isinstance(rows, datasets.DatasetDict):
        if split not in rows:
            raise DataError(f"saved dataset {path} has no split {split!r} (splits: {', '.join(rows)})")
        rows = rows[split]
    for row_no, fields in enumerate(rows):
        yield Record(f"{path} row {row_no}", fields)


def iter_records(spec: str | os.PathLike, *, split: str = "train") -> Iterator[Record]:
    """Rows with named fields from a .jsonl/.parquet file, a directory of them, a saved dataset or a hub dataset."""
    if is_hub_spec(spec):
        yield from _hub_records(str(spec).removeprefix(HUB_PREFIX), split)
        return
    if Path(spec).is_dir() and is_saved_dataset(Path(spec)):
        yield from _saved_records(Path(spec), split)
        return
    for path in resolve_files(spec):
        fmt = _format_of(path)
        if fmt == "txt":
            raise DataError(f"{path} is plain text without fields; records (e.g. SFT examples) need .jsonl or .parquet")
        yield from _jsonl_records(path) if fmt == "jsonl" else _parquet_records(path)


def text_of(record: Record, field: str) -> str:
    """The string in ``record.fields[field]``, or a one-line error naming the row and the fields it has."""
    if field not in record.fields:
        have = ", ".join(sorted(record.fields)) or "none"
        raise DataError(f"{record.where} has no field {field!r} (fields: {have}); set text_field to one of them")
    value = record.fields[field]
    if not isinstance(value, str):
        raise DataError(f"{record.where}: field {field!r} is a {type(value).__name__}, expected a string")
    return value


def _txt_documents(path: Path, unit: TxtUnit) -> Iterator[str]:
    with _open_text(path) as handle:
        text = handle.read()
    yield from ([text] if unit == "file" else _BLANK_LINE.split(text))


def _raw_documents(spec: str | os.PathLike, text_field: str, txt_unit: TxtUnit, split: str) -> Iterator[str]:
    if is_hub_spec(spec) or (Path(spec).is_dir() and is_saved_dataset(Path(spec))):
        yield from (text_of(rec, text_field) for rec in iter_records(spec, split=split))
        return
    for path in resolve_files(spec):
        if _format_of(path) == "txt":
            yield from _txt_documents(path, txt_unit)
        else:
            yield from (text_of(rec, text_field) for rec in iter_records(path))


def load_documents(
    spec: str | os.PathLike,
    *,
    text_field: str = "text",
    txt_unit: TxtUnit = "block",
    split: str = "train",
    limit: int | None = None,
) -> list[str]:
    """Documents of a source, stripped, blank ones dropped, in source order.

    Args:
        spec: a path or hub name (see the module docstring).
        text_field: the field holding the document in .jsonl/.parquet/hub rows.
        txt_unit: "block" splits .txt files at blank lines, "file" makes each .txt file one document.
        split: the hub dataset split.
        limit: stop after this many documents (a subset, e.g. for fast tokenizer training in tests).

    Returns:
        At least one non-empty document; an empty result is an error, not a silent empty epoch.
    """
    docs = (doc.strip() for doc in _raw_documents(spec, text_field, txt_unit, split))
    documents = list(itertools.islice((doc for doc in docs if doc), limit))
    if not documents:
        raise DataError(f"no documents in {spec}: it is empty or every document in it is blank")
    return documents
