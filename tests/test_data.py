"""Tests of disagmoe_ds.data: corpus, sources, tokenizer cache, packing, SFT masking, sampler and loader.

Tokenizers are trained with a 512-token vocabulary on the first 20 chapters of the bundled corpus (well under a
second) into a temporary cache directory.
"""

from __future__ import annotations

import gzip
import json
import threading
import time
from pathlib import Path

import pytest
import torch

from disagmoe_ds.data import (
    IGNORE_INDEX,
    DataError,
    MicroBatchLoader,
    PackedDataset,
    SFTExample,
    ShardedSampler,
    build_pretrain_dataset,
    build_sft_dataset,
    bundled_corpus,
    check_vocab,
    corpus_stats,
    load_documents,
    load_hf_tokenizer,
    load_sft_examples,
    pack_documents,
    train_or_load_tokenizer,
)
from disagmoe_ds.data import tokenizer as tokenizer_module
from disagmoe_ds.data.corpus import CORPUS_DIR
from disagmoe_ds.data.packing import document_order

VOCAB = 512
NUM_DOCS = 20  # chapters used to train test tokenizers


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return train_or_load_tokenizer([bundled_corpus()], VOCAB, tmp_path_factory.mktemp("tok"), limit=NUM_DOCS)


@pytest.fixture(scope="module")
def docs():
    return load_documents(bundled_corpus(), limit=NUM_DOCS)


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    return path


def assert_one_line(excinfo: pytest.ExceptionInfo) -> None:
    assert "\n" not in str(excinfo.value), str(excinfo.value)


# ---------------------------------------------------------------- corpus and sources


def test_bundled_corpus_is_real_prose_with_licence():
    documents = load_documents(bundled_corpus())
    assert len(documents) == 269  # chapters of the six novels
    assert any(doc.startswith("It is a truth universally acknowledged") for doc in documents)
    assert 3_500_000 < sum(map(len, documents)) < 4_500_000
    assert "public domain" in (CORPUS_DIR / "LICENSE-CORPUS.md").read_text().lower()


def test_txt_blocks_files_and_directories(tmp_path):
    (tmp_path / "a.txt").write_text("first block\nstill first\n\n  \nsecond block\n\n\n", encoding="utf-8")
    with gzip.open(tmp_path / "b.txt.gz", "wt", encoding="utf-8") as handle:
        handle.write("third\n\nfourth")
    (tmp_path / "notes.md").write_text("ignored: not a data file")
    assert load_documents(tmp_path / "a.txt") == ["first block\nstill first", "second block"]
    assert load_documents(tmp_path / "a.txt", txt_unit="file") == ["first block\nstill first\n\n  \nsecond block"]
    assert load_documents(tmp_path) == ["first block\nstill first", "second block", "third", "fourth"]
    assert load_documents(tmp_path, limit=3) == ["first block\nstill first", "second block", "third"]


def test_jsonl_and_parquet_sources(tmp_path):
    rows = [{"body": "alpha", "id": 0}, {"body": "  ", "id": 1}, {"body": "beta", "id": 2}]
    assert load_documents(write_jsonl(tmp_path / "d.jsonl", rows), text_field="body") == ["alpha", "beta"]
    pq = pytest.importorskip("pyarrow.parquet")
    pa = pytest.importorskip("pyarrow")
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "d.parquet")
    assert load_documents(tmp_path / "d.parquet", text_field="body") == ["alpha", "beta"]


def test_corpus_stats_line(tok, docs):
    stats = corpus_stats(docs, tok.encode_batch(docs))
    assert stats.num_documents == NUM_DOCS and stats.num_tokens > stats.num_documents
    assert str(stats).startswith(f"{NUM_DOCS} documents, ") and "tokens/doc" in str(stats)


# ---------------------------------------------------------------- tokenizer


