"""run_pretrain.py's data: SFT trains on the responses only; the tokenizer must fit the model; clear errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from disagmoe_ds.data import IGNORE_INDEX, DataError, bundled_corpus, train_or_load_tokenizer
from disagmoe_ds.models.loading import load_config
from disagmoe_ds.train.args import parse_args
from disagmoe_ds.train.data import check_data_args, prepare_data
from tests.runs import write_sft_jsonl

ROOT = Path(__file__).resolve().parent.parent
MODEL = ROOT / "hf_models" / "tiny-qwen3-moe-lm"


def _args(tmp_path: Path, *argv: str):
    args, _ = parse_args([*argv, "--tokenizer-cache", str(tmp_path / "tok")], root=ROOT, description="")
    return args


def _segments(sample: dict) -> list[tuple[list[int], list[int]]]:
    """(input_ids, labels) of each packed example of one sample (position ids restart at 0)."""
    ids, labels, pos = (sample[k].tolist() for k in ("input_ids", "labels", "position_ids"))
    starts = [i for i, p in enumerate(pos) if p == 0] + [len(pos)]
    return [(ids[a:b], labels[a:b]) for a, b in zip(starts, starts[1:])]


def test_sft_loss_covers_the_responses_only(tmp_path: Path) -> None:
    pairs = write_sft_jsonl(tmp_path / "sft.jsonl")
    tokenizer = train_or_load_tokenizer(bundled_corpus(), 512, tmp_path / "tok")
    args = _args(tmp_path, "--sft", "--data", str(tmp_path / "sft.jsonl"), "--tokenizer", str(tokenizer.model_path),
                 "--seq-len", "64")  # fmt: skip
    data = prepare_data(args, load_config(MODEL))
    learned, prompts_seen = [], []
    for index in range(len(data.dataset)):
        for ids, labels in _segments(data.dataset[index]):
            first = next((i for i, label in enumerate(labels) if label != IGNORE_INDEX), None)
            if first is None:
                continue  # padding
            assert all(label == IGNORE_INDEX for label in labels[:first])  # the whole prompt is masked ...
            assert labels[first:] == ids[first:]  # ... and the whole response is learned, up to its eos
            assert ids[-1] == tokenizer.eos_id
            learned.append(tokenizer.decode(ids[first:-1]))
            prompts_seen.append(tokenizer.decode(ids[:first]))
    assert sorted(learned) == sorted(r for _, r in pairs)
    assert sorted(p.strip() for p in prompts_seen) == sorted(p for p, _ in pairs)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--data", "/no/such/file.jsonl"], r"data file /no/such/file.jsonl does not exist"),
        (["--seq-len", "1024"], r"seq_len \(1024\) exceeds the model's max_position_embeddings \(512\)"),
        (["--vocab-size", "1000"], r"tokenizer has 1000 token ids but the model's vocab_size is 512"),
        (["--sft"], r"--sft needs --data"),
    ],
)
def test_cheap_checks_run_before_any_rank(tmp_path: Path, argv: list[str], message: str) -> None:
    with pytest.raises(DataError, match=message):
        check_data_args(_args(tmp_path, *argv), load_config(MODEL))


def test_tokenizer_larger_than_the_model_is_rejected(tmp_path: Path) -> None:
    big = train_or_load_tokenizer(bundled_corpus(), 600, tmp_path / "tok", limit=20)
    args = _args(tmp_path, "--tokenizer", str(big.model_path))
    with pytest.raises(DataError, match=r"tokenizer has 600 token ids but the model's vocab_size is 512"):
        prepare_data(args, load_config(MODEL))


def test_empty_dataset(tmp_path: Path) -> None:
    (tmp_path / "empty.txt").write_text("\n\n  \n")
    with pytest.raises(DataError, match=r"no documents in .*empty.txt: it is empty"):
        prepare_data(_args(tmp_path, "--data", str(tmp_path / "empty.txt")), load_config(MODEL))


def _model_with_word_tokenizer(root: Path, num_ids: int) -> Path:
    """A model directory (the tiny default's config) that ships its own HF tokenizer of ``num_ids`` ids."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    root.mkdir()
    (root / "config.json").write_text((MODEL / "config.json").read_text())
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i + 3 for i in range(num_ids - 3)}}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    tok.save_pretrained(root)
    return root


def test_the_model_directory_tokenizer_is_used_and_checked(tmp_path: Path) -> None:
    (tmp_path / "words.txt").write_text("w1 w2 w3 w4\n\nw5 w6 w7 w8 w9 w10\n\n" * 20)
    fits = _model_with_word_tokenizer(tmp_path / "fits", 300)
    args = _args(tmp_path, "--model", str(fits), "--data", str(tmp_path / "words.txt"), "--seq-len", "8")
    data = prepare_data(args, load_config(fits))
    assert data.tokenizer.startswith(f"HF tokenizer of {fits}, 300 ids")
    assert data.dataset[0]["input_ids"].max() < 300
    too_big = _model_with_word_tokenizer(tmp_path / "too_big", 600)
    args = _args(tmp_path, "--model", str(too_big), "--data", str(tmp_path / "words.txt"), "--seq-len", "8")
    with pytest.raises(DataError, match=r"tokenizer has 600 token ids but the model's vocab_size is 512"):
        prepare_data(args, load_config(too_big))


