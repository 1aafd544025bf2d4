"""Frozen FP8 base weights for LoRA (issue 42): a checkpoint in DeepSeek-V3's FP8 block layout stays FP8 on the ranks.

The tiny DeepSeek-V3 checkpoint here is written in that layout (every projection of its decoder layers e4m3 with a
float32 ``weight_scale_inv`` per block; the tiny widths call for [16, 16] blocks where DeepSeek's are [128, 128], and
its q_lora_rank of 24 leaves partial blocks). Its reference is PEFT's LoRA on the same model with the base
dequantized, the exact values the FP8 base stands for, at the fp32 tolerance.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from disagmoe_ds.afpipe.verify_run import run_verify
from disagmoe_ds.checkpoint.fp8_blocks import to_fp8_blocks
from disagmoe_ds.colocated.layout import ColocatedConfig
from disagmoe_ds.colocated.verify import ColocatedVerifyArgs, run_colocated_verify
from disagmoe_ds.config import DisagMoEConfig
from disagmoe_ds.errors import CheckpointError, ConfigError
from disagmoe_ds.fp8.blocks import BlockScaled, block_grouped_mm, block_linear, dequantize_blocks, quantize_blocks
from disagmoe_ds.fp8.frozen import BlockFp8Linear, held_weights
from disagmoe_ds.fp8.quantize import E4M3
from disagmoe_ds.models.fp8_base import base_fp8_line, fp8_block_size, keep_base_fp8
from disagmoe_ds.models.lora_settings import LoraSettings
from disagmoe_ds.parity.reference import TOLERANCE, VerifyArgs
from tests.conftest import write_tiny_checkpoint

BLOCK = [16, 16]
LORA = LoraSettings(rank=4, init_lora_weights=False)  # a non-zero update from the start


def write_fp8_checkpoint(out: Path, block=BLOCK, seed: int = 2, **overrides) -> Path:
    """The tiny DeepSeek-V3 in the FP8 block layout (``quantization_config`` as DeepSeek-V3's, ``block`` its)."""
    plain = write_tiny_checkpoint("deepseek-v3", out.with_name(out.name + "-plain"), seed=seed, **overrides)
    to_fp8_blocks(plain, out, tuple(block))
    return out


@pytest.fixture(scope="module")
def fp8_checkpoint(tmp_path_factory) -> Path:
    return write_fp8_checkpoint(tmp_path_factory.mktemp("fp8") / "tiny-deepseek-v3-fp8")


def test_block_dequantization_is_each_value_times_its_block_s_scale() -> None:
    """Against a float64 reference, partial blocks included (a 40 x 24 weight in 16 x 16 blocks)."""
    torch.manual_seed(0)
    w = torch.randn(2, 40, 24)
    q = quantize_blocks(w, (16, 16))
    assert q.data.dtype == E4M3 and q.scale_inv.shape == (2, 3, 2)
    expected = q.data.double().clone()
    for i in range(3):
        for j in range(2):
            expected[:, 16 * i : 16 * i + 16, 16 * j : 16 * j + 16] *= q.scale_inv[:, i, j, None, None].double()
    assert torch.equal(q.dequantize(), expected.float())
    assert (q.dequantize() - w).abs().max() <= w.abs().max() / 8  # e4m3's rounding


def test_products_with_a_block_scaled_weight_are_those_with_its_values() -> None:
    """Forward and the input gradient equal torch's own products with the dequantized weight; no weight gradient."""
    torch.manual_seed(0)
    w, w_e = quantize_blocks(torch.randn(40, 24), (16, 16)), quantize_blocks(torch.randn(3, 32, 40), (16, 16))
    x = torch.randn(7, 24, requires_grad=True)
    offsets = torch.tensor([2, 2, 7], dtype=torch.int32)
    y = block_grouped_mm(block_linear(x, w), w_e, offsets)
    x_ref = x.detach().clone().requires_grad_()
    y_ref = F.grouped_mm(F.linear(x_ref, w.dequantize()), w_e.dequantize().transpose(1, 2), offs=offsets)
    assert torch.equal(y, y_ref)
    g = torch.randn_like(y)
    assert torch.equal(torch.autograd.grad(y, x, g)[0], torch.autograd.grad(y_ref, x_ref, g)[0])
    assert not w.data.requires_grad and not w_e.data.requires_grad


KERNEL_SCRIPT = r"""
import torch, torch.nn.functional as F
from disagmoe_ds.fp8 import triton_block_mm
from disagmoe_ds.fp8.blocks import block_grouped_mm, block_linear, quantize_blocks
torch.manual_seed(0)
tiles = {"BLOCK_M": 16, "BLOCK_OUT": 16, "BLOCK_RED": 16, "num_warps": 1, "num_stages": 1}
# an empty group, ragged groups, partial edge blocks (40 = 2.5 blocks), rows past the last offset
for e, n, k, counts in [(3, 64, 48, [5, 0, 20]), (2, 40, 36, [17, 3])]:
    w = quantize_blocks(torch.randn(e, n, k), (16, 16))
    offsets = torch.tensor(counts).cumsum(0).to(torch.int32)
    rows = int(offsets[-1])
    for transposed, x in ((True, torch.randn(rows + 2, k)), (False, torch.randn(rows + 2, n))):
        weight = w.dequantize().transpose(1, 2) if transposed else w.dequantize()
        want = F.grouped_mm(x, weight, offs=offsets)[:rows]
        got = triton_block_mm.grouped_block_mm(x, w.data, w.scale_inv, w.block, offsets, transposed=transposed,
                                               tiles=tiles)
        torch.testing.assert_close(got[:rows], want, rtol=1e-5, atol=1e-5)
        assert not got[rows:].any()
# the autograd products take the kernel where it runs (forced here) and agree with the dequantizing path
w = quantize_blocks(torch.randn(3, 32, 48), (16, 16))
offsets = torch.tensor([9, 9, 30], dtype=torch.int32)
x = torch.randn(30, 48, requires_grad=True)
dy = torch.randn(30, 32)
generic = block_grouped_mm(x, w, offsets)
dx_generic, = torch.autograd.grad(generic, x, dy)
triton_block_mm.TILES.update(tiles)
triton_block_mm.runs = lambda t, block: triton_block_mm.fits(block)
kernel = block_grouped_mm(x, w, offsets)
dx_kernel, = torch.autograd.grad(kernel, x, dy)
torch.testing.assert_close(kernel, generic, rtol=1e-5, atol=1e-5)
torch.testing.assert_close(dx_kernel, dx_generic, rtol=1e-5, atol=1e-5)
# and a dense projection as one group of every row, the leading dimensions kept
w = quantize_blocks(torch.randn(40, 48), (16, 16))
x = torch.randn(2, 5, 48, requires_grad=True)
g = torch.randn(2, 5, 40)
y = block_linear(x, w)
dx, = torch.autograd.grad(y, x, g)
x_ref = x.detach().clone().requires_grad_()
y_ref = F.linear(x_ref, w.dequantize())
dx_ref, = torch.autograd.grad(y_ref, x_ref, g)
torch.testing.assert_close(y, y_ref, rtol=1e-5, atol=1e-5)
torch.testing.assert_close(dx, dx_ref, rtol=1e-5, atol=1e-5)
print("ok")
"""


def test_the_block_scaled_grouped_kernel_equals_the_products_with_the_dequantized_weight() -> None:
    """``fp8.triton_block_mm`` (the FP8 base's products on CUDA, reading e4m3 tiles as stored) in Triton's
    interpreter: both directions against ``F.grouped_mm`` with the dequantized weight, and through
    ``block_grouped_mm``'s and ``block_linear``'s autograd against the dequantizing path (only the order of the sums
    differs)."""
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    done = subprocess.run([sys.executable, "-c", KERNEL_SCRIPT], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().endswith("ok")


def test_the_config_s_block_size_is_read_and_other_formats_refused() -> None:
    def config(**quant):
        return type("Config", (), {"quantization_config": quant})()

    assert fp8_block_size(config(quant_method="fp8", fmt="e4m3", weight_block_size=[128, 128])) == (128, 128)
    assert fp8_block_size(config(quant_method="fp8")) is None  # per-tensor: HF's quantizer, as before
    assert fp8_block_size(config(quant_method="mxfp4")) is None
    with pytest.raises(CheckpointError, match="e4m3"):
        fp8_block_size(config(quant_method="fp8", fmt="e5m2", weight_block_size=[128, 128]))


def _rank_parts(path: Path, lora: bool):
    """An attention stage and an expert shard stage cut, placed and filled as a rank does it."""
    from disagmoe_ds.models.loading import build_meta_model
    from disagmoe_ds.models.partial_load import PretrainedWeights, place
    from disagmoe_ds.models.parts import AttentionStage, ExpertStage

    model = build_meta_model(path, dtype=torch.float32)
    weights = PretrainedWeights(path, model)
    if lora:
        keep_base_fp8(model, weights)
    stages = [
        AttentionStage(model, (0, 1, 2, 3), with_embedding=True, with_head=True),
        ExpertStage(model, (1, 2), 2, 6),
    ]
    for stage in stages:
        place(stage, model, torch.device("cpu"), weights=weights)
    return stages


def test_a_rank_holds_its_base_in_fp8_and_reads_its_own_values(fp8_checkpoint) -> None:
    """Every quantized projection is held as e4m3 plus scales (about one byte a parameter, no float copy), with the
    checkpoint's own values (an expert shard: its experts' rows, gate and up fused with their scales)."""
    stored = load_file(fp8_checkpoint / "model.safetensors")
    attention, experts = _rank_parts(fp8_checkpoint, lora=True)
    held = held_weights(attention)
    assert len(held) == 4 * 5 + 3 * 3 + 3  # MLA's five projections a layer, three shared experts, one dense MLP
    assert all(w.data.dtype == E4M3 and w.scale_inv.dtype == torch.float32 for w in held.values())
    assert not any(n.endswith("proj.weight") for n, _ in attention.named_parameters())  # no float copy anywhere
    q_b = held["layers.1.self_attn.q_b_proj.weight"]
    assert torch.equal(q_b.data.view(torch.uint8), stored["model.layers.1.self_attn.q_b_proj.weight"].view(torch.uint8))
    assert isinstance(attention.part(1).self_attn.q_b_proj, BlockFp8Linear)
    gate_up = held_weights(experts)["layers.2.experts.gate_up_proj"]
    gate = "model.layers.2.mlp.experts.3.gate_proj.weight"
    gate_e3 = dequantize_blocks(stored[gate], stored[gate + "_scale_inv"], (16, 16))
    assert gate_up.shape == (4, 64, 64) and gate_up.scale_inv.shape == (4, 4, 4)
    assert torch.equal(gate_up.dequantize()[1, :32], gate_e3)  # shard of experts 2-5: its row 1 is expert 3
    params = sum(w.data.numel() for w in {**held, **held_weights(experts)}.values())
    size = sum(w.data.nbytes + w.scale_inv.nbytes for w in {**held, **held_weights(experts)}.values())
    assert 1 < size / params < 1.04  # 4 bytes of scale per 256 parameters, and partial blocks
    line = base_fp8_line(experts)
    assert line is not None and "stays FP8" in line and "bytes per parameter" in line


def test_without_lora_the_checkpoint_is_read_dequantized(fp8_checkpoint) -> None:
    """Full fine-tuning: every weight a parameter in the training dtype, the exact values the FP8 blocks stand for."""
    stored = load_file(fp8_checkpoint / "model.safetensors")
    attention, _ = _rank_parts(fp8_checkpoint, lora=False)
    assert not held_weights(attention)
    weight = attention.part(1).self_attn.q_b_proj.weight
    expected = dequantize_blocks(stored["model.layers.1.self_attn.q_b_proj.weight"],
                                 stored["model.layers.1.self_attn.q_b_proj.weight_scale_inv"], (16, 16))  # fmt: skip
    assert weight.dtype == torch.float32 and weight.requires_grad and torch.equal(weight.detach(), expected)


@pytest.fixture
def ranks_kept_fp8(monkeypatch, tmp_path):
    """``() -> int``: how many ranks kept their base in FP8 (``runtime.rank`` calls ``keep_base_fp8``; the ranks
    are forked, so each leaves a file)."""
    from disagmoe_ds.runtime import rank

    def kept(model, weights) -> int:
        held = keep_base_fp8(model, weights)
        (tmp_path / f"kept-{os.getpid()}").write_text(str(held))
        return held

    monkeypatch.setattr(rank, "keep_base_fp8", kept)
    return lambda: sum(int(f.read_text()) > 0 for f in tmp_path.glob("kept-*"))


@pytest.mark.parametrize(
    "layout",
    [{}, {"attention_gpus": 2, "ffn_gpus": 2}, {"attention_gpus": 2, "sequence_parallel": 2}],
    ids=["111", "221", "ulysses2"],
)
def test_disaggregated_lora_on_an_fp8_base_equals_peft_on_the_dequantized_base(
    fp8_checkpoint, ranks_kept_fp8, layout
) -> None:
    cfg = DisagMoEConfig(**layout, micro_batches=2, transport="rendezvous", lora=LORA)
    result = run_verify(VerifyArgs(model=str(fp8_checkpoint), cfg=cfg, zero=1, seq_len=8), timeout_s=240)
    assert result["tolerance"] == TOLERANCE["fp32"] and result["pass"], result["max_abs_diff"]
    assert ranks_kept_fp8() == cfg.world_size


def test_lora_on_an_fp8_base_with_the_expert_side_at_zero3_equals_peft(fp8_checkpoint) -> None:
    """ZeRO-3 partitions the expert side's parameters (the adapters); its FP8 base, buffers, stays whole."""
    zero = {"attention": 2, "ffn": 3}
    cfg = DisagMoEConfig(attention_gpus=2, ffn_gpus=2, expert_data_parallel=2, micro_batches=2, transport="rendezvous",
                         lora=LORA, zero_stage=zero)  # fmt: skip
    result = run_verify(VerifyArgs(model=str(fp8_checkpoint), cfg=cfg, zero=2, seq_len=8), timeout_s=240)
    assert result["tolerance"] == TOLERANCE["fp32"] and result["pass"], result["max_abs_diff"]


def test_colocated_lora_on_an_fp8_base_equals_peft_on_the_dequantized_base(fp8_checkpoint, ranks_kept_fp8) -> None:
    cfg = ColocatedConfig(world_size=2, ep_size=2, micro_batches=2, lora=LORA)
    result = run_colocated_verify(ColocatedVerifyArgs(str(fp8_checkpoint), cfg, zero=1, seq_len=8), timeout_s=240)
    assert result["tolerance"] == TOLERANCE["fp32"] and result["pass"], result["max_abs_diff"]
    assert ranks_kept_fp8() == 2


def test_full_fine_tuning_of_an_fp8_checkpoint_equals_hf_on_its_dequantized_values(fp8_checkpoint) -> None:
    cfg = DisagMoEConfig(ffn_gpus=2, micro_batches=2, transport="rendezvous")
    result = run_verify(VerifyArgs(model=str(fp8_checkpoint), cfg=cfg, zero=1, seq_len=8), timeout_s=240)
    assert result["pass"], result["max_abs_diff"]


def test_what_cannot_keep_an_fp8_base_is_refused_before_launch(fp8_checkpoint) -> None:
    """FP8 compute over it, and experts whose gate and up scales cannot be fused (I not whole blocks)."""
    from disagmoe_ds.train.args import parse_args
    from disagmoe_ds.train.model import check_train_model
    from tests.conftest import ROOT

    def check(*flags: str) -> None:
        args = parse_args(["--init-from", str(fp8_checkpoint), "--lora-rank", "4", *flags], root=ROOT,
                          description="")[0]  # fmt: skip
        check_train_model(args, None)

    check()
    with pytest.raises(ConfigError, match="does not work yet with LoRA over a checkpoint in FP8 blocks"):
        check("--fp8")
    fp8_checkpoint = write_fp8_checkpoint(fp8_checkpoint.with_name("odd-experts"), moe_intermediate_size=24)
    with pytest.raises(CheckpointError, match="intermediate size 24 is not a multiple of the FP8 block's 16 rows"):
        check()


def test_the_block_scaled_weight_is_a_value() -> None:
    q = quantize_blocks(torch.ones(16, 16), (16, 16))
    assert isinstance(q, BlockScaled) and q.shape == (16, 16) and q.block == (16, 16)


def dequantized_model(path: Path) -> torch.nn.Module:
    """The whole model of an FP8 checkpoint with the exact values it stands for (as the verifies' reference)."""
    from disagmoe_ds.parity.reference import load_for_verify

    return load_for_verify(VerifyArgs(model=str(path), cfg=DisagMoEConfig()))


def test_lora_run_logs_its_fp8_base_resumes_and_exports_an_adapter_peft_loads_on_the_dequantized_base(
    tok_cache, tmp_path, capfd
) -> None:
    """run_pretrain.py --init-from an FP8 checkpoint --lora-rank: each rank logs what its FP8 base takes; a resume at
    step 2 repeats steps 3-4 bit for bit (the checkpoint holds the adapters, the base comes from --init-from again);
    the PEFT adapter directory (--export-hf) on the dequantized base and the merged model (--export-hf-merged, high
    precision) give the same logits, and not the base's (DeepSeek-V3's expert biases kept: an adapter leaves them
    out); disagmoe-to-hf writes the same adapter from the checkpoint."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from disagmoe_ds import convert
    from disagmoe_ds.data import bundled_corpus, train_or_load_tokenizer
    from tests.runs import pretrain, records, same, write_sft_jsonl

    fp8_dir = write_fp8_checkpoint(tmp_path / "fp8", vocab_size=512)
    train_or_load_tokenizer(bundled_corpus(), 512, tok_cache).save_hf(fp8_dir)
    write_sft_jsonl(tmp_path / "sft.jsonl", n=40)
    full, resumed, ck, adapter, merged = (tmp_path / n for n in ("full.jsonl", "resumed.jsonl", "ck", "ad", "m"))
    argv = ("--init-from", fp8_dir, "--sft", "--data", tmp_path / "sft.jsonl", "--ffn-gpus", 2, "--steps", 4,
            "--micro-batches", 2, "--bias-update-rate", 0, "--lora-rank", 8, "--lr", "1e-2")  # fmt: skip
    exports = ("--export-hf", adapter, "--export-hf-merged", merged)
    assert pretrain(tok_cache, *argv, "--save-dir", ck, "--save-every", 2, "--metrics-file", full, *exports) == 0
    out = capfd.readouterr().out
    logged = re.findall(r"rank (\d+): the LoRA base stays FP8 \(e4m3, block scales\)", out)  # ranks' lines may meet
    assert sorted(logged) == [str(r) for r in range(4)], out
    assert pretrain(tok_cache, *argv, "--resume", ck / "step2", "--metrics-file", resumed) == 0
    assert [r["step"] for r in records(resumed)] == [3, 4] and same(records(resumed), records(full)[2:])
    assert "quantization_config" not in json.loads((merged / "config.json").read_text())
    ids = torch.arange(3, 35).view(2, 16)
    base = dequantized_model(fp8_dir)
    with torch.no_grad():
        plain = base(ids).logits
        adapted = PeftModel.from_pretrained(base, adapter)(ids).logits
        folded = AutoModelForCausalLM.from_pretrained(merged)(ids).logits
    assert torch.allclose(adapted, folded, atol=1e-4)
    assert (adapted - plain).abs().max() > 1e-3
    converted = tmp_path / "converted"
    assert convert.main(["disagmoe-to-hf", "--ckpt", str(ck), "--model", str(fp8_dir), "--out", str(converted)]) == 0
    ours, theirs = (load_file(str(d / "adapter_model.safetensors")) for d in (converted, adapter))
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)


def test_lora_on_an_fp8_base_in_bf16_with_the_memory_levers_equals_peft(fp8_checkpoint) -> None:
    """bf16 (the base dequantized in bf16 inside each product), ZeRO-2, the split backward (its B and W passes over
    products without a weight gradient), the experts' recomputed middle, activation offload (the FP8 base, saved by
    its products, stays on the device) and trained routers."""
    lora = LoraSettings(rank=4, train_router=True, init_lora_weights=False)
    cfg = DisagMoEConfig(ffn_gpus=2, micro_batches=2, selective_recompute=True, split_backward=True, lora=lora,
                         offload={"attention": 1.0, "ffn": 1.0})  # fmt: skip
    result = run_verify(VerifyArgs(model=str(fp8_checkpoint), cfg=cfg, zero=2, dtype="bf16"), timeout_s=240)
    assert result["pass"], result["max_abs_diff"]


def test_any_family_converted_to_fp8_blocks_keeps_its_lora_base_in_fp8(tmp_path, ranks_kept_fp8) -> None:
    """``disagmoe-convert to-fp8`` on a sharded Qwen3-MoE checkpoint: its projections (the routed experts per expert)
    in blocks with the index rewritten, the rest as it was; LoRA over it equals PEFT on the dequantized base, with
    every rank holding its base in FP8."""
    from disagmoe_ds.convert import main as convert

    plain = write_tiny_checkpoint("qwen3-moe", tmp_path / "plain", seed=3, max_shard_size="60KB")
    out = tmp_path / "fp8"
    assert convert(["to-fp8", "--model", str(plain), "--out", str(out), "--block", *map(str, BLOCK)]) == 0
    index = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    assert len(set(index.values())) > 1  # sharded, each tensor in its source's shard
    stored = {k: v for f in set(index.values()) for k, v in load_file(out / f).items()}
    assert set(index) == set(stored)
    router = "model.layers.1.mlp.gate.weight"
    expert = next(k for k in stored if ".experts." in k and k.endswith("proj.weight"))
    assert stored[expert].dtype == E4M3 and expert + "_scale_inv" in stored
    assert stored[router].dtype == torch.float32 and router + "_scale_inv" not in stored
    assert stored["model.embed_tokens.weight"].dtype == torch.float32
    assert json.loads((out / "config.json").read_text())["quantization_config"]["weight_block_size"] == BLOCK
    cfg = DisagMoEConfig(attention_gpus=1, ffn_gpus=2, micro_batches=2, transport="rendezvous", lora=LORA)
    result = run_verify(VerifyArgs(model=str(out), cfg=cfg, zero=1, seq_len=8), timeout_s=240)
    assert result["tolerance"] == TOLERANCE["fp32"] and result["pass"], result["max_abs_diff"]
    assert ranks_kept_fp8() == cfg.world_size
    with pytest.raises(CheckpointError, match="is quantized already"):
        to_fp8_blocks(out, tmp_path / "twice")
    assert convert(["to-fp8", "--model", str(plain), "--out", str(out)]) == 2  # nothing is overwritten