def test_tokenizer_trains_once_then_loads_from_cache(tmp_path, monkeypatch):
    calls = []
    real_train = tokenizer_module._train
    monkeypatch.setattr(tokenizer_module, "_train", lambda *a: calls.append(1) or real_train(*a))
    start = time.perf_counter()
    first = train_or_load_tokenizer([bundled_corpus()], VOCAB, tmp_path, limit=NUM_DOCS)
    train_s = time.perf_counter() - start
    start = time.perf_counter()
    second = train_or_load_tokenizer([bundled_corpus()], VOCAB, tmp_path, limit=NUM_DOCS)
    load_s = time.perf_counter() - start
    assert len(calls) == 1 and second.model_path == first.model_path and load_s < train_s
    text = "It is a truth universally acknowledged."
    assert second.encode(text) == first.encode(text)
    other = train_or_load_tokenizer([bundled_corpus()], VOCAB + 64, tmp_path, limit=NUM_DOCS)
    assert len(calls) == 2 and other.model_path != first.model_path  # the vocab size is part of the key


def test_tokenizer_round_trips_text_exactly(tok):
    text = 'Mr. Bennet said:\n\n"Caf\u00e9,  na\u00efve \u2014 1813!"\tend'
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    assert max(ids) < tok.vocab_size == VOCAB and (tok.bos_id, tok.eos_id, tok.pad_id) == (1, 2, 3)


# ---------------------------------------------------------------- packing


def test_packing_layout_written_out():
    # Documents of 3, 5 and 2 tokens, in order, bos=1 and eos=2, S=4. The stream (| = sample boundary):
    #   1 10 11 12 | 2 1 20 21 | 22 23 24 2 | 1 30 31 2 |
    # positions restart at each document start and at each sample start (doc 2 continues into sample 2).
    packed = pack_documents([[10, 11, 12], [20, 21, 22, 23, 24], [30, 31]], seq_len=4, eos_id=2, bos_id=1, seed=None)
    assert packed.input_ids.tolist() == [[1, 10, 11, 12], [2, 1, 20, 21], [22, 23, 24, 2], [1, 30, 31, 2]]
    assert packed.position_ids.tolist() == [[0, 1, 2, 3], [0, 0, 1, 2], [0, 1, 2, 3], [0, 1, 2, 3]]
    ignore = IGNORE_INDEX
    assert packed.labels.tolist() == [[ignore, 10, 11, 12], [2, ignore, 20, 21], [22, 23, 24, 2], [ignore, 30, 31, 2]]


def test_packing_corpus_boundaries_and_text(tok, docs):
    seq_len = 128
    token_ids = tok.encode_batch(docs)
    packed = pack_documents(token_ids, seq_len=seq_len, eos_id=tok.eos_id, bos_id=tok.bos_id, seed=7)
    # Expected document-start offsets in the flat stream, computed the slow way.
    starts, offset = set(), 0
    for i in document_order(len(docs), 7):
        starts.add(offset)
        offset += len(token_ids[i]) + 2
    assert len(packed) == offset // seq_len
    for n in range(len(packed)):
        sample = packed[n]
        assert all(v.shape == (seq_len,) and v.dtype == torch.int64 for v in sample.values())
        restarts = {n * seq_len + s for s in range(seq_len) if sample["position_ids"][s] == 0}
        doc_starts = {p for p in range(n * seq_len, (n + 1) * seq_len) if p in starts}
        assert restarts == doc_starts | {n * seq_len}
        masked = {n * seq_len + s for s in range(seq_len) if sample["labels"][s] == IGNORE_INDEX}
        assert masked == doc_starts
    # Tokens after a document start (bos) decode to the start of that document's text.
    early = [(n, s) for n in range(len(packed)) for s in range(1, 32) if packed[n]["position_ids"][s] == 0]
    n, start = early[0]
    body = tok.decode(packed[n]["input_ids"][start + 1 :])[:100]  # the tail may end inside a character
    assert len(body) == 100 and any(doc.startswith(body) for doc in docs)


