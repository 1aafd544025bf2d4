"""What one step trains and how (``Workload``): sequence, micro-batch, precision, ZeRO stages, recompute, the
AF-Pipe variant and LoRA; the key every per-rank cost and memory function of the planner is cached on."""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import lru_cache

from disagmoe_ds.fp8.shapes import BF16_WIDTH, EXPERT_BF16_WIDTH
from disagmoe_ds.planner.lora import TARGETS, LoRA
from disagmoe_ds.planner.recompute import Recompute


@dataclass(frozen=True)
class Workload:
    """What one step trains and how: sequence length, micro-batch per lane, precision, ZeRO stage, recompute,
    and the AF-Pipe variants (ignored by the co-located baseline).

    Args:
        resend: the F side keeps nothing between a micro-batch's forward and its backward: the A side (which keeps
            the tokens as its post-attention norm output) sends them again with the backward's gradient, and F
            re-runs the expert forward from them before its backward (one more expert forward per micro-batch and
            layer, whatever ``recompute`` is; with "full" that is the recompute F pays anyway, not a second one).
            With p > 1 the tokens go to A_next with the residual hand-off (it sends the backward's gradient) and
            wait there: more resid bytes and A memory (``DisagMoEConfig.resend``).
        offload: (A, F) share of a micro-batch's kept activations moved to host memory between its forward
            and its backward.
        split_backward: each backward runs as an input-gradient task on the critical path and a weight-gradient
            task that fills idle time (zero-bubble pipelining on the A/F ring).
        attention_zero_stage, ffn_zero_stage: per-side ZeRO stage (None: ``zero_stage``).
        attention_recompute, ffn_recompute: per-side recompute policy (None: ``recompute``, which the co-located
            baseline reads for both sides of its layers); ``with_recompute`` sets both.
        sequence_parallel, tensor_parallel: s and t of an A-lane of s x t ranks (``attention_lanes.py``): DeepSpeed-
            Ulysses over s ranks, Megatron-style TP+SP over t; the lane's micro-batch is split over its s x t ranks.
        lora_rank, lora_targets, lora_train_router, lora_fp8_base: LoRA fine-tuning (``lora.LoRA``; rank 0: full
            fine-tuning).
        fp8: the FP8 lever, in both systems: its GEMMs at the FP8 rates, the m2n rows and the co-located dispatch in
            e4m3 (``fp8_costs.py``), the expert weights cast once a step and their FP8 copies held for it.
        fp8_cast_per_call: with ``fp8``, the expert weights cast in every call instead (no copies held; the
            runtime's ``fp8_cast_per_call``), a memory variant.
        fp8_bf16_width: with ``fp8``, the attention side's projections with a width of at most this stay bf16 (the
            runtime's ``fp8_bf16_width``, ``fp8.shapes.fp8_pays``).
        fp8_expert_bf16_width: with ``fp8``, the routed experts keep bf16 GEMMs where their harmonic width is at most
            this (the runtime's ``fp8_expert_bf16_width``, ``fp8.shapes.experts_fp8_pay``); their rows still travel
            in FP8.
        ffn_optimizer_on_host: the expert side's fp32 master weights, Adam moments and step in host memory
            (DeepSpeed's ZeRO-Offload on that side alone, the runtime's ``"offload_optimizer": {"ffn": true}``), a
            memory variant: 12 bytes a trained expert parameter (over the replicas) leave the GPU, and the step
            streams them on the host after copying the gradients down and before copying the parameters up.
    """

    seq_len: int
    micro_batch_size: int
    zero_stage: int = 1
    precision: str = "bf16"
    recompute: Recompute = "none"
    resend: bool = False
    offload: tuple[float, float] = (0.0, 0.0)
    split_backward: bool = False
    attention_zero_stage: int | None = None
    ffn_zero_stage: int | None = None
    attention_recompute: Recompute | None = None
    ffn_recompute: Recompute | None = None
    sequence_parallel: int = 1
    tensor_parallel: int = 1
    lora_rank: int = 0
    lora_targets: tuple[str, ...] = TARGETS
    lora_train_router: bool = False
    fp8: bool = False
    fp8_cast_per_call: bool = False
    fp8_bf16_width: int = BF16_WIDTH
    fp8_expert_bf16_width: int = EXPERT_BF16_WIDTH
    lora_fp8_base: bool = False
    ffn_optimizer_on_host: bool = False

    def __post_init__(self) -> None:
        # validated once; the targets kept in canonical order so that equal runs hash equal
        try:
            lora = _lora(self.lora_rank, self.lora_targets, self.lora_train_router, self.lora_fp8_base)
        except TypeError:  # unhashable targets (a list): LoRA checks and normalises them
            lora = LoRA(self.lora_rank, self.lora_targets, self.lora_train_router, self.lora_fp8_base)
        object.__setattr__(self, "lora_targets", lora.targets)

    @property
    def fp8_cast_once(self) -> bool:
        """The expert weights are cast to FP8 once a step, their copies held for it."""
        return self.fp8 and not self.fp8_cast_per_call

    @property
    def lora(self) -> LoRA:
        return _lora(self.lora_rank, self.lora_targets, self.lora_train_router, self.lora_fp8_base)

    def with_lora(self, lora: LoRA) -> Workload:
        """This workload training ``lora``'s adapters (``FULL``: full fine-tuning)."""
        return replace(
            self,
            lora_rank=lora.rank,
            lora_targets=lora.targets,
            lora_train_router=lora.train_router,
            lora_fp8_base=lora.fp8_base,
        )

    @property
    def lane_size(self) -> int:
        """Ranks of one A-lane: s x t."""
        return self.sequence_parallel * self.tensor_parallel

    @property
    def tokens_per_micro_batch(self) -> int:
        return self.seq_len * self.micro_batch_size

    def zero_of(self, side: str) -> int:
        """ZeRO stage of the "attention" or "ffn" side."""
        stage = self.attention_zero_stage if side == "attention" else self.ffn_zero_stage
        return self.zero_stage if stage is None else stage

    def recompute_of(self, side: str) -> Recompute:
        """Recompute policy of the "attention" or "ffn" side (the runtime's ``MemoryLevers.recompute_of``)."""
        policy = self.attention_recompute if side == "attention" else self.ffn_recompute
        return self.recompute if policy is None else policy

    @property
    def per_side_recompute(self) -> bool:
        """The sides recompute differently (the runtime's per-side ``"recompute"`` key, not its switches)."""
        return self.recompute_of("attention") != self.recompute_of("ffn")

    @property
    def recompute_name(self) -> str:
        """The sides' policies: one word where they agree ("full"), else each ("A none F full")."""
        a, f = self.recompute_of("attention"), self.recompute_of("ffn")
        return a if a == f else f"A {a} F {f}"

    def with_recompute(self, attention: Recompute, ffn: Recompute) -> Workload:
        """This workload with each side's policy; one policy for both is ``recompute`` alone, as before the sides
        had their own (so that equal runs hash equal)."""
        if attention == ffn:
            return replace(self, recompute=attention, attention_recompute=None, ffn_recompute=None)
        return replace(self, attention_recompute=attention, ffn_recompute=ffn)

    @property
    def ffn_rerun(self) -> Recompute:
        """The recompute the F side's backward pays for: with ``resend`` it re-runs the whole expert forward (the
        compute of full recompute, charged once), otherwise its own policy."""
        return "full" if self.resend else self.recompute_of("ffn")

    @property
    def variant(self) -> str:
        """Short name of the AF-Pipe variant, e.g. "recompute selective, resend, ZeRO 1/3" ("recompute A none F
        full" where the sides differ)."""
        parts = [f"recompute {self.recompute_name}"]
        parts += ["resend"] if self.resend else []
        off_a, off_f = self.offload
        parts += [f"offload A {off_a:.0%} F {off_f:.0%}"] if off_a or off_f else []
        parts += ["split backward"] if self.split_backward else []
        parts += ["F optimizer on host"] if self.ffn_optimizer_on_host else []
        parts += [f"SP {self.sequence_parallel} x TP {self.tensor_parallel}"] if self.lane_size > 1 else []
        return ", ".join(parts + [f"ZeRO {self.zero_of('attention')}/{self.zero_of('ffn')}"])


@lru_cache(maxsize=64, typed=True)  # typed: True is no LoRA rank, and must not hit rank 1's entry
def _lora(rank: int, targets: tuple[str, ...], train_router: bool, fp8_base: bool) -> LoRA:
    """``Workload.lora``, validated once: the search builds and asks for hundreds of thousands of workloads."""
    return LoRA(rank, targets, train_router, fp8_base)
