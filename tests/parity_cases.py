"""Parity cases by name: one frozen case per multi-process job against HF, built by keyword from the defaults below.

``str(case)`` is its pytest id, the layout it runs: ``qwen3_moe-M2N4p2-K3-z1-skew`` is Qwen3-MoE disaggregated on 2
attention and 4 FFN ranks at depth 2 (``e2``: 2 expert-data-parallel replicas), 3 micro-batches, ZeRO-1, the skewed
router; then the switches on and what the case changes in the model or the job (``label``, where a short name says
it better). ``ColocatedJob``: the co-located mode's (``W4ep2``). Modules with knobs of their own extend ``Job``
(``test_sequence_parallel.SPJob``...).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any

from disagmoe_ds.config import DisagMoEConfig


def tag(name: str, value: Any) -> str:
    """One setting in an id: its name for a switch that is on, else ``name=value`` without spaces or quotes."""
    if value is True:
        return name
    return f"{name}={value}".replace(" ", "").replace("'", "")


@dataclass(frozen=True, kw_only=True)
class Case(ABC):
    """What every parity job has, whichever the mode.

    Attributes:
        family: ``hf_models/tiny-<family>``.
        overrides: fields of the tiny model's config set before it is written (``tiny_checkpoint``).
        K, zero, skew: micro-batches, ZeRO stage, the skewed router (``disagmoe-verify --skew``).
        extra: further fields of the job's config.
        label: what the id says of ``overrides`` and ``extra`` (empty: each written out).
    """

    family: str = "qwen3-moe"
    overrides: dict[str, Any] = field(default_factory=dict)
    K: int = 3
    zero: int = 1
    skew: bool = False
    extra: dict[str, Any] = field(default_factory=dict)
    label: str = ""

    @abstractmethod
    def layout_id(self) -> str:
        """The layout part of the case's id (each kind of job names its own)."""

    def run_tags(self) -> list[str]:
        return [f"K{self.K}", f"z{self.zero}"] + ["skew"] * self.skew

    def __str__(self) -> str:
        named = [self.label] if self.label else [tag(k, v) for k, v in {**self.overrides, **self.extra}.items()]
        return "-".join([self.family.replace("-", "_"), self.layout_id(), *self.run_tags(), *named])


@dataclass(frozen=True, kw_only=True)
class Job(Case):
    """A disaggregated job: ``M`` attention ranks, ``N`` FFN ranks, depth ``p``, ``edp`` expert-data-parallel
    replicas, ``node`` expert ranks per node sharing a lane's message (``node_dedup``); ``resend`` and ``factor``
    (``capacity_factor``, None: exact message sizes) of its ``"disagmoe"`` section, ``extra`` the rest of it."""

    M: int = 1
    N: int = 1
    p: int = 1
    edp: int = 1
    node: int = 1
    resend: bool = False
    factor: float | None = None

    def config(self, **fields: Any) -> DisagMoEConfig:
        """The job's ``"disagmoe"`` section, with ``fields`` (the transport, the switches a test adds)."""
        return DisagMoEConfig(
            attention_gpus=self.M,
            ffn_gpus=self.N,
            depth=self.p,
            micro_batches=self.K,
            expert_data_parallel=self.edp,
            node_dedup=self.node,
            resend=self.resend,
            capacity_factor=self.factor,
            **self.extra,
            **fields,
        )

    def layout_id(self) -> str:
        replicas, nodes = f"e{self.edp}" if self.edp > 1 else "", f"n{self.node}" if self.node > 1 else ""
        return f"M{self.M}N{self.N}p{self.p}{replicas}{nodes}"

    def run_tags(self) -> list[str]:
        tags = super().run_tags() + ["resend"] * self.resend
        return tags + ([f"cap{self.factor}"] if self.factor is not None else [])


@dataclass(frozen=True, kw_only=True)
class LaneJob(Job):
    """A job whose lanes hold each micro-batch in slices: ``s`` to an SP group (Ulysses) or ``t`` to a TP group;
    ``B`` sequences a micro-batch and, ``packed``, documents packed into them (restarting positions: the whole
    sequence's block mask); 2 micro-batches, the skewed router."""

    s: int = 1
    t: int = 1
    B: int = 1
    packed: bool = False
    K: int = 2
    skew: bool = True

    def config(self, **fields: Any) -> DisagMoEConfig:
        return super().config(sequence_parallel=self.s, tensor_parallel=self.t, **fields)

    def layout_id(self) -> str:
        return super().layout_id() + (f"s{self.s}" if self.s > 1 else "") + (f"t{self.t}" if self.t > 1 else "")

    def run_tags(self) -> list[str]:
        return super().run_tags() + ([f"B{self.B}"] if self.B > 1 else []) + ["packed"] * self.packed

    def verify(self, tiny_checkpoint, clip: float) -> None:
        """Run it against HF under the rendezvous transport with clipping at ``clip`` (active: below every
        reference gradient norm); fails on any difference over the tolerance."""
        from disagmoe_ds.afpipe.verify_run import run_verify
        from disagmoe_ds.parity.reference import VerifyArgs

        ckpt = str(tiny_checkpoint(self.family, **self.overrides))
        args = VerifyArgs(
            ckpt, self.config(transport="rendezvous"), zero=self.zero, seq_len=8, micro_batch_size=self.B, clip=clip,
            skew=self.skew, packed=self.packed,
        )  # fmt: skip
        summary = run_verify(args, timeout_s=240)
        assert all(n > clip for n in summary["reference_grad_norms"]), "clipping must be active in this test"
        assert summary["pass"], summary


@dataclass(frozen=True, kw_only=True)
class ColocatedJob(Case):
    """A co-located EP+DP job: ``W`` ranks, expert parallelism ``ep``."""

    W: int = 2
    ep: int = 2

    def layout_id(self) -> str:
        return f"W{self.W}ep{self.ep}"


def warm_each_rank_up(monkeypatch, seq_len: int = 8) -> None:
    """Make every rank a verify builds run its kernel warm-up (``executor.warm_up``, as compiled jobs do before the
    first step) right after the build, and check it left no gradient behind."""
    from disagmoe_ds.afpipe import build

    original = build.build_rank

    def build_and_warm(*args, **kwargs):
        runtime = original(*args, **kwargs)
        runtime.executor.warm_up(seq_len=seq_len, packed=True)
        assert all(p.grad is None for p in runtime.module.parameters()), "warm-up touched a gradient"
        return runtime

    monkeypatch.setattr(build, "build_rank", build_and_warm)


def whole_layer_zero(family: str, B: int = 2, S: int = 8):
    """On a gloo rank: layer 0's attention part of ``hf_models/tiny-<family>`` (seed 0) run forward and backward on
    a random whole sequence. Returns (config, stage, part, h_BSH with its gradient, output, output gradient)."""
    import deepspeed
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from disagmoe_ds.models.parts import AttentionStage
    from tests.conftest import ROOT

    deepspeed.init_distributed(dist_backend="gloo")
    config = AutoConfig.from_pretrained(ROOT / "hf_models" / f"tiny-{family}")
    torch.manual_seed(0)
    stage = AttentionStage(AutoModelForCausalLM.from_config(config), (0,), with_embedding=False, with_head=False)
    part = stage.part(0)
    h_BSH = torch.randn(B, S, config.hidden_size, requires_grad=True)
    out_BSH = part(h_BSH, stage.context(h_BSH, None), config).residual_BSH
    g_BSH = torch.randn_like(out_BSH)
    (out_BSH * g_BSH).sum().backward()
    return config, stage, part, h_BSH, out_BSH, g_BSH