def test_packing_is_deterministic_given_the_seed(tok, docs):
    token_ids = tok.encode_batch(docs)
    a, b, c = (pack_documents(token_ids, seq_len=64, eos_id=2, seed=s) for s in (3, 3, 4))
    assert torch.equal(a.input_ids, b.input_ids) and not torch.equal(a.input_ids, c.input_ids)


def test_position_restarts_give_hf_block_diagonal_segments(tok):
    masking_utils = pytest.importorskip("transformers.masking_utils")
    packed = pack_documents([[5] * 3, [6] * 4, [7] * 20], seq_len=12, eos_id=2, bos_id=1, seed=None)
    segments = masking_utils.find_packed_sequence_indices(packed.position_ids[:1].long())
    assert segments.tolist() == [[0] * 5 + [1] * 6 + [2]]


def test_packed_forward_equals_separate_documents_in_an_hf_model():
    """The packing contract end to end: with use_cache=False, an HF model sees each document alone.

    With a cache (HF's default whenever config.use_cache is True, in training too) HF skips the detection of
    position restarts and attends across documents, so trainers must pass use_cache=False.
    """
    transformers = pytest.importorskip("transformers")
    config_dir = Path(__file__).resolve().parent.parent / "hf_models" / "tiny-qwen3-moe"
    if not (config_dir / "config.json").is_file():
        pytest.skip(f"no model config at {config_dir}")
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(config_dir)).eval()
    packed = pack_documents([[5, 6, 7, 8, 9], [10, 11, 12]], seq_len=12, eos_id=2, bos_id=1, seed=None)
    ids, positions = packed.input_ids[:1].long(), packed.position_ids[:1].long()  # documents at [0, 7), [7, 12)
    with torch.no_grad():
        logits = model(input_ids=ids, position_ids=positions, use_cache=False).logits
        first = model(input_ids=ids[:, :7], use_cache=False).logits
        second = model(input_ids=ids[:, 7:], use_cache=False).logits
    torch.testing.assert_close(logits, torch.cat([first, second], dim=1))  # fp32, same kernels: near-exact


def test_build_pretrain_dataset(tok):
    dataset, stats = build_pretrain_dataset(bundled_corpus(), tok, seq_len=256, limit=NUM_DOCS)
    assert len(dataset) == (stats.num_tokens + 2 * stats.num_documents) // 256 and dataset.seq_len == 256


# ---------------------------------------------------------------- SFT


def sft_rows() -> list[dict]:
    return [
        {"prompt": "Who let Netherfield Park?", "response": "Mr. Bingley, a young man of large fortune."},
        {"prompt": "Name a sister.", "response": "Jane."},
        {"messages": [{"role": "user", "content": "Where is Pemberley?"}, {"role": "assistant", "content": "Derby"}]},
    ]


def expected_plain(tok, prompt: str, response: str) -> tuple[list[int], list[int]]:
    prompt_ids = [tok.bos_id] + tok.encode(prompt + "\n")
    response_ids = tok.encode(response) + [tok.eos_id]
    return prompt_ids + response_ids, [IGNORE_INDEX] * len(prompt_ids) + response_ids


