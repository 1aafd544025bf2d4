"""The evaluation loss on held-out data (issue 45): the split and its batches, forward-only streams that cannot
deadlock, and run_pretrain.py end to end on CPU ranks: the eval loss equals HF's (fp32, single process, the same
weights and held-out tokens) in both modes, for pretraining and SFT; training goes on bit for bit with evaluations
between its steps; a resumed run and ``--eval-only`` over an exported HF directory report the same loss.

The disaggregated runs use the rendezvous transport (a send completes only once its receive started, as NCCL's
network transport): an evaluation's streams must not deadlock there.
"""

from __future__ import annotations

import doctest
import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from disagmoe_ds.data import IGNORE_INDEX, HeldOutBatches, PackedDataset, hold_out
from disagmoe_ds.schedule import (
    Costs,
    ForwardAttn,
    ForwardExperts,
    PipeShape,
    check_streams,
    forward_stream,
    generate,
)
from tests.runs import ROOT, SHORT, assert_refused_before_launch, pretrain, records, same, write_sft_jsonl

MODEL = ROOT / "hf_models" / "tiny-qwen3-moe-lm"
TOL = 1e-5  # fp32: the ranks sum the token losses in another order than HF's single process
EVAL = ("--eval-split", 0.002, "--eval-steps", 2)  # 120 of the bundled corpus's 32-token samples; 2 batches of 32


def test_held_out_split_is_seeded_disjoint_and_its_batches_read_each_sample_once() -> None:
    from disagmoe_ds.data import held_out

    assert doctest.testmod(held_out).failed == 0
    data = PackedDataset.from_rows([([i] * 4, [i] * 4, [0, 1, 2, 3]) for i in range(50)])
    train, held = hold_out(data, 0.2, seed=3)
    again, _ = hold_out(data, 0.2, seed=3)
    other, _ = hold_out(data, 0.2, seed=4)
    ids = lambda d: d.input_ids[:, 0].tolist()  # noqa: E731
    assert len(held) == 10 and sorted(ids(train) + ids(held)) == list(range(50)) and ids(again) == ids(train)
    assert ids(other) != ids(train)
    lanes = [HeldOutBatches(held, lanes=2, lane=j, micro_batches=2, micro_batch_size=2) for j in range(2)]
    assert [len(b) for b in lanes] == [2, 2]  # 10 samples, 8 per batch: the second is filled up
    seen = [
        int(row[0])
        for b in lanes
        for i in range(len(b))
        for mb in b[i]
        for row, labels in zip(mb["input_ids"], mb["labels"], strict=True)
        if (labels != IGNORE_INDEX).any()
    ]
    assert sorted(seen) == sorted(ids(held)) and lanes[0].tokens() == 10 * 3
    assert len(HeldOutBatches(held, lanes=2, lane=0, micro_batches=2, micro_batch_size=2, limit=1)) == 1


@pytest.mark.parametrize("depth", [1, 2, 4])
@pytest.mark.parametrize("split", [False, True])
def test_forward_streams_keep_the_contract(depth: int, split: bool) -> None:
    """An evaluation runs each worker's stream without its backward: still deadlock-free under rendezvous."""
    costs = Costs(a_wgt=1.0, f_wgt=1.0, head_wgt=1.0) if split else Costs()
    for micro_batches in (1, 3, 8):
        moe = tuple(layer != 1 for layer in range(8))  # a dense layer too
        schedule = generate(PipeShape(depth, 8, moe), micro_batches, costs=costs)
        forwards = {worker: forward_stream(stream) for worker, stream in schedule.streams.items()}
        check_streams(forwards)
        computes = [i for s in forwards.values() for i in s if isinstance(i, ForwardAttn | ForwardExperts)]
        assert len(computes) == micro_batches * (8 + 1 + sum(moe))  # every forward once, the head's included


