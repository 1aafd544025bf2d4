"""Selective recompute (``"disagmoe": {"selective_recompute": true}``, ``models.recompute``): the parts keep less
for the backward and still compute exactly what they computed before, alone and in the disaggregated job."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM

from disagmoe_ds.afpipe.verify_run import run_verify
from disagmoe_ds.config import DisagMoEConfig
from disagmoe_ds.errors import ConfigError
from disagmoe_ds.models import grouped_experts
from disagmoe_ds.models.parts import AttentionStage
from disagmoe_ds.models.recompute import apply_selective_recompute
from disagmoe_ds.parity.reference import VerifyArgs

CLIP = 0.05  # below the tiny models' gradient norms: clipping is active


class SavedBytes:
    """Bytes of the distinct storages autograd saves for the backward while active."""

    def __init__(self) -> None:
        self.storages: dict[int, int] = {}

    def __enter__(self) -> SavedBytes:
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        self.storages[storage.data_ptr()] = storage.nbytes()
        return t

    @property
    def total(self) -> int:
        return sum(self.storages.values())


def _experts_step(recompute: bool, dropped_pairs: bool):
    g = torch.Generator().manual_seed(0)
    R, H, inter, E, K = 48, 32, 16, 4, 2
    x = torch.randn(R, H, generator=g, requires_grad=True)
    idx = torch.randint(0, E, (R, K), generator=g)
    if dropped_pairs:
        idx[::3, 1] = E  # held by another rank: the sentinel
    w = torch.rand(R, K, generator=g, requires_grad=True)
    gate_up = torch.randn(E, 2 * inter, H, generator=g, requires_grad=True)
    down = torch.randn(E, H, inter, generator=g, requires_grad=True)
    pairs = int((idx < E).sum())
    with SavedBytes() as saved:
        out = grouped_experts.grouped_gated_experts(
            x, idx, w, gate_up, down, F.silu, pairs, grouped_experts.EAGER, recompute=recompute
        )
    out.backward(torch.randn(R, H, generator=g))
    return [out.detach(), x.grad, w.grad, gate_up.grad, down.grad], saved.total, pairs * inter * 4


@pytest.mark.parametrize("dropped_pairs", [False, True])
def test_recomputed_expert_middle_is_exact_and_keeps_three_intermediates_less(dropped_pairs):
    plain, plain_bytes, pair_row_bytes = _experts_step(False, dropped_pairs)
    again, again_bytes, _ = _experts_step(True, dropped_pairs)
    assert all(torch.equal(a, b) for a, b in zip(plain, again, strict=True))  # bit for bit, gradients included
    assert plain_bytes - again_bytes >= 3 * pair_row_bytes  # gate, up and activation outputs: 3 x I per pair


@pytest.mark.parametrize("family", ["qwen2-moe", "deepseek-v3"])
def test_recomputed_attention_parts_are_exact_and_keep_less(tiny_checkpoint, family):
    """Attention blocks (MLA too) and shared/dense SwiGLUs (qwen2-moe has both, and a dense layer) are checkpointed."""
    model = AutoModelForCausalLM.from_pretrained(tiny_checkpoint(family), dtype=torch.float32)
    layers = tuple(range(model.config.num_hidden_layers))
    results = []
    for selective in (False, True):
        stage = AttentionStage(model, layers, with_embedding=False, with_head=False)
        if selective:
            apply_selective_recompute(stage)
        h = torch.randn(2, 8, model.config.hidden_size, generator=torch.Generator().manual_seed(1), requires_grad=True)
        ctx, outs = stage.context(h, None), []
        with SavedBytes() as saved:
            for layer in layers:
                out = stage.part(layer)(h, ctx, model.config)
                outs += [t for t in (out.residual_BSH, out.x_TH, out.topk_w_TK) if t is not None]
        torch.stack([t.float().sum() for t in outs]).sum().backward()
        grads = [h.grad] + [p.grad.clone() for p in stage.parameters()]
        stage.zero_grad(set_to_none=True)
        results.append(([t.detach() for t in outs] + grads, saved.total))
    (plain, plain_bytes), (again, again_bytes) = results
    assert all(torch.allclose(a, b, rtol=0, atol=1e-6) for a, b in zip(plain, again, strict=True))
    assert again_bytes < 0.8 * plain_bytes, (again_bytes, plain_bytes)


@pytest.mark.parametrize(("family", "M", "N", "p", "zero"), [("qwen2-moe", 2, 2, 2, 1), ("deepseek-v3", 1, 2, 1, 2)])
def test_selective_recompute_job_equals_hf(tiny_checkpoint, family, M, N, p, zero):
    cfg = DisagMoEConfig(
        attention_gpus=M, ffn_gpus=N, depth=p, micro_batches=3, transport="rendezvous", selective_recompute=True
    )
    args = VerifyArgs(str(tiny_checkpoint(family)), cfg, zero=zero, seq_len=8, clip=CLIP, skew=family == "deepseek-v3")
    assert run_verify(args, timeout_s=240)["pass"]


def test_selective_and_full_recompute_are_exclusive():
    with pytest.raises(ConfigError, match="exclusive"):
        DisagMoEConfig(selective_recompute=True, activation_checkpointing=True)


@pytest.mark.parametrize(
    "recompute", [{"attention": "selective", "ffn": "full"}, {"attention": "full"}], ids=["selective-full", "full-none"]
)
def test_each_side_recomputes_as_its_own_setting_says_and_equals_hf(tiny_checkpoint, monkeypatch, tmp_path, recompute):
    from disagmoe_ds.afpipe import attention_runner, build, expert_runner

    def logged(what, fn):
        def call(*args, **kwargs):
            with open(tmp_path / "log.txt", "a", encoding="utf-8") as f:  # the ranks are forked: they append here
                f.write(f"{what(*args) if callable(what) else what}\n")
            return fn(*args, **kwargs)

        return call

    monkeypatch.setattr(attention_runner, "checkpointed", logged("attention full", attention_runner.checkpointed))
    monkeypatch.setattr(expert_runner, "checkpointed", logged("ffn full", expert_runner.checkpointed))
    side_of = {"AttentionStage": "attention", "ExpertStage": "ffn"}
    selective = logged(lambda stage: f"{side_of[type(stage).__name__]} selective", build.apply_selective_recompute)
    monkeypatch.setattr(build, "apply_selective_recompute", selective)
    cfg = DisagMoEConfig(attention_gpus=2, ffn_gpus=2, micro_batches=2, transport="rendezvous", recompute=recompute)
    args = VerifyArgs(str(tiny_checkpoint("qwen3-moe")), cfg, zero=1, seq_len=8, clip=CLIP)
    assert run_verify(args, timeout_s=240)["pass"]
    policies = {side: cfg.recompute_of(side) for side in ("attention", "ffn")}
    ran = set((tmp_path / "log.txt").read_text().split("\n")) - {""}
    assert ran == {f"{side} {policy}" for side, policy in policies.items() if policy != "none"}


def test_the_per_side_recompute_is_checked_and_replaces_the_switches():
    assert DisagMoEConfig(recompute={"ffn": "full"}).recompute_of("attention") == "none"
    assert DisagMoEConfig(selective_recompute=True).recompute_of("ffn") == "selective"
    with pytest.raises(ConfigError, match=r'"disagmoe.recompute.ffn" must be one of \[.none., .selective., .full.\]'):
        DisagMoEConfig(recompute={"ffn": "some"})
    with pytest.raises(ConfigError, match='"disagmoe.recompute" sets each side.s recompute and replaces'):
        DisagMoEConfig(recompute={"ffn": "full"}, activation_checkpointing=True)
    with pytest.raises(ConfigError, match='"disagmoe.cuda_graphs" does not work with "disagmoe.recompute"'):
        DisagMoEConfig(recompute={"attention": "selective"}, cuda_graphs=True)
