"""FP8 compute priced for ``disagmoe-plan --fp8`` (issue 42): which GEMMs the runtime's FP8 lever runs in FP8, how much
faster (``FP8_SPEEDUP``), and the quantize passes it adds (pure Python).

What the lever (``"disagmoe": {"fp8": true}``, ``disagmoe_ds.fp8``) computes in FP8, with rowwise e4m3 scales:

* the attention side's projections, dense MLPs and shared experts: forward, input-grad and weight-grad GEMMs; not the
  router, the shared-expert gate, the LM head or the attention core (SDPA), nor a projection too narrow for FP8 to
  pay (``fp8.shapes.fp8_pays`` at ``Workload.fp8_bf16_width``: the runtime's rule, read from the same function);
* the routed experts' gate_up and down grouped GEMMs, forward and input-grad, where the experts are wide enough to
  pay (``fp8.shapes.experts_fp8_pay`` at ``Workload.fp8_expert_bf16_width``: ``expert_lever``); narrower experts are
  priced in bf16 (their rows still travel in FP8: the received rows' dequantize, one pass, is not priced). Their
  weight-grad GEMMs run in bf16 on the high-precision operands (``fp8.gemm.grouped_weight_grad``), so they are priced
  at its rate, with one pass: gate_up's input dequantized.

An FP8 GEMM costs its bf16 time over its class's factor: its FLOPs enter the same time models (shape table or
profile) divided by the factor, as bf16-equivalent FLOPs. The token exchange's bytes are ``ModelSpec.wire_bytes_per_
token``'s and ``colocated_costs.alltoall_s``'s (the m2n rows and the co-located dispatch in e4m3 with a float32 scale
per row).

Assumption: every quantize (and dequantize) is one unfused pass over its operand at the rates' HBM bandwidth, reading
2 bytes and writing 1 per element (``PASS_BYTES``); under ``torch.compile`` they fuse into their neighbours, so this
prices the lever's worst case. The routed experts' weights are cast once per optimizer step, not per call (the
runtime's ``fp8.weight_cache``: ``weight_cast_s``, with the optimizer step), and their two FP8 copies
(``CAST_COPIES`` bytes a parameter) stay for the step (``memory.py``); the attention side's run inside its compiled
parts, where they are cast in every call. Master weights, gradients and optimizer state keep their dtype, autograd
keeps the high-precision inputs but the routed experts' received rows (in e4m3: ``memory._fp8_rows_saving``), and
the activations' other FP8 operands are transient.

>>> fp8_speedup("projection"), fp8_speedup("gate_up", 768), fp8_speedup("down", 1536), fp8_speedup("down", 14336)
(1.77, 1.27, 1.34, 1.34)
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from disagmoe_ds.fp8.shapes import BF16_WIDTH, experts_fp8_pay, fp8_pays
from disagmoe_ds.planner.cluster import Rates
from disagmoe_ds.planner.lora import GemmFlops, LoRA, Params, Projection, mixer_projections, mlp_projections
from disagmoe_ds.planner.model import ModelSpec
from disagmoe_ds.planner.workload import Workload

# FP8 over bf16 speedup per GEMM class (GEMM, expert width I or 0, factor). Measured with torch 2.11, rowwise e4m3
# scales: torch._scaled_mm against bf16 on the attention projections, 1.77-1.85x (one H200, issue 42; the low end:
# the projections' mix was not measured apart); fp8.gemm.scaled_grouped_mm against bf16 grouped_mm at 32,768 rows in
# equal groups on Qwen3-30B-A3B's experts (I = 768, on torch's small tile, one H100: 1.27x / 1.06x, input grads
# 1.32x / 1.24x; docs/performance-log.md section 26) and DeepSeek-V3's (I = 2048, one H200: 1.42x / 1.34x, input
# grads 1.29x / 1.35x; section 25); bench/fp8_grouped_gemms.py (2026-12-06).
# A class the table lacks takes the nearest measured one:
# * shared experts and dense MLPs: "projection" (the same _scaled_mm on dense, model-sized GEMMs);
# * every input-grad GEMM and the attention side's weight-grad GEMMs: their forward's factor (only forward GEMMs were
#   measured; a backward GEMM has the forward's rows and FLOPs, with its other two dimensions swapped);
# * other expert widths: the nearest measured width in log2 (Qwen3-235B-A22B's 1536 and Mixtral's 14336: 2048's).
FP8_SPEEDUP: tuple[tuple[str, int, float], ...] = (
    ("projection", 0, 1.77),
    ("gate_up", 768, 1.27),
    ("down", 768, 1.06),
    ("gate_up", 2048, 1.42),
    ("down", 2048, 1.34),
)
PASS_BYTES = 3  # one quantize: read a bf16 element, write an e4m3 one (a dequantize the other way round)
CAST_COPIES = 2  # a weight's FP8 copies for a step: rowwise (forward) and of its transpose (input-grad), 1 B each


def fp8_speedup(gemm: str, width: int = 0) -> float:
    """``FP8_SPEEDUP``'s factor of ``gemm`` ("projection", "gate_up", "down") at the measured expert width nearest
    ``width`` in log2."""
    rows = [(w, factor) for g, w, factor in FP8_SPEEDUP if g == gemm]
    return min(rows, key=lambda row: abs(math.log2(max(width, 1) / max(row[0], 1))))[1]


def fastest_speedup() -> float:
    """The largest factor of the table: no FLOP runs faster than bf16 time over it."""
    return max(factor for _, _, factor in FP8_SPEEDUP)


@dataclass(frozen=True)
class Fp8:
    """The FP8 lever on one rank's part: ``shards`` ranks hold one layer's FP8 weights between them (the TP degree on
    the attention side, the EP degree for the routed experts); ``per_call``: the expert weights are cast in every
    call (``Workload.fp8_cast_per_call``), not once a step; ``bf16_width``: the attention side's projections with a
    width of at most this stay bf16 (``Workload.fp8_bf16_width``)."""

    shards: int = 1
    per_call: bool = False
    bf16_width: int = BF16_WIDTH


def lever(work: Workload, shards: int) -> Fp8 | None:
    """The FP8 lever of ``work`` on a part whose weights ``shards`` ranks split (None: bf16)."""
    return Fp8(shards, work.fp8_cast_per_call, work.fp8_bf16_width) if work.fp8 else None


def expert_lever(spec: ModelSpec, work: Workload, shards: int) -> Fp8 | None:
    """The FP8 lever of ``work`` on ``spec``'s routed experts, ``shards`` ranks splitting them (None: bf16 GEMMs)."""
    return lever(work, shards) if experts_in_fp8(spec, work) else None