def test_the_eval_loss_is_logged_beside_the_training_loss(tmp_path: Path, capsys) -> None:
    """No terminal: a log line after every evaluation, ``eval_loss`` in its JSON line only, TensorBoard's
    ``eval/lm_loss`` (a stand-in writer: tensorboard may not be installed); --eval-only's one record."""
    from disagmoe_ds.runtime.step import StepResult
    from disagmoe_ds.train.args import parse_args
    from disagmoe_ds.train.metrics import Throughput
    from disagmoe_ds.train.progress import Progress

    class Scalars:
        def __init__(self) -> None:
            self.points: list[tuple[str, float, int]] = []

        def add_scalar(self, tag: str, value: float, step: int) -> None:
            self.points.append((tag, value, step))

        def close(self) -> None:
            pass

    args, _ = parse_args(["--steps", "3", "--log-every", "10", "--eval-split", "0.1", "--metrics-file",
                          str(tmp_path / "m.jsonl")], root=ROOT, description="")  # fmt: skip
    progress, scalars = Progress(args, start_step=0), Scalars()
    progress.tensorboard = scalars
    throughput = Throughput(tokens_per_step=10, flops_per_token=1.0, world_size=1, peak_tflops=None)
    for step, eval_loss in ((1, None), (2, 4.5), (3, None)):
        result = StepResult(5.0, 4.9, 1.0, 0.5, 1.0)
        progress.step(throughput.record(step, result, lr=0.1, seconds=1.0, imbalance=[], eval_loss=eval_loss))
    progress.evaluation(3, 4.25)
    progress.close()
    rest = "aux 1.000 tok/s 10 TFLOP/s/gpu 1e-11 MFU n/a imb n/a"
    assert capsys.readouterr().out.splitlines() == [f"step {n}/3 loss 5.0000 eval 4.5000 {rest}" for n in (2, 3)]
    assert [r.get("eval_loss") for r in records(tmp_path / "m.jsonl")] == [None, 4.5, None, 4.25]
    assert [(v, n) for tag, v, n in scalars.points if tag == "eval/lm_loss"] == [(4.5, 2), (4.25, 3)]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--eval-every", 2], r"--eval-every needs held-out data: pass --eval-data PATH, or --eval-split F"),
        (["--eval-split", 0.1, "--eval-data", "x.txt"], r"--eval-data and --eval-split both"),
        (["--eval-split", 1.5], r"--eval-split must be a fraction between 0 and 1"),
        (["--eval-split", 0.1, "--eval-only"], r"--eval-only evaluates the weights of --init-from HF_DIR or --resume"),
        (["--eval-split", 0.1, "--eval-only", "--init-from", MODEL, "--export-hf", "x"], r"drop --export-hf"),
    ],
)
def test_bad_eval_flags_are_refused_before_launch(tok_cache, capfd, argv, message) -> None:
    assert_refused_before_launch(tok_cache, capfd, argv, message)


def _rendezvous(tmp: Path) -> Path:
    """The default ds_config with the rendezvous transport."""
    config = json.loads((ROOT / "ds_configs" / "tiny-cpu.json").read_text())
    config["disagmoe"]["transport"] = "rendezvous"
    (tmp / "rendezvous.json").write_text(json.dumps(config))
    return tmp / "rendezvous.json"


def _eval_losses(path: Path) -> dict[int, float]:
    return {r["step"]: r["eval_loss"] for r in records(path) if "eval_loss" in r}


def _hf_eval_loss(hf_dir: Path, tok_cache: Path, *argv: object) -> float:
    """HF's model from ``hf_dir`` (fp32, one process) on the held-out samples ``run_pretrain.py argv`` evaluates: the
    LM loss summed over every labelled token, over their count."""
    from transformers import AutoModelForCausalLM

    from disagmoe_ds.models.loading import load_config
    from disagmoe_ds.train.args import parse_args
    from disagmoe_ds.train.data import prepare_data

    args, _ = parse_args([*SHORT, "--tokenizer-cache", str(tok_cache), *map(str, argv)], root=ROOT, description="")
    held = prepare_data(args, load_config(args.model)).held_out
    assert held is not None
    n = len(held) if args.eval_steps is None else args.eval_steps * args.sequences_per_step
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    total, tokens = 0.0, 0
    with torch.no_grad():
        for i in range(min(n, len(held))):
            sample = held[i]
            logits = model(sample["input_ids"][None], position_ids=sample["position_ids"][None], use_cache=False).logits
            labels = sample["labels"][1:]
            total += F.cross_entropy(logits[0, :-1].double(), labels, ignore_index=IGNORE_INDEX, reduction="sum").item()
            tokens += int((labels != IGNORE_INDEX).sum())
    return total / tokens


@pytest.fixture(scope="module")
def pretraining(tmp_path_factory, tok_cache) -> Path:
    """2 steps of the default job, disaggregated under rendezvous, evaluating after each, saved after each, exported."""
    tmp = tmp_path_factory.mktemp("eval-pretrain")
    argv = ("--deepspeed_config", _rendezvous(tmp), *EVAL, "--steps", 2, "--eval-every", 1, "--save-dir", tmp / "ck",
            "--save-every", 1, "--export-hf", tmp / "hf", "--metrics-file", tmp / "m.jsonl")  # fmt: skip
    assert pretrain(tok_cache, *argv) == 0
    return tmp


