"""Throughput metrics: Megatron-style model FLOPs, tokens/s, TFLOP/s per GPU, MFU."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from disagmoe_ds.runtime.step import StepResult
from disagmoe_ds.train.args import parse_args
from disagmoe_ds.train.metrics import Throughput, model_facts, peak_tflops
from disagmoe_ds.train.progress import Progress

ROOT = Path(__file__).resolve().parent.parent


def test_model_facts_of_the_tiny_default() -> None:
    """tiny-qwen3-moe-lm by hand: H 128, 4 layers (all MoE), 8 experts of I 128, top-2, vocab 512, GQA 4/2 x 32."""
    facts = model_facts(ROOT / "hf_models" / "tiny-qwen3-moe-lm", seq_len=128)
    h, i, s = 128, 128, 128
    attn_proj = 2 * h * 128 + 2 * 2 * h * 64 + 2 * 128 * h  # q, k+v, o
    attn_core = 2 * 4 * (32 + 32) * (s * s / 2) / s  # scores + values over half the causal matrix
    per_layer = attn_proj + attn_core + 2 * h * 8 + 2 * 6 * h * i  # + router + top-2 SwiGLU experts
    assert facts.flops_per_token == pytest.approx(3 * (4 * per_layer + 2 * h * 512))
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(ROOT / "hf_models" / "tiny-qwen3-moe-lm"))
    assert facts.total_params == sum(p.numel() for p in model.parameters())
    assert facts.total_params - facts.active_params == 4 * (8 - 2) * 3 * h * i  # idle experts of 4 MoE layers


def test_throughput_record() -> None:
    tp = Throughput(tokens_per_step=1000, flops_per_token=6e9, world_size=4, peak_tflops=1.0)
    rec = tp.record(7, StepResult(2.0, 1.9, 10.0, 0.5, 1.5), lr=1e-3, seconds=2.0, imbalance=[None, 1.5, 3.0])
    assert rec.tokens_per_s == 500 and rec.tflops_per_gpu == pytest.approx(0.75) and rec.mfu == pytest.approx(0.75)
    assert rec.max_imbalance == 3.0 and rec.to_json()["max_imbalance"] == 3.0
    no_peak = Throughput(tokens_per_step=1000, flops_per_token=6e9, world_size=4, peak_tflops=None)
    assert no_peak.record(1, StepResult(2.0, 1.9, 1.0, None, 1.0), lr=0.0, seconds=1.0, imbalance=[]).mfu is None


def test_rank_0_peak_memory_is_shown_on_a_gpu_only(monkeypatch) -> None:
    from disagmoe_ds.train.progress import summary_fields

    tp = Throughput(tokens_per_step=1000, flops_per_token=6e9, world_size=4, peak_tflops=None)
    cpu = tp.record(1, StepResult(2.0, 1.9, 1.0, None, 1.0), lr=0.0, seconds=1.0, imbalance=[])
    assert cpu.peak_gib is None and "mem" not in summary_fields(cpu)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda: 3 * 2**30)
    gpu = tp.record(1, StepResult(2.0, 1.9, 1.0, None, 1.0), lr=0.0, seconds=1.0, imbalance=[])
    assert gpu.peak_gib == 3.0 and summary_fields(gpu)["mem"] == "3.0G" and gpu.to_json()["peak_gib"] == 3.0


def test_peak_is_unknown_on_cpu_unless_given() -> None:
    assert peak_tflops(torch.device("cpu"), None) is None
    assert peak_tflops(torch.device("cpu"), 123.0) == 123.0


def _tensorboard_installed() -> bool:
    try:
        import torch.utils.tensorboard  # noqa: F401
    except ImportError:
        return False
    return True


def test_progress_without_a_terminal(tmp_path: Path, capsys) -> None:
    """No TTY (CI, a log file): a plain line every --log-every steps and at the end; every step as a JSON line."""
    argv = ["--steps", "3", "--log-every", "2", "--metrics-file", str(tmp_path / "m.jsonl")]
    if _tensorboard_installed():  # without it --tensorboard is refused up front (test_train_args)
        argv += ["--tensorboard", str(tmp_path / "tb")]
    args, _ = parse_args(argv, root=ROOT, description="")
    tp = Throughput(tokens_per_step=100, flops_per_token=1e9, world_size=4, peak_tflops=None)
    progress = Progress(args, start_step=0)
    for step in (1, 2, 3):
        progress.step(tp.record(step, StepResult(5.0 - step, 4.0, 2.0, 1.0, 0.1), lr=0.1, seconds=0.5, imbalance=[1.5]))
    progress.close()
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[1] for line in lines] == ["2/3", "3/3"]
    assert "loss 2.0000 aux 2.000 tok/s 200 TFLOP/s/gpu 0.05 MFU n/a imb 1.50" in lines[-1]
    assert [json.loads(line)["step"] for line in (tmp_path / "m.jsonl").read_text().splitlines()] == [1, 2, 3]