def test_sft_plain_labels_mask_prompt_and_padding(tok, tmp_path):
    examples = load_sft_examples(write_jsonl(tmp_path / "sft.jsonl", sft_rows()))
    assert examples[2].messages[-1] == {"role": "assistant", "content": "Derby"}
    padded = build_sft_dataset(examples, tok, seq_len=48, pack=False, seed=None)
    assert len(padded) == 3
    for n, example in enumerate(examples):
        ids, labels = expected_plain(tok, example.messages[0]["content"], example.messages[1]["content"])
        num_pad = 48 - len(ids)
        assert padded[n]["input_ids"].tolist() == ids + [tok.pad_id] * num_pad
        assert padded[n]["labels"].tolist() == labels + [IGNORE_INDEX] * num_pad
        assert padded[n]["position_ids"].tolist() == list(range(len(ids))) + list(range(num_pad))
    # Packed: example 0 does not leave room for example 1, so rows are [0] and [1, 2], each padded to 48.
    plain = [expected_plain(tok, e.messages[0]["content"], e.messages[-1]["content"]) for e in examples]
    lengths = [len(ids) for ids, _ in plain]
    assert lengths[0] + lengths[1] > 48 >= lengths[1] + lengths[2]  # precondition of the layout above
    packed = build_sft_dataset(examples, tok, seq_len=48, pack=True, seed=None)
    assert len(packed) == 2
    for n, group in enumerate([[0], [1, 2]]):
        num_pad = 48 - sum(lengths[i] for i in group)
        ids = [t for i in group for t in plain[i][0]] + [tok.pad_id] * num_pad
        labels = [t for i in group for t in plain[i][1]] + [IGNORE_INDEX] * num_pad
        positions = [p for i in group for p in range(lengths[i])] + list(range(num_pad))
        assert packed[n]["input_ids"].tolist() == ids and packed[n]["labels"].tolist() == labels
        assert packed[n]["position_ids"].tolist() == positions


def make_hf_tokenizer_dir(path: Path, docs: list[str]) -> Path:
    """A small byte-level BPE tokenizer with a chat template, saved as an HF model directory would hold it."""
    tokenizers = pytest.importorskip("tokenizers")
    transformers = pytest.importorskip("transformers")
    backend = tokenizers.Tokenizer(tokenizers.models.BPE())
    backend.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<pad>", "<s>", "</s>"],
        initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet(),
    )
    backend.train_from_iterator(docs, trainer)
    hf = transformers.PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token="<s>", eos_token="</s>", pad_token="<pad>"
    )
    hf.chat_template = (
        "{% for m in messages %}<s>{{ m['role'] }}:\n{{ m['content'] }}</s>{% endfor %}"
        "{% if add_generation_prompt %}<s>assistant:\n{% endif %}"
    )
    hf.save_pretrained(str(path))
    return path


def test_sft_chat_template_masks_the_rendered_prompt(tmp_path, docs):
    hf = load_hf_tokenizer(make_hf_tokenizer_dir(tmp_path / "hf", docs[:3]))
    assert hf.has_chat_template and hf.eos_id == 2 and hf.pad_id == 0
    example = SFTExample(({"role": "user", "content": "Who?"}, {"role": "assistant", "content": "Mr. Darcy"}))
    sample = build_sft_dataset([example], hf, seq_len=64, pack=False)[0]
    prompt = hf.apply_chat_template(example.messages[:1], add_generation_prompt=True)
    labels = sample["labels"].tolist()
    assert labels[: len(prompt)] == [IGNORE_INDEX] * len(prompt)
    learned = [t for t in labels if t != IGNORE_INDEX]
    assert hf.decode(learned) == "Mr. Darcy</s>"
    assert labels.index(IGNORE_INDEX, len(prompt)) == len(prompt) + len(learned)  # then only padding


# ---------------------------------------------------------------- sampler and loader


def test_lanes_are_disjoint_and_cover_the_data():
    num_samples, lanes = 24, 3
    shares = [ShardedSampler(num_samples, num_lanes=lanes, lane=j, seed=5) for j in range(lanes)]
    epoch0 = [[next(s) for _ in range(8)] for s in shares]
    assert sorted(i for share in epoch0 for i in share) == list(range(num_samples))
    epoch1 = [[next(s) for _ in range(8)] for s in shares]
    assert sorted(i for share in epoch1 for i in share) == list(range(num_samples)) and epoch1 != epoch0
    assert all(s.epoch == 1 for s in shares)
    uneven = [ShardedSampler(10, num_lanes=3, lane=j).epoch_indices(0) for j in range(3)]
    assert [len(u) for u in uneven] == [3, 3, 3] and len({i for u in uneven for i in u}) == 9