def test_pretraining_eval_loss_is_hfs_and_leaves_training_bit_identical(pretraining, tok_cache, tmp_path, capfd):
    capfd.readouterr()
    losses = _eval_losses(pretraining / "m.jsonl")
    assert list(losses) == [1, 2] and losses[2] < losses[1]
    assert losses[2] == pytest.approx(_hf_eval_loss(pretraining / "hf", tok_cache, *EVAL), rel=TOL)
    # The same split without --eval-every: the same training steps bit for bit, one evaluation after the last.
    argv = ("--deepspeed_config", _rendezvous(tmp_path), *EVAL, "--steps", 2, "--metrics-file", tmp_path / "m.jsonl")
    assert pretrain(tok_cache, *argv) == 0
    assert same(records(tmp_path / "m.jsonl"), records(pretraining / "m.jsonl"))
    assert _eval_losses(tmp_path / "m.jsonl") == {2: losses[2]}
    out, _ = capfd.readouterr()
    assert f"eval loss {losses[2]:.4f} over" in out and "after step 2" in out


def test_a_resumed_run_reports_the_same_eval_loss(pretraining, tok_cache, tmp_path) -> None:
    """Resumed at step 1, and --eval-only on the step-2 checkpoint: the loss of step 2, bit for bit."""
    losses = _eval_losses(pretraining / "m.jsonl")
    rendezvous = ("--deepspeed_config", _rendezvous(tmp_path), *EVAL)
    argv = (*rendezvous, "--steps", 2, "--eval-every", 1, "--resume", pretraining / "ck" / "step1", "--metrics-file",
            tmp_path / "resumed.jsonl")  # fmt: skip
    assert pretrain(tok_cache, *argv) == 0
    assert _eval_losses(tmp_path / "resumed.jsonl") == {2: losses[2]}
    argv = (*rendezvous, "--eval-only", "--resume", pretraining / "ck" / "step2", "--metrics-file", tmp_path / "e")
    assert pretrain(tok_cache, *argv) == 0
    assert records(tmp_path / "e") == [{"step": 2, "eval_loss": losses[2]}]


def test_eval_only_over_the_export_matches_in_the_other_mode(pretraining, tok_cache, tmp_path, capfd) -> None:
    capfd.readouterr()
    metrics = tmp_path / "m.jsonl"
    argv = ("--mode", "colocated", "--world-size", 2, "--init-from", pretraining / "hf", *EVAL, "--eval-only",
            "--metrics-file", metrics)  # fmt: skip
    assert pretrain(tok_cache, *argv) == 0
    (record,) = records(metrics)
    assert record["step"] == 0 and record["eval_loss"] == pytest.approx(_eval_losses(pretraining / "m.jsonl")[2],
                                                                        rel=TOL)  # fmt: skip
    out, _ = capfd.readouterr()
    assert f"done: eval loss {record['eval_loss']:.4f} over" in out and "step 1/" not in out
    assert not (tmp_path / "ck").exists()


@pytest.fixture(scope="module")
def sft_model(tmp_path_factory, tok_cache) -> tuple[Path, Path]:
    """A tiny Qwen3-MoE with its own tokenizer, and 40 prompt/response rows."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from disagmoe_ds.data import bundled_corpus, train_or_load_tokenizer

    root = tmp_path_factory.mktemp("eval-sft")
    torch.manual_seed(1)
    AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(MODEL)).save_pretrained(root / "hf")
    train_or_load_tokenizer(bundled_corpus(), 512, tok_cache).save_hf(root / "hf")
    write_sft_jsonl(root / "sft.jsonl", n=40)
    return root / "hf", root / "sft.jsonl"


def test_sft_eval_loss_is_hfs_in_both_modes(sft_model, tok_cache, tmp_path) -> None:
    """Co-located SFT with an evaluation (prompts masked: the loss averages over response tokens only), then the
    disaggregated --eval-only over its export at depth 2, under rendezvous."""
    hf_dir, data = sft_model
    sft = ("--sft", "--data", data, "--seq-len", 64, "--eval-split", 0.25)
    colocated = tmp_path / "colocated.jsonl"
    argv = ("--mode", "colocated", "--world-size", 2, "--init-from", hf_dir, *sft, "--steps", 1, "--eval-every", 1,
            "--export-hf", tmp_path / "hf", "--metrics-file", colocated)  # fmt: skip
    assert pretrain(tok_cache, *argv) == 0
    loss = _eval_losses(colocated)[1]
    assert loss == pytest.approx(_hf_eval_loss(tmp_path / "hf", tok_cache, "--init-from", hf_dir, *sft), rel=TOL)
    disaggregated = tmp_path / "disaggregated.jsonl"
    argv = ("--deepspeed_config", _rendezvous(tmp_path), "--depth", 2, "--attention-gpus", 2, "--ffn-gpus", 2,
            "--init-from", tmp_path / "hf", *sft, "--eval-only", "--metrics-file", disaggregated)  # fmt: skip
    assert pretrain(tok_cache, *argv) == 0
    assert _eval_losses(disaggregated)[0] == pytest.approx(loss, rel=TOL)
