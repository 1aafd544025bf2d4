"""run_pretrain.py's command line: flags override the ds_config, bad values fail with the flag's name."""

from __future__ import annotations

import doctest
import importlib
import json
import sys
import types
from pathlib import Path

import pytest
import torch

from disagmoe_ds.errors import ConfigError
from disagmoe_ds.train.args import parse_args
from disagmoe_ds.train.flags import build_parser

ROOT = Path(__file__).resolve().parent.parent

# The command line is an interface: a flag is added or removed on purpose, with this list (torchtitan's rule).
FLAGS = frozenset(
    {
        "--help", "--model", "--init-from", "--data", "--text-field", "--tokenizer", "--vocab-size",
        "--tokenizer-cache", "--seq-len", "--attention-gpus", "--ffn-gpus", "--depth", "--micro-batches",
        "--expert-data-parallel", "--node-dedup", "--sequence-parallel", "--tensor-parallel", "--steps",
        "--micro-batch-size", "--lr",
        "--dtype", "--seed", "--fp8", "--attention",
        "--bias-update-rate", "--sft", "--freeze-router", "--freeze-attention", "--save-dir", "--save-every",
        "--keep-last", "--resume", "--metrics-file", "--tensorboard", "--timeline", "--log-every", "--peak-tflops",
        "--hostfile", "--launcher-args", "--check-hostfile", "--local_rank", "--mode", "--world-size", "--ep-size",
        "--pp-size", "--virtual-stages", "--stage-layers",
        "--zero", "--export-hf", "--prompt-field", "--response-field", "--messages-field", "--export-hf-merged",
        "--lora-rank", "--lora-alpha", "--lora-targets", "--lora-dropout", "--lora-train-router", "--sft-truncate",
        "--txt-documents", "--eval-data", "--eval-split", "--eval-every", "--eval-steps", "--eval-only",
        # deepspeed.add_config_arguments' names
        "--deepspeed", "--deepspeed_config", "--deepscale", "--deepscale_config",
    }
)  # fmt: skip


def _parse(*argv: str, ds_config: dict | None = None, tmp_path: Path | None = None):
    if ds_config is not None:
        path = tmp_path / "ds.json"
        path.write_text(json.dumps(ds_config))
        argv = (*argv, "--deepspeed_config", str(path))
    return parse_args(list(argv), root=ROOT, description="")


def test_flags_are_frozen() -> None:
    parser = build_parser(description="", default_model=ROOT, default_ds_config=ROOT, default_cache=ROOT)
    flags = {opt for action in parser._actions for opt in action.option_strings if opt.startswith("--")}
    assert flags == FLAGS


def test_defaults_are_the_embedded_run() -> None:
    args, _ = _parse()
    assert args.model == ROOT / "hf_models" / "tiny-qwen3-moe-lm" and not args.pretrained
    assert (args.cfg.attention_gpus, args.cfg.ffn_gpus, args.cfg.depth, args.cfg.micro_batches) == (2, 2, 1, 4)
    assert args.micro_batch_size == 4 and args.dtype == "fp32"
    assert args.tokens_per_step == 2 * 4 * 4 * 128
    assert args.ds_config["scheduler"]["params"]["total_num_steps"] == args.steps


def test_flags_override_the_ds_config(tmp_path: Path) -> None:
    ds = {
        "disagmoe": {"attention_gpus": 4, "ffn_gpus": 2, "micro_batches": 8},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 5}},
        "train_micro_batch_size_per_gpu": 2,
    }
    args, _ = _parse("--ffn-gpus", "4", "--lr", "0.5", "--dtype", "bf16", "--zero", "1", "--steps", "7",
                     ds_config=ds, tmp_path=tmp_path)  # fmt: skip
    assert (args.cfg.attention_gpus, args.cfg.ffn_gpus, args.cfg.micro_batches) == (4, 4, 8)
    assert args.ds_config["optimizer"]["params"]["lr"] == 0.5
    assert args.ds_config["scheduler"]["params"]["warmup_max_lr"] == 0.5  # WarmupLR's peak is its own key
    assert "total_num_steps" not in args.ds_config["scheduler"]["params"]  # WarmupLR has no run length
    assert args.ds_config["bf16"]["enabled"] and args.dtype == "bf16"
    assert args.ds_config["zero_optimization"]["stage"] == 1  # bf16 needs ZeRO >= 1
    assert args.micro_batch_size == 2  # from the ds_config when the flag is absent