@pytest.mark.parametrize("stop_at", [5, 11, 12])  # mid-epoch, one before and exactly at the epoch boundary
def test_sampler_resumes_exactly(stop_at):
    reference = ShardedSampler(25, num_lanes=2, lane=1, seed=9)
    expected = [next(reference) for _ in range(40)]
    first = ShardedSampler(25, num_lanes=2, lane=1, seed=9)
    head = [next(first) for _ in range(stop_at)]
    resumed = ShardedSampler(25, num_lanes=2, lane=1, seed=9)
    resumed.load_state_dict(first.state_dict())
    assert head + [next(resumed) for _ in range(40 - stop_at)] == expected


def small_dataset(num_samples: int = 30, seq_len: int = 8) -> PackedDataset:
    ids = torch.arange(num_samples * seq_len, dtype=torch.int32).reshape(num_samples, seq_len)
    return PackedDataset(ids, ids.clone(), torch.arange(seq_len, dtype=torch.int32).repeat(num_samples, 1))


def steps_as_lists(steps) -> list:
    return [[mb["input_ids"].tolist() for mb in step] for step in steps]


def test_loader_yields_micro_batches_and_resumes_exactly():
    dataset = small_dataset()
    with MicroBatchLoader(
        dataset, ShardedSampler(30, num_lanes=2, lane=0, seed=1), micro_batch_size=2, num_micro_batches=3
    ) as reference:
        expected = [next(reference) for _ in range(6)]  # 6 steps x 6 samples crosses the 15-sample epoch
    assert all(len(step) == 3 for step in expected)
    assert all(mb[k].shape == (2, 8) and mb[k].dtype == torch.int64 for step in expected for mb in step for k in mb)
    first = MicroBatchLoader(
        dataset, ShardedSampler(30, num_lanes=2, lane=0, seed=1), micro_batch_size=2, num_micro_batches=3, prefetch=3
    )
    head = [next(first) for _ in range(2)]
    state = first.state_dict()
    first.close()
    resumed = MicroBatchLoader(
        dataset, ShardedSampler(30, num_lanes=2, lane=0, seed=1), micro_batch_size=2, num_micro_batches=3
    )
    resumed.load_state_dict(state)
    with resumed:
        tail = [next(resumed) for _ in range(4)]
    assert steps_as_lists(head + tail) == steps_as_lists(expected)


def test_loader_thread_shuts_down_cleanly_and_continues_after_close():
    loader = MicroBatchLoader(small_dataset(), ShardedSampler(30), micro_batch_size=1, num_micro_batches=1, prefetch=2)
    first = next(loader)
    time.sleep(0.05)  # let the producer fill the queue and block on it
    assert loader.is_running
    loader.close()
    assert not loader.is_running and not any(t.name == "MicroBatchLoader" for t in threading.enumerate())
    second = next(loader)  # the prefetched steps were dropped and are drawn again, none skipped
    loader.close()
    expected = ShardedSampler(30).epoch_indices(0)[:2]
    assert [first[0]["input_ids"][0, 0].item() // 8, second[0]["input_ids"][0, 0].item() // 8] == expected


def test_loader_reraises_dataset_errors():
    class Broken(PackedDataset):
        def __getitem__(self, index):
            raise KeyError("broken sample")

    base = small_dataset()
    loader = MicroBatchLoader(
        Broken(base.input_ids, base.labels, base.position_ids),
        ShardedSampler(30),
        micro_batch_size=2,
        num_micro_batches=1,
    )
    with pytest.raises(KeyError, match="broken sample"):
        next(loader)
    assert not loader.is_running


# ---------------------------------------------------------------- one-line errors


def test_missing_file(tmp_path):
    with pytest.raises(DataError, match=r"data file .*nope\.jsonl does not exist") as excinfo:
        load_documents(tmp_path / "nope.jsonl")
    assert_one_line(excinfo)


@pytest.mark.parametrize("content", ["", "\n\n  \n", '{"text": "  "}\n'])
def test_empty_source(tmp_path, content):
    path = tmp_path / ("e.jsonl" if content.startswith("{") else "e.txt")
    path.write_text(content)
    with pytest.raises(DataError, match=r"no documents in .*: it is empty") as excinfo:
        load_documents(path)
    assert_one_line(excinfo)


def test_wrong_jsonl_field(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"body": "x", "id": 1}])
    with pytest.raises(DataError, match=r"d\.jsonl line 1 has no field 'text' \(fields: body, id\)") as excinfo:
        load_documents(path)
    assert_one_line(excinfo)
    with pytest.raises(DataError, match=r"line 1 needs fields 'prompt' and 'response' or a 'messages' list"):
        load_sft_examples(path)


