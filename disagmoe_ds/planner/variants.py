"""The AF-Pipe variants the allocator tries for a layout, and how much offload a side needs (pure Python).

A variant is a ``Workload``: the recompute policy (one for both sides, or with ``per_side_recompute`` one per
side: say the attention side keeping its activations while the expert side rebuilds them), ``resend`` (F keeps
nothing between a micro-batch's forward and backward: the tokens come again with the backward and F re-runs the
expert forward), per-side ZeRO stages (memory at rest), ``offload`` shares (activations in host memory), the
expert side's optimizer in host memory (``optimizer_offload``: its state leaves the GPU, its step runs on the host)
and ``split_backward`` (a schedule change only, tried at simulation time). Every saving costs something (FLOPs, wire
bytes, collective bytes or PCIe bytes; resend both FLOPs and wire bytes; ``stages.py``, ``task_costs.py``), so a
layout tries a variant only if no variant with a subset of its savings already holds twice the ring (2 (2p + 1)
micro-batches) in flight: beyond that memory buys no speed. A per-side variant is also not tried where a side it
recomputes on holds that many under a cheaper policy (``allocator._needless_recompute``); a one-policy variant is
never pruned for a per-side one, so that a search without them tries every variant it tried before (the search
stays monotone in its options).

>>> [w.variant for w in memory_variants(Workload(4096, 1), ("none",), frozenset({"resend"}))]
['recompute none, ZeRO 1/1', 'recompute none, resend, ZeRO 1/1']
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable
from dataclasses import replace
from functools import lru_cache

from disagmoe_ds.planner.memory import RankMemory
from disagmoe_ds.planner.recompute import Recompute
from disagmoe_ds.planner.workload import Workload

VARIANTS = (
    "selective",
    "resend",
    "offload",
    "split_backward",
    "zero2",
    "zero3",
    "per_side_recompute",
    "optimizer_offload",
)
PAPER: frozenset[str] = frozenset()  # the paper's AF-Pipe: recompute none or full for both sides, one ZeRO stage
POLICIES: tuple[Recompute, ...] = ("none", "selective", "full")  # each saves what the one before it does, and more
OFFLOAD_STEP = 0.05  # offload shares are rounded up to this grid


def memory_variants(
    base: Workload, recompute: Iterable[Recompute], allowed: frozenset[str], expert_copies: bool = True
) -> list[Workload]:
    """Every memory variant ``allowed`` permits, cheapest first (fewest savings switched on). Per-side policies
    (``per_side_recompute``) come without resend, under which the F side keeps nothing and re-runs its whole forward
    whatever its policy: they would repeat the one-policy variants. ``expert_copies``: under FP8 the step keeps FP8
    copies of the expert weights (``fp8_costs.experts_in_fp8``), so each variant comes again without them."""
    z = base.zero_stage
    ffn_stages = sorted({z} | ({max(z, 2)} if "zero2" in allowed else set()) | ({3} if "zero3" in allowed else set()))
    attention_stages = sorted({z} | ({max(z, 2)} if "zero2" in allowed else set()))
    policies = list(recompute)
    out = []
    for rc in policies:
        for resend in (False, True) if "resend" in allowed else (False,):
            for fz in ffn_stages:
                for az in attention_stages:
                    out.append(replace(base, recompute=rc, resend=resend, attention_zero_stage=az, ffn_zero_stage=fz))
    sides = itertools.permutations(policies, 2) if "per_side_recompute" in allowed else ()
    for (a, f), fz, az in itertools.product(sides, ffn_stages, attention_stages):
        out.append(replace(base.with_recompute(a, f), resend=False, attention_zero_stage=az, ffn_zero_stage=fz))
    if base.fp8_cast_once and expert_copies:  # each variant again without the step's FP8 weight copies
        out += [replace(work, fp8_cast_per_call=True) for work in out]
    if "optimizer_offload" in allowed:  # ZeRO-Offload runs at stage 1 or 2 (the runtime refuses it at 3)
        out += [replace(work, ffn_optimizer_on_host=True) for work in out if work.zero_of("ffn") in (1, 2)]
    return sorted(out, key=_escalation)


def _escalation(work: Workload) -> float:
    """How many savings ``work`` switches on, a recompute policy counted once for both sides (half per side): the
    one-policy variants keep the order they had before the sides had their own."""
    return len(savings(work)) - sum(_rank(work.recompute_of(side)) for side in ("attention", "ffn")) / 2


def _rank(policy: Recompute) -> int:
    return POLICIES.index(policy)


@lru_cache(maxsize=65536)  # a search ranks each workload's families many times
def savings(work: Workload) -> frozenset[str]:
    """The memory savings a workload switches on, as comparable labels (a side's full recompute saves what its
    selective one does, and more). "resend" stands for all of F's activations (it re-runs the expert forward, so it
    also costs FLOPs on F, not only A->F bytes)."""
    out = set()
    for side, tag in (("attention", "A"), ("ffn", "F")):
        out |= {f"{tag} recompute {p}" for p in POLICIES[1 : _rank(work.recompute_of(side)) + 1]}
    out |= {"resend"} if work.resend else set()
    out |= {f"A zero {s}" for s in range(2, work.zero_of("attention") + 1)}
    out |= {f"F zero {s}" for s in range(2, work.zero_of("ffn") + 1)}
    out |= {"FP8 cast per call"} if work.fp8_cast_per_call else set()
    out |= {"F optimizer on host"} if work.ffn_optimizer_on_host else set()
    return frozenset(out)


def dominated(work: Workload, roomy: list[Workload]) -> bool:
    """True when a variant with a subset of ``work``'s savings already fits twice the ring in flight; a variant with
    one policy for both sides only by another such (a search without ``per_side_recompute`` tries it too)."""
    mine = savings(work)
    return any(savings(other) < mine for other in roomy if work.per_side_recompute or not other.per_side_recompute)


def offload_share(mem: RankMemory, *, layers: int, target: int, usable: float) -> float | None:
    """Smallest share (on the ``OFFLOAD_STEP`` grid) of each micro-batch's activations to keep in host memory
    so that ``target`` micro-batches fit: state + working + 2 f act / layers + target (1 - f) act <= usable.
    0.0 when nothing needs offloading, None when even offloading everything does not fit."""
    act = mem.activations_per_micro_batch
    free = usable - mem.state - mem.working
    if target * act <= free:
        return 0.0
    denominator = act * (target - 2 / max(layers, 1))
    if denominator <= 0:
        return None
    share = (target * act - free) / denominator
    share = math.ceil(share / OFFLOAD_STEP - 1e-9) * OFFLOAD_STEP
    return share if share <= 1.0 else None


def variants_used(work: Workload) -> frozenset[str]:
    """The names in ``VARIANTS`` a workload needs switched on (the split backward aside: it is tried at simulation
    time on every simulated plan)."""
    z, sides = work.zero_stage, (work.zero_of("attention"), work.zero_of("ffn"))
    policies = {work.recompute_of("attention"), work.recompute_of("ffn")}
    used = {"selective"} if "selective" in policies else set()
    used |= {"per_side_recompute"} if work.per_side_recompute else set()
    used |= {"resend"} if work.resend else set()
    used |= {"offload"} if any(work.offload) else set()
    used |= {"zero2"} if any(s == 2 > z for s in sides) else set()
    used |= {"zero3"} if sides[1] == 3 > z else set()
    used |= {"optimizer_offload"} if work.ffn_optimizer_on_host else set()
    return frozenset(used)


def search_options(work: Workload) -> frozenset[str]:
    """The options of the search a workload needs: its ``variants_used`` and its A-lane degrees above 1 ("sp2",
    "tp4", ...: a search allowing s in {1, 2} allows "sp2")."""
    lane = {f"sp{work.sequence_parallel}"} if work.sequence_parallel > 1 else set()
    lane |= {f"tp{work.tensor_parallel}"} if work.tensor_parallel > 1 else set()
    return variants_used(work) | lane
