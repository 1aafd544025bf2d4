"""``"disagmoe.attention"``: which of HF's attention functions the parts run, chosen before the parts are cut and
refused before launch where the model's HF class lacks it."""

from __future__ import annotations

import time

import pytest
import torch
from transformers import AutoConfig

from disagmoe_ds.afpipe.verify import main
from disagmoe_ds.config import DisagMoEConfig
from disagmoe_ds.errors import ConfigError
from disagmoe_ds.models.attention_kernel import attention_for, attention_refusal, use_attention
from disagmoe_ds.models.check import compare
from disagmoe_ds.models.loading import build_meta_model

GPT_OSS, QWEN3 = "hf_models/tiny-gpt-oss", "hf_models/tiny-qwen3-moe"


@pytest.mark.parametrize(
    ("model", "device", "runs"),
    [(GPT_OSS, "cuda", "flex_attention"), (GPT_OSS, "cpu", "eager"), (QWEN3, "cuda", "sdpa"), (QWEN3, "cpu", "sdpa")],
)
def test_auto_replaces_only_hfs_eager_fallback_and_only_on_cuda(model, device, runs):
    assert attention_for(AutoConfig.from_pretrained(model), "auto", device) == runs


def test_auto_keeps_an_implementation_the_model_was_built_with():
    model = build_meta_model(QWEN3)
    model.set_attn_implementation("eager")
    use_attention(model, "auto", torch.device("cpu"))
    assert model.config._attn_implementation == "eager"


def test_a_named_kernel_reaches_every_attention_module():
    model = build_meta_model(QWEN3)
    use_attention(model, "eager", torch.device("cpu"))
    assert {layer.self_attn.config._attn_implementation for layer in model.model.layers} == {"eager"}


def test_the_check_runs_the_split_and_hf_on_the_named_kernel():
    summary = compare(QWEN3, shards=2, dtype="fp32", seq_len=16, batch=2, seed=0, attention="eager")
    assert summary["attention"] == "eager" and summary["pass"], summary


def test_a_kernel_the_model_lacks_fails_before_launch(capsys):
    start = time.monotonic()
    assert main(["--model", GPT_OSS, "--attention", "sdpa"]) == 2
    assert time.monotonic() - start < 10  # no rank was started
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        'disagmoe-verify: error: "disagmoe.attention": sdpa is not one HF\'s gpt_oss runs (it runs eager, '
        'flex_attention): pick one or "auto"'
    ]


def test_flex_attention_on_a_cpu_rank_fails_with_the_fix():
    assert attention_refusal(AutoConfig.from_pretrained(QWEN3), "flex_attention", "cuda") is None
    with pytest.raises(ConfigError, match='flex_attention has no backward on CPU .*: use "auto" on CPU ranks'):
        use_attention(build_meta_model(QWEN3), "flex_attention", torch.device("cpu"))


def test_an_unknown_kernel_is_refused_where_the_config_is_read():
    with pytest.raises(ConfigError, match=r'"disagmoe.attention" must be one of \[.*\], got \'flash\''):
        DisagMoEConfig.from_ds_config({"disagmoe": {"attention": "flash"}})


def test_bf16_logits_beyond_their_bound_pass_only_as_close_to_fp32_as_hfs_bf16(monkeypatch):
    """``models.check``'s bf16 yardstick where the fixed bound is missed: HF's own bf16 distance to the fp32 model."""
    from disagmoe_ds.models import check

    monkeypatch.setitem(check.TOLERANCE["bf16"], "logits", 0.0)  # every bf16 run misses it
    summary = compare(QWEN3, shards=2, dtype="bf16", seq_len=16, batch=2, seed=0)
    hf, split = summary["logits_to_fp32"]["hf"], summary["logits_to_fp32"]["split"]
    assert summary["pass"] and 0 < split <= check.AS_CLOSE_TO_FP32 * hf, summary
    monkeypatch.setattr(check, "AS_CLOSE_TO_FP32", 0.5 * split / hf)
    assert not compare(QWEN3, shards=2, dtype="bf16", seq_len=16, batch=2, seed=0)["pass"]