def test_unknown_format_and_bad_json(tmp_path):
    (tmp_path / "d.csv").write_text("text\nhello\n")
    with pytest.raises(DataError, match=r"d\.csv has an unknown format"):
        load_documents(tmp_path / "d.csv")
    (tmp_path / "bad.jsonl").write_text('{"text": "ok"}\n{"text": \n')
    with pytest.raises(DataError, match=r"bad\.jsonl line 2 is not valid JSON"):
        load_documents(tmp_path / "bad.jsonl")


def test_vocab_mismatch(tmp_path):
    check_vocab(512, 512)
    with pytest.raises(DataError, match=r"tokenizer has 512 token ids but the model's vocab_size is 128") as excinfo:
        check_vocab(512, 128)
    assert_one_line(excinfo)
    with pytest.raises(
        DataError, match=r"SentencePiece cannot train vocab_size=32 .*pass a larger --vocab-size"
    ) as excinfo:
        train_or_load_tokenizer(bundled_corpus(), 32, tmp_path, limit=2)
    assert_one_line(excinfo)
    assert not list(tmp_path.iterdir())  # no partial model left in the cache


def test_too_long_sft_example(tok):
    example = SFTExample(
        ({"role": "user", "content": "Tell the story."}, {"role": "assistant", "content": "word " * 200})
    )
    with pytest.raises(
        DataError, match=r"SFT example .* has \d+ tokens, more than fit \(seq_len 64, model max positions 64\)"
    ) as excinfo:
        build_sft_dataset([example], tok, seq_len=64, max_positions=64)
    assert_one_line(excinfo)
    truncated = build_sft_dataset([example], tok, seq_len=64, truncate=True)[0]
    assert truncated["labels"][0] == IGNORE_INDEX and truncated["labels"][-1] != IGNORE_INDEX  # prompt, response
    with pytest.raises(DataError, match=r"seq_len \(128\) exceeds the model's max_position_embeddings \(64\)"):
        build_sft_dataset([example], tok, seq_len=128, max_positions=64)


def test_no_tokenizer_files_and_sampler_mismatch(tmp_path):
    with pytest.raises(DataError, match=r"has no tokenizer files"):
        load_hf_tokenizer(tmp_path)
    state = ShardedSampler(30, num_lanes=2).state_dict()
    with pytest.raises(DataError, match=r"sampler state has num_lanes=2 but this run has num_lanes=3"):
        ShardedSampler(30, num_lanes=3).load_state_dict(state)


def test_hub_dataset_offline_fails_with_one_line(monkeypatch):
    datasets = pytest.importorskip("datasets")
    import huggingface_hub.constants

    # Offline mode makes the failure immediate instead of five network retries.
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    with pytest.raises(DataError, match=r"cannot load hub dataset 'nobody/no-such-dataset' split 'train'") as excinfo:
        load_documents("hf:nobody/no-such-dataset")
    assert_one_line(excinfo)