def experts_in_fp8(spec: ModelSpec, work: Workload) -> bool:
    """Whether ``work``'s FP8 lever runs ``spec``'s routed experts' GEMMs in FP8 (the runtime's shape rule)."""
    return work.fp8 and experts_fp8_pay(spec.hidden_size, spec.expert_intermediate, work.fp8_expert_bf16_width)


def keeps_expert_copies(spec: ModelSpec, work: Workload) -> bool:
    """Whether the step keeps FP8 copies of ``spec``'s expert weights: its experts run FP8, cast once a step."""
    return work.fp8_cast_once and experts_in_fp8(spec, work)


@dataclass(frozen=True)
class Passes:
    """Seconds of a part call's quantize passes: in the forward, the backward's input-grad and its weight-grad."""

    fwd: float = 0.0
    dgrad: float = 0.0
    wgrad: float = 0.0

    @property
    def bwd(self) -> float:
        return self.dgrad + self.wgrad


NO_PASSES = Passes()


# ----- the attention side -----
def projection_flops(spec: ModelSpec, layer: int, bf16_width: int = BF16_WIDTH) -> float:
    """Forward FLOPs per token of ``layer``'s GEMMs in FP8: its token mixer's projections and the shared or dense
    MLP's gate, up and down (not the router, not Qwen2's shared-expert gate), less those that stay bf16 at
    ``bf16_width`` (``fp8_pays``)."""
    width = spec.shared_intermediate if spec.moe_layers[layer] else spec.dense_intermediate
    narrow = sum(2 * k * n for k, n in layer_projections(spec, layer) if not fp8_pays(k, n, bf16_width))
    return spec.attention_projection_flops(layer) + 6 * spec.hidden_size * width - narrow


def layer_projections(spec: ModelSpec, layer: int) -> tuple[Projection, ...]:
    """Every projection of ``layer``'s A part the lever may put in FP8 (``(in, out)``, whole, not a TP shard's)."""
    return mixer_projections(spec, layer) + mlp_projections(spec, layer)


def projection_saved_flops(spec: ModelSpec, layer: int, bf16_width: int = BF16_WIDTH) -> float:
    """The forward FLOPs per token FP8 takes off ``layer``'s A part in bf16-equivalent terms."""
    return projection_flops(spec, layer, bf16_width) * (1 - 1 / fp8_speedup("projection"))


def a_side_fp8_gemms(spec: ModelSpec, layer: int, lora: LoRA, gemm: GemmFlops, fp8: Fp8) -> GemmFlops:
    """``gemm`` (``lora.a_side_gemm_flops``) in bf16-equivalent FLOPs: the FP8 projections at 1/factor in the forward,
    the input-grad and, where the base weights train, the weight-grad."""
    saved = projection_saved_flops(spec, layer, fp8.bf16_width)
    return GemmFlops(gemm.fwd - saved, gemm.dgrad - saved, gemm.wgrad - (0.0 if lora.enabled else saved))


def projection_rerun_share(spec: ModelSpec, layer: int, fp8: Fp8 | None) -> float:
    """bf16-equivalent FLOPs per FLOP of a selective recompute's re-run projections of ``layer`` (those FP8 leaves in
    bf16 count whole)."""
    if fp8 is None:
        return 1.0
    return 1 - projection_saved_flops(spec, layer, fp8.bf16_width) / projection_flops(spec, layer, bf16_width=0)


