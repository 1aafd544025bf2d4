"""The smaller user-flow fixes of issue 45: advice that names real flags and lines, help examples that run, and
what a run changes without being asked said in its banner."""

from __future__ import annotations

import json
import re

from disagmoe_ds import convert
from disagmoe_ds.config import DisagMoEConfig
from disagmoe_ds.data import bundled_corpus, train_or_load_tokenizer
from tests.conftest import write_tiny_checkpoint
from tests.runs import assert_refused_before_launch, pretrain, records


def _sft_argv(tok_cache, data) -> list:
    """SFT on ``data`` with the default model and the bundled corpus's 512-piece SentencePiece model."""
    model = train_or_load_tokenizer(bundled_corpus(), 512, tok_cache).model_path
    return ["--sft", "--data", data, "--tokenizer", model, "--steps", 1]


def _sft_rows(path, rows) -> None:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))


def test_an_over_long_sft_example_names_the_flag_that_cuts_it(tok_cache, tmp_path, capfd) -> None:
    data = tmp_path / "sft.jsonl"
    _sft_rows(data, [{"prompt": "Who? " * 40, "response": "Her."}] + [{"prompt": "Why?", "response": "So."}] * 8)
    argv = _sft_argv(tok_cache, data)
    assert_refused_before_launch(tok_cache, capfd, argv, r"more than fit \(seq_len 32.*pass --sft-truncate")
    assert pretrain(tok_cache, *argv, "--sft-truncate", "--metrics-file", tmp_path / "m.jsonl") == 0
    assert len(records(tmp_path / "m.jsonl")) == 1


def test_multi_turn_rows_without_a_chat_template_are_announced(tok_cache, tmp_path, capfd) -> None:
    data = tmp_path / "chat.jsonl"
    turns = [{"role": "user", "content": "Hi."}, {"role": "assistant", "content": "Hello."}]
    _sft_rows(data, [{"messages": turns + turns}] * 3 + [{"messages": turns}] * 6)
    argv = _sft_argv(tok_cache, data)
    assert pretrain(tok_cache, *argv) == 0
    assert "(3 multi-turn: without a chat template each is plain text" in capfd.readouterr().out


def test_sft_from_weights_without_a_tokenizer_points_at_the_tokenizer_line(tok_cache, tmp_path, capfd) -> None:
    hf_dir = write_tiny_checkpoint("qwen3-moe", tmp_path / "hf", seed=1, vocab_size=512)
    data = tmp_path / "sft.jsonl"
    _sft_rows(data, [{"prompt": "Why?", "response": "So."}] * 8)
    message = r"--sft needs the tokenizer .* the SentencePiece \.model the pretraining run's 'tokenizer:' line names"
    assert_refused_before_launch(tok_cache, capfd, ["--init-from", hf_dir, "--sft", "--data", data], message)


def test_the_relayout_help_examples_are_layouts_of_the_default_model() -> None:
    examples = [line for line in convert.__doc__.splitlines() if "relayout --ckpt" in line]
    assert examples
    for line in examples:
        flags = dict(re.findall(r"--(attention-gpus|ffn-gpus|expert-data-parallel) (\d+)", line))
        cfg = DisagMoEConfig(**{k.replace("-", "_"): int(v) for k, v in flags.items()})
        cfg.layout(num_layers=4, num_experts=8)  # tiny-qwen3-moe-lm, run_pretrain's default


def test_a_resume_under_a_layout_of_another_batch_says_so(tok_cache, tmp_path, capfd) -> None:
    ck = tmp_path / "ck"
    assert pretrain(tok_cache, "--steps", 1, "--save-dir", ck) == 0
    capfd.readouterr()
    assert pretrain(tok_cache, "--steps", 2, "--resume", ck / "step1", "--micro-batches", 2) == 0
    out = capfd.readouterr().out
    assert "note: it trained on 1,024 tokens per step and this layout takes 512" in out, out


def test_a_zero1_run_with_an_export_prints_nothing_a_user_cannot_act_on(tok_cache, tmp_path, capfd) -> None:
    """No third-party line per rank (DeepSpeed's warm-up warning, torch's deprecation of DeepSpeed's call),
    no progress bar in a log, and the banner's lines agree (a frozen router is not "every weight")."""
    argv = ["--zero", 1, "--steps", 2, "--save-dir", tmp_path / "ck", "--export-hf", tmp_path / "hf"]
    assert pretrain(tok_cache, *argv, "--freeze-router") == 0
    out, err = capfd.readouterr()
    noise = ("is less than warmup_num_steps", "all_gather_into_tensor", "Writing model shards", "Traceback")
    assert not [n for n in noise if n in out + err], (out + err)[-3000:]
    assert "every weight but the frozen routers trains" in out
    assert "schedule: the warm-up (10 steps) is longer than the run (2)" in out