@pytest.mark.parametrize(
    ("argv", "ds_config", "message"),
    [
        (["--steps", "0"], None, r"--steps must be a positive integer, got 0"),
        (["--keep-last", "-1"], None, r"--keep-last must be >= 0"),
        (["--resume"], None, r"--resume without a checkpoint path needs --save-dir"),
        (["--model", "a", "--init-from", "b"], None, r"--model a and --init-from b disagree"),
        (["--bias-update-rate", "-1"], None, r"--bias-update-rate must be >= 0"),
        ([], {"disagmoe": {"atention_gpus": 2}}, r'unknown key\(s\) in "disagmoe": atention_gpus'),
        ([], {"gradient_accumulation_steps": 3}, r'"gradient_accumulation_steps" is 3 but this run has 1'),
        (["--micro-batch-size", "2"], {"train_batch_size": 5}, r'"train_batch_size" is 5 but this run has 2'),
        (["--attention-gpus", "0"], None, r'"disagmoe.attention_gpus" must be a positive int'),
    ],
)
def test_bad_values_name_the_flag(tmp_path: Path, argv: list[str], ds_config: dict | None, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        _parse(*argv, ds_config=ds_config, tmp_path=tmp_path)


def test_missing_ds_config_is_one_line() -> None:
    with pytest.raises(ConfigError, match=r"DeepSpeed config /nope.json does not exist"):
        _parse("--deepspeed_config", "/nope.json")


@pytest.mark.parametrize("module", ["settings", "balance"])
def test_doctests(module: str) -> None:
    assert doctest.testmod(importlib.import_module(f"disagmoe_ds.train.{module}")).failed == 0


def test_short_of_gpus_says_what_to_do(monkeypatch):
    from disagmoe_ds.train.job import local_backend

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(ConfigError, match=r"has 1 GPU; .*--mode colocated"):
        local_backend(4)
    assert local_backend(1) == "nccl"


def test_zero_flag_and_engine_settings_refused_at_parse_time(tmp_path) -> None:
    args, _ = _parse("--zero", "2")
    assert args.ds_config["zero_optimization"]["stage"] == 2
    refused = {
        ("--lr=-1e-3",): r"--lr must be a positive number, got -0.001",
        ("--dtype", "bf16", "--zero", "0"): r"bf16 needs .* \(--zero 1, or --dtype fp32\)",
    }
    for argv, message in refused.items():
        with pytest.raises(ConfigError, match=message):
            _parse(*argv)
    for ds_config, message in [
        ({"zero_optimization": {"stage": 3}}, r'"zero_optimization.stage" 3 is not supported'),
        ({"fp16": {"enabled": True}}, r'"fp16" is not supported'),
        ({"optimizer": {"type": "AdamW", "params": {"betas": [0.9, 1.5]}}}, r"betas\" must be in \[0, 1\), got 1.5"),
    ]:
        with pytest.raises(ConfigError, match=message):
            _parse(ds_config=ds_config, tmp_path=tmp_path)


def test_tensorboard_without_the_package_is_refused_with_the_fix(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "tensorboard", None)  # import tensorboard raises ImportError, installed or not
    with pytest.raises(ConfigError, match=r"^--tensorboard .*tb needs the tensorboard package, which is not "
                       r"installed; pip install tensorboard"):  # fmt: skip
        _parse("--tensorboard", str(tmp_path / "tb"))
    monkeypatch.setitem(sys.modules, "tensorboard", types.ModuleType("tensorboard"))
    assert _parse("--tensorboard", str(tmp_path / "tb"))[0].tensorboard == tmp_path / "tb"


def test_a_ds_config_key_unlike_any_deepspeed_reads_is_warned_about() -> None:
    from disagmoe_ds.train.checks import check_ds_config_keys

    with pytest.warns(UserWarning, match=r'ds_config key "my_notes" is not one DeepSpeed .* reads; it is ignored'):
        check_ds_config_keys({"my_notes": "run 7", "zero_optimization": {"stage": 1}})
    with pytest.raises(ConfigError, match=r'"scheduler.type" \'Cosine\' is not a DeepSpeed scheduler; one of'):
        check_ds_config_keys({"scheduler": {"type": "Cosine"}})


def test_a_colocated_section_runs_co_located(tmp_path) -> None:
    """``"disagmoe": {"colocated": ...}`` (what disagmoe-plan writes for a co-located plan) sets the mode, the world
    size and the EP size; the flags override it, and --mode disaggregated contradicts it."""
    section = {"colocated": {"world_size": 4, "ep_size": 2}, "micro_batches": 3}
    args, _ = _parse(ds_config={"disagmoe": section}, tmp_path=tmp_path)
    assert args.mode == "colocated" and (args.cfg.world_size, args.cfg.ep_size, args.cfg.micro_batches) == (4, 2, 3)
    args, _ = _parse("--world-size", "2", "--ep-size", "1", ds_config={"disagmoe": section}, tmp_path=tmp_path)
    assert (args.cfg.world_size, args.cfg.ep_size) == (2, 1)
    refused = [
        ((("--mode", "disaggregated"), section), r'--mode disaggregated, but the ds_config\'s "disagmoe.colocated"'),
        (((), {"colocated": {"ep": 2}}), r'unknown key\(s\) in "disagmoe.colocated": ep; known: world_size, ep_size'),
        (((), {"colocated": {"world_size": 0}}), r"colocated.world_size must be a positive int, got 0"),
    ]
    for (argv, bad), message in refused:
        with pytest.raises(ConfigError, match=message):
            _parse(*argv, ds_config={"disagmoe": bad}, tmp_path=tmp_path)