def shared_rerun_share(spec: ModelSpec, fp8: Fp8 | None) -> float:
    """bf16-equivalent FLOPs per FLOP of the shared experts' GEMMs (1 where they stay bf16)."""
    h, width = spec.hidden_size, spec.shared_intermediate
    if fp8 is None or not fp8_pays(h, width, fp8.bf16_width):
        return 1.0
    return 1 / fp8_speedup("projection")


def a_side_passes(spec: ModelSpec, rates: Rates, *, layer: int, tokens: float, lora: LoRA, fp8: Fp8 | None) -> Passes:
    """The quantize passes of one A part call on ``tokens`` tokens: per FP8 projection of in K and out N, the
    forward's x (K) and weight, the input-grad's dy (N) and weight, the weight-grad's dy and x (N + K, where the base
    trains); on an MoE layer also the routed rows (H) quantized for the exchange."""
    if fp8 is None:
        return NO_PASSES
    projections = [(k, n) for k, n in layer_projections(spec, layer) if fp8_pays(k, n, fp8.bf16_width)]
    ins, outs = sum(k for k, _ in projections), sum(n for _, n in projections)
    weights = sum(k * n for k, n in projections) / fp8.shards
    exchange = spec.hidden_size if spec.moe_layers[layer] else 0
    wgrad = 0.0 if lora.enabled else tokens * (ins + outs)
    return _seconds(rates, tokens * (ins + exchange) + weights, tokens * outs + weights, wgrad)


# ----- the routed experts -----
def expert_fp8_gemms(spec: ModelSpec, gemm: GemmFlops) -> GemmFlops:
    """``gemm`` (``lora.expert_gemm_flops``, per assignment) in bf16-equivalent FLOPs: gate_up (4 H I) and down
    (2 H I) at 1/factor in the forward and the input-grad; the weight-grad at the bf16 rate."""
    h, i = spec.hidden_size, spec.expert_intermediate
    saved = 4 * h * i * (1 - 1 / fp8_speedup("gate_up", i)) + 2 * h * i * (1 - 1 / fp8_speedup("down", i))
    return GemmFlops(gemm.fwd - saved, gemm.dgrad - saved, gemm.wgrad)


def expert_rerun_share(spec: ModelSpec, fp8: Fp8 | None) -> float:
    """bf16-equivalent FLOPs per FLOP of a selective recompute's re-run gate_up GEMMs."""
    return 1.0 if fp8 is None else 1 / fp8_speedup("gate_up", spec.expert_intermediate)


def expert_passes(
    spec: ModelSpec, rates: Rates, *, assignments: float, fp8: Fp8 | None, lora: LoRA | None = None
) -> Passes:
    """The quantize passes of one expert call of ``assignments`` (token, expert) rows: the forward dequantizes the
    received e4m3 rows and quantizes gate_up's input (H each), the input-grad down's output grad (H), the weight-grad
    dequantizes gate_up's input again (H, its GEMMs in bf16). Per assignment: exact for Megatron's dispatcher, an
    upper bound where a token comes once per rank (the experts' FP8 node, ``models.fp8_experts``, quantizes and keeps
    each received row once). The SwiGLU middle writes down's input and gate_up's output grad in FP8 itself
    (``models.fp8_experts``), except under LoRA adapters on the experts, whose path quantizes them in passes of their
    own (I forward, 2I input-grad). The rank's E/ep experts' weights are cast once a step (``weight_cast_s``), or with
    ``per_call`` in every call, for the forward and again for the input-grad."""
    if fp8 is None:
        return NO_PASSES
    h, i = spec.hidden_size, spec.expert_intermediate
    middle = i if lora is not None and lora.enabled and "experts" in lora.targets else 0
    weights = spec.num_experts / fp8.shards * 3 * h * i if fp8.per_call else 0.0
    fwd, dgrad = assignments * (2 * h + middle) + weights, assignments * (h + 2 * middle) + weights
    return _seconds(rates, fwd, dgrad, assignments * h)


def cast_expert_weights(experts: Params, lora: LoRA) -> float:
    """How many of a rank's expert parameters ``experts`` the step casts to FP8: the base weights (full
    fine-tuning: the trained ones; LoRA: the frozen ones, not an FP8 base's nor the adapters)."""
    return experts.frozen - experts.fp8 if lora.enabled else experts.trained


def weight_cast_s(weights: float, rates: Rates) -> float:
    """Seconds of a step's FP8 copies of ``weights`` parameters: two passes (rowwise and of the transpose), made at
    their first use and kept for the step (the runtime's ``fp8.weight_cache``)."""
    return weights * CAST_COPIES * PASS_BYTES / rates.hbm_bw


def _seconds(rates: Rates, fwd: float, dgrad: float, wgrad: float) -> Passes:
    """Passes over these element counts at the rates' HBM bandwidth."""
    per = PASS_BYTES / rates.hbm_bw
    return Passes(fwd * per, dgrad * per, wgrad * per)
