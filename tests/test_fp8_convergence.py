"""FP8 training converges as high-precision training does: 300 steps of the default job's model
(hf_models/tiny-qwen3-moe-lm) on the bundled corpus, with the default job's optimizer (AdamW, lr 1e-3, betas
(0.9, 0.95), weight decay 0.1, clipping 1.0, 10 warm-up steps then cosine to 0.1x), from the same seed and on the
same batches, once in fp32 and once with the FP8 lever's GEMMs (emulated on the CPU).

The FP8 model is the single-process FP8 reference (``fp8.hf.to_fp8_reference``), which the parity tests
(tests/test_fp8_parity.py) hold both modes' ranks to at the fp32 tolerance, so this is the lever's own
convergence without the cost of ranks. Done when: no step's loss is NaN or above the first's (no divergence), and
the final loss (mean of the last 20 steps) is within 2% of fp32's.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from disagmoe_ds.data import build_pretrain_dataset, bundled_corpus, train_or_load_tokenizer
from disagmoe_ds.fp8.hf import to_fp8_reference
from disagmoe_ds.launch.testing import run_ranks

ROOT = Path(__file__).resolve().parents[1]
STEPS, BATCH, SEQ_LEN, WARMUP = 300, 4, 128, 10  # 150k tokens: about 60 s on two cores (the two runs side by side)


def _lr_factor(step: int) -> float:
    """The default job's WarmupCosineLR: linear from 0.1 over the warm-up, then cosine down to 0.1."""
    if step < WARMUP:
        return 0.1 + 0.9 * step / WARMUP
    progress = (step - WARMUP) / (STEPS - WARMUP)
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))


def _losses(batches: list[dict[str, torch.Tensor]], *, fp8: bool) -> list[float]:
    torch.manual_seed(0)
    config = AutoConfig.from_pretrained(ROOT / "hf_models" / "tiny-qwen3-moe-lm")
    model = AutoModelForCausalLM.from_config(config)
    if fp8:
        to_fp8_reference(model, "gate", bf16_width=0)  # every projection, narrow as they are here
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, _lr_factor)
    losses = []
    for batch in batches:
        loss = model(**batch).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


def _run_of_rank(rank: int, batches: list[dict[str, torch.Tensor]]) -> list[float]:
    """Rank 0 trains in fp32, rank 1 with FP8: the two independent single-process runs side by side, one core and
    one intra-op thread each (at this size a second thread speeds a run up by 10-20% only)."""
    return _losses(batches, fp8=rank == 1)


def test_fp8_training_converges_as_fp32_does(tok_cache):
    tokenizer = train_or_load_tokenizer(bundled_corpus(), 512, tok_cache)
    dataset, _ = build_pretrain_dataset(bundled_corpus(), tokenizer, seq_len=SEQ_LEN, seed=0)
    order = torch.randperm(len(dataset), generator=torch.Generator().manual_seed(0))
    batches = []
    for step in range(STEPS):
        rows = [dataset[int(i)] for i in order[(step * BATCH + torch.arange(BATCH)) % len(dataset)]]
        batches.append({key: torch.stack([row[key] for row in rows]) for key in ("input_ids", "labels")})
    fp32, fp8 = run_ranks(_run_of_rank, 2, args=(batches,), timeout_s=900)
    assert all(math.isfinite(x) and x <= fp8[0] for x in fp8), "FP8 training diverged"
    final32, final8 = sum(fp32[-20:]) / 20, sum(fp8[-20:]) / 20
    assert final32 < 0.7 * fp32[0], f"fp32 training did not learn ({fp32[0]:.3f} -> {final32:.3f})"
    assert abs(final8 - final32) <= 0.02 * final32, f"final loss: FP8 {final8:.4f} vs fp32 {final32:.4f}"
    assert fp8 != fp32, "the FP8 run computed in high precision"
