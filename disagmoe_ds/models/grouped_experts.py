"""Fast expert compute: one sort of the (row, expert) pairs, two grouped GEMMs, gathers for the permutation.

Used by ``ExpertShard`` for the families whose experts are gated MLPs stored as HF's fused tensors
(``gate_up_proj [e, 2I, H]`` with gate rows first, ``down_proj [e, H, I]``): Qwen2/3-MoE, Mixtral, OLMoE,
DeepSeek-V2/V3/V4 and the others of ``GATED_FUSED_FAMILIES``. GPT-OSS (transposed, interleaved, biased, clamped)
keeps HF's own module. DeepSeek-V4 clamps its SwiGLU (``swiglu_limit``: the gate from above, the up projection both
ways, before the activation, as its ``_apply_gate``): ``limit`` clamps the gate/up GEMM's output before the middle.

No per-expert Python loop; pairs whose local id is the sentinel (expert on another rank) are sorted last and
dropped before any compute. The permutation and its inverse are gathers in both directions: the un-permute
gathers each row's K pair outputs and sums them, instead of an ``index_add`` whose bf16 atomics took 1.1 ms per
direction at Qwen3-30B-A3B sizes on an H200 (expert path 8.45 -> 6.67 ms, ``bench/bench_experts.py``).

The math is HF's, ``w * (act(x W_g^T) * (x W_u^T)) W_d^T`` summed per row, with one
re-association: the routing weight scales the I-wide intermediate before the down projection instead of the
H-wide output after it (linear, so equal up to rounding; it saves an H-wide multiply and its backward). The
elementwise middle (activation, gating, weighting) and the un-permute's gather-and-sum are the two functions of
an ``Elementwise`` value that each caller passes: ``EAGER``, or ``compiled_elementwise()``, which fuses them with
``torch.compile`` and, on CUDA, runs the middle as Triton kernels (``triton_swiglu``; experts of Qwen3-30B-A3B,
8192 tokens, on an H200: eager 5.52 ms, compiled 4.56, with the Triton middle 4.13, against 3.57 for the grouped
GEMMs alone). An expert shard holds its own (``ExpertShard.elementwise``); nothing here is process-wide.
No host sync when the caller passes ``num_pairs``.

Shape suffixes: R rows, H hidden, K top-k, P routed (row, expert) pairs, I expert intermediate size, e experts.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import nn
from transformers.activations import SiLUActivation

from disagmoe_ds.capabilities.facts import FACTS
from disagmoe_ds.fp8.blocks import BlockScaled, block_grouped_mm
from disagmoe_ds.fp8.projections import fp8_grouped_mm
from disagmoe_ds.models import triton_swiglu
from disagmoe_ds.models.fp8_experts import fp8_routed_experts, weighted_pair_grads
from disagmoe_ds.models.lora import ExpertAdapters

GatedFn = Callable[[torch.Tensor, torch.Tensor, nn.Module], torch.Tensor]  # (gate_up_PF, w_P, act_fn) -> hidden_PI
SumSlotsFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor]  # (y_PH, slot_RK, keep_RK)

# Every family whose facts say its experts are gated and fused; GPT-OSS's keep HF's own module (see above).
GATED_FUSED_FAMILIES = tuple(t for t, facts in FACTS.items() if facts.experts == "gated_fused")


def _grouped_mm(x_PD: torch.Tensor, w_eDN: torch.Tensor, offsets_e: torch.Tensor) -> torch.Tensor:
    """``x_PD[rows of group i] @ w_eDN[i]`` for every group i, rows grouped by ``offsets_e`` (end offsets)."""
    return F.grouped_mm(x_PD, w_eDN, offs=offsets_e)


def supports_grouped(family: str, experts: nn.Module, dtype: torch.dtype, device: torch.device) -> bool:
    """Grouped GEMMs on rows of ``dtype`` on ``device`` need 16-byte aligned rows and, on CUDA, bf16 (the fp32 path
    keeps HF's module)."""
    if family not in GATED_FUSED_FAMILIES:
        return False
    itemsize = dtype.itemsize
    down: torch.Tensor = getattr(experts, "down_proj")  # noqa: B009  # a parameter, or a frozen FP8 base's buffer
    aligned = all(d * itemsize % 16 == 0 for d in down.shape[1:])
    return aligned and (device.type == "cpu" or dtype == torch.bfloat16)


def grouped_gated_experts(
    x_RH: torch.Tensor,
    local_idx_RK: torch.Tensor,
    w_RK: torch.Tensor,
    gate_up_eFH: torch.Tensor | BlockScaled,
    down_eHI: torch.Tensor | BlockScaled,
    act_fn: nn.Module,
    num_pairs: int | None = None,
    elementwise: Elementwise | None = None,
    recompute: bool = False,
    bounded: bool = False,
    adapters: ExpertAdapters | None = None,
    limit: float | None = None,
    fp8: bool = False,
) -> torch.Tensor:
    """Each row's sum over its local experts of ``w * expert(x)``; sentinel ids (>= e) are skipped.

    ``num_pairs``, the number of non-sentinel ids, sizes the buffers. Pass it when the host knows it (the
    dispatch plan counts it, the M2N header carries it): else it is read from the device, a host sync that
    drains the compute stream. ``elementwise``: the middle's functions (``ExpertShard`` passes its own), ``EAGER``
    when None. ``recompute``: keep only the permuted inputs for the backward, which re-runs the gate/up GEMM and
    the activation (selective recompute: ``_RecomputedMiddle``). ``bounded``: ``num_pairs`` is only an upper bound
    (messages at a fixed capacity, ``routing.Capacity``): the buffers take that many pairs, the grouped GEMMs compute
    the real ones (their count stays on the device) and the slots past them are masked to zero both ways (a GEMM
    leaves those rows unwritten); pairs past the bound are dropped. ``adapters``: LoRA factors of both projections
    (``models.lora``), two more grouped GEMMs per projection. ``limit``: the SwiGLU's clamp (DeepSeek-V4's
    ``swiglu_limit``), None for none. ``fp8``: the two projections' GEMMs (forward and both backward ones, not the
    adapters') in FP8 (``disagmoe_ds.fp8``), see ``_projected_experts``; ``x_RH``'s rows must then be FP8 values (as
    the lever sends the routed tokens), which autograd keeps in e4m3. A projection given as ``BlockScaled`` is a
    frozen FP8 base (``fp8.frozen``): its GEMMs multiply the weight it stands for (``fp8.blocks``), no dW.
    """
    elementwise = EAGER if elementwise is None else elementwise
    if limit is not None:
        elementwise = replace(elementwise, gated=clamped(elementwise.gated, limit))
    num_experts, K = gate_up_eFH.shape[0], local_idx_RK.shape[1]
    sorted_ids_P, order_P = torch.sort(local_idx_RK.reshape(-1), stable=True)  # sentinels (== e) sort last
    # Each expert's end offset in the sorted order, without a host sync (the ids are sorted anyway).
    experts_e = torch.arange(1, num_experts + 1, device=sorted_ids_P.device, dtype=sorted_ids_P.dtype)
    offsets_e = torch.searchsorted(sorted_ids_P, experts_e, out_int32=True)
    kept = None  # bounded: the real pairs, the first offsets_e[-1] of the num_pairs slots (a device count)
    if bounded:
        if num_pairs is None:
            raise ValueError("bounded experts need num_pairs, the bound on their pairs")
        num_pairs = min(num_pairs, order_P.numel())
        offsets_e = offsets_e.clamp(max=num_pairs)  # an overflow: its excess pairs are dropped
        kept = offsets_e[-1]
    elif num_pairs is None:
        num_pairs = int(offsets_e[-1])  # host sync
    if num_pairs == 0:
        return x_RH * 0  # nothing routed here; keeps the autograd edge to x
    slots = _Slots.of(order_P, num_pairs, K, x_RH.dtype, elementwise.sum_slots, kept=kept)
    order_P = order_P[:num_pairs]
    w_P = w_RK.reshape(-1).index_select(0, order_P)
    if kept is not None:  # the slots past the real pairs: no weight, so no weight gradient from their garbage rows
        w_P = torch.where(torch.arange(num_pairs, device=w_P.device) < kept, w_P, 0)
    weights = gate_up_eFH, down_eHI
    if fp8 and adapters is None and fused_fp8_middle(elementwise, act_fn, x_RH):
        if isinstance(gate_up_eFH, torch.Tensor) and isinstance(down_eHI, torch.Tensor):  # not a frozen FP8 base
            w_sum_RK = slots.coefficients(w_RK)
            return fp8_routed_experts(x_RH, w_P, w_sum_RK, gate_up_eFH, down_eHI, offsets_e, slots, recompute)
    x_PH = _Permute.apply(x_RH, slots)
    if adapters is not None or fp8 or isinstance(gate_up_eFH, BlockScaled) or isinstance(down_eHI, BlockScaled):
        out_PH = _projected_experts(x_PH, w_P, weights, offsets_e, act_fn, elementwise, adapters, recompute, fp8)
        if fp8:  # the routing weight scales each pair's output in the un-permute's sum
            return _WeightedUnpermute.apply(out_PH, w_P, slots.coefficients(w_RK), slots)
    elif recompute:
        out_PH = _RecomputedMiddle.apply(x_PH, w_P, gate_up_eFH, down_eHI, offsets_e, act_fn, elementwise.gated)
    else:
        hidden_PI = elementwise.gated(_grouped_mm(x_PH, gate_up_eFH.transpose(1, 2), offsets_e), w_P, act_fn)
        out_PH = _grouped_mm(hidden_PI, down_eHI.transpose(1, 2), offsets_e)
    return _Unpermute.apply(out_PH, slots)


def _projected_experts(x_PH, w_P, weights, offsets_e, act_fn, elementwise, adapters, recompute, fp8):
    """The two projections (``weights``: gate/up and down) with their LoRA updates (``adapters``, or None), their
    base GEMMs in FP8 when ``fp8``; ``recompute`` keeps only the inputs of the gate/up projection and the middle
    (``torch.utils.checkpoint``), as ``_RecomputedMiddle`` does for the plain projections.

    In FP8 the routing weight scales the down projection's output, as HF's experts apply it, instead of the
    intermediate: its rowwise quantization would otherwise round ``w * h`` instead of ``h`` (another rounding than
    the reference's, a non-power-of-two w changing which e4m3 value each element lands on). The output returned is
    then unweighted: the caller's un-permute applies the weight in its sum (``_WeightedUnpermute``)."""
    gate_up_eFH, down_eHI = weights
    gate_up, down = (None, None) if adapters is None else (adapters.gate_up, adapters.down)
    scaling = 0.0 if adapters is None else adapters.scaling

    def middle(x_PH: torch.Tensor, w_P: torch.Tensor) -> torch.Tensor:
        gate_up_PF = _adapted_mm(x_PH, gate_up_eFH, gate_up, scaling, offsets_e, fp8, fp8_rows=fp8)
        return elementwise.gated(gate_up_PF, w_P, act_fn)

    w_mid_P = torch.ones_like(w_P) if fp8 else w_P
    if recompute:
        hidden_PI = torch.utils.checkpoint.checkpoint(middle, x_PH, w_mid_P, use_reentrant=False)
    else:
        hidden_PI = middle(x_PH, w_mid_P)
    return _adapted_mm(hidden_PI, down_eHI, down, scaling, offsets_e, fp8)


def fused_fp8_middle(elementwise: Elementwise, act_fn: nn.Module, x_RH: torch.Tensor) -> bool:
    """Whether FP8 experts of trained weights run ``fp8_experts.fp8_routed_experts`` (one node from rows to rows, the
    Triton middle writing the GEMMs' FP8 operands): where the unfused path would run the Triton SwiGLU
    (``TritonSwiGLUOr``: SiLU, no clamp, Triton on the rows' device) between its two FP8 grouped GEMMs."""
    gated = elementwise.gated
    return isinstance(gated, TritonSwiGLUOr) and gated.limit is None and gated.applies(act_fn, x_RH)


def _adapted_mm(x_PD, w_eND, factors, scaling, offsets_e, fp8=False, fp8_rows=False):
    """``x W_e^T + s * (x A_e^T) B_e^T`` per group (``factors`` None: ``x W_e^T``), the first GEMM in FP8 when
    ``fp8`` (or on a frozen block-scaled FP8 ``w_eND``), the adapters' in the model's dtype; the rank is zero-padded
    to a 16-byte row (grouped GEMMs need aligned rows; the padded columns are zero, so they change nothing and get no
    gradient). ``fp8_rows``: ``x``'s rows are FP8 values (the routed tokens, as the lever sends them in every
    layout), kept so for dW (``fp8_grouped_mm``)."""
    if isinstance(w_eND, BlockScaled):
        base_PN = block_grouped_mm(x_PD, w_eND, offsets_e)
    elif fp8:
        base_PN = fp8_grouped_mm(x_PD, w_eND, offsets_e, fp8_rows=fp8_rows)
    else:
        base_PN = _grouped_mm(x_PD, w_eND.transpose(1, 2), offsets_e)
    if factors is None:
        return base_PN
    a_eRD, b_eNR = factors
    pad = -a_eRD.shape[1] % (16 // x_PD.element_size())
    if pad:
        a_eRD, b_eNR = F.pad(a_eRD, (0, 0, 0, pad)), F.pad(b_eNR, (0, pad))
    low_PR = _grouped_mm(x_PD, a_eRD.transpose(1, 2), offsets_e)
    return base_PN + _grouped_mm(low_PR, b_eNR.transpose(1, 2), offsets_e) * scaling


class _Slots:
    """The permutation between rows and sorted pairs, for gathers in both directions (no atomic scatter-add).

    ``rows_P``: the row of sorted pair p. ``slot_RK``: where pair (r, k) sits in the sorted order; a dropped pair
    (sentinel id) points at pair 0 and has ``keep_RK`` 0, which is None when no pair is dropped. ``sum_fn``: the
    gather-and-sum of the caller's ``Elementwise``.

    Bounded pairs (``kept`` a device count): the grouped GEMMs leave the rows past the real pairs unwritten, forward
    and backward, and a sum reads only kept slots and pair 0, which is one of those rows only when no pair is real.
    ``any_kept`` then zeroes pair 0 before the sum (one row), so a masked garbage value never turns into NaN.
    """

    def __init__(
        self,
        rows_P: torch.Tensor,
        slot_RK: torch.Tensor,
        keep_RK: torch.Tensor | None,
        sum_fn: SumSlotsFn,
        any_kept: torch.Tensor | None = None,
    ) -> None:
        self.rows_P, self.slot_RK, self.keep_RK, self.sum_fn = rows_P, slot_RK, keep_RK, sum_fn
        self.any_kept = any_kept

    @classmethod
    def of(
        cls,
        order_P: torch.Tensor,
        num_pairs: int,
        K: int,
        dtype: torch.dtype,
        sum_fn: SumSlotsFn,
        kept: int | torch.Tensor | None = None,
    ) -> _Slots:
        """``kept``: the pairs that count, the first ``num_pairs`` unless given (a device count: bounded pairs)."""
        positions = torch.arange(order_P.numel(), device=order_P.device)
        slot = torch.empty_like(order_P).index_copy_(0, order_P, positions)
        rows_P = order_P[:num_pairs] // K
        kept = num_pairs if kept is None else kept
        if isinstance(kept, int) and kept == order_P.numel():
            return cls(rows_P, slot.view(-1, K), None, sum_fn)
        keep = slot < kept
        any_kept = kept > 0 if isinstance(kept, torch.Tensor) else None
        return cls(rows_P, torch.where(keep, slot, 0).view(-1, K), keep.to(dtype).view(-1, K), sum_fn, any_kept)

    def coefficients(self, w_RK: torch.Tensor) -> torch.Tensor:
        """``w_RK`` as a weighted sum's coefficients: detached, zero where a pair is dropped."""
        return w_RK.detach() if self.keep_RK is None else w_RK.detach() * self.keep_RK

    def sum_slots(self, y_PH: torch.Tensor, weight_RK: torch.Tensor | None = None) -> torch.Tensor:
        """Row r's sum over its kept pairs of ``y_PH[slot]``, each times ``weight_RK`` where given (which must then
        be zero where a pair is dropped)."""
        # Detached: both callers run without autograd (a Function's forward or backward); a compiled sum_fn would
        # otherwise compile again for each requires_grad flag and run out of recompiles (eager from then on).
        y_PH = y_PH.detach()
        if self.any_kept is not None:  # nothing else reads these rows: a GEMM's output, or the gradient of its input
            y_PH[:1].masked_fill_(~self.any_kept, 0)
        return self.sum_fn(y_PH, self.slot_RK, self.keep_RK if weight_RK is None else weight_RK)


class _Permute(torch.autograd.Function):
    """``x_RH[rows_P]``; its backward sums each row's pairs with a gather instead of ``index_add``'s atomics."""

    @staticmethod
    def forward(ctx, x_RH: torch.Tensor, slots: _Slots) -> torch.Tensor:
        ctx.slots = slots
        return x_RH.index_select(0, slots.rows_P)

    @staticmethod
    def backward(ctx, grad_PH: torch.Tensor):
        return ctx.slots.sum_slots(grad_PH), None


class _Unpermute(torch.autograd.Function):
    """Each row's sum of its pairs' outputs; the backward is a gather of the rows' gradients."""

    @staticmethod
    def forward(ctx, y_PH: torch.Tensor, slots: _Slots) -> torch.Tensor:
        ctx.slots = slots
        return slots.sum_slots(y_PH)

    @staticmethod
    def backward(ctx, grad_RH: torch.Tensor):
        return grad_RH.index_select(0, ctx.slots.rows_P), None


class _WeightedUnpermute(torch.autograd.Function):
    """Each row's sum of its pairs' outputs times their routing weights, accumulated in float32 (the FP8 experts'
    combine: the weight applied in the sum's one kernel, not in a float32 pass over the H-wide outputs before it).
    ``w_P``: the pairs' weights in the sorted order (their gradient's way back to the router); ``w_RK``: the same
    weights per row and choice, detached and masked where a pair is dropped (the sum's coefficients)."""

    @staticmethod
    def forward(ctx, y_PH: torch.Tensor, w_P: torch.Tensor, w_RK: torch.Tensor, slots: _Slots) -> torch.Tensor:
        ctx.save_for_backward(y_PH, w_P)
        ctx.slots = slots
        return slots.sum_slots(y_PH, w_RK)

    @staticmethod
    def backward(ctx, grad_RH: torch.Tensor):
        y_PH, w_P = ctx.saved_tensors
        d_y_PH, d_w_P = weighted_pair_grads(grad_RH, ctx.slots.rows_P, y_PH, w_P)
        return d_y_PH, d_w_P, None, None


class _RecomputedMiddle(torch.autograd.Function):
    """``gated(x W_gu^T, w) W_d^T`` per group, saving only its inputs: the gate/up output and the activation
    (3 x I per pair) are rebuilt in the backward, which re-runs the gate/up GEMM and the elementwise middle but not
    the down GEMM (its two backward GEMMs are written out here, as autograd's grouped-GEMM backward computes them).
    The planner's "selective" recompute of routed experts (``planner/recompute.py``)."""

    @staticmethod
    def forward(ctx, x_PH, w_P, gate_up_eFH, down_eHI, offsets_e, act_fn: nn.Module, gated: GatedFn):
        ctx.save_for_backward(x_PH, w_P, gate_up_eFH, down_eHI, offsets_e)
        ctx.act_fn, ctx.gated = act_fn, gated
        hidden_PI = gated(_grouped_mm(x_PH, gate_up_eFH.transpose(1, 2), offsets_e), w_P, act_fn)
        return _grouped_mm(hidden_PI, down_eHI.transpose(1, 2), offsets_e)

    @staticmethod
    def backward(ctx, grad_PH: torch.Tensor):
        x_PH, w_P, gate_up_eFH, down_eHI, offsets_e = ctx.saved_tensors
        leaves = [t.detach().requires_grad_(need) for t, need in zip((x_PH, w_P, gate_up_eFH), ctx.needs_input_grad)]
        with torch.enable_grad():
            gate_up_PF = _grouped_mm(leaves[0], leaves[2].transpose(1, 2), offsets_e)
            hidden_PI = ctx.gated(gate_up_PF, leaves[1], ctx.act_fn)
        d_down = None
        if ctx.needs_input_grad[3]:
            d_down = _grouped_mm(grad_PH.t(), hidden_PI.detach(), offsets_e)  # [e, H, I]
        wanted = [t for t in leaves if t.requires_grad]
        grads = iter(
            torch.autograd.grad(hidden_PI, wanted, _grouped_mm(grad_PH, down_eHI, offsets_e)) if wanted else ()
        )
        d_x, d_w, d_gate_up = (next(grads) if t.requires_grad else None for t in leaves)
        return d_x, d_w, d_gate_up, d_down, None, None, None


def _sum_slots_eager(y_PH: torch.Tensor, slot_RK: torch.Tensor, keep_RK: torch.Tensor | None) -> torch.Tensor:
    gathered_RKH = y_PH.index_select(0, slot_RK.reshape(-1)).view(*slot_RK.shape, -1)
    if keep_RK is None:
        return gathered_RKH.sum(1)
    if keep_RK.dtype != y_PH.dtype:  # routing weights (float32): the weighted sum in float32, rounded once
        return torch.bmm(keep_RK.float().unsqueeze(1), gathered_RKH.float()).squeeze(1).to(y_PH.dtype)
    return torch.bmm(keep_RK.unsqueeze(1), gathered_RKH).squeeze(1)  # masked sum in one pass


def _sum_slots_fusable(y_PH: torch.Tensor, slot_RK: torch.Tensor, keep_RK: torch.Tensor | None) -> torch.Tensor:
    # Compiled, this is one elementwise kernel with K gathered loads per output (fp32 accumulation, like sum's):
    # the [R, K, H] gathered rows are never written. A sum(1) over them compiles to a slow strided reduction.
    acc_RH = torch.zeros(slot_RK.shape[0], y_PH.shape[1], device=y_PH.device, dtype=torch.float32)
    for k in range(slot_RK.shape[1]):
        term_RH = y_PH[slot_RK[:, k]].float()
        acc_RH = acc_RH + (term_RH if keep_RK is None else term_RH * keep_RK[:, k, None])
    return acc_RH.to(y_PH.dtype)


def _gated_eager(gate_up_PF: torch.Tensor, w_P: torch.Tensor, act_fn: nn.Module) -> torch.Tensor:
    gate_PI, up_PI = gate_up_PF.chunk(2, dim=-1)
    return (act_fn(gate_PI) * up_PI * w_P.unsqueeze(1)).to(gate_up_PF.dtype)


@dataclass(frozen=True)
class Elementwise:
    """The expert path's elementwise functions: the gated middle and the un-permute's gather-and-sum."""

    gated: GatedFn
    sum_slots: SumSlotsFn

    def without_triton(self) -> Elementwise:
        """The same functions with the middle as ``TritonSwiGLUOr``'s fallback computes it (benchmarks compare)."""
        return replace(self, gated=self.gated.fallback) if isinstance(self.gated, TritonSwiGLUOr) else self


EAGER = Elementwise(_gated_eager, _sum_slots_eager)


def is_silu(act_fn: Callable) -> bool:
    """``act_fn`` is SiLU (HF's ``SiLUActivation``, torch's module or function): the Triton middle computes it."""
    return act_fn is F.silu or isinstance(act_fn, nn.SiLU | SiLUActivation)


@dataclass(frozen=True)
class ClampedGate:
    """A gated middle whose gate/up input is clamped first, as DeepSeek-V4's experts clamp it (``_apply_gate``):
    the gate half at most ``limit``, the up half within +-``limit``."""

    inner: GatedFn
    limit: float

    def __call__(self, gate_up_PF: torch.Tensor, w_P: torch.Tensor, act_fn: nn.Module) -> torch.Tensor:
        gate_PI, up_PI = gate_up_PF.chunk(2, dim=-1)
        clamped_PF = torch.cat([gate_PI.clamp(max=self.limit), up_PI.clamp(min=-self.limit, max=self.limit)], dim=-1)
        return self.inner(clamped_PF, w_P, act_fn)


def clamped(gated: GatedFn, limit: float) -> GatedFn:
    """``gated`` with its gate/up input clamped at ``limit`` (``ClampedGate``); the Triton middle clamps inside its
    kernels (eager clamps and a concatenated copy of the rows took 1.3 ms of DeepSeek-V4-Flash's 66 ms layer on an
    H100)."""
    if isinstance(gated, TritonSwiGLUOr):
        return replace(gated, fallback=ClampedGate(gated.fallback, limit), limit=limit)
    return ClampedGate(gated, limit)


@dataclass(frozen=True)
class TritonSwiGLUOr:
    """A gated middle that runs ``triton_swiglu.SwiGLU`` where it applies (SiLU gating on a CUDA device with Triton:
    every grouped family), else ``fallback``; ``limit``: DeepSeek-V4's clamp, inside the kernels (``clamped``)."""

    fallback: GatedFn
    limit: float | None = None

    def __call__(self, gate_up_PF: torch.Tensor, w_P: torch.Tensor, act_fn: nn.Module) -> torch.Tensor:
        if self.applies(act_fn, gate_up_PF):
            return triton_swiglu.SwiGLU.apply(gate_up_PF, w_P, self.limit)
        return self.fallback(gate_up_PF, w_P, act_fn)

    def applies(self, act_fn: nn.Module, rows: torch.Tensor) -> bool:
        """The Triton kernels run for ``act_fn`` on ``rows``' device (SiLU; CUDA with Triton)."""
        return is_silu(act_fn) and triton_swiglu.runs_on(rows)


@functools.cache
def compiled_elementwise() -> Elementwise:
    """The same functions fused: the activation, gating and weighting into one kernel and its backward into
    another (Triton's ``triton_swiglu`` on CUDA, else ``torch.compile``), and each un-permute's gather with its
    sum over K (``torch.compile``). Made once per process, so every expert shard that uses it shares its compiled
    graphs.

    Not the default: compiling costs seconds per new shape class on first use, which CPU tests do not need.
    """
    # Automatic dynamic shapes: the row count becomes dynamic at its first change, the widths stay static. Fully
    # dynamic kernels index with run-time divisions and took 2-3x longer (bench/bench_experts.py, H200).
    return Elementwise(TritonSwiGLUOr(torch.compile(_gated_eager)), torch.compile(_sum_slots_fusable))