def test_sampler_regroup_doctest() -> None:
    """A data position saved by d lanes continues under another lane count (``disagmoe-convert relayout``)."""
    import doctest

    from disagmoe_ds.data import sampler

    assert doctest.testmod(sampler).failed == 0


def test_sentencepiece_tokenizer_exports_as_an_identical_hf_tokenizer(tmp_path: Path) -> None:
    """``save_hf`` (checkpoints, --export-hf): AutoTokenizer encodes and decodes the corpus like SentencePiece."""
    from transformers import AutoTokenizer

    from disagmoe_ds.data import bundled_corpus, train_or_load_tokenizer
    from disagmoe_ds.data.sources import load_documents

    tokenizer = train_or_load_tokenizer(bundled_corpus(), 512, tmp_path / "cache", limit=20)
    tokenizer.save_hf(tmp_path / "hf")
    hf = AutoTokenizer.from_pretrained(tmp_path / "hf")
    texts = [doc[:3000] for doc in load_documents(bundled_corpus(), limit=30)] + [
        "  two\n\n 3.14 \u00e9\u2014\U0001f600"
    ]
    for text in texts:
        ids = tokenizer.encode(text)
        assert hf.encode(text, add_special_tokens=False) == ids and hf.decode(ids) == text
    assert (hf.eos_token_id, hf.pad_token_id, len(hf)) == (tokenizer.eos_id, tokenizer.pad_id, tokenizer.vocab_size)


def test_sft_fields_are_flags_and_the_missing_field_error_names_them(tmp_path: Path) -> None:
    rows = [{"question": f"What is {i}?", "answer": f"It is {i}."} for i in range(8)]
    (tmp_path / "qa.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    tokenizer = train_or_load_tokenizer(bundled_corpus(), 512, tmp_path / "tok")
    argv = ("--sft", "--data", str(tmp_path / "qa.jsonl"), "--tokenizer", str(tokenizer.model_path), "--seq-len", "64")
    with pytest.raises(DataError, match=r"needs fields 'prompt' and 'response' .* name the fields with "
                       r"--prompt-field/--response-field or --messages-field"):  # fmt: skip
        prepare_data(_args(tmp_path, *argv), load_config(MODEL))
    data = prepare_data(_args(tmp_path, *argv, "--prompt-field", "question", "--response-field", "answer"),
                        load_config(MODEL))  # fmt: skip
    assert "8 SFT examples" in data.summary


def test_a_saved_dataset_folder_is_data(tmp_path: Path) -> None:
    """``Dataset.save_to_disk`` and ``DatasetDict.save_to_disk`` folders read like .jsonl rows (a DatasetDict's
    train split; SFT rows too)."""
    import datasets

    rows = {"text": [f"Chapter {i}. It was a fine day in the village of Meryton." for i in range(6)]}
    datasets.Dataset.from_dict(rows).save_to_disk(str(tmp_path / "ds"))
    split = datasets.Dataset.from_dict({"text": ["held out"]})
    datasets.DatasetDict(train=datasets.Dataset.from_dict(rows), test=split).save_to_disk(str(tmp_path / "dd"))
    tokenizer = train_or_load_tokenizer(bundled_corpus(), 512, tmp_path / "tok").model_path
    for folder in ("ds", "dd"):
        args = _args(tmp_path, "--data", str(tmp_path / folder), "--tokenizer", str(tokenizer), "--seq-len", "16")
        assert ": 6 documents" in prepare_data(args, load_config(MODEL)).summary
    pairs = {"prompt": ["Who?"] * 4, "response": ["Emma."] * 4}
    datasets.Dataset.from_dict(pairs).save_to_disk(str(tmp_path / "sft"))
    args = _args(tmp_path, "--sft", "--data", str(tmp_path / "sft"), "--tokenizer", str(tokenizer), "--seq-len", "16")
    assert len(prepare_data(args, load_config(MODEL)).dataset) >= 1


def test_txt_files_as_whole_documents(tmp_path: Path) -> None:
    corpus = tmp_path / "books"
    corpus.mkdir()
    for i in range(3):
        (corpus / f"book{i}.txt").write_text(f"Book {i}, part one.\n\nBook {i}, part two.\n")
    tokenizer = train_or_load_tokenizer(bundled_corpus(), 512, tmp_path / "tok").model_path
    argv = ["--data", str(corpus), "--tokenizer", str(tokenizer), "--seq-len", "16"]
    assert ": 6 documents" in prepare_data(_args(tmp_path, *argv), load_config(MODEL)).summary
    whole = prepare_data(_args(tmp_path, *argv, "--txt-documents", "file"), load_config(MODEL))
    assert ": 3 documents" in whole.summary
